"""Every gradient rule against central finite differences, in float64.

``check_gradients`` builds y = sum_k sum(out_k * R_k) over an op's outputs out_k, with
fixed random weights R_k so that every output element matters, and asks af.gradients for
dy/dx of each input. A second graph computes y alone from placeholders; it is compiled
once and run on all the perturbed feeds (x +- eps at one element) in one pipelined call.
Inputs are placeholders or, where asked, parameters (their perturbed copies are fed to the
second graph). Graphs stay tiny so the suite is fast.
"""

from __future__ import annotations

import numpy as np
import pytest

import actorflow as af
import userfns

EPS = 1e-6
RTOL, ATOL = 1e-6, 1e-8


def rand(shape, seed, low=-2.0, high=2.0):
    return np.random.default_rng(seed).uniform(low, high, size=shape)


def away_from_zero(shape, seed, low=0.3, high=2.0):
    """Values with |v| in [low, high] and random signs (for div, relu, log's friends)."""
    rng = np.random.default_rng(seed)
    return rng.uniform(low, high, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def distinct(shape, seed, gap=0.1):
    """Values at least ``gap`` apart in random order, so max has no ties, even perturbed."""
    size = int(np.prod(shape, dtype=int))
    rng = np.random.default_rng(seed)
    return (rng.permutation(size) * gap - size * gap / 2 + rng.uniform(0, gap / 10, size)).reshape(shape)


def _as_list(outs):
    return [outs] if isinstance(outs, af.Tensor) else list(outs)


def _objective(outs, seed):
    """sum_k sum(out_k * R_k), on the first output's device."""
    home = outs[0].device
    total = None
    for k, out in enumerate(outs):
        weights = np.random.default_rng(1000 + seed + k).uniform(-1.5, 1.5, size=out.shape)
        r = af.parameter(f"weights__{k}", weights.astype(out.dtype), device=out.device)
        term = af.ops.to_device(af.ops.sum(af.ops.mul(out, r)), home)
        total = term if total is None else af.ops.add(total, term)
    return total


def _declare(values, params=()):
    tensors = {}
    for name, (value, device) in values.items():
        if name in params:
            tensors[name] = af.parameter(name, value, device=device)
        else:
            tensors[name] = af.placeholder(name, value.shape, value.dtype.name, device)
    return tensors


def numeric_gradients(build, inputs, fixed=None, seed=0):
    """Central differences of the objective, and its value at ``inputs``."""
    fixed = fixed or {}
    with af.Graph() as g:
        t = _declare({**inputs, **fixed})
        af.output("objective__", _objective(_as_list(build(t)), seed))
    base = {name: value for name, (value, _) in {**inputs, **fixed}.items()}
    feeds = [base]
    for name, (value, _) in inputs.items():
        for i in range(value.size):
            for sign in (1, -1):
                moved = value.copy()
                moved.flat[i] += sign * EPS
                feeds.append({**base, name: moved})
    ys = [r["objective__"] for r in af.run(af.compile(g), feeds)]
    grads, k = {}, 1
    for name, (value, _) in inputs.items():
        g_ = np.empty_like(value)
        for i in range(value.size):
            g_.flat[i] = (ys[k] - ys[k + 1]) / (2 * EPS)
            k += 2
        grads[name] = g_
    return ys[0], grads


def analytic_gradients(build, inputs, fixed=None, params=(), seed=0):
    """The objective and af.gradients of it, checked to match each input's shape, dtype
    and device."""
    fixed = fixed or {}
    with af.Graph() as g:
        t = _declare({**inputs, **fixed}, params)
        y = _objective(_as_list(build(t)), seed)
        names = list(inputs)
        grads = af.gradients(y, [t[n] for n in names])
        af.output("objective__", y)
        for name, d in zip(names, grads):
            assert d is not None, f"no gradient for {name}"
            x = t[name]
            assert (d.shape, d.dtype, d.device) == (x.shape, x.dtype, x.device), (name, d, x)
            af.output(f"grad__{name}", d)
    feeds = {n: v for n, (v, _) in {**inputs, **fixed}.items() if n not in params}
    out = af.run(af.compile(g), feeds)
    return out["objective__"], {n: out[f"grad__{n}"] for n in names}


def check_gradients(build, inputs, fixed=None, params=(), seed=0):
    """``inputs``: name -> array or (array, device), differentiated; ``fixed``: the same,
    fed but not differentiated; ``params``: input names to declare as af.parameter."""

    def norm(d):
        return {
            n: (np.asarray(v[0]), v[1]) if isinstance(v, tuple) else (np.asarray(v), "cpu:0")
            for n, v in (d or {}).items()
        }

    inputs, fixed = norm(inputs), norm(fixed)
    y_num, numeric = numeric_gradients(build, inputs, fixed, seed)
    y, analytic = analytic_gradients(build, inputs, fixed, params, seed)
    np.testing.assert_allclose(y, y_num, rtol=1e-12, atol=1e-12)
    for name in inputs:
        np.testing.assert_allclose(analytic[name], numeric[name], rtol=RTOL, atol=ATOL, err_msg=f"d/d{name}")
    return analytic


def dev(k):
    return f"cpu:{k}"


# -- elementwise -------------------------------------------------------------------------

BROADCASTS = [
    ((2, 3), (2, 3)),
    ((2, 3), (3,)),
    ((3,), (2, 3)),
    ((2, 1), (1, 3)),
    ((), (2, 2)),
    ((2, 1, 2), (3, 1)),
]
BINARY = {"add": af.ops.add, "sub": af.ops.sub, "mul": af.ops.mul, "div": af.ops.div}


@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_broadcasting(op, shapes):
    fn = BINARY[op]
    a = rand(shapes[0], 1)
    b = away_from_zero(shapes[1], 2) if op == "div" else rand(shapes[1], 2)
    check_gradients(lambda t: fn(t["a"], t["b"]), {"a": a, "b": b})


UNARY = {
    "relu": (af.ops.relu, away_from_zero),
    "gelu": (af.ops.gelu, lambda s, seed: rand(s, seed, -3, 3)),
    "tanh": (af.ops.tanh, lambda s, seed: rand(s, seed, -2, 2)),
    "exp": (af.ops.exp, lambda s, seed: rand(s, seed, -2, 2)),
    "log": (af.ops.log, lambda s, seed: rand(s, seed, 0.2, 3)),
}


@pytest.mark.parametrize("shape", [(5,), (2, 3)], ids=str)
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op, shape):
    fn, values = UNARY[op]
    check_gradients(lambda t: fn(t["x"]), {"x": values(shape, 3)})


