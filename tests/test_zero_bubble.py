"""ZB-H1 (``schedule: zb1``): autodiff splits each backward pass into input gradients (B)
and weight gradients (W); the compiler defers W behind forward and B work. It trains
to 1F1B's parameters, holds no more micro-batches in flight than 1F1B's first stage,
really defers W, and never hangs."""

from __future__ import annotations

import numpy as np
import pytest

from actorflow.compiler.schedules import kept_for_backward, read_by_weight_grads
from actorflow.config import parse_config
from actorflow.errors import ConfigError
from actorflow.runtime import Session
from actorflow.training import compile_config
from actorflow.training.data import step_feeds, synthetic_classification
from actorflow.training.model import build_graph
from actorflow.training.runner import local_feeds

YAML = """\
model: {kind: mlp, sizes: [8, 16, 16, 16, 16, 4], activation: relu, dtype: float64}
data: {kind: synthetic_classification, samples: 64, seed: 3}
train: {steps: 5, batch_size: 16, optimizer: {kind: sgd, lr: 0.2, momentum: 0.5}}
parallel: {stages: [cpu:0, cpu:1], micro_batches: 4, schedule: 1f1b}
"""

STAGES = {2: "parallel.stages=[cpu:0, cpu:1]", 3: "parallel.stages=[cpu:0, cpu:1, cpu:2]"}
STALL_TIMEOUT = 20.0  # seconds without an act before a run fails instead of hanging


def config(schedule, p, *extra):
    return parse_config(YAML, [f"parallel.schedule={schedule}", STAGES[p], *extra])


def run(config):
    """Train ``config``'s steps traced: (parameters, losses, kernel spans, register stats, plan)."""
    plan = compile_config(config)
    data = synthetic_classification(config)
    losses = []
    with Session(plan, trace=True, stall_timeout=STALL_TIMEOUT) as session:
        for step in range(config.train.steps):
            outputs = session.run(step_feeds(config, data, step, local_feeds(plan, 0)))
            losses.append(float(np.mean([o["loss"] for o in outputs])))
        return session.parameters(), losses, session.recorder.kernels(), session.register_stats(), plan


def test_autodiff_marks_the_weight_gradients_of_an_mlp():
    """Two layers, one per stage: W = dW = x.T @ dy and db = sum(dy); B = the rest."""
    graph = build_graph(config("1f1b", 2, "model.sizes=[8, 16, 4]"))
    backward = [n for n in graph.nodes if n.backward]

    def readers(node):
        return [n for n in backward if node.id in {i for i, _ in n.inputs}]

    def named(name):
        (node,) = [n for n in graph.nodes if n.name == name]
        return node

    (dy1,) = [n for n in backward if n.op == "softmax_cross_entropy_grad"]
    assert not dy1.weight_grad
    w = {n.op: n.weight_grad for n in readers(dy1) if named("w1").id not in {i for i, _ in n.inputs}}
    assert w == {"matmul": True, "sum_to": True}  # dW1, db1
    (dx1,) = [n for n in readers(dy1) if named("w1").id in {i for i, _ in n.inputs}]
    assert not dx1.weight_grad
    # the gradient goes back to cpu:0 (B) and through the relu (B)
    (back,) = readers(dx1)
    assert back.op == "copy" and not back.weight_grad
    (dy0,) = readers(back)
    assert dy0.op == "relu_grad" and not dy0.weight_grad
    # layer 0: dW0 and db0 are W, and so is dx0, the feed's gradient, which no one reads
    assert {n.op for n in readers(dy0)} == {"matmul", "sum_to"}
    assert all(n.weight_grad for n in readers(dy0))
    assert not any(n.weight_grad for n in graph.nodes if not n.backward)
    plan = compile_config(config("zb1", 2, "model.sizes=[8, 16, 4]"))
    ops = [a.ops for a in plan.actors if a.weight_grad]  # a fused chain's members
    assert {op for chain in ops for op in chain} == {"matmul", "sum_to", "accumulate"}
    assert sum(chain[0] == "matmul" for chain in ops) == 2  # dead dx0 dropped


def test_weight_gradients_go_behind_forward_and_input_gradients():
    plan = compile_config(config("zb1", 3))
    assert any(a.weight_grad for a in plan.actors)
    for stream in {a.stream for a in plan.actors}:
        mine = [a for a in plan.actors if a.stream == stream and a.kind == "compute"]
        w = [a.priority for a in mine if a.weight_grad]
        other = [a.priority for a in mine if not a.weight_grad]
        assert not w or not other or min(w) > max(other), stream
    # under 1F1B a weight gradient can go ahead of a forward op (deeper first)
    ahead = compile_config(config("1f1b", 3))
    assert any(
        w.priority < f.priority
        for w in ahead.actors
        if w.weight_grad
        for f in ahead.actors
        if f.stream == w.stream and not f.backward and f.kind == "compute"
    )


