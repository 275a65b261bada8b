"""Chain fusion (``compiler.chains``): which actors fuse, and that a fused plan computes
what the unfused one does, on the streams' own threads, within its quotas."""

from __future__ import annotations

import threading
from collections import Counter

import attrs
import numpy as np
import pytest

import actorflow as af
import userfns
from actorflow.compiler.chains import MAX_MEMBERS
from actorflow.config import parse_config
from actorflow.ops import kernels
from actorflow.ops.chain import bind, chain
from actorflow.ops.micro_batch import accumulate
from actorflow.ops.registry import register
from actorflow.training import compile_config
from actorflow.training.data import step_feeds, synthetic_classification
from actorflow.training.runner import local_feeds

YAML = """\
model: {kind: mlp, sizes: [8, 16, 16, 4], activation: relu, dtype: float64}
data: {kind: synthetic_classification, samples: 64, seed: 3}
train: {steps: 4, batch_size: 16, optimizer: {kind: sgd, lr: 0.2, momentum: 0.5}}
parallel: {stages: [cpu:0, cpu:1], micro_batches: 4, schedule: 1f1b}
"""


def thread_tagged(a):
    """Identity that records the thread it ran on, in call order."""
    RAN.append(threading.current_thread().name)
    return a + 1


RAN: list[str] = []