@pytest.mark.parametrize("shape,axis", [((2, 3), -1), ((2, 3), 0), ((2, 3, 2), 1), ((4,), 0)], ids=str)
def test_softmax(shape, axis):
    check_gradients(lambda t: af.ops.softmax(t["x"], axis), {"x": rand(shape, 4)})


@pytest.mark.parametrize(
    "sa,sb",
    [
        ((2, 3), (3, 2)),
        ((1, 1), (1, 3)),
        ((2, 2, 3), (3, 2)),
        ((3, 2), (2, 2, 2)),
        ((2, 1, 2, 3), (1, 2, 3, 2)),
    ],
    ids=str,
)
def test_matmul(sa, sb):
    check_gradients(lambda t: af.ops.matmul(t["a"], t["b"]), {"a": rand(sa, 5), "b": rand(sb, 6)})


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("batch", [(), (2,)], ids=str)
def test_matmul_with_transposed_operands(ta, tb, batch):
    a_shape = (*batch, 4, 3) if ta else (*batch, 3, 4)
    b_shape = (5, 4) if tb else (4, 5)
    check_gradients(
        lambda t: af.ops.matmul(t["a"], t["b"], transpose_a=ta, transpose_b=tb),
        {"a": rand(a_shape, 15), "b": rand(b_shape, 16)},
    )


@pytest.mark.parametrize("bias_shape", [(3,), (2, 3)], ids=str)
def test_bias_add(bias_shape):
    check_gradients(
        lambda t: af.ops.bias_add(t["x"], t["b"]), {"x": rand((2, 2, 3), 7), "b": rand(bias_shape, 8)}
    )


# -- reductions --------------------------------------------------------------------------

AXES = [None, 0, -1, (0, 2), (0, 1, 2), ()]


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_reductions(op, axis, keepdims):
    fn = {"sum": af.ops.sum, "mean": af.ops.mean, "max": af.ops.max}[op]
    x = distinct((2, 3, 2), 9)  # no ties for max, and no two within eps of each other
    check_gradients(lambda t: fn(t["x"], axis=axis, keepdims=keepdims), {"x": x})


