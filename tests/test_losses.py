"""The loss ops: values against numpy, gradients against finite differences (float64),
build-time errors, and labels out of range at run time."""

from __future__ import annotations

import numpy as np
import pytest

import actorflow as af
from test_gradients import check_gradients, rand


def np_cross_entropy(logits, labels):
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_softmax = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -log_softmax[np.arange(len(labels)), labels].mean()


def run_loss(build, feeds):
    with af.Graph() as g:
        af.output("loss", build())
    return af.run(af.compile(g), feeds)["loss"]


# -- mse_loss ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(), (4,), (2, 3)], ids=str)
def test_mse_loss_value(shape, dtype):
    p, t = rand(shape, 1).astype(dtype), rand(shape, 2).astype(dtype)

    def build():
        pred = af.placeholder("p", shape, dtype)
        target = af.placeholder("t", shape, dtype)
        loss = af.ops.mse_loss(pred, target)
        assert (loss.shape, loss.dtype) == ((), dtype)
        return loss

    loss = run_loss(build, {"p": p, "t": t})
    assert loss.shape == () and loss.dtype == np.dtype(dtype)
    expected = np.mean((p.astype(np.float64) - t) ** 2)
    np.testing.assert_allclose(loss, expected, rtol=1e-6 if dtype == "float32" else 1e-13)


@pytest.mark.parametrize("shape", [(), (4,), (2, 3)], ids=str)
def test_mse_loss_gradients(shape):
    check_gradients(lambda t: af.ops.mse_loss(t["p"], t["t"]), {"p": rand(shape, 3), "t": rand(shape, 4)})


def test_mse_loss_gradient_closed_form():
    p, t = rand((2, 3), 5), rand((2, 3), 6)
    with af.Graph() as g:
        pred = af.parameter("p", p)
        target = af.placeholder("t", (2, 3), "float64")
        dp, dt = af.gradients(af.ops.mse_loss(pred, target), [pred, target])
        af.output("dp", dp)
        af.output("dt", dt)
    out = af.run(af.compile(g), {"t": t})
    np.testing.assert_allclose(out["dp"], 2 * (p - t) / 6, rtol=1e-13)
    np.testing.assert_allclose(out["dt"], -2 * (p - t) / 6, rtol=1e-13)


def test_mse_loss_on_a_second_device():
    check_gradients(
        lambda t: af.ops.mse_loss(af.ops.tanh(t["p"]), t["t"]),
        {"p": (rand((3,), 7), "cpu:1")},
        fixed={"t": (rand((3,), 8), "cpu:1")},
    )


def test_mse_loss_build_errors():
    with af.Graph():
        a = af.placeholder("a", (2, 3), "float64")
        b = af.placeholder("b", (3, 2), "float64")
        c = af.placeholder("c", (2, 3), "float32")
        i = af.placeholder("i", (2, 3), "int64")
        j = af.placeholder("j", (2, 3), "int64")
        d = af.placeholder("d", (2, 3), "float64", "cpu:1")
        e = af.placeholder("e", (0, 3), "float64")
        with pytest.raises(af.GraphError, match=r"mse_loss: .*shape"):
            af.ops.mse_loss(a, b)
        with pytest.raises(af.GraphError, match=r"mse_loss: .*float32"):
            af.ops.mse_loss(a, c)
        with pytest.raises(af.GraphError, match=r"mse_loss: .*floating-point"):
            af.ops.mse_loss(i, j)
        with pytest.raises(af.GraphError, match=r"mse_loss: .*different devices"):
            af.ops.mse_loss(a, d)
        with pytest.raises(af.GraphError, match=r"mse_loss: .*empty"):
            af.ops.mse_loss(e, e)
        with pytest.raises(af.GraphError, match=r"mse_loss: .*test_losses.py"):
            af.ops.mse_loss(a, b)


# -- softmax_cross_entropy ---------------------------------------------------------------


