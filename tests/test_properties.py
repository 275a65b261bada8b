"""Property-based tests of the runtime on random graphs.

Random graphs (tests/graph_strategies.py) mix elementwise, matmul, reductions, softmax,
concat/split, copies between up to four devices, collectives and user ``call`` kernels;
they are compiled with random default and per-tensor quotas and run for several
pipelined iterations with different feeds. The properties:

1. every output of every iteration equals an independent float64 numpy evaluation;
2. no buffer is written while still read, from the trace: a producer's write of
   iteration i + quota starts only after every consumer of iteration i ended (with
   micro-batches: per act, through holds and periods); a slow consumer makes the
   producers use every credit; micro-batched training over random stages equals numpy;
3. every kernel runs on its actor's stream thread, never on the host or trio thread;
4. no consumer starts before its producer ended, for every data edge whatever its sync
   (stream order, event, implied by another input, at completion), with random sleeps
   inside kernels;
5. iterations pipeline across devices.
"""

from __future__ import annotations

import json
import threading
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

import actorflow as af
import graph_strategies as gs
import userfns
from trace_checks import check_quotas_in_trace, data_edges, unit_of

SETTINGS = dict(
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
HOST_THREADS = {"MainThread", "actorflow-session"}


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def compile_random(data, recipe: gs.Recipe):
    """Compile with a random default quota and random per-tensor overrides (by name or
    tensor, where a graph tensor has the register's name: the compiler's own registers,
    such as a fused collective's, have none), maybe through a serialization round trip;
    check the quotas landed."""
    graph, tensors = gs.build(recipe)
    quota = data.draw(st.sampled_from([1, 2, 3]), label="quota")
    fuse = data.draw(st.booleans(), label="fuse_kernels")
    names = sorted(
        r.name for r in af.compile(graph, quota=quota, fuse_kernels=fuse).registers if not r.is_parameter
    )
    overrides = data.draw(
        st.dictionaries(st.sampled_from(names), st.sampled_from([1, 2, 3]), max_size=3), label="quotas"
    )
    by_name = {t.name: t for t in tensors}
    keys = {
        (by_name[k] if k in by_name and data.draw(st.booleans(), label="key by tensor") else k): q
        for k, q in overrides.items()
    }
    priority = data.draw(st.booleans(), label="priority")
    plan = af.compile(graph, quota=quota, quotas=keys, priority=priority, fuse_kernels=fuse)
    read = {r.name for r in af.compile(graph, fuse_kernels=False).registers if r.consumers} if fuse else set()
    for r in plan.registers:
        internal = r.name in read and not r.consumers  # read only inside a fused chain: 1 buffer
        assert r.quota == overrides.get(r.name, 1 if r.is_parameter or internal else quota), r
    if data.draw(st.booleans(), label="serialization round trip"):
        plan = af.Plan.from_bytes(plan.to_bytes(), allow=["graph_strategies", "userfns"])
    return plan


ORDERS = st.sampled_from(["replay", "dynamic"])
"""How a run's acts are ordered (``Runtime``'s ``order``): both must compute the same."""


def draw_case(data, recipes, most_iterations: int = 5) -> tuple[gs.Recipe, af.Plan, list]:
    """A random graph compiled by ``compile_random``, and feeds for 1 to ``most_iterations`` iterations."""
    recipe = data.draw(recipes, label="recipe")
    plan = compile_random(data, recipe)
    n = data.draw(st.integers(1, most_iterations), label="iterations")
    return recipe, plan, gs.make_feeds(recipe, n, data.draw(st.integers(0, 2**16), label="feed seed"))


def live(plan: af.Plan, feeds: list[dict]) -> list[dict]:
    """The feeds the plan takes: placeholders no output depends on are compiled away."""
    names = {f.name for f in plan.feeds}
    return [{k: v for k, v in f.items() if k in names} for f in feeds]


def run_traced(plan: af.Plan, feeds: list[dict], *, stall_timeout: float = 20.0, order="replay"):
    with af.Session(plan, trace=True, stall_timeout=stall_timeout, order=order) as s:
        outs = s.run(live(plan, feeds))
        stats = s.register_stats()
        spans = s.recorder.kernels()
    return outs, stats, spans


def index_spans(plan: af.Plan, spans, iterations: int) -> dict[tuple[str, int], object]:
    """(unit name, iteration) -> span; checks there is exactly one span per unit and iteration."""
    index = {}
    for span in spans:
        key = (span.args["actor"], span.args["iteration"])
        assert key not in index, f"two spans for {key}"
        assert span.start <= span.end, span
        index[key] = span
    units = set(unit_of(plan).values())
    assert set(index) == {(u, i) for u in units for i in range(iterations)}
    return index


def stream_of_unit(plan: af.Plan) -> dict[str, af.plan.Stream]:
    unit = unit_of(plan)
    return {unit[a.id]: plan.streams[a.stream] for a in plan.actors}


def tolerances(recipe: gs.Recipe) -> tuple[float, float]:
    scale = max(1.0, recipe.bound)
    if recipe.dtype == "float64":
        return 1e-9, 1e-9 * scale
    return 1e-4, 1e-4 * scale


def check_outputs(recipe: gs.Recipe, feeds, outs) -> None:
    rtol, atol = tolerances(recipe)
    assert isinstance(outs, list) and len(outs) == len(feeds)
    for it, (f, out) in enumerate(zip(feeds, outs)):
        expected = gs.evaluate(recipe, f)
        assert set(out) == set(expected)
        for name, want in expected.items():
            got = out[name]
            assert isinstance(got, np.ndarray) and got.dtype == np.dtype(recipe.dtype)
            assert got.shape == want.shape, (it, name)
            np.testing.assert_allclose(
                got, want, rtol=rtol, atol=atol, err_msg=f"iteration {it}, output {name!r}"
            )


def probe_actors(plan: af.Plan) -> dict[int, af.plan.Actor]:
    """Probe index -> the actor that runs its call, alone or as part of a fused chain
    (probes in dead code are not there)."""
    found = {}
    for a in plan.actors:
        for _, attrs in a.kernels():
            if attrs.get("fn") in gs.PROBES:
                found[gs.PROBES.index(attrs["fn"])] = a
    return found


# --------------------------------------------------------------------------------------
# 1. random graphs compute what numpy computes
# --------------------------------------------------------------------------------------


@settings(max_examples=40, **SETTINGS)
@given(st.data())
def test_random_graphs_match_numpy(data):
    recipe, plan, feeds = draw_case(data, gs.recipes())
    event(f"{len(recipe.devices)} devices, {len(plan.actors) // 5 * 5}+ actors")
    for kind in {node[0] for node in recipe.nodes}:
        event(f"op {kind}")

    order = data.draw(ORDERS, label="order")
    event(f"order {order}")
    with af.Session(plan, stall_timeout=20, order=order) as s:
        check_outputs(recipe, feeds, s.run(live(plan, feeds)))
        # the same session again, in another order: no state leaks between runs
        check_outputs(recipe, feeds[::-1], s.run(live(plan, feeds[::-1])))
        # a single dict gives a single dict back
        (single,) = [s.run(live(plan, feeds[:1])[0])]
        check_outputs(recipe, feeds[:1], [single])
        # parameters are untouched by running
        for p in plan.parameters:
            np.testing.assert_array_equal(s.parameters()[p.name], p.value)


# --------------------------------------------------------------------------------------
# 2. quotas: never exceeded, counted three ways; and really used
# --------------------------------------------------------------------------------------


@settings(max_examples=30, **SETTINGS)
@given(st.data())
def test_quota_never_exceeded(data):
    recipe, plan, feeds = draw_case(data, gs.recipes(probe=True))
    n = len(feeds)
    gs.reset_probes()
    outs, stats, spans = run_traced(plan, feeds, order=data.draw(ORDERS, label="order"))
    check_outputs(recipe, feeds, outs)

    # the runtime's own count covers every produced register
    produced = {r.name: r for r in plan.registers if not r.is_parameter}
    assert {name: st_["quota"] for name, st_ in stats.items()} == {k: r.quota for k, r in produced.items()}
    # the probe saw one input buffer per iteration, the one its producer wrote
    for k, _ in probe_actors(plan).items():
        assert len(gs.PROBE_RECORDS[k]) == n

    # from the trace: the write of iteration i + quota into a register starts only after
    # every consumer of iteration i ended (no write-after-read on any buffer)
    index_spans(plan, spans, n)
    checked = check_quotas_in_trace(plan, spans)
    event(f"{'some' if checked else 'no'} write-after-read pairs")


@settings(max_examples=30, **SETTINGS)
@given(st.data())
def test_random_micro_batched_training_matches_numpy(data):
    """Random dense networks pipelined over 1-3 stages, m micro-batches a step, every step
    in one run (so steps overlap): each micro-batch's loss is the one numpy computes with
    that step's parameters, the parameters end where whole-batch numpy training ends, and
    no buffer is written while still read (holds and periods included)."""
    recipe = data.draw(gs.training_recipes(), label="recipe")
    plan = af.compile(
        gs.build_training(recipe),
        quota=data.draw(st.sampled_from([1, 2, 3]), label="quota"),
        priority=data.draw(st.booleans(), label="priority"),
        micro_batches=recipe.micro_batches,
        stages=list(recipe.stages) if recipe.schedule else None,
        schedule=recipe.schedule,
    )
    event(f"{len(recipe.stages)} stages, {recipe.micro_batches} micro-batches, {recipe.optimizer[0]}")
    batches = gs.training_batches(recipe)
    want, want_losses = gs.train_reference(recipe, batches)
    with af.Session(plan, trace=True, stall_timeout=20, order=data.draw(ORDERS, label="order")) as s:
        outs = s.run(gs.micro_batch_feeds(recipe, batches))
        got = s.parameters()
        spans = s.recorder.kernels()
    np.testing.assert_allclose([float(o["loss"]) for o in outs], want_losses, rtol=1e-9, atol=1e-12)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-7, atol=1e-10, err_msg=name)
    event(f"{'some' if check_quotas_in_trace(plan, spans) else 'no'} write-after-read pairs")