def call_chain(n: int, devices=("cpu:0",)) -> af.Graph:
    with af.Graph() as g:
        h = af.placeholder("x", (3,), "float64", devices[0])
        for k in range(n):
            device = devices[k * len(devices) // n]
            if device != devices[0] and k and devices[(k - 1) * len(devices) // n] != device:
                h = af.ops.to_device(h, device)
            h = af.ops.call(thread_tagged, h, shape=(3,), dtype="float64", name=f"c{k}")
        af.output("y", h)
    return g


def test_a_chain_of_calls_is_one_actor_whose_parts_run_in_order_on_its_stream_thread():
    plan = af.compile(call_chain(4))
    (fused,) = [a for a in plan.actors if a.kind == "compute"]
    assert fused.name == "c0+c1+c2+c3" and fused.op == "call+call+call+call"
    inner = [r for r in plan.registers if r.producer == fused.id and not r.consumers]
    assert [r.name for r in inner] == ["c0", "c1", "c2"] and {r.quota for r in inner} == {1}
    RAN.clear()
    with af.Session(plan) as s:
        outs = s.run([{"x": np.full(3, float(i))} for i in range(5)])
        threads = s._runtime.threads()
    np.testing.assert_array_equal([o["y"] for o in outs], [np.full(3, i + 4.0) for i in range(5)])
    assert RAN == [threads[fused.name]] * 20 and threads[fused.name] == "cpu:0/compute"


def test_a_long_chain_fuses_in_pieces_of_at_most_max_members():
    plan = af.compile(call_chain(2 * MAX_MEMBERS + 1))
    fused = [a.name.split("+") for a in plan.actors if a.kind == "compute"]
    assert [len(names) for names in fused] == [MAX_MEMBERS, MAX_MEMBERS, 1]
    assert [n for names in fused for n in names] == [f"c{k}" for k in range(2 * MAX_MEMBERS + 1)]
    out = af.run(plan, {"x": np.zeros(3)})
    np.testing.assert_array_equal(out["y"], np.full(3, 2.0 * MAX_MEMBERS + 1))


def test_devices_split_chains_and_unfused_plans_keep_one_actor_per_op():
    plan = af.compile(call_chain(4, ("cpu:0", "cpu:1")))
    assert sorted(a.name for a in plan.actors if a.kind == "compute") == ["c0+c1", "c2+c3"]
    unfused = af.compile(call_chain(4, ("cpu:0", "cpu:1")), fuse_kernels=False)
    assert sorted(a.name for a in unfused.actors if a.kind == "compute") == ["c0", "c1", "c2", "c3"]
    feeds = [{"x": np.full(3, float(i))} for i in range(3)]
    for got, want in zip(af.run(plan, feeds), af.run(unfused, feeds)):
        np.testing.assert_array_equal(got["y"], want["y"])


def test_only_a_consumer_that_reads_nothing_else_fuses_and_a_producer_takes_one():
    with af.Graph() as g:
        x = af.placeholder("x", (3,), "float64", "cpu:0")
        a = af.ops.relu(x, name="a")
        b = af.ops.tanh(a, name="b")  # reads only a: fuses
        c = af.ops.exp(a, name="c")  # reads only a too, but a takes one follower
        d = af.ops.add(b, c, name="d")  # reads two actors' outputs: stays
        af.output("y", d)
    plan = af.compile(g)
    names = sorted(a.name for a in plan.actors if a.kind == "compute")
    assert names == ["a+b", "c", "d"]
    (ab,) = [a for a in plan.actors if a.name == "a+b"]
    assert {plan.registers[o].name: len(plan.registers[o].consumers) for o in ab.outputs} == {"a": 1, "b": 1}
    x = np.array([-1.0, 0.5, 2.0])
    np.testing.assert_allclose(
        af.run(plan, {"x": x})["y"], np.tanh(np.maximum(x, 0)) + np.exp(np.maximum(x, 0))
    )


def test_a_user_quota_on_an_inner_register_wins():
    plan = af.compile(call_chain(3), quotas={"c0": 3})
    quotas = {r.name: r.quota for r in plan.registers}
    assert quotas["c0"] == 3 and quotas["c1"] == 1 and quotas["c2"] == 2


def test_a_failing_part_names_the_fused_actor_and_its_own_line():
    with af.Graph() as g:
        x = af.placeholder("x", (3,), "float64", "cpu:0")
        h = af.ops.call(userfns.identity, x, shape=(3,), dtype="float64", name="ok")
        af.output("y", af.ops.call(userfns.fail, h, shape=(3,), dtype="float64", name="boom"))
    plan = af.compile(g)
    boom_line = af.compile(g, fuse_kernels=False).actors[2].where
    with pytest.raises(ZeroDivisionError) as info:
        af.run(plan, {"x": np.ones(3)})
    notes = "\n".join(info.value.__notes__)
    assert "actor 'ok+boom' (op call+call)" in notes
    assert f"in part 'boom' of the fused chain, built at {boom_line}" in notes


@pytest.mark.parametrize("phase", [0, 1])
def test_a_bound_chain_calls_what_the_chain_calls_and_notes_a_failing_part_alike(phase):
    """The runtime runs ``bind``'s generated function; the fallbacks that run parts on the
    host run ``chain``: the same writes, the same note on the same part."""
    rng = np.random.default_rng(phase)
    parts = (
        (kernels.add, {}, (0, 1), (0,), False, "a", "line a"),
        (accumulate, {"micro_batches": 2}, (~0,), (1,), True, "b", "line b"),
        (kernels.matmul, {"transpose_b": True}, (~0, 2), (2,), False, "c", "line c"),
        (kernels.relu, {}, (~2,), (3,), False, "d", "line d"),  # one source, a later output
    )
    ins = [rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), phase]
    start = [rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), np.zeros((3, 5)), np.zeros((3, 5))]
    ours, theirs = [o.copy() for o in start], [o.copy() for o in start]
    bind(parts)(ins, ours)
    chain(ins, theirs, parts)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(ours[2], (ins[0] + ins[1]) @ ins[2].T)
    np.testing.assert_allclose(ours[3], np.maximum(ours[2], 0))
    ins[2] = rng.standard_normal((5, 3))  # part c now fails
    notes = []
    for run in (bind(parts), lambda i, o: chain(i, o, parts)):
        with pytest.raises(ValueError) as info:
            run(ins, [o.copy() for o in start])
        notes.append(info.value.__notes__)
    assert notes[0] == notes[1] == ["actorflow: in part 'c' of the fused chain, built at line c"]
    assert bind(())(ins, start) is None  # no parts: nothing to call, as chain calls nothing