@pytest.mark.parametrize("label_dtype", ["int32", "int64", "uint8"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cross_entropy_value(dtype, label_dtype):
    logits = rand((4, 5), 10, -3, 3).astype(dtype)
    labels = np.array([0, 4, 2, 2], label_dtype)

    def build():
        x = af.placeholder("x", (4, 5), dtype)
        y = af.placeholder("y", (4,), label_dtype)
        loss = af.ops.softmax_cross_entropy(x, y)
        assert (loss.shape, loss.dtype) == ((), dtype)
        return loss

    loss = run_loss(build, {"x": logits, "y": labels})
    assert loss.shape == () and loss.dtype == np.dtype(dtype)
    np.testing.assert_allclose(
        loss, np_cross_entropy(logits, labels), rtol=1e-6 if dtype == "float32" else 1e-13
    )


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cross_entropy_is_stable_for_large_logits(dtype):
    logits = np.array([[1000.0, 0.0, -1000.0], [-800.0, -790.0, -805.0], [1e4, 1e4, 1e4]], dtype)
    labels = np.array([1, 1, 2])

    def build():
        logits_ = af.placeholder("x", (3, 3), dtype)
        return af.ops.softmax_cross_entropy(logits_, af.placeholder("y", (3,), "int64"))

    loss = run_loss(build, {"x": logits, "y": labels})
    assert np.isfinite(loss)
    expected = (1000.0 + (np.log1p(np.exp(-10) + np.exp(-15))) + np.log(3)) / 3
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(loss, np_cross_entropy(logits, labels), rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (4, 3)], ids=str)
def test_cross_entropy_gradients(shape):
    labels = np.random.default_rng(11).integers(0, shape[1], size=shape[0])
    check_gradients(
        lambda t: af.ops.softmax_cross_entropy(t["x"], t["y"]),
        {"x": rand(shape, 12, -3, 3)},
        fixed={"y": labels},
    )


def test_cross_entropy_gradient_closed_form_and_labels_get_none():
    logits = rand((3, 4), 13, -3, 3)
    labels = np.array([3, 0, 1])
    with af.Graph() as g:
        x = af.parameter("x", logits)
        y = af.placeholder("y", (3,), "int64")
        dx, dy = af.gradients(af.ops.softmax_cross_entropy(x, y), [x, y])
        assert dy is None
        af.output("dx", dx)
    out = af.run(af.compile(g), {"y": labels})
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(3), labels] -= 1
    np.testing.assert_allclose(out["dx"], p / 3, rtol=1e-12, atol=1e-15)


def test_classifier_with_parameters():
    """A small classifier: gelu MLP -> cross entropy, parameters w.r.t. finite differences."""

    def build(t):
        h = af.ops.gelu(af.ops.bias_add(af.ops.matmul(t["x"], t["w1"]), t["b1"]))
        return af.ops.softmax_cross_entropy(af.ops.matmul(h, t["w2"]), t["y"])

    inputs = {"w1": rand((3, 4), 14), "b1": rand((4,), 15), "w2": rand((4, 3), 16)}
    fixed = {"x": rand((5, 3), 17), "y": np.array([0, 2, 1, 1, 0])}
    check_gradients(build, inputs, fixed=fixed, params=["w1", "b1", "w2"])