@pytest.mark.parametrize("order", ["replay", "dynamic"])
def test_a_buffer_is_written_again_only_after_its_slow_reader_ended(order):
    """cpu:1 reads what the copy to it writes (on cpu:0's thread, a small move), 20 ms a
    read, quota 1: each write of the register starts after the read of the write before
    it ended (a free at the read's launch, not its end, would let the writer in while the
    reader still reads)."""
    with af.Graph() as g:
        x = af.placeholder("x", (4,), "float32", "cpu:0")
        p = af.ops.relu(x, name="p")
        af.output("y", af.ops.call(userfns.sleep_20ms, af.ops.to_device(p, "cpu:1"), shape=(4,), name="slow"))
    plan = af.compile(g, quota=1, fuse_kernels=False)
    feeds = [{"x": np.full(4, i, np.float32)} for i in range(4)]
    outs, _, spans = run_traced(plan, feeds, order=order)
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out["y"], np.full(4, i, np.float32))
    index = index_spans(plan, spans, len(feeds))
    writer = next(a.name for a in plan.actors if a.kind == "copy")
    for i in range(1, len(feeds)):
        assert index[(writer, i)].start >= index[("slow", i - 1)].end


@pytest.mark.parametrize("q", [1, 2, 3])
def test_slow_consumer_makes_producers_use_every_credit(q):
    """cpu:0 produces, cpu:1 copies and consumes; the consumer holds its first buffer until
    the producer has run as often as its credits allow (2q times: q buffers held by the
    copy, q by itself). Both registers then hold exactly q buffers, never more. (Decided
    as the run goes: a replayed order would have the producer's stream wait for the
    copy's credit, in its place, before the producer's next act.)"""
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 4), dtype="float32", device="cpu:0")
        p = af.ops.call(gs.counting, af.ops.relu(x), shape=(4, 4), name="p")
        k = af.ops.to_device(p, "cpu:1", name="k")
        c = af.ops.call(gs.gate, k, shape=(4, 4), name="c")
        # fetch from another device so cpu:1's copy stream only runs k
        af.output("y", af.ops.to_device(c, "cpu:2"))
    plan = af.compile(g, quota=1, quotas={"p": q, "k": q}, fuse_kernels=False)
    n = 2 * q + 2
    feeds = [{"x": np.full((4, 4), i, np.float32)} for i in range(n)]
    gs.reset_gate(target=2 * q)
    outs, stats, spans = run_traced(plan, feeds, stall_timeout=30, order="dynamic")

    assert not gs.GATE["timed_out"], "the producer never got to use its credits"
    assert gs.GATE["count_at_open"] == 2 * q
    assert gs.GATE["count"] == n
    assert stats["p"] == {"quota": q, "max_held": q}
    assert stats["k"] == {"quota": q, "max_held": q}
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out["y"], np.full((4, 4), i, np.float32))
    index = index_spans(plan, spans, n)
    # the producer's first 2q kernels started while the consumer's first one still ran
    c0 = index[("c", 0)]
    assert all(index[("p", i)].start <= c0.end for i in range(2 * q))