def test_a_part_that_would_fail_every_act_is_refused_at_load():
    plan = af.compile(call_chain(2))
    (fused,) = [a for a in plan.actors if len(a.ops) > 1]
    kernel, attrs, *rest = fused.attrs["parts"][1]
    parts = (fused.attrs["parts"][0], (kernel, {**attrs, "alpha": 1}, *rest))
    bad = attrs_evolve(plan, fused, parts)
    with pytest.raises(af.PlanSerializationError, match="does not take attributes \\['alpha', 'fn'\\]"):
        af.Plan.from_bytes(bad.to_bytes(), allow=["test_chains", "userfns"])
    beyond = (fused.attrs["parts"][0], (kernel, attrs, (5,), *rest[1:]))
    with pytest.raises(af.PlanSerializationError, match="part 1 of its chain reads \\[5\\]"):
        af.Plan.from_bytes(attrs_evolve(plan, fused, beyond).to_bytes(), allow=["test_chains", "userfns"])
    first, second = fused.attrs["parts"]
    ahead = ((*first[:2], (~1,), *first[3:]), second)  # reads what the second part writes
    with pytest.raises(af.PlanSerializationError, match="reads outputs \\[1\\] no part before wrote"):
        af.Plan.from_bytes(attrs_evolve(plan, fused, ahead).to_bytes(), allow=["test_chains", "userfns"])
    phased = (first, (*second[:4], True, *second[5:]))  # no once-per-step reader hands a phase
    with pytest.raises(af.PlanSerializationError, match="takes a phase, but the actor acts at one rate"):
        af.Plan.from_bytes(attrs_evolve(plan, fused, phased).to_bytes(), allow=["test_chains", "userfns"])


def attrs_evolve(plan: af.Plan, actor, parts) -> af.Plan:
    actors = list(plan.actors)
    actors[actor.id] = attrs.evolve(actor, attrs={"parts": parts})
    return attrs.evolve(plan, actors=tuple(actors))


def test_a_producer_also_read_off_its_stream_keeps_its_follower_apart():
    """Fused, the other reader would wait for the follower's kernel too: a copy to cpu:1
    of what a relu makes runs beside the tanh that reads it on cpu:0."""
    with af.Graph() as g:
        x = af.placeholder("x", (3,), "float64", "cpu:0")
        a = af.ops.relu(x, name="a")
        b = af.ops.tanh(a, name="b")
        c = af.ops.exp(af.ops.to_device(a, "cpu:1"), name="c")
        af.output("y", b)
        af.output("z", c)
    plan = af.compile(g)
    assert sorted(a.name for a in plan.actors if a.kind == "compute") == ["a", "b", "c"]
    out = af.run(plan, {"x": np.array([-1.0, 2.0, 3.0])})
    np.testing.assert_allclose(out["z"], np.exp([0.0, 2.0, 3.0]))


