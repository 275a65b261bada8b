"""Data parallelism from SBP alone: batch S(0), parameters B. Training on several devices
ends where training on one device with the whole batch ends."""

import numpy as np
import pytest

import actorflow as af

RNG = np.random.default_rng(0)
N, D, H, C = 16, 6, 8, 3
X = RNG.standard_normal((N, D))
LABELS = RNG.integers(0, C, N)
W1 = RNG.standard_normal((D, H)) * 0.3
B1 = RNG.standard_normal(H) * 0.1
W2 = RNG.standard_normal((H, C)) * 0.3


def mlp(devices: int, optimizer, loss_kind: str = "xent"):
    """An MLP on ``devices`` devices (batch S(0), parameters B), or on cpu:0 alone."""
    with af.Graph() as g:
        if devices == 1:
            x = af.placeholder("x", (N, D), "float64")
            y = (
                af.placeholder("y", (N,), "int64")
                if loss_kind == "xent"
                else af.placeholder("y", (N, C), "float64")
            )
            w1, b1, w2 = af.parameter("w1", W1), af.parameter("b1", B1), af.parameter("w2", W2)
        else:
            place = [f"cpu:{k}" for k in range(devices)]
            x = af.placeholder("x", (N, D), "float64", place, af.S(0))
            if loss_kind == "xent":
                y = af.placeholder("y", (N,), "int64", place, af.S(0))
            else:
                y = af.placeholder("y", (N, C), "float64", place, af.S(0))
            w1, b1, w2 = (af.parameter(n, v, place, af.B) for n, v in (("w1", W1), ("b1", B1), ("w2", W2)))
        logits = af.ops.matmul(af.ops.tanh(af.ops.bias_add(af.ops.matmul(x, w1), b1)), w2)
        if loss_kind == "xent":
            loss = af.ops.softmax_cross_entropy(logits, y)
        else:
            loss = af.ops.mse_loss(logits, y)
        af.minimize(loss, optimizer)
        af.output("loss", loss)
        af.output("logits", logits)
    return af.compile(g)


def train(devices, optimizer, steps=20, loss_kind="xent"):
    target = LABELS if loss_kind == "xent" else np.eye(C)[LABELS]
    with af.Session(mlp(devices, optimizer, loss_kind)) as s:
        outs = s.run([{"x": X, "y": target}] * steps)
        return s.parameters(), outs


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize(
    "optimizer", [af.optim.SGD(lr=0.1), af.optim.SGD(lr=0.1, momentum=0.9), af.optim.Adam(lr=0.05)], ids=repr
)
@pytest.mark.parametrize("loss_kind", ["xent", "mse"])
def test_data_parallel_training_equals_one_device(devices, optimizer, loss_kind):
    single, single_outs = train(1, optimizer, loss_kind=loss_kind)
    parallel, parallel_outs = train(devices, optimizer, loss_kind=loss_kind)
    assert set(parallel) == {"w1", "b1", "w2"}
    for name in single:
        np.testing.assert_allclose(parallel[name], single[name], rtol=1e-6, atol=1e-12)
    for a, b in zip(parallel_outs, single_outs):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)
        assert type(a["loss"]) is type(b["loss"]) is np.ndarray
        np.testing.assert_allclose(a["logits"], b["logits"], rtol=1e-6, atol=1e-12)
    losses = [float(o["loss"]) for o in parallel_outs]
    assert losses[-1] < losses[0]


def test_only_the_gradients_of_broadcast_parameters_are_all_reduced():
    """The forward pass is local (batch split, weights replicated); the loss stays partial
    and is summed on the host; the three gradients are all-reduced, whether fused or not."""
    plan = mlp(2, af.optim.SGD(lr=0.1))
    assert {c.op for c in plan.collectives} == {"all_reduce"}
    reduced = sorted(
        plan.registers[i.register].shape
        for c in plan.collectives
        for a in c.actors
        if plan.actors[a].device == "cpu:0"
        for i in plan.actors[a].inputs
    )
    assert reduced == sorted([W1.shape, B1.shape, W2.shape])
    assert len([a for a in plan.actors if a.kind == "update"]) == 6


def test_a_logical_feed_that_does_not_split_is_refused():
    plan = mlp(4, af.optim.SGD(lr=0.1))
    with pytest.raises(af.FeedError, match="missing"):
        af.run(plan, {"x": X})
    with pytest.raises(af.FeedError):
        af.run(plan, {"x": X[:6], "y": LABELS})


def test_minimize_and_gradients_work_outside_the_with_block():
    place = ["cpu:0", "cpu:1"]
    with af.Graph() as g:
        x = af.placeholder("x", (N, D), "float64", place, af.S(0))
        w = af.parameter("w", W1, place, af.B)
        partial = af.ops.sum(af.ops.matmul(x, w))
        replicated = af.box(partial, af.B)
    (dw,) = af.gradients(replicated, [w])
    af.minimize(partial, af.optim.SGD(lr=0.1))
    with g:
        af.output("dw", dw)
    out = af.run(af.compile(g), {"x": X})
    np.testing.assert_allclose(out["dw"], np.repeat(X.sum(axis=0, keepdims=True).T, H, axis=1), rtol=1e-12)