@pytest.mark.parametrize("q", [1, 2, 3])
def test_no_buffer_is_written_while_a_probe_still_reads_it(q):
    """A probe downstream of a copy and one on the producer's own stream: over many
    iterations, no producer writes a buffer a probe has not finished reading."""
    with af.Graph() as g:
        x = af.placeholder("x", shape=(3, 3), dtype="float64", device="cpu:0")
        h = af.ops.tanh(x, name="h")
        a = af.ops.call(gs.probe0, h, shape=(3, 3), dtype="float64")  # same stream as h
        m = af.ops.to_device(h, "cpu:1", name="m")
        b = af.ops.call(gs.probe1, m, shape=(3, 3), dtype="float64")  # reads the copy
        af.output("a", a)
        af.output("b", af.ops.call(gs.sleep3ms, b, shape=(3, 3), dtype="float64"))
    plan = af.compile(g, quota=q)
    n = 7
    feeds = [{"x": np.full((3, 3), i / 10)} for i in range(n)]
    gs.reset_probes()
    outs, _, spans = run_traced(plan, feeds)
    for k in (0, 1):
        assert len(gs.PROBE_RECORDS[k]) == n
    assert check_quotas_in_trace(plan, spans) > 0
    for i, out in enumerate(outs):
        np.testing.assert_allclose(out["a"], np.tanh(np.full((3, 3), i / 10)))
        np.testing.assert_allclose(out["b"], np.tanh(np.full((3, 3), i / 10)))


