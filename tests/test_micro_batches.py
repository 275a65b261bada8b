"""Micro-batching and pipeline schedules at the library level, on hand-built float64 graphs:
a step of m micro-batches ends where one step on the whole batch ends, the plan gets its
rates (per-micro-batch readers holding a parameter in place), accumulate actors and
schedule quotas, and the runtime takes whole
steps, returns one dict per micro-batch and never holds more than a quota."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import actorflow as af
import userfns
from actorflow.compiler.schedules import crossing_stages, kept_for_backward, read_by_weight_grads
from trace_checks import check_quotas_in_trace

RNG = np.random.default_rng(11)
N, D, H, C = 16, 5, 7, 3  # whole batch rows, input width, hidden width, classes
X = RNG.standard_normal((N, D))
LABELS = RNG.integers(0, C, N)
W1 = RNG.standard_normal((D, H)) * 0.4
B1 = RNG.standard_normal(H) * 0.1
W2 = RNG.standard_normal((H, C)) * 0.4
STAGES = ["cpu:0", "cpu:1"]
STEPS = 4

OPTIMIZERS = {
    "sgd-momentum": lambda: af.optim.SGD(lr=0.2, momentum=0.9),
    "adam": lambda: af.optim.Adam(lr=0.05),
}


def sleepy_identity(a):
    """A module-level user kernel (plans keep it by import path): 5 ms, then the input."""
    time.sleep(0.005)
    return a


def two_stage_mlp(rows, optimizer, devices=STAGES, slow=None):
    """relu(x W1 + b1) on devices[0], copied to devices[-1], then W2 and the mean
    cross-entropy there. ``slow``: a user kernel that delays the labels on the last stage
    (off the differentiated path, so the stage's stream is slow)."""
    with af.Graph() as g:
        x = af.placeholder("x", (rows, D), "float64", devices[0])
        labels = af.placeholder("labels", (rows,), "int64", devices[-1])
        w1 = af.parameter("w1", W1, devices[0])
        b1 = af.parameter("b1", B1, devices[0])
        w2 = af.parameter("w2", W2, devices[-1])
        h = af.ops.relu(af.ops.bias_add(af.ops.matmul(x, w1), b1))
        h = af.ops.to_device(h, devices[-1])
        if slow is not None:
            labels = af.ops.call(slow, labels, shape=(rows,), dtype="int64")
        loss = af.ops.softmax_cross_entropy(af.ops.matmul(h, w2), labels)
        af.minimize(loss, optimizer)
        af.output("loss", loss)
    return g


def step_feeds(m, x=X, labels=LABELS):
    rows = len(x) // m
    return [
        {"x": x[k * rows : (k + 1) * rows], "labels": labels[k * rows : (k + 1) * rows]} for k in range(m)
    ]


def train(plan, feeds, steps=STEPS):
    outs = []
    with af.Session(plan) as s:
        for _ in range(steps):
            outs.extend(s.run(feeds))
        return s.parameters(), outs


def whole_batch(optimizer_name, steps=STEPS):
    """The reference: the same model on one device, the whole batch, no micro-batches."""
    plan = af.compile(two_stage_mlp(N, OPTIMIZERS[optimizer_name](), devices=["cpu:0"]))
    assert plan.micro_batches == 1
    return train(plan, [{"x": X, "labels": LABELS}], steps)


def numpy_losses(x, labels):
    """Per-row cross-entropy of the initial model (for checking outputs)."""
    logits = np.maximum(x @ W1 + B1, 0) @ W2
    logits = logits - logits.max(axis=1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(labels)), labels]


def assert_same_parameters(got, want, rtol=1e-6):
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-12, err_msg=name)