@pytest.mark.parametrize("keepdims", [False, True])
def test_max_ties_split_evenly(keepdims):
    x = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0], [0.0, 5.0, -1.0]])
    with af.Graph() as g:
        t = af.placeholder("x", x.shape, "float64")
        y = af.ops.max(t, axis=1, keepdims=keepdims)
        dy = af.placeholder("dy", y.shape, "float64")
        (d,) = af.gradients(y, [t], dy)
        af.output("d", d)
        (d_all,) = af.gradients(af.ops.max(t), [t])  # one maximum: 5
        af.output("d_all", d_all)
    dyv = np.array([6.0, 3.0, 1.0]).reshape(y.shape)
    out = af.run(af.compile(g), {"x": x, "dy": dyv})
    expected = np.array([[0, 3, 3], [1, 1, 1], [0, 1, 0]], np.float64)
    np.testing.assert_array_equal(out["d"], expected)
    np.testing.assert_array_equal(out["d_all"], np.array([[0, 0, 0], [0, 0, 0], [0, 1, 0]], np.float64))


# -- shapes ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6,), (3, 2), (1, 3, 2), (-1, 2)], ids=str)
def test_reshape(shape):
    check_gradients(lambda t: af.ops.reshape(t["x"], shape), {"x": rand((2, 3), 10)})


@pytest.mark.parametrize("perm", [None, (1, 2, 0), (0, 2, 1)], ids=str)
def test_transpose(perm):
    check_gradients(lambda t: af.ops.transpose(t["x"], perm), {"x": rand((2, 3, 2), 11)})


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis):
    shapes = {0: [(1, 2), (2, 2), (1, 2)], 1: [(2, 1), (2, 3), (2, 1)], -1: [(2, 2), (2, 1), (2, 1)]}[axis]
    inputs = {f"x{k}": rand(s, 12 + k) for k, s in enumerate(shapes)}
    check_gradients(lambda t: af.ops.concat([t["x0"], t["x1"], t["x2"]], axis), inputs)


@pytest.mark.parametrize(
    "sections,axis,used",
    [(2, 0, None), ([1, 2, 1], 1, None), ([1, 2, 1], 1, [1]), (4, 1, [0, 3]), ([3, 0, 1], 1, [0, 2])],
    ids=str,
)
def test_split(sections, axis, used):
    """Multi-output; outputs nobody uses count as zero gradients."""

    def build(t):
        parts = af.ops.split(t["x"], sections, axis)
        return parts if used is None else [parts[k] for k in used]

    check_gradients(build, {"x": rand((2, 4), 13)})


@pytest.mark.parametrize("begin,end", [((0, 1), (2, 3)), ((1,), (2,)), ((1, 0, 1), (2, 2, 2))], ids=str)
def test_slice(begin, end):
    check_gradients(lambda t: af.ops.slice(t["x"], begin, end), {"x": rand((2, 3, 2), 14)})


def test_full_in_a_graph():
    """full has no inputs: it gets no rule call, and the graph around it differentiates."""

    def build(t):
        return af.ops.mul(t["x"], af.ops.add(af.ops.full((2, 3), 2.5, "float64"), t["x"]))

    check_gradients(build, {"x": rand((2, 3), 15)})


# -- devices and collectives -------------------------------------------------------------


def test_to_device_chain():
    def build(t):
        h = af.ops.tanh(af.ops.to_device(t["x"], dev(1)))
        h = af.ops.mul(af.ops.to_device(h, dev(2)), af.ops.to_device(t["w"], dev(2)))
        return af.ops.to_device(h, dev(0))

    x, w = rand((2, 3), 16), rand((3,), 17)
    check_gradients(build, {"x": (x, dev(0)), "w": (w, dev(1))}, params=["w"])


def _per_device(n, shape, seed, values=rand):
    return {f"x{k}": (values(shape, seed + k), dev(k)) for k in range(n)}


def _xs(t, n):
    return [t[f"x{k}"] for k in range(n)]


@pytest.mark.parametrize("used", [None, [1]], ids=str)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_all_reduce(op, n, used):
    def build(t):
        outs = af.ops.all_reduce(_xs(t, n), op)
        return outs if used is None else [outs[k] for k in used]

    # max: distinct values across all devices, no ties
    values = distinct((n, 2, 3), 18).reshape(n, 2, 3)
    inputs = {f"x{k}": (values[k], dev(k)) for k in range(n)}
    check_gradients(build, inputs)