# --------------------------------------------------------------------------------------
# 3. kernels run on their stream's thread
# --------------------------------------------------------------------------------------


@settings(max_examples=30, **SETTINGS)
@given(st.data())
def test_kernels_run_on_their_stream_thread(data):
    recipe, plan, feeds = draw_case(data, gs.recipes(probe=True), most_iterations=3)
    n = len(feeds)
    gs.reset_probes()
    userfns.calls.clear()
    outs, _, spans = run_traced(plan, feeds)
    check_outputs(recipe, feeds, outs)

    # user kernels saw their own stream's thread
    for k, actor in probe_actors(plan).items():
        threads = {t for t, _ in gs.PROBE_RECORDS[k]}
        assert threads == {plan.streams[actor.stream].name}, (actor.name, threads)
    tn_streams = {
        plan.streams[a.stream].name
        for a in plan.actors
        for _, attrs in a.kernels()
        if attrs.get("fn") is userfns.thread_name
    }
    seen = {t for fn, t in userfns.calls if fn == "thread_name"}
    assert seen == tn_streams
    assert not seen & HOST_THREADS

    # every span is on its actor's stream, named after it, on its device's track
    streams = stream_of_unit(plan)
    index_spans(plan, spans, n)
    for span in spans:
        stream = streams[span.args["actor"]]
        assert span.thread == stream.name and span.process == stream.device, span
        assert span.thread not in HOST_THREADS
    # a stream is one thread running kernels in order: its spans never overlap
    by_thread = defaultdict(list)
    for span in spans:
        by_thread[span.thread].append(span)
    for thread_spans in by_thread.values():
        thread_spans.sort(key=lambda s: s.start)
        for a, b in zip(thread_spans, thread_spans[1:]):
            assert a.end <= b.start, (a, b)


