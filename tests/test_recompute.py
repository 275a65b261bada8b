"""Recompute (``af.recompute``, ``parallel.recompute``): the same training as the plain
run, fewer bytes kept for backward, one more forward kernel per recomputed op and
micro-batch, collectives recomputed only when asked, and clear errors for what can't be
recomputed."""

from collections import Counter

import numpy as np
import pytest

import actorflow as af
from actorflow import ops
from actorflow.compiler.schedules import kept_for_backward
from actorflow.config import parse_config
from actorflow.errors import ConfigError, GraphError
from actorflow.training import compile_config
from actorflow.training.data import step_feeds, synthetic_classification
from actorflow.training.runner import kept_bytes_per_stage

# A micro-batch's activations (16 rows x 64) outweigh the first layer's weights (8 x 64):
# with micro-batches the clones read those in place, as every reader of a parameter does.
YAML = """\
model: {kind: mlp, sizes: [8, 64, 64, 4], activation: tanh, dtype: float64}
data: {kind: synthetic_classification, samples: 128, seed: 3}
train: {steps: 10, batch_size: 64, optimizer: {kind: sgd, lr: 0.1, momentum: 0.5}}
parallel: {stages: [cpu:0, cpu:1], micro_batches: 4, schedule: 1f1b}
"""

RUNS = {
    "one-device": ("parallel.stages=[cpu:0]", "parallel.micro_batches=1"),
    "micro-batches": ("parallel.stages=[cpu:0]",),
    "gpipe": ("parallel.schedule=gpipe",),
    "1f1b": (),
}

# per layer: matmul and bias_add, and the activation but for the last layer
LAYER_OPS = Counter({"matmul": 3, "bias_add": 3, "tanh": 2})


def train(overrides):
    """10 steps of the config: (plan, parameters, losses, register stats, kernel spans)."""
    config = parse_config(YAML, overrides)
    plan = compile_config(config)
    data = synthetic_classification(config)
    with af.Session(plan, trace=True) as session:
        losses = [
            np.mean([o["loss"] for o in session.run(step_feeds(config, data, step))])
            for step in range(config.train.steps)
        ]
        return plan, session.parameters(), losses, session.register_stats(), session.recorder.kernels()


_plain: dict[str, tuple] = {}


def plain(name):
    if name not in _plain:
        _plain[name] = train(RUNS[name])
    return _plain[name]