def test_all_reduce_max_ties_split_over_devices():
    a = np.array([1.0, 4.0, 2.0])
    b = np.array([1.0, 3.0, 2.0])
    c = np.array([0.0, 4.0, 2.0])
    with af.Graph() as g:
        xs = [af.placeholder(f"x{k}", (3,), "float64", dev(k)) for k in range(3)]
        outs = af.ops.all_reduce(xs, "max")
        total = af.ops.add(af.ops.sum(outs[0]), af.ops.to_device(af.ops.sum(outs[2]), dev(0)))
        grads = af.gradients(total, xs)
        for k, d in enumerate(grads):
            af.output(f"d{k}", d)
    out = af.run(af.compile(g), {"x0": a, "x1": b, "x2": c})
    np.testing.assert_allclose(out["d0"], [1.0, 1.0, 2 / 3])
    np.testing.assert_allclose(out["d1"], [1.0, 0.0, 2 / 3])
    np.testing.assert_allclose(out["d2"], [0.0, 1.0, 2 / 3])


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("n", [2, 3])
def test_all_gather(n, axis):
    check_gradients(lambda t: af.ops.all_gather(_xs(t, n), axis), _per_device(n, (2, 2), 20))


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("n", [2, 3])
def test_reduce_scatter(n, axis):
    shape = (6, 2) if axis == 0 else (2, 6)
    check_gradients(lambda t: af.ops.reduce_scatter(_xs(t, n), axis), _per_device(n, shape, 22))


@pytest.mark.parametrize(
    "source,targets", [(0, [0, 1, 2]), (1, [0, 2]), (0, [3]), (2, [1, 2, 3, 0])], ids=str
)
def test_broadcast(source, targets):
    check_gradients(
        lambda t: af.ops.broadcast(t["x"], [dev(k) for k in targets]),
        {"x": (rand((2, 2), 24), dev(source))},
    )


def test_broadcast_with_unused_results():
    def build(t):
        outs = af.ops.broadcast(t["x"], [dev(1), dev(2), dev(3)])
        return [outs[0], outs[2]]

    check_gradients(build, {"x": (rand((3,), 25), dev(0))})


@pytest.mark.parametrize("split_axis,concat_axis", [(0, 0), (0, 1), (1, 0), (1, 1)], ids=str)
@pytest.mark.parametrize("n", [2, 3])
def test_all_to_all(n, split_axis, concat_axis):
    check_gradients(
        lambda t: af.ops.all_to_all(_xs(t, n), split_axis, concat_axis),
        _per_device(n, (6, 3) if split_axis == 0 else (3, 6), 26),
    )


def test_all_to_all_with_unused_results():
    def build(t):
        return af.ops.all_to_all(_xs(t, 3), 0, 1)[1]

    check_gradients(build, _per_device(3, (3, 2), 27))


def test_data_parallel_step():
    """Parameters on cpu:0 broadcast to 3 devices, each with its shard of the batch; the
    losses' mean over devices (all_reduce) is the objective."""

    def build(t):
        ws = af.ops.broadcast(t["w"], [dev(k) for k in range(3)])
        bs = af.ops.broadcast(t["b"], [dev(k) for k in range(3)])
        losses = []
        for k in range(3):
            h = af.ops.gelu(af.ops.bias_add(af.ops.matmul(t[f"x{k}"], ws[k]), bs[k]))
            losses.append(af.ops.mse_loss(h, t[f"y{k}"]))
        return af.ops.all_reduce(losses, "mean")[0]

    inputs = {"w": (rand((3, 2), 28), dev(0)), "b": (rand((2,), 29), dev(0))}
    fixed = {f"x{k}": (rand((2, 3), 30 + k), dev(k)) for k in range(3)}
    fixed |= {f"y{k}": (rand((2, 2), 40 + k), dev(k)) for k in range(3)}
    check_gradients(build, inputs, fixed=fixed, params=["w", "b"])


# -- the framework ----------------------------------------------------------------------


def test_tensor_used_twice_sums_its_gradients():
    def build(t):
        x = t["x"]
        h = af.ops.tanh(x)
        return af.ops.add(af.ops.mul(h, x), af.ops.mul(af.ops.exp(x), h))

    check_gradients(build, {"x": rand((2, 3), 50)})


def test_tensor_twice_in_one_op():
    """Both inputs of one node are the same tensor: the two gradients add up."""

    def build(t):
        x = t["x"]
        return [af.ops.mul(x, x), af.ops.div(x, x), af.ops.concat([x, x], 1), af.ops.matmul(x, x)]

    check_gradients(build, {"x": away_from_zero((2, 2), 64)})