def test_thread_name_on_every_device(tmp_path):
    """userfns.thread_name on each of four devices, after copies and a collective; and in
    the Chrome trace af.run writes, every kernel sits on its actor's stream's track."""
    devices = [f"cpu:{i}" for i in range(4)]
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2, 3), dtype="float32", device="cpu:0")
        parts = [x] + [af.ops.to_device(x, d) for d in devices[1:]]
        parts = [af.ops.call(userfns.thread_name, t, shape=(2, 3)) for t in parts]
        reduced = af.ops.all_reduce(parts, op="sum")
        for i, r in enumerate(reduced):
            af.output(f"y{i}", af.ops.call(userfns.thread_name, r, shape=(2, 3)))
    plan = af.compile(g, quota=2)
    userfns.calls.clear()
    xs = [np.full((2, 3), i, np.float32) for i in range(3)]
    outs = af.run(plan, [{"x": a} for a in xs], trace=tmp_path / "run.json")
    names = [t for fn, t in userfns.calls if fn == "thread_name"]
    assert sorted(set(names)) == [f"{d}/compute" for d in devices]
    for d in devices:  # two calls per device per iteration
        assert names.count(f"{d}/compute") == 2 * len(xs)
    for a, out in zip(xs, outs):
        for i in range(4):
            np.testing.assert_array_equal(out[f"y{i}"], 4 * a)
    assert threading.current_thread().name not in names

    trace = json.loads((tmp_path / "run.json").read_text())["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    thread = {e["tid"]: e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    kernels = [
        e for e in trace if e["ph"] == "X" and e["cat"] not in ("wait", "step")
    ]  # waits and steps are spans of their own
    streams = stream_of_unit(plan)
    assert len(kernels) == len(set(streams)) * len(xs)
    for e in kernels:
        stream = streams[e["args"]["actor"]]
        assert (process[e["pid"]], thread[e["tid"]]) == (stream.device, stream.name), e


# --------------------------------------------------------------------------------------
# 4. no consumer starts before its producer ended
# --------------------------------------------------------------------------------------


def check_order(plan: af.Plan, spans, n: int) -> Counter:
    """Every data edge, every iteration: consumer start >= producer end, whatever the
    edge's sync (stream order, event, implied by another input, at completion). Returns
    how many cross-stream edges of each sync kind were checked."""
    index = index_spans(plan, spans, n)
    kinds: Counter = Counter()
    for reg, p, c, actor, inp in data_edges(plan):
        if plan.actors[reg.producer].stream != actor.stream:
            kinds[inp.sync] += 1
        for i in range(n):
            assert index[(c, i)].start >= index[(p, i)].end, (
                f"{c} started iteration {i} before {p} (which writes {reg.name!r}) ended; sync={inp.sync}"
            )
    return kinds


HAND_OFFS = ("inside a fused chain", "one thread", "two threads of a device", "two devices", "a collective")


