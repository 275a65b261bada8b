"""Communication subgraph reuse (compiler/reuse.py, MindSpore's MS_COMM_COMPILER_OPT):
reused plans compute what unreused ones do, with fewer streams, actors and registers."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

import actorflow as af
from actorflow.compiler.reuse import ENV
from test_resources import DEVICES, collective_streams, expected, same_key_all_reduces

X = np.arange(12.0).reshape(4, 3)
FEEDS = {"x[cpu:0]": X, "x[cpu:1]": X * 2}


@pytest.fixture(autouse=True)
def no_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def test_the_seeds_thirty_all_reduces_need_ten_streams_without_reuse_and_one_with_it():
    graph = same_key_all_reduces(30)
    plain = af.compile(graph, max_ops_per_stream=3, fusion=False)
    reused = af.compile(graph, max_ops_per_stream=3, fusion=False, comm_reuse=-1)
    assert (len(collective_streams(plain)), len(collective_streams(reused))) == (10, 1)
    assert (len(plain.collectives), len(reused.collectives)) == (30, 1)
    (subgraph,) = reused.collectives
    assert [reused.actors[a].calls for a in subgraph.actors] == [30, 30]
    assert len(plain.actors) - len(reused.actors) == 29 * len(DEVICES)
    assert reused.labels == 31 and "labels: 31 of max_labels 65536" in reused.summary()
    shared = [r for r in reused.registers if r.name.startswith("comm_subgraph_0")]
    assert len(shared) == 2 and sum(r.nbytes * r.quota for r in shared) < sum(
        r.nbytes * r.quota
        for r in plain.registers
        if r.producer in {a for c in plain.collectives for a in c.actors}
    )
    np.testing.assert_array_equal(af.run(reused, FEEDS)["y"], af.run(plain, FEEDS)["y"])
    np.testing.assert_allclose(af.run(reused, FEEDS)["y"], expected(30, X) * 1.5)


def test_a_group_a_stream_can_carry_is_not_reused():
    plan = af.compile(same_key_all_reduces(3), max_ops_per_stream=3, fusion=False, comm_reuse=-1)
    assert len(plan.collectives) == 3 and plan.labels == 0


def test_at_most_the_limit_is_reused():
    plan = af.compile(same_key_all_reduces(30), max_ops_per_stream=3, fusion=False, comm_reuse=12)
    calls = [plan.actors[c.actors[0]].calls for c in plan.collectives]
    assert sorted(calls) == [1] * 18 + [12]
    assert len(collective_streams(plan)) == 1 + 6  # the subgraph's, and 18 others at 3 a stream
    np.testing.assert_allclose(af.run(plan, FEEDS)["y"], expected(30, X) * 1.5)


@pytest.mark.parametrize(("value", "reused"), [("-1", 30), ("7", 7), (None, 0), ("0", 0), ("-5", 0)])
def test_the_environment_switch(monkeypatch, caplog, value, reused):
    if value is not None:
        monkeypatch.setenv(ENV, value)
    caplog.set_level(logging.INFO, logger="actorflow.compiler")
    plan = af.compile(same_key_all_reduces(30), max_ops_per_stream=3, fusion=False)
    assert (
        sum(plan.actors[c.actors[0]].calls for c in plan.collectives if plan.actors[c.actors[0]].calls > 1)
        == reused
    )
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if value in ("0", "-5"):
        assert warned == [
            f"{ENV}={value}: communication subgraph reuse stays off (-1 or a positive integer turns it on)"
        ]
    else:
        assert warned == []
    limit = {"-1": 1000, "7": 7}.get(value)
    if limit:
        assert f"MAX_COMM_OP_REUSE_NUM: {limit}" in caplog.messages


@pytest.mark.parametrize("junk", ["on", "1.5", "", "-1x"])
def test_a_value_that_is_no_integer_is_an_error(monkeypatch, junk):
    monkeypatch.setenv(ENV, junk)
    with pytest.raises(af.CompileError, match=f"{ENV}={junk!r} is not an integer"):
        af.compile(same_key_all_reduces(4), fusion=False)


def test_the_variable_wins_over_the_option(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    plan = af.compile(same_key_all_reduces(8), max_ops_per_stream=2, fusion=False, comm_reuse=-1)
    assert len(plan.collectives) == 8
    monkeypatch.setenv(ENV, "-1")
    plan = af.compile(same_key_all_reduces(8), max_ops_per_stream=2, fusion=False, comm_reuse=0)
    assert len(plan.collectives) == 1


@pytest.mark.parametrize("option", [True, 1.5, "-1"])
def test_the_option_is_an_int(option):
    with pytest.raises(af.CompileError, match="comm_reuse: an int"):
        af.compile(same_key_all_reduces(4), comm_reuse=option)


def test_past_the_label_limit_an_error_names_the_labels_and_says_to_lower_the_value():
    with pytest.raises(af.CompileError) as caught:
        af.compile(same_key_all_reduces(30), max_ops_per_stream=3, fusion=False, comm_reuse=-1, max_labels=20)
    message = str(caught.value)
    assert (
        "takes 31 labels (30 calls of 1 subgraphs: one a call, one a subgraph), more than max_labels=20"
        in message
    )
    assert f"lower the reuse limit (comm_reuse or {ENV}, now 1000 operators)" in message
    plan = af.compile(
        same_key_all_reduces(30), max_ops_per_stream=3, fusion=False, comm_reuse=19, max_labels=20
    )
    assert plan.labels == 20


def test_the_log_lines(caplog):
    caplog.set_level(logging.INFO, logger="actorflow.compiler")
    graph = same_key_all_reduces(10, shape=(2, 2))
    af.compile(graph, max_ops_per_stream=3, fusion=False, comm_reuse=-1)
    assert [r.name for r in caplog.records] == ["actorflow.compiler"] * 4
    assert caplog.messages == [
        "MAX_COMM_OP_REUSE_NUM: 1000",
        "Start reuse comm_subgraph_0: 10 calls of all_reduce (2, 2) over cpu:0,cpu:1",
        "Reuse comm op reused_comm_sub_graphs_ size: 10",
        "Label list size: 11",
    ]


def chained_layers(n: int, direct: bool = False) -> af.Graph:
    """``n`` layers, each all-reducing what the layer before it computed from the last
    all-reduce (tanh between, unless ``direct``): every call reads the one before it."""
    with af.Graph() as g:
        h = [af.placeholder(f"x[{d}]", (4, 3), "float64", d) for d in DEVICES]
        for _ in range(n):
            h = af.ops.all_reduce(h if direct else [af.ops.tanh(t) for t in h], op="sum")
        af.output("y", h[0])
    return g


def chained_reference(n: int, feeds: dict) -> np.ndarray:
    h = [feeds[f"x[{d}]"] for d in DEVICES]
    for _ in range(n):
        h = [sum(np.tanh(t) for t in h)] * len(DEVICES)
    return h[0]


def test_chained_layers_of_the_seeds_kind_need_six_streams_without_reuse_and_one_with_it():
    """24 layers, each all-reduce feeding the next layer: the calls run in the collective
    order, which is topological, so the chain is one subgraph."""
    graph = chained_layers(24)
    plain = af.compile(graph, max_ops_per_stream=4, fusion=False)
    reused = af.compile(graph, max_ops_per_stream=4, fusion=False, comm_reuse=-1)
    assert (len(collective_streams(plain)), len(collective_streams(reused))) == (6, 1)
    (subgraph,) = reused.collectives
    assert [reused.actors[a].calls for a in subgraph.actors] == [24, 24]
    assert reused.labels == 25


@pytest.mark.parametrize("quota", [1, 2, 3])
def test_chained_reused_layers_give_the_results_of_unreused_ones(quota):
    graph = chained_layers(24)
    plain = af.compile(graph, max_ops_per_stream=4, fusion=False, quota=quota)
    reused = af.compile(graph, max_ops_per_stream=4, fusion=False, comm_reuse=-1, quota=quota)
    feeds = [{"x[cpu:0]": X / 10, "x[cpu:1]": X / 5}, {"x[cpu:0]": -X / 7, "x[cpu:1]": X / 3}]
    got, want = af.run(reused, feeds), af.run(plain, feeds)
    for mine, theirs, fed in zip(got, want, feeds):
        np.testing.assert_array_equal(mine["y"], theirs["y"])
        np.testing.assert_allclose(mine["y"], chained_reference(24, fed))


def test_a_call_reading_the_one_before_it_straight_stays_out_of_its_subgraph():
    """all_reduce(all_reduce(x)): the subgraph would read its own register, so every
    other call stays a collective of its own."""
    graph = chained_layers(6, direct=True)
    plain = af.compile(graph, max_ops_per_stream=1, fusion=False)
    reused = af.compile(graph, max_ops_per_stream=1, fusion=False, comm_reuse=-1)
    calls = sorted(reused.actors[c.actors[0]].calls for c in reused.collectives)
    assert calls == [1, 1, 1, 3]
    np.testing.assert_array_equal(af.run(reused, FEEDS)["y"], af.run(plain, FEEDS)["y"])


# -- random graphs with many same-key collectives ---------------------------------------


@st.composite
def collective_graphs(draw):
    """Per device a pool of (4, 3) values; each step applies an elementwise op per device
    or an all-reduce (sum or max) over all devices of a pool entry: often an early one, so
    that many all-reduces share a key and don't depend on each other, or (a layer) the
    tanh of the latest entry, so that others read the one before them."""
    n_dev = draw(st.integers(2, 4))
    step = st.tuples(
        st.sampled_from(["reduce"] * 4 + ["layer"] * 3 + ["tanh", "mul", "add"]),
        st.one_of(st.integers(0, 3), st.integers(0, 10**6)),
        st.integers(0, 10**6),
        st.sampled_from(["sum", "max"]),
    )
    steps = draw(st.lists(step, min_size=8, max_size=30))
    outs = draw(st.lists(st.integers(0, 10**6), min_size=1, max_size=3))
    return n_dev, steps, outs


def build(case) -> af.Graph:
    n_dev, steps, outs = case
    devices = [f"cpu:{k}" for k in range(n_dev)]
    with af.Graph() as g:
        pool = [[af.placeholder(f"x[{d}]", (4, 3), "float64", d) for d in devices]]
        for op, a, b, reduce in steps:
            left, right = pool[a % len(pool)], pool[b % len(pool)]
            if op == "reduce":
                pool.append(af.ops.all_reduce(left, op=reduce))
            elif op == "layer":
                pool.append(af.ops.all_reduce([af.ops.tanh(t) for t in pool[-1]], op=reduce))
            elif op == "tanh":
                pool.append([af.ops.tanh(t) for t in left])
            else:
                pool.append([getattr(af.ops, op)(t, u) for t, u in zip(left, right)])
        for k, o in enumerate(dict.fromkeys(o % len(pool) for o in outs)):
            for d, t in enumerate(pool[o]):
                af.output(f"y{k}[{d}]", af.ops.tanh(t))
        for d in range(len(devices)):  # every all-reduce's result is used
            used = [t[d] for t in pool[1:]]
            if used:
                af.output(f"all[{d}]", af.ops.concat(used, axis=0))
    return g


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    collective_graphs(),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from([-1, 2, 3, 5]),
    st.booleans(),
    st.integers(1, 3),
)
def test_reused_plans_give_the_results_of_unreused_ones(case, quota, per_stream, limit, fusion, iterations):
    graph = build(case)
    options = dict(quota=quota, max_ops_per_stream=per_stream, fusion=fusion)
    plain = af.compile(graph, **options)
    reused = af.compile(graph, comm_reuse=limit, **options)
    assert len(collective_streams(reused)) <= len(collective_streams(plain))
    target(float(reused.labels))
    rng = np.random.default_rng(0)
    feeds = [{f.name: rng.uniform(-1, 1, (4, 3)) for f in plain.feeds} for _ in range(iterations)]
    got, want = af.run(reused, feeds), af.run(plain, feeds)
    for mine, theirs in zip(got, want):
        assert mine.keys() == theirs.keys()
        for name in theirs:
            np.testing.assert_array_equal(mine[name], theirs[name])


def test_a_loaded_plan_with_a_reused_subgraph_on_a_shared_stream_is_refused():
    """A reused subgraph's calls are nodes of their own in the deadlock check; one on a
    stream another collective uses would be waited on in that stream's order too."""
    from test_plan import edited, load_error

    with af.Graph() as g:
        xs = [af.placeholder(f"x[{d}]", (4, 3), "float64", d) for d in DEVICES]
        total = af.ops.all_reduce(xs, op="max")[0]
        for _ in range(6):
            total = af.ops.add(total, af.ops.all_reduce(xs, op="sum")[0])
        af.output("y", total)
    plan = af.compile(g, comm_reuse=-1, max_ops_per_stream=2, fusion=False)
    reused = [a for a in plan.actors if a.calls > 1]
    other = next(a for a in plan.actors if a.kind == "collective" and a.calls == 1)
    assert reused and other.stream not in {a.stream for a in reused}

    def share(data):
        for a in reused:
            data["actors"][a.id]["stream"] = other.stream

    assert "shares its streams" in str(load_error(edited(plan, share)))