def test_mlp_with_parameters():
    def build(t):
        h = af.ops.relu(af.ops.bias_add(af.ops.matmul(t["x"], t["w1"]), t["b1"]))
        z = af.ops.bias_add(af.ops.matmul(h, t["w2"]), t["b2"])
        return af.ops.softmax(z)

    inputs = {
        "w1": rand((3, 4), 51),
        "b1": rand((4,), 52),
        "w2": rand((4, 2), 53),
        "b2": rand((2,), 54),
        "x": rand((2, 3), 55),
    }
    check_gradients(build, inputs, params=["w1", "b1", "w2", "b2"])


def test_gradient_with_respect_to_an_intermediate():
    with af.Graph() as g:
        x = af.placeholder("x", (3,), "float64")
        h = af.ops.exp(x)
        y = af.ops.sum(af.ops.mul(h, x))
        dh, dx = af.gradients(y, [h, x])
        af.output("dh", dh)
        af.output("dx", dx)
    xv = rand((3,), 56)
    out = af.run(af.compile(g), {"x": xv})
    np.testing.assert_allclose(out["dh"], xv, rtol=1e-12)
    np.testing.assert_allclose(out["dx"], np.exp(xv) * (xv + 1), rtol=1e-12)


def test_dy_weights_the_output():
    with af.Graph() as g:
        x = af.placeholder("x", (2, 3), "float64")
        dy = af.placeholder("dy", (2, 3), "float64")
        (d,) = af.gradients(af.ops.tanh(x), [x], dy)
        af.output("d", d)
    xv, dyv = rand((2, 3), 57), rand((2, 3), 58)
    out = af.run(af.compile(g), {"x": xv, "dy": dyv})
    np.testing.assert_allclose(out["d"], dyv * (1 - np.tanh(xv) ** 2), rtol=1e-12)


def test_float32_gradients_stay_float32():
    with af.Graph() as g:
        x = af.placeholder("x", (2, 3), "float32")
        w = af.parameter("w", np.ones((3,), np.float32))
        y = af.ops.mean(af.ops.softmax(af.ops.mul(af.ops.gelu(x), w)))
        grads = af.gradients(y, [x, w])
        assert all(d.dtype == "float32" for d in grads)
        af.output("dx", grads[0])
    xv = rand((2, 3), 59).astype(np.float32)
    assert af.run(af.compile(g), {"x": xv})["dx"].dtype == np.float32


def test_unrelated_input_gets_none():
    with af.Graph():
        x = af.placeholder("x", (3,), "float64")
        z = af.placeholder("z", (3,), "float64")
        unused = af.ops.exp(z)
        y = af.ops.sum(af.ops.tanh(x))
        dx, dz, du = af.gradients(y, [x, z, unused])
        assert dx is not None
        assert dz is None and du is None


def test_integer_tensors_get_no_gradient():
    with af.Graph():
        k = af.placeholder("k", (3,), "int64")
        x = af.placeholder("x", (3,), "float64")
        y = af.ops.sum(af.ops.mul(af.ops.exp(k), x))
        dk, dx = af.gradients(y, [k, x])
        assert dk is None and dx is not None


def test_wrong_dy_shape_raises():
    with af.Graph():
        x = af.placeholder("x", (2, 3), "float64")
        y = af.ops.tanh(x)
        dy = af.placeholder("dy", (3, 2), "float64")
        with pytest.raises(af.GraphError, match="dy"):
            af.gradients(y, [x], dy)
        dy32 = af.placeholder("dy32", (2, 3), "float32")
        with pytest.raises(af.GraphError, match="dy"):
            af.gradients(y, [x], dy32)


def test_call_without_grad_is_not_differentiable():
    with af.Graph():
        x = af.placeholder("x", (3,), "float64")
        y = af.ops.call(userfns.double, af.ops.exp(x), shape=(3,), dtype="float64", name="user_fn")
        with pytest.raises(af.GraphError, match=r"call 'user_fn'.*has no gradient: give it grad="):
            af.gradients(af.ops.sum(y), [x])


def test_call_off_the_path_is_fine():
    """A call that x does not reach needs no gradient."""
    with af.Graph() as g:
        x = af.placeholder("x", (3,), "float64")
        z = af.placeholder("z", (3,), "float64")
        c = af.ops.call(userfns.double, z, shape=(3,), dtype="float64")
        y = af.ops.sum(af.ops.mul(af.ops.exp(x), c))
        (dx,) = af.gradients(y, [x])
        af.output("dx", dx)
    xv, zv = rand((3,), 60), rand((3,), 61)
    out = af.run(af.compile(g), {"x": xv, "z": zv})
    np.testing.assert_allclose(out["dx"], np.exp(xv) * 2 * zv, rtol=1e-12)