def hand_offs(plan: af.Plan, threads: dict[str, str]) -> Counter:
    """Each data edge as the runtime hands it over (``HAND_OFFS``): from one part of a
    fused chain's kernel to the next, a call on one thread (same stream, or a small
    move run on its partner's thread), a message between two stream threads of one
    device or of two devices, or into or out of a collective."""
    device = {s.name: s.device for s in plan.streams}
    kinds: Counter = Counter()
    for actor in plan.actors:
        if len(actor.ops) > 1:
            kinds["inside a fused chain"] += len(actor.ops) - 1
    for reg, _, _, actor, _ in data_edges(plan):
        producer = plan.actors[reg.producer]
        sender, receiver = threads[producer.name], threads[actor.name]
        if producer.group >= 0 or actor.group >= 0:
            kinds["a collective"] += 1
        elif sender == receiver:
            kinds["one thread"] += 1
        elif device[sender] == device[receiver]:
            kinds["two threads of a device"] += 1
        else:
            kinds["two devices"] += 1
    return kinds


@settings(max_examples=30, **SETTINGS)
@given(st.data())
def test_no_consumer_starts_before_its_producer_ended(data):
    recipe, plan, feeds = draw_case(data, gs.recipes(sleepy=True, max_ops=12))
    n = len(feeds)
    with af.Session(plan, trace=True, stall_timeout=20) as s:
        outs = s.run(live(plan, feeds))
        spans = s.recorder.kernels()
        threads = s.threads()
    check_outputs(recipe, feeds, outs)
    for kind in check_order(plan, spans, n):
        event(f"cross-stream edges with sync {kind}")
    for kind in hand_offs(plan, threads):
        event(f"hand-off: {kind}")


def test_every_kind_of_hand_off_orders_and_delivers():
    """One graph with every hand-off of ``HAND_OFFS``: a relu fused with the call that
    reads it, a feed and a small copy run on their partner's thread, a 2 MiB copy keeps cpu:1's copy stream (a message from
    cpu:0's compute thread, then one to cpu:1's), an all-reduce's stream. Sleepy kernels
    shuffle the timing; every consumer starts after its producer ended and the results
    are numpy's."""
    big = (512, 512)
    with af.Graph() as g:
        x = af.placeholder("x", big, "float64", "cpu:0")
        h = af.ops.call(userfns.sleepy, af.ops.relu(x), shape=big, dtype="float64")
        far = af.ops.tanh(af.ops.to_device(h, "cpu:1"))
        near = af.ops.to_device(af.ops.slice(h, [0, 0], [2, 2]), "cpu:1")
        s = af.ops.all_reduce([af.ops.slice(h, [0, 0], [2, 2]), af.ops.slice(far, [0, 0], [2, 2])])
        af.output("y", af.ops.add(af.ops.add(s[1], near), af.ops.slice(far, [0, 0], [2, 2])))
    plan = af.compile(g, quota=2)
    n = 4
    feeds = [{"x": np.full(big, (i - 1.5) / 2)} for i in range(n)]
    with af.Session(plan, trace=True, stall_timeout=20) as session:
        outs = session.run(feeds)
        spans = session.recorder.kernels()
        threads = session.threads()
    assert set(hand_offs(plan, threads)) == set(HAND_OFFS), threads
    check_order(plan, spans, n)
    for f, out in zip(feeds, outs):
        v = np.maximum(f["x"][:2, :2], 0)
        np.testing.assert_allclose(out["y"], v + 2 * np.tanh(v) + v, rtol=1e-12)


def test_every_input_of_a_kernel_is_waited_for():
    """A kernel on cpu:1 reads a feed and two copies of slow results from cpu:0: it may
    start only once all three producers ended, not just the first it hears of."""
    with af.Graph() as g:
        x0 = af.placeholder("x0", shape=(2, 3), dtype="float64", device="cpu:0")
        x1 = af.placeholder("x1", shape=(2, 3), dtype="float64", device="cpu:1")
        a = af.ops.call(gs.sleep3ms, af.ops.relu(x0), shape=(2, 3), dtype="float64")
        b = af.ops.call(gs.sleep3ms, af.ops.tanh(x0), shape=(2, 3), dtype="float64")
        y = af.ops.concat([x1, af.ops.to_device(a, "cpu:1"), af.ops.to_device(b, "cpu:1")])
        af.output("y", af.ops.to_device(y, "cpu:2"))
    n = 4
    feeds = [{"x0": np.full((2, 3), i - 1.5), "x1": np.full((2, 3), float(i))} for i in range(n)]
    for quota in (1, 2):
        plan = af.compile(g, quota=quota)
        outs, _, spans = run_traced(plan, feeds)
        check_order(plan, spans, n)
        for f, out in zip(feeds, outs):
            want = np.concatenate([f["x1"], np.maximum(f["x0"], 0), np.tanh(f["x0"])])
            np.testing.assert_allclose(out["y"], want, rtol=1e-12)