def test_a_traced_reused_subgraph_counts_its_calls_and_each_reader_names_its_call():
    plan = af.compile(same_key_all_reduces(6), max_ops_per_stream=3, fusion=False, comm_reuse=-1)
    subgraph = [a for a in plan.actors if a.calls > 1]
    calls = subgraph[0].calls
    with af.Session(plan, trace=True) as s:
        s.run([FEEDS, FEEDS])
        spans = [sp for sp in s.recorder.spans if "act" in sp.args]
    by_act = {(sp.args["actor"], sp.args["act"]): sp for sp in spans}
    name = next(sp.args["actor"] for sp in spans if "call" in sp.args)
    assert sorted(sp.args["act"] for sp in spans if sp.args["actor"] == name) == list(range(2 * calls))
    read_calls: dict[int, set[int]] = {}
    for o in (o for a in subgraph for o in a.outputs):
        for c in plan.registers[o].consumers:
            read_calls.setdefault(c.actor, set()).add(c.call)
    readers = [
        sp for sp in spans if sp.args["actor"] != name and any(n == name for n, _ in sp.args["inputs"])
    ]
    assert len(readers) == 2 * len(read_calls)
    for sp in readers:
        actor = next(a for a in plan.actors if a.name == sp.args["actor"])
        named = [by_act[(name, act)] for n, act in sp.args["inputs"] if n == name]
        assert {p.args["call"] for p in named} == read_calls[actor.id]
        assert {p.args["iteration"] for p in named} == {sp.args["iteration"]}