DIFFERENTIABLE = """add sub mul div matmul relu gelu tanh exp log softmax sum mean max reshape
transpose concat split slice bias_add copy full all_reduce all_gather reduce_scatter broadcast
all_to_all mse_loss softmax_cross_entropy""".split()


def test_every_differentiable_op_has_a_rule():
    from actorflow.autodiff.registry import rule_for

    assert [op for op in DIFFERENTIABLE if rule_for(op) is None] == []


# -- the backward-only ops' own checks --------------------------------------------------


def test_backward_op_build_errors():
    with af.Graph():
        x = af.placeholder("x", (2, 3), "float64")
        with pytest.raises(af.GraphError, match="broadcast_to"):
            af.ops.broadcast_to(x, (3, 3))
        with pytest.raises(af.GraphError, match="sum_to"):
            af.ops.sum_to(x, (4,))
        with pytest.raises(af.GraphError, match="pad"):
            af.ops.pad(x, (1, 0), (2, 3))
        with pytest.raises(af.GraphError, match="scale"):
            af.ops.scale(x, float("nan"))
        with pytest.raises(af.GraphError, match="max_grad"):
            af.ops.max_grad(x, x, x, axis=1)
        with pytest.raises(af.GraphError, match="softmax_grad"):
            af.ops.softmax_grad(x, af.placeholder("y", (3, 2), "float64"))
        k = af.placeholder("k", (2, 3), "int64")
        with pytest.raises(af.GraphError, match="scale: needs floating-point"):
            af.ops.scale(k, 2.0)
        with pytest.raises(af.GraphError, match="tanh_grad: needs floating-point"):
            af.ops.tanh_grad(k, k)
        assert af.ops.broadcast_to(x, (2, 3)) is x
        assert af.ops.scale(x, 1) is x


def test_backward_ops_against_numpy():
    xv = rand((2, 3), 62)
    with af.Graph() as g:
        x = af.placeholder("x", (2, 3), "float64")
        af.output("bt", af.ops.broadcast_to(af.ops.sum(x, axis=0, keepdims=True), (2, 2, 3)))
        af.output("scale", af.ops.scale(x, -2.5))
        af.output("pad", af.ops.pad(x, (1, 0), (4, 4)))
        af.output("mask", af.ops.equal_mask(x, af.ops.mul(x, af.ops.full((2, 3), 1.0, "float64"))))
    out = af.run(af.compile(g), {"x": xv})
    np.testing.assert_allclose(out["bt"], np.broadcast_to(xv.sum(0, keepdims=True), (2, 2, 3)))
    np.testing.assert_allclose(out["scale"], -2.5 * xv)
    padded = np.zeros((4, 4))
    padded[1:3, 0:3] = xv
    np.testing.assert_array_equal(out["pad"], padded)
    np.testing.assert_array_equal(out["mask"], np.ones((2, 3)))


def test_gradient_plan_round_trips():
    """Backward ops' kernels serialize by import path like any other."""
    with af.Graph() as g:
        x = af.placeholder("x", (2, 4), "float64")
        xs = af.ops.split(x, 2, axis=1)
        h = af.ops.all_reduce([xs[0], af.ops.to_device(xs[1], dev(1))], "max")
        y = af.ops.mean(af.ops.softmax(af.ops.gelu(af.ops.slice(h[0], (0, 0), (2, 1)))))
        (dx,) = af.gradients(y, [x])
        af.output("dx", dx)
    plan = af.compile(g)
    xv = rand((2, 4), 63)
    same = af.Plan.from_bytes(plan.to_bytes())
    np.testing.assert_array_equal(af.run(same, {"x": xv})["dx"], af.run(plan, {"x": xv})["dx"])


def test_gradients_build_in_ys_graph_wherever_they_are_called():
    with af.Graph() as g:
        x = af.placeholder("x", (3,), "float64")
        y = af.ops.sum(af.ops.exp(x))
    with af.Graph() as other:
        (dx,) = af.gradients(y, [x])
    assert other.nodes == []
    with g:
        af.output("dx", dx)
    xs = np.array([0.5, -1.0, 2.0])
    np.testing.assert_allclose(af.run(af.compile(g), {"x": xs})["dx"], np.exp(xs), rtol=1e-12)