def ops_per_step(plan, spans) -> Counter:
    counts = Counter(op for s in spans for op in s.args["op"].split("+"))  # a fused chain's members
    return Counter({op: n // len({s.args["iteration"] for s in spans}) for op, n in counts.items()})


@pytest.mark.parametrize("name", list(RUNS))
def test_recompute_trains_as_the_plain_run(name):
    _, want, want_losses, _, _ = plain(name)
    plan, got, losses, _, _ = train((*RUNS[name], "parallel.recompute=true"))
    assert any(a.name.endswith(".recompute") for a in plan.actors)
    assert set(got) == set(want)
    for param, value in want.items():
        np.testing.assert_allclose(got[param], value, rtol=1e-9, atol=0, err_msg=param)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-9)


@pytest.mark.parametrize("name", list(RUNS))
def test_recompute_keeps_fewer_bytes_and_adds_the_forward_kernels(name):
    config = parse_config(YAML, RUNS[name])
    stages, m = config.parallel.stages, config.parallel.micro_batches
    plain_plan, _, _, plain_stats, plain_spans = plain(name)
    plan, _, _, stats, spans = train((*RUNS[name], "parallel.recompute=true"))
    # a micro-batch keeps fewer bytes on every stage; how many micro-batches a pipeline
    # stage held at once depends on timing, so measured bytes are compared on one stream
    per_micro_batch = kept_bytes_per_stage(plan, {r.name: {"max_held": 1} for r in plan.registers}, stages)
    plain_per_micro_batch = kept_bytes_per_stage(
        plain_plan, {r.name: {"max_held": 1} for r in plain_plan.registers}, stages
    )
    assert all(0 < k < p for k, p in zip(per_micro_batch, plain_per_micro_batch))
    kept = kept_bytes_per_stage(plan, stats, stages)
    plain_kept = kept_bytes_per_stage(plain_plan, plain_stats, stages)
    if len(stages) == 1:
        assert 0 < kept[0] < plain_kept[0], (kept, plain_kept)
    quota = {r.name: r.quota for r in plan.registers}
    bound = kept_bytes_per_stage(plan, {n: {"max_held": q} for n, q in quota.items()}, stages)
    assert all(0 < k <= b for k, b in zip(kept, bound))
    extra = ops_per_step(plan, spans) - ops_per_step(plain_plan, plain_spans)
    assert extra == Counter({op: n * m for op, n in LAYER_OPS.items()})
    recomputed = Counter(s.args["op"] for s in spans if s.args["actor"].endswith(".recompute"))
    assert recomputed == Counter({op: n * m * config.train.steps for op, n in LAYER_OPS.items()})


def test_gpipe_plans_less_memory_with_recompute():
    """Under GPipe each kept register has m buffers; recomputed ones have one each. On
    the last stage, that is: the first stage's output crosses to the next stage, which
    GPipe gives m buffers anyway."""
    overrides = ["parallel.schedule=gpipe", "parallel.micro_batches=8"]
    plain_plan = compile_config(parse_config(YAML, overrides))
    plan = compile_config(parse_config(YAML, [*overrides, "parallel.recompute=true"]))
    assert plan.memory["cpu:1"] < plain_plan.memory["cpu:1"]


def test_recompute_per_stage():
    _, want, _, _, _ = plain("1f1b")
    plan, got, _, _, _ = train(("parallel.recompute=[false, true]",))
    clones = [a for a in plan.actors if a.name.endswith(".recompute")]
    assert clones and {a.device for a in clones} == {"cpu:1"}
    for param, value in want.items():
        np.testing.assert_allclose(got[param], value, rtol=1e-9, atol=0, err_msg=param)


def test_a_clone_waits_for_the_gradient_of_its_backward_reader():
    plan = compile_config(parse_config(YAML, [*RUNS["one-device"], "parallel.recompute=true"]))
    clones = [a for a in plan.actors if a.name.endswith(".recompute")]
    assert all(a.backward and a.recompute for a in clones)
    gated = []
    for clone in clones:
        for i in clone.inputs:
            reg = plan.registers[i.register]
            if reg.control:
                gated.append(clone)
                assert plan.actors[reg.producer].backward
    # each chain of clones starts at the block's input and waits once, at its start
    assert [a.op for a in gated] == ["matmul"] * len(gated) and gated
    kept = {r.name for r in kept_for_backward(plan)}
    assert not kept & {r.name for a in plan.actors if a.recompute and not a.backward for r in _outs(plan, a)}


def _outs(plan, actor):
    return [plan.registers[o] for o in actor.outputs]


# -- the graph API ------------------------------------------------------------------------


def two_device_graph(comm: bool | None, inline: bool = False):
    """y = tanh(all_reduce(tanh(x_d @ w_d))) on two devices, in a recompute block (unless
    comm is None), and SGD on the w_d; with ``inline``, only the first tanh is marked."""
    rng = np.random.default_rng(7)
    with af.Graph() as g:
        xs = [af.placeholder(f"x{d}", (4, 3), "float64", f"cpu:{d}") for d in range(2)]
        ws = [af.parameter(f"w{d}", rng.standard_normal((3, 5)), f"cpu:{d}") for d in range(2)]
        if inline:
            hs = [af.recompute(ops.tanh(ops.matmul(x, w))) for x, w in zip(xs, ws)]
            s = ops.all_reduce(hs)
            ys = [ops.tanh(t) for t in s]
        elif comm is None:
            ys = [ops.tanh(t) for t in ops.all_reduce([ops.tanh(ops.matmul(x, w)) for x, w in zip(xs, ws)])]
        else:
            with af.recompute(comm=comm):
                s = ops.all_reduce([ops.tanh(ops.matmul(x, w)) for x, w in zip(xs, ws)])
                ys = [ops.tanh(t) for t in s]
        loss = ops.reduce_sum(ops.mul(ys[0], ys[0]))
        af.minimize(loss, af.optim.SGD(lr=0.05))
        af.output("loss", loss)
    return g


def steps(plan):
    rng = np.random.default_rng(11)
    feeds = [{f"x{d}": rng.standard_normal((4, 3)) for d in range(2)} for _ in range(10)]
    with af.Session(plan, trace=True) as s:
        for f in feeds:
            s.run(f)
        return s.parameters(), Counter(op for k in s.recorder.kernels() for op in k.args["op"].split("+"))


@pytest.mark.parametrize("comm", [False, True])
def test_collectives_are_recomputed_only_when_asked(comm):
    want, plain_ops = steps(af.compile(two_device_graph(None)))
    plan = af.compile(two_device_graph(comm), fusion=False)  # else it shares a bucket with a gradient
    got, got_ops = steps(plan)
    for param, value in want.items():
        np.testing.assert_allclose(got[param], value, rtol=1e-9, atol=0, err_msg=param)
    cloned = {c.name for c in plan.collectives if c.name.endswith(".recompute")}
    assert cloned == ({"all_reduce_8.recompute"} if comm else set())
    # y0's tanh, each device's tanh and matmul before the all-reduce (y1 feeds nothing),
    # and the all-reduce itself with comm=True; once a step
    extra = Counter({"tanh": 3, "matmul": 2, **({"all_reduce": 1} if comm else {})})
    assert got_ops - plain_ops == Counter({op: 10 * n for op, n in extra.items()})


def test_recompute_one_op_inline():
    want, plain_ops = steps(af.compile(two_device_graph(None)))
    plan = af.compile(two_device_graph(None, inline=True))
    got, got_ops = steps(plan)
    for param, value in want.items():
        np.testing.assert_allclose(got[param], value, rtol=1e-9, atol=0, err_msg=param)
    assert sorted(a.name for a in plan.actors if a.name.endswith(".recompute")) == [
        "tanh_5.recompute",
        "tanh_7.recompute",
    ]
    assert got_ops - plain_ops == Counter({"tanh": 20})


def test_what_no_backward_reads_is_not_recomputed():
    with af.Graph() as g:
        x = af.placeholder("x", (2, 2), "float64")
        af.output("y", af.recompute(ops.relu(x)))
    plan = af.compile(g)
    assert [a.name for a in plan.actors if a.recompute] == ["relu_1"]
    assert not any(a.name.endswith(".recompute") for a in plan.actors)


def test_a_block_marks_only_forward_compute_ops():
    with af.Graph() as g:
        x = af.placeholder("x", (2, 2), "float64")
        with af.recompute():
            w = af.parameter("w", np.eye(2))
            h = ops.to_device(ops.matmul(x, w), "cpu:1")
            loss = ops.reduce_sum(h)
            (dw,) = af.gradients(loss, [w])
        af.output("dw", dw)
    marked = {n.op for n in g.nodes if n.recompute}
    assert marked == {"matmul", "sum"}
    assert not any(n.recompute for n in g.nodes if n.backward)


def test_a_failed_block_marks_nothing():
    with af.Graph() as g:
        x = af.placeholder("x", (2, 2), "float64")
        with pytest.raises(GraphError), af.recompute():
            ops.relu(x)
            ops.matmul(x, af.placeholder("bad", (3, 3), "float64"))
    assert not any(n.recompute for n in g.nodes)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda x, w: af.recompute(x), "feed op"),
        (lambda x, w: af.recompute(w), "parameter op (parameter), kept anyway"),
        (lambda x, w: af.recompute(ops.to_device(x, "cpu:1")), "copy op (copy); pass comm=True"),
        (lambda x, w: af.recompute(af.gradients(ops.reduce_sum(ops.matmul(x, w)), [w])[0]), "backward pass"),
        (lambda x, w: af.recompute(np.ones(2)), "expected a tensor, got ndarray"),
    ],
)
def test_what_cannot_be_recomputed_is_refused(make, message):
    with af.Graph():
        x = af.placeholder("x", (2, 2), "float64")
        w = af.parameter("w", np.eye(2))
        with pytest.raises(
            GraphError, match="recompute: .*" + message.replace("(", r"\(").replace(")", r"\)")
        ):
            make(x, w)