# -- training equals the whole batch on one device ------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("m", [1, 2, 4])
def test_pipelined_training_equals_the_whole_batch_on_one_device(m, optimizer, schedule):
    want, want_outs = whole_batch(optimizer)
    plan = af.compile(
        two_stage_mlp(N // m, OPTIMIZERS[optimizer]()), micro_batches=m, stages=STAGES, schedule=schedule
    )
    assert plan.micro_batches == m
    got, outs = train(plan, step_feeds(m))
    assert_same_parameters(got, want)
    # the parameters moved, so the comparison is not between two untouched models
    assert not np.allclose(got["w1"], W1)
    # one dict per micro-batch; a step's mean micro-batch loss is the whole batch's loss
    assert len(outs) == STEPS * m
    step_losses = np.array([o["loss"] for o in outs]).reshape(STEPS, m).mean(axis=1)
    np.testing.assert_allclose(step_losses, [o["loss"] for o in want_outs], rtol=1e-9)


def test_a_run_of_several_steps_at_once_equals_steps_one_by_one():
    m = 4
    plan = af.compile(
        two_stage_mlp(N // m, OPTIMIZERS["adam"]()), micro_batches=m, stages=STAGES, schedule="1f1b"
    )
    with af.Session(plan) as s:
        outs = s.run(step_feeds(m) * STEPS)  # STEPS steps, pipelined across step boundaries
        together = s.parameters()
    assert len(outs) == STEPS * m
    one_by_one, _ = train(plan, step_feeds(m))
    assert_same_parameters(together, one_by_one, rtol=1e-12)


def test_micro_batched_plans_round_trip():
    m = 2
    plan = af.compile(
        two_stage_mlp(N // m, OPTIMIZERS["sgd-momentum"]()), micro_batches=m, stages=STAGES, schedule="gpipe"
    )
    same = af.Plan.from_bytes(plan.to_bytes())
    assert same == plan and same.micro_batches == m
    assert [a.every for a in same.actors] == [a.every for a in plan.actors]
    assert_same_parameters(train(same, step_feeds(m), 2)[0], train(plan, step_feeds(m), 2)[0], rtol=1e-12)


def shared_parameter_graph(rows):
    """w1 is read on cpu:0 and, copied, on cpu:1 (once per step, the product w1c @ w2 too):
    the once-per-step region grows past the variables."""
    with af.Graph() as g:
        x = af.placeholder("x", (rows, D), "float64", "cpu:0")
        t = af.placeholder("t", (rows, C), "float64", "cpu:1")
        w1 = af.parameter("w1", W1, "cpu:0")
        w2 = af.parameter("w2", W2, "cpu:1")
        h = af.ops.to_device(af.ops.tanh(af.ops.matmul(x, w1)), "cpu:1")
        w1c = af.ops.to_device(w1, "cpu:1", name="w1_on_cpu1")
        skip = af.ops.matmul(af.ops.to_device(x, "cpu:1"), af.ops.matmul(w1c, w2, name="w1w2"))
        loss = af.ops.mse_loss(af.ops.add(af.ops.matmul(h, w2), skip), t)
        af.minimize(loss, af.optim.SGD(lr=0.05, momentum=0.5))
        af.output("loss", loss)
    return g


@pytest.mark.parametrize("m", [2, 4])
def test_a_parameter_read_on_two_devices_is_copied_once_per_step(m):
    target = RNG.standard_normal((N, C))
    feeds = [
        {"x": f["x"], "t": target[k * (N // m) : (k + 1) * (N // m)]} for k, f in enumerate(step_feeds(m))
    ]
    want, _ = train(af.compile(shared_parameter_graph(N)), [{"x": X, "t": target}])
    plan = af.compile(shared_parameter_graph(N // m), micro_batches=m, stages=STAGES, schedule="1f1b")
    actors = {a.name: a for a in plan.actors}
    # the copy of w1 and the product of two parameters are once-per-step work
    assert actors["w1_on_cpu1"].every == m and actors["w1w2"].every == m
    got, _ = train(plan, feeds)
    assert_same_parameters(got, want)


# -- the plan -------------------------------------------------------------------------


def producer(plan, register):
    return plan.actors[plan.registers[register].producer]


@pytest.mark.parametrize("m", [2, 4])
def test_rates_holds_and_accumulates(m):
    plan = af.compile(
        two_stage_mlp(N // m, OPTIMIZERS["sgd-momentum"]()), micro_batches=m, fuse_kernels=False
    )
    per_step = [a for a in plan.actors if a.kind in ("variable", "update")]
    assert {a.every for a in per_step} == {m}
    assert {a.every for a in plan.actors if a.kind not in ("variable", "update")} == {1}

    variables = [a for a in plan.actors if a.kind == "variable"]
    updates = [a for a in plan.actors if a.kind == "update"]
    accumulates = [a for a in plan.actors if a.op == "accumulate"]
    assert len(variables) == len(updates) == 3

    # per-micro-batch actors read each variable in place (the runtime holds it for m acts):
    # nothing copies it per micro-batch
    readers_of = {}
    for var in variables:
        (reg,) = var.outputs
        readers = [plan.actors[c.actor] for c in plan.registers[reg].consumers]
        readers_of[reg] = {r.id for r in readers}
        assert "sgd_update" in [r.op for r in readers] and any(r.every == 1 for r in readers), var.name
        assert {r.every for r in readers if r.kind != "update"} == {1}, var.name
        assert {r.op for r in readers} <= {"matmul", "bias_add", "sgd_update"}, var.name

    # one accumulate per updated parameter's gradient, averaging over the m micro-batches
    assert len(accumulates) == len(updates)
    for acc in accumulates:
        assert acc.attrs == {"micro_batches": m} and acc.backward
        assert producer(plan, acc.inputs[0].register).every == 1
    for update in updates:
        regs = [
            plan.registers[i.register] for i in update.inputs if not plan.registers[i.register].is_parameter
        ]
        data_inputs = [producer(plan, r.id) for r in regs if not r.control]
        assert [p.op for p in data_inputs if p.kind != "variable"] == ["accumulate"], update.name
        # a reader of the parameter that no data path leads to the update (dX's matmul)
        # tells it, once per step, that its last read is done
        for r in regs:
            if r.control:
                assert producer(plan, r.id).every == 1 and r.producer in readers_of[update.inputs[0].register]


def test_one_micro_batch_adds_nothing():
    plan = af.compile(two_stage_mlp(N, OPTIMIZERS["adam"]()), micro_batches=1)
    assert plan.micro_batches == 1
    assert {a.every for a in plan.actors} == {1}
    assert not [a for a in plan.actors if a.op == "accumulate"]


def stage_of(device, stages=STAGES):
    return next(
        s
        for s, devices in enumerate(stages)
        if device in ([devices] if isinstance(devices, str) else devices)
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_kept_for_backward_registers_get_the_schedule_quota(m, schedule):
    plan = af.compile(
        two_stage_mlp(N // m, OPTIMIZERS["adam"]()),
        micro_batches=m,
        stages=STAGES,
        schedule=schedule,
        quota=3,
    )
    kept = kept_for_backward(plan)
    p = len(STAGES)
    assert {stage_of(r.device) for r in kept} == {0, 1}  # both stages keep something
    assert {r.name for r in kept} >= {"x", "labels"}  # the stage's own inputs are kept
    for reg in kept:
        want = m if schedule == "gpipe" else p - stage_of(reg.device)
        assert reg.quota == want, reg.name
    # under GPipe what crosses stages holds m too (or the default, if more)
    crossing = {r.id for r in crossing_stages(plan)} - {r.id for r in kept}
    # the activation stage 0 sends and the gradient stage 1 sends back, at least
    assert {plan.actors[plan.registers[i].producer].backward for i in crossing} == {False, True}
    for i in crossing:
        assert plan.registers[i].quota == (max(m, 3) if schedule == "gpipe" else 3), plan.registers[i].name
    # the rest keep the default quota
    others = {r.id for r in plan.registers} - {r.id for r in kept} - crossing
    data = [
        plan.registers[i]
        for i in others
        if not plan.registers[i].is_parameter and not plan.registers[i].control
    ]
    variables = {a.outputs[0] for a in plan.actors if a.kind == "variable"}
    assert {r.quota for r in data if r.id not in variables and r.consumers} == {3}
    # what only the next part of a fused chain reads (a gradient its accumulate sums) needs one
    assert {r.quota for r in data if not r.consumers} <= {1}


@pytest.mark.parametrize("priority", [True, False])
def test_a_stage_computes_the_gradient_the_previous_stage_waits_for_first(priority):
    """Compute-first: the actor whose result a copy to another stage reads goes ahead of
    every other actor on its stream (here stage 1's input gradient, before its weight
    gradient); without priorities, depth alone decides."""
    g = two_stage_mlp(N // 2, OPTIMIZERS["sgd-momentum"]())
    plan = af.compile(g, micro_batches=2, stages=STAGES, schedule="1f1b", priority=priority)
    send = next(a for a in plan.actors if a.kind == "copy" and a.backward)
    grad = plan.actors[plan.registers[send.inputs[0].register].producer]
    assert grad.device == "cpu:1" and grad.backward
    rivals = [a for a in plan.actors if a.stream == grad.stream and a.id != grad.id]
    first = all(grad.priority < a.priority for a in rivals)
    assert first == priority


def test_three_stage_1f1b_quotas_count_down():
    """Three stages: 1F1B keeps 3, 2, 1 micro-batches."""
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    rows = N // 4
    with af.Graph() as g:
        x = af.placeholder("x", (rows, D), "float64", devices[0])
        labels = af.placeholder("labels", (rows,), "int64", devices[2])
        w1 = af.parameter("w1", W1, devices[0])
        wm = af.parameter("wm", np.eye(H) * 0.9, devices[1])
        w2 = af.parameter("w2", W2, devices[2])
        h = af.ops.to_device(af.ops.tanh(af.ops.matmul(x, w1)), devices[1])
        h = af.ops.to_device(af.ops.tanh(af.ops.matmul(h, wm)), devices[2])
        loss = af.ops.softmax_cross_entropy(af.ops.matmul(h, w2), labels)
        af.minimize(loss, af.optim.SGD(lr=0.1))
        af.output("loss", loss)
    plan = af.compile(g, micro_batches=4, stages=devices, schedule="1f1b")
    kept = kept_for_backward(plan)
    assert {stage_of(r.device, devices) for r in kept} == {0, 1, 2}
    for reg in kept:
        assert reg.quota == 3 - stage_of(reg.device, devices), reg.name
    with af.Session(plan) as s:
        s.run(step_feeds(4) * 2)
        stats = s.register_stats()
    for reg in kept:
        assert 1 <= stats[reg.name]["max_held"] <= 3 - stage_of(reg.device, devices)


def test_user_quotas_override_the_schedule():
    m = 4
    g = two_stage_mlp(N // m, OPTIMIZERS["adam"]())
    plan = af.compile(g, micro_batches=m, stages=STAGES, schedule="gpipe", quotas={"x": 1, "labels": 3})
    regs = {r.name: r for r in plan.registers}
    assert regs["x"].quota == 1 and regs["labels"].quota == 3
    untouched = [r for r in kept_for_backward(plan) if r.name not in ("x", "labels")]
    assert untouched and {r.quota for r in untouched} == {m}
    # and it still trains to the same place
    want, _ = whole_batch("adam")
    assert_same_parameters(train(plan, step_feeds(m))[0], want)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "zigzag", "stages": STAGES}, "schedule: one of gpipe, 1f1b, zb1, zbh1, got 'zigzag'"),
        ({"schedule": "1f1b"}, "a schedule needs stages"),
        ({"schedule": "1f1b", "stages": []}, "a schedule needs stages"),
        ({"schedule": "gpipe", "stages": ["cpu:0", "gpu:1"]}, r"stages: unknown device 'gpu:1'"),
        ({"schedule": "gpipe", "stages": ["cpu:0", ["cpu:1", None]]}, "stages: "),
        ({"schedule": "gpipe", "stages": ["cpu:0", 7]}, "stages: "),
        ({"schedule": "1f1b", "stages": ["cpu:0"]}, "lives on cpu:1, which no stage lists"),
    ],
    ids=[
        "bad-schedule",
        "no-stages",
        "empty-stages",
        "unknown-device",
        "device-none",
        "stage-int",
        "stage-missing",
    ],
)
def test_bad_schedules_and_stages_are_compile_errors(kwargs, match):
    with pytest.raises(af.CompileError, match=match):
        af.compile(two_stage_mlp(N // 2, OPTIMIZERS["adam"]()), micro_batches=2, **kwargs)


def test_a_device_in_two_stages_is_a_compile_error():
    with pytest.raises(af.CompileError, match="cpu:1"):
        af.compile(
            two_stage_mlp(N // 4, OPTIMIZERS["adam"]()),
            micro_batches=4,
            stages=["cpu:0", "cpu:1", "cpu:1"],
            schedule="1f1b",
        )


def test_stages_given_as_one_string_is_a_compile_error_saying_so():
    with pytest.raises(af.CompileError, match="a list"):
        af.compile(
            two_stage_mlp(N // 2, OPTIMIZERS["adam"]()), micro_batches=2, stages="cpu:0", schedule="1f1b"
        )


@pytest.mark.parametrize("m", [0, -1, 2.5, "2", True, None])
def test_micro_batches_must_be_a_positive_int(m):
    with pytest.raises(af.CompileError, match="micro_batches"):
        af.compile(two_stage_mlp(N, OPTIMIZERS["adam"]()), micro_batches=m)


def test_canonical_stage_device_names_are_accepted():
    plan = af.compile(
        two_stage_mlp(N // 2, OPTIMIZERS["adam"]()),
        micro_batches=2,
        stages=["cpu:00", " cpu:1"],
        schedule="1f1b",
    )
    assert {r.quota for r in kept_for_backward(plan) if r.device == "cpu:0"} == {2}


# -- the runtime -------------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 3, 4])
def test_a_run_takes_whole_steps(m):
    plan = af.compile(two_stage_mlp(N // 4, OPTIMIZERS["adam"]()), micro_batches=m)
    one = step_feeds(4)[0]
    with af.Session(plan) as s:
        for count in (1, m - 1, m + 1, 2 * m - 1):
            feeds = one if count == 1 else [one] * count
            with pytest.raises(af.FeedError, match=rf"whole steps of {m} micro-batches.*got {count} feed"):
                s.run(feeds)
        # nothing ran, and the session still takes a whole step
        assert_same_parameters(s.parameters(), {"w1": W1, "b1": B1, "w2": W2}, rtol=0)
        outs = s.run([one] * m)
    assert isinstance(outs, list) and len(outs) == m


def test_outputs_come_back_one_dict_per_micro_batch():
    m = 4
    plan = af.compile(
        two_stage_mlp(N // m, OPTIMIZERS["sgd-momentum"]()), micro_batches=m, stages=STAGES, schedule="1f1b"
    )
    feeds = step_feeds(m)
    with af.Session(plan) as s:
        outs = s.run(feeds)
    assert len(outs) == m and all(set(o) == {"loss"} for o in outs)
    # all micro-batches of the first step see the initial parameters, each its own rows
    for out, feed in zip(outs, feeds):
        np.testing.assert_allclose(out["loss"], numpy_losses(feed["x"], feed["labels"]).mean(), rtol=1e-12)
    losses = [float(o["loss"]) for o in outs]
    assert len(set(losses)) == m  # different rows, different losses: not one value copied m times


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_no_buffer_is_written_while_still_read(schedule):
    """Over three steps in one run, from the trace: each register's write into a buffer
    starts only after every read of what that buffer held before (repeats' holds and
    accumulates' periods included), and the runtime counts every register."""
    m = 4
    plan = af.compile(
        two_stage_mlp(N // m, OPTIMIZERS["adam"]()),
        micro_batches=m,
        stages=STAGES,
        schedule=schedule,
        quota=2,
    )
    with af.Session(plan, trace=True) as s:
        s.run(step_feeds(m) * 3)
        stats = s.register_stats()
        spans = s.recorder.kernels()
    regs = {r.name: r for r in plan.registers if r.producer >= 0}
    assert {name: stat["quota"] for name, stat in stats.items()} == {
        name: r.quota for name, r in regs.items()
    }
    assert any(a.op.endswith("accumulate") for a in plan.actors)  # fused into its gradient's act
    assert check_quotas_in_trace(plan, spans) > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("slow", "schedule"),
    [(userfns.sleep_20ms, "1f1b"), (userfns.sleep_20ms, "gpipe"), (sleepy_identity, "1f1b")],
    ids=["1f1b", "gpipe", "1f1b-own-kernel"],
)
def test_a_slow_last_stage_fills_the_first_stage_up_to_its_schedule_quota(slow, schedule):
    """With the last stage slow, stage 0 runs ahead as far as its quota lets it: p - s
    micro-batches for 1F1B, m for GPipe, and never more."""
    m, p = 4, 2
    plan = af.compile(
        two_stage_mlp(N // m, OPTIMIZERS["sgd-momentum"](), slow=slow),
        micro_batches=m,
        stages=STAGES,
        schedule=schedule,
    )
    assert any(attrs.get("fn") is slow for a in plan.actors for _, attrs in a.kernels())
    with af.Session(plan) as s:
        s.run(step_feeds(m) * 2)
        stats = s.register_stats()
        got = s.parameters()
    kept = kept_for_backward(plan)
    bound = {s: (m if schedule == "gpipe" else p - s) for s in range(p)}
    for reg in kept:
        assert 1 <= stats[reg.name]["max_held"] <= bound[stage_of(reg.device)], reg.name
    # stage 0 did run ahead: its input was held for as many micro-batches as allowed
    assert stats["x"]["max_held"] == bound[0]
    # the slow kernel is an identity, so training is unchanged
    want, _ = whole_batch("sgd-momentum", steps=2)
    assert_same_parameters(got, want)


# -- data parallel within each stage ---------------------------------------------------


def replicated_two_stage_mlp(rows, optimizer, stages):
    with af.Graph() as g:
        x = af.placeholder("x", (rows, D), "float64", stages[0], af.S(0))
        labels = af.placeholder("labels", (rows,), "int64", stages[1], af.S(0))
        w1 = af.parameter("w1", W1, stages[0], af.B)
        b1 = af.parameter("b1", B1, stages[0], af.B)
        w2 = af.parameter("w2", W2, stages[1], af.B)
        h = af.ops.relu(af.ops.bias_add(af.ops.matmul(x, w1), b1))
        h = af.ops.to_device(h, stages[1])
        loss = af.ops.softmax_cross_entropy(af.ops.matmul(h, w2), labels)
        af.minimize(loss, optimizer)
        af.output("loss", loss)
    return g


@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_two_stages_of_two_replicas_equal_one_device(optimizer, schedule, fusion):
    m = 2
    stages = [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]]
    plan = af.compile(
        replicated_two_stage_mlp(N // m, OPTIMIZERS[optimizer](), stages),
        micro_batches=m,
        stages=stages,
        schedule=schedule,
        fusion=fusion,
        fuse_kernels=False,
    )
    # every replica has its own variables, updates and accumulates
    kinds = {}
    for a in plan.actors:
        kinds.setdefault(a.op if a.op == "accumulate" else a.kind, set()).add(a.device)
    for kind in ("variable", "update", "accumulate"):
        assert kinds[kind] == {f"cpu:{k}" for k in range(4)}, kind
    # the gradients' all-reduces run once per step, on accumulated gradients
    collectives = [a for a in plan.actors if a.kind == "collective"]
    assert collectives and {a.every for a in collectives} == {m}
    for coll in collectives:
        assert {producer(plan, i.register).op for i in coll.inputs} == {"accumulate"}, coll.name
    assert len([a for a in plan.actors if a.op == "accumulate"]) == len(
        [a for a in plan.actors if a.kind == "update"]
    )
    held_for_w = {r.name for r in read_by_weight_grads(plan)} if schedule == "zb1" else set()
    for reg in kept_for_backward(plan):
        quota = 2 if reg.name in held_for_w else 2 - stage_of(reg.device, stages)
        assert reg.quota == (m if schedule == "gpipe" else quota), reg.name

    got, outs = train(plan, step_feeds(m))
    want, want_outs = whole_batch(optimizer)
    assert_same_parameters(got, want)
    assert len(outs) == STEPS * m
    step_losses = np.array([o["loss"] for o in outs], dtype=float).reshape(STEPS, m).mean(axis=1)
    np.testing.assert_allclose(step_losses, [o["loss"] for o in want_outs], rtol=1e-9)


# -- property: pipelined equals unpipelined ---------------------------------------------


def mlp_graph(widths, rows, stage_devices, seed):
    """tanh MLP of ``widths``, its layers split over ``stage_devices`` in order, mse loss."""
    rng = np.random.default_rng(seed)
    layers = len(widths) - 1
    split = max(1, layers // 2)
    with af.Graph() as g:
        x = af.placeholder("x", (rows, widths[0]), "float64", stage_devices[0])
        t = af.placeholder("t", (rows, widths[-1]), "float64", stage_devices[-1])
        h = x
        for k in range(layers):
            device = stage_devices[0] if k < split else stage_devices[-1]
            h = af.ops.to_device(h, device)
            w = af.parameter(f"w{k}", rng.standard_normal((widths[k], widths[k + 1])) * 0.5, device)
            b = af.parameter(f"b{k}", rng.standard_normal(widths[k + 1]) * 0.1, device)
            h = af.ops.bias_add(af.ops.matmul(h, w), b)
            if k < layers - 1:
                h = af.ops.tanh(h)
        loss = af.ops.mse_loss(af.ops.to_device(h, stage_devices[-1]), t)
        af.minimize(loss, af.optim.SGD(lr=0.1, momentum=0.5))
        af.output("loss", loss)
    return g


@settings(max_examples=15, deadline=None)
@given(
    m=st.sampled_from([1, 2, 3, 4]),
    rows=st.integers(1, 3),
    steps=st.integers(1, 3),
    quota=st.integers(1, 3),
    schedule=st.sampled_from([None, "gpipe", "1f1b"]),
    widths=st.lists(st.integers(1, 6), min_size=3, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_pipelined_parameters_equal_unpipelined(m, rows, steps, quota, schedule, widths, seed):
    batch = m * rows
    data = np.random.default_rng(seed + 1)
    x = data.standard_normal((batch, widths[0]))
    t = data.standard_normal((batch, widths[-1]))
    want, _ = train(
        af.compile(mlp_graph(widths, batch, ["cpu:0"], seed), quota=quota), [{"x": x, "t": t}], steps
    )
    plan = af.compile(
        mlp_graph(widths, rows, STAGES, seed),
        quota=quota,
        micro_batches=m,
        stages=STAGES if schedule else None,
        schedule=schedule,
    )
    feeds = [{"x": x[k * rows : (k + 1) * rows], "t": t[k * rows : (k + 1) * rows]} for k in range(m)]
    got, outs = train(plan, feeds, steps)
    assert len(outs) == steps * m
    assert_same_parameters(got, want)