def test_a_gradient_that_communication_reads_is_not_held_behind_a_fused_follower():
    """Data-parallel backward: a hidden layer's output gradient (tanh_grad) is read by
    the input gradient's matmul, which could fuse, and by the weight and bias gradients,
    whose all-reduces read them. Fused with the matmul, it would hold those gradients and
    their all-reduces behind it; apart, compute-first priorities put the weight and bias
    gradients ahead of the input gradient on the stream. A pipeline's input gradient,
    which a copy to the previous stage reads, may still fuse (the last test above)."""
    devices = ["cpu:0", "cpu:1"]
    with af.Graph() as g:
        h = af.placeholder("x", (8, 4), "float64", devices, af.S(0))
        y = af.placeholder("y", (8, 4), "float64", devices, af.S(0))
        for k in range(3):
            w = af.parameter(f"w{k}", np.full((4, 4), 0.1), devices, af.B)
            b = af.parameter(f"b{k}", np.full(4, 0.1), devices, af.B)
            h = af.ops.bias_add(af.ops.matmul(h, w), b)
            h = af.ops.tanh(h) if k < 2 else h
        loss = af.ops.mse_loss(h, y)
        af.minimize(loss, af.optim.SGD(lr=0.1))
        af.output("loss", loss)
    plan = af.compile(g)
    on0 = [a for a in plan.actors if a.device == "cpu:0" and a.kind == "compute"]

    def readers_of(actor):
        return [plan.actors[c.actor] for o in actor.outputs for c in plan.registers[o].consumers]

    (grad,) = [a for a in on0 if a.op == "tanh_grad" and len(readers_of(a)) == 3]  # the middle layer's
    readers = readers_of(grad)
    talking = [r for r in readers if any(c.kind == "collective" for c in readers_of(r))]
    (input_grad,) = [r for r in readers if r not in talking]
    assert {r.op for r in talking} == {"matmul", "sum_to"} and input_grad.op == "matmul"
    assert all(r.priority < input_grad.priority for r in talking)


def test_a_fused_plan_travels_and_a_part_that_cannot_is_named():
    plan = af.compile(call_chain(3))
    back = af.Plan.from_bytes(plan.to_bytes(), allow=["test_chains", "userfns"])
    assert back == plan
    np.testing.assert_array_equal(af.run(back, {"x": np.zeros(3)})["y"], np.full(3, 3.0))
    lock = threading.Lock()

    def locked(a):
        with lock:
            return a

    with af.Graph() as g:
        x = af.placeholder("x", (3,), "float64", "cpu:0")
        h = af.ops.call(userfns.identity, x, shape=(3,), dtype="float64", name="first")
        af.output("y", af.ops.call(locked, h, shape=(3,), dtype="float64", name="second"))
    with pytest.raises(af.PlanSerializationError, match="actor 'first\\+second'"):
        af.compile(g).to_bytes()


def train(schedule: str, fuse: bool):
    config = parse_config(
        YAML, [f"parallel.schedule={schedule}", f"runtime.fuse_kernels={str(fuse).lower()}"]
    )
    plan = compile_config(config)
    data = synthetic_classification(config)
    with af.Session(plan, trace=True, stall_timeout=20) as s:
        losses = [
            [float(o["loss"]) for o in s.run(step_feeds(config, data, step, local_feeds(plan, 0)))]
            for step in range(config.train.steps)
        ]
        return plan, losses, s.parameters(), s.register_stats(), s.recorder.kernels()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
def test_a_pipeline_trains_the_same_fused_with_fewer_acts_and_within_its_quotas(schedule):
    plan, losses, params, stats, spans = train(schedule, fuse=True)
    plain, want_losses, want_params, _, plain_spans = train(schedule, fuse=False)
    assert losses == want_losses  # the same kernels on the same buffers: bitwise equal
    for name, value in want_params.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    ops = Counter(a.op for a in plan.actors)
    # every bias_add, relu and accumulate runs inside a chain: a layer's matmul, bias and
    # activation (and the next layer's, on the same stage), each gradient and its accumulate
    assert not {"bias_add", "relu", "accumulate"} & set(ops)
    chains = " ".join(a.op for a in plan.actors if len(a.ops) > 1)
    assert chains.count("bias_add+relu") == 2 and chains.count("accumulate") == 6
    assert len(spans) < len(plain_spans)
    assert all(s["max_held"] <= s["quota"] for s in stats.values())
    # a fused gradient's inner register is read only in its act: one buffer
    inner = [r for r in plan.registers if r.producer >= 0 and not r.consumers and not r.control]
    assert inner and {stats[r.name]["quota"] for r in inner} == {1}


def test_an_op_name_with_a_plus_is_refused_since_plus_joins_a_chains_ops():
    with pytest.raises(ValueError, match="an op's name has no '\\+'"):
        register("relu+tanh", "compute", None)