def test_recompute_needs_a_graph_and_the_forward_pass():
    with pytest.raises(GraphError, match="no graph is being built"), af.recompute():
        pass
    with af.Graph() as g:
        g.building_backward = True
        with pytest.raises(GraphError, match="mark forward ops only"), af.recompute():
            pass
    with af.Graph():
        t = af.placeholder("x", (2,), "float64")
    with af.Graph(), pytest.raises(GraphError, match="belongs to another graph"):
        af.recompute(t)


def test_a_collective_is_marked_with_comm_true():
    with af.Graph() as g:
        xs = [af.placeholder(f"x{d}", (2,), "float64", f"cpu:{d}") for d in range(2)]
        s = ops.all_reduce(xs)
        with pytest.raises(GraphError, match=r"collective op \(all_reduce\); pass comm=True"):
            af.recompute(s[0])
        af.recompute(s[0], comm=True)
    assert [n.op for n in g.nodes if n.recompute] == ["all_reduce"]


@pytest.mark.parametrize(
    "value, message",
    [
        ("[true]", r"parallel.recompute: expected true, false or one flag per stage \(2\), got \[True\]"),
        ("[true, 1]", r"parallel.recompute\[1\]: expected true or false, got 1"),
        ("yes please", "parallel.recompute: expected true or false"),
    ],
)
def test_bad_recompute_in_yaml(value, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(YAML, [f"parallel.recompute={value}"])