def test_implied_edges_still_ordered():
    """Edges the compiler gives no wait of their own ("implied" by another input): on
    cpu:1, add(x, f(x)) reads the copy x both directly and through f. With sleeps in
    every kernel, every edge still orders, and the results are right."""
    with af.Graph() as g:
        x0 = af.placeholder("x", shape=(3, 3), dtype="float64", device="cpu:0")
        a = af.ops.call(userfns.sleepy, af.ops.relu(x0), shape=(3, 3), dtype="float64")
        x = af.ops.to_device(a, "cpu:1")
        fx = af.ops.call(userfns.sleepy, af.ops.tanh(x), shape=(3, 3), dtype="float64")
        y = af.ops.call(userfns.sleepy, af.ops.add(x, fx), shape=(3, 3), dtype="float64")
        af.output("y", y)
    plan = af.compile(g, quota=2)
    n = 5
    feeds = [{"x": np.full((3, 3), (i - 2) / 3)} for i in range(n)]
    outs, _, spans = run_traced(plan, feeds)
    kinds = check_order(plan, spans, n)
    assert kinds["implied"] >= 1, plan.summary()
    for f, out in zip(feeds, outs):
        v = np.maximum(f["x"], 0)
        np.testing.assert_allclose(out["y"], v + np.tanh(v), rtol=1e-12)


# --------------------------------------------------------------------------------------
# 5. pipelining across devices
# --------------------------------------------------------------------------------------


def overlapping_pairs(spans, early: str, late: str) -> list[tuple[int, int]]:
    """(i, i + 1) where a kernel of iteration i + 1 on ``early`` overlaps one of iteration i
    on ``late``."""
    pairs = set()
    for a in spans:
        for b in spans:
            if (
                a.thread == early
                and b.thread == late
                and a.args["iteration"] == b.args["iteration"] + 1
                and a.start < b.end
                and b.start < a.end
            ):
                pairs.add((b.args["iteration"], a.args["iteration"]))
    return sorted(pairs)


def _chain(stage0, stage1, quota: int):
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 4), dtype="float32", device="cpu:0")
        h = af.ops.call(stage0, af.ops.call(userfns.sleepy, x, shape=(4, 4)), shape=(4, 4))
        h1 = af.ops.to_device(h, "cpu:1")
        y = af.ops.call(userfns.sleepy, af.ops.call(stage1, h1, shape=(4, 4)), shape=(4, 4))
        af.output("y", y)
    return af.compile(g, quota=quota)


@pytest.mark.parametrize("quota", [2, 3])
def test_pipelining_rendezvous(quota):
    """Stage A of iteration i + 1 (cpu:0) and stage B of iteration i (cpu:1) each wait,
    inside their kernels, until the other has started. This completes without a timeout
    only if the runtime lets the two iterations run at the same time, and then every such
    pair overlaps in the trace. (A form with sleeping kernels, asserting that some pair
    overlapped, failed once on a loaded machine: a timing, not a runtime, fault.)"""
    n = 5
    plan = _chain(gs.stage_a, gs.stage_b, quota)
    feeds = [{"x": np.full((4, 4), i, np.float32)} for i in range(n)]
    gs.reset_rendezvous(n)
    outs, _, spans = run_traced(plan, feeds)
    assert gs.RENDEZVOUS["timeouts"] == []
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out["y"], np.full((4, 4), i, np.float32))
    assert overlapping_pairs(spans, "cpu:0/compute", "cpu:1/compute") == [(i, i + 1) for i in range(n - 1)]
    check_quotas_in_trace(plan, spans)