@pytest.mark.parametrize("p", [2, 3])
def test_quotas_hold_what_deferred_weight_gradients_read(p):
    plan = compile_config(config("zbh1", p))
    stage = {d: s for s, (d,) in enumerate(plan.stages)}
    forward = {r.name for r in kept_for_backward(plan)}
    read_by_w = {r.name for r in read_by_weight_grads(plan)}
    assert read_by_w & forward and read_by_w - forward
    for r in plan.registers:
        s = stage.get(r.device)
        if r.name in read_by_w:
            assert r.quota == (p if r.name in forward else max(2, min(p, s + 1))), r.name
        elif r.name in forward:
            assert r.quota == p - s, r.name


@pytest.mark.parametrize("p", [2, 3])
def test_zb1_trains_like_1f1b_and_keeps_its_peak_activations(p):
    want_params, want_losses, _, want_stats, one_f_one_b = run(config("1f1b", p))
    got_params, got_losses, spans, stats, plan = run(config("zb1", p))
    assert set(got_params) == set(want_params)
    for name, value in want_params.items():
        np.testing.assert_allclose(got_params[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-9)

    # micro-batches in flight: no stage past 1F1B's first stage (p), which is unchanged
    def peaks(plan, stats):
        stage = {d: s for s, (d,) in enumerate(plan.stages)}
        held = [0] * p
        for r in kept_for_backward(plan):
            held[stage[r.device]] = max(held[stage[r.device]], stats[r.name]["max_held"])
        return held

    want, got = peaks(one_f_one_b, want_stats), peaks(plan, stats)
    assert max(got) <= max(want) == p
    assert got[0] <= want[0]
    # full activations (what B reads, no W) stay within 1F1B's p - s on every stage
    read_by_w = {r.name for r in read_by_weight_grads(plan)}
    for r in kept_for_backward(plan):
        if r.name not in read_by_w:
            assert stats[r.name]["max_held"] <= p - plan.stage_of(r.device), r.name
    # the first stage, which holds the most under 1F1B, plans the same bytes
    assert plan.memory["cpu:0"] == one_f_one_b.memory["cpu:0"]
    assert deferrals(plan, spans) > 0


def deferrals(plan, spans):
    """How often a stage ran a forward or B matmul of a later micro-batch of the step
    after micro-batch i's B began and before its W matmuls ended: W deferred, which
    1F1B's order (W before forward, the deeper first) does not do."""
    actor = {a.name: a for a in plan.actors}
    matmuls = [s for s in spans if s.name in actor and "matmul" in actor[s.name].ops]
    count = 0
    for stream in {s.thread for s in matmuls}:
        mine = [
            (s, actor[s.name], s.args["iteration"], s.args["micro_batch"])
            for s in matmuls
            if s.thread == stream
        ]
        for w, a, step, i in mine:
            if not a.weight_grad:
                continue
            b_start = min(
                s.start for s, b, k, j in mine if b.backward and not b.weight_grad and (k, j) == (step, i)
            )
            count += sum(
                1
                for s, b, k, j in mine
                if not b.weight_grad and k == step and j > i and b_start < s.start < w.start
            )
    return count


def test_1f1b_runs_no_later_micro_batch_before_its_weight_gradients():
    """The trace measure above, on 1F1B: what zb1 changes."""
    _, _, spans, _, plan = run(config("1f1b", 2))
    assert deferrals(plan, spans) == 0


@pytest.mark.parametrize("p", [2, 3])
def test_zb1_never_hangs(p):
    """Every m from 1 to 8 runs its steps to the end (a stall fails within STALL_TIMEOUT)
    and gives 1F1B's parameters."""
    for m in range(1, 9):
        overrides = (f"parallel.micro_batches={m}", f"train.batch_size={2 * m}", "train.steps=2")
        got, want = (run(config(schedule, p, *overrides))[0] for schedule in ("zb1", "1f1b"))
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=f"m={m} {name}")


def test_config_names_the_schedules():
    assert parse_config(YAML, ["parallel.schedule=zbh1"]).parallel.schedule == "zbh1"
    with pytest.raises(ConfigError, match="parallel.schedule"):
        parse_config(YAML, ["parallel.schedule=zb2"])