def test_cross_entropy_build_errors():
    with af.Graph():
        x = af.placeholder("x", (4, 3), "float64")
        y = af.placeholder("y", (4,), "int64")
        with pytest.raises(af.GraphError, match=r"softmax_cross_entropy: logits must be \(N, C\)"):
            af.ops.softmax_cross_entropy(af.placeholder("x3", (4, 3, 1), "float64"), y)
        with pytest.raises(af.GraphError, match=r"softmax_cross_entropy: logits must be floating"):
            af.ops.softmax_cross_entropy(af.placeholder("xi", (4, 3), "int64"), y)
        with pytest.raises(af.GraphError, match=r"softmax_cross_entropy: labels must be \(4,\)"):
            af.ops.softmax_cross_entropy(x, af.placeholder("y5", (5,), "int64"))
        with pytest.raises(af.GraphError, match=r"softmax_cross_entropy: labels must be \(4,\)"):
            af.ops.softmax_cross_entropy(x, af.placeholder("y2", (4, 1), "int64"))
        with pytest.raises(af.GraphError, match=r"softmax_cross_entropy: labels must be integer"):
            af.ops.softmax_cross_entropy(x, af.placeholder("yf", (4,), "float64"))
        with pytest.raises(af.GraphError, match=r"softmax_cross_entropy: labels must be integer"):
            af.ops.softmax_cross_entropy(x, af.placeholder("yb", (4,), "bool"))
        with pytest.raises(af.GraphError, match=r"softmax_cross_entropy: .*different devices"):
            af.ops.softmax_cross_entropy(x, af.placeholder("y1", (4,), "int64", "cpu:1"))
        with pytest.raises(af.GraphError, match=r"softmax_cross_entropy: needs at least one"):
            empty = af.placeholder("x0", (0, 3), "float64")
            af.ops.softmax_cross_entropy(empty, af.placeholder("y0", (0,), "int64"))
        with pytest.raises(af.GraphError, match=r"test_losses.py"):
            af.ops.softmax_cross_entropy(x, af.placeholder("yff", (4,), "float32"))


@pytest.mark.parametrize("bad", [[0, 3, 1, 1], [0, -1, 1, 1]], ids=str)
def test_cross_entropy_labels_out_of_range_raise_at_run(bad):
    with af.Graph() as g:
        x = af.placeholder("x", (4, 3), "float64")
        y = af.placeholder("y", (4,), "int64")
        af.output("loss", af.ops.softmax_cross_entropy(x, y))
    with pytest.raises(ValueError, match=r"labels must be class ids in \[0, 3\)"):
        af.run(af.compile(g), {"x": rand((4, 3), 18), "y": np.array(bad)})


def test_loss_grad_op_build_errors():
    with af.Graph():
        x = af.placeholder("x", (4, 3), "float64")
        y = af.placeholder("y", (4,), "int64")
        d = af.placeholder("d", (1,), "float64")
        with pytest.raises(af.GraphError, match=r"softmax_cross_entropy_grad: dy must be a scalar"):
            af.ops.softmax_cross_entropy_grad(d, x, y)
        with pytest.raises(af.GraphError, match=r"mse_loss_grad: dy must be a scalar"):
            af.ops.mse_loss_grad(d, x, x)


def test_data_parallel_training_lowers_the_loss():
    """End to end: parameters on cpu:0 broadcast to two devices, each with half the batch,
    cross entropy averaged over devices with all_reduce, af.minimize with SGD."""
    rng = np.random.default_rng(19)
    centers = rng.standard_normal((3, 4)) * 2
    labels = rng.integers(0, 3, size=8)
    x = centers[labels] + rng.standard_normal((8, 4)) * 0.3
    devices = ["cpu:0", "cpu:1"]
    with af.Graph() as g:
        w = af.parameter("w", np.zeros((4, 3)))
        b = af.parameter("b", np.zeros((3,)))
        ws, bs = af.ops.broadcast(w, devices), af.ops.broadcast(b, devices)
        losses = []
        for k, d in enumerate(devices):
            xk = af.placeholder(f"x{k}", (4, 4), "float64", d)
            yk = af.placeholder(f"y{k}", (4,), "int64", d)
            logits = af.ops.bias_add(af.ops.matmul(xk, ws[k]), bs[k])
            losses.append(af.ops.softmax_cross_entropy(logits, yk))
        loss = af.ops.all_reduce(losses, "mean")[0]
        af.minimize(loss, af.optim.SGD(lr=0.5))
        af.output("loss", loss)
    feeds = {"x0": x[:4], "x1": x[4:], "y0": labels[:4], "y1": labels[4:]}
    with af.Session(af.compile(g)) as s:
        seen = [float(s.run(feeds)["loss"]) for _ in range(20)]
    np.testing.assert_allclose(seen[0], np.log(3), rtol=1e-12)  # zero weights: uniform
    assert all(b < a for a, b in zip(seen, seen[1:])), seen
    assert seen[-1] < 0.3 * seen[0]
