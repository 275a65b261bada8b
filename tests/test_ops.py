"""Every compute op against a plain numpy reference, through af.compile + af.run.

Each test builds a small graph, compiles it, runs it and compares every output with numpy
(float32: rtol 1e-5, float64: rtol 1e-12). Multi-device graphs, to_device chains and
pipelined iterations (a list of feeds) are checked the same way.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import actorflow as af
import userfns

DTYPES = ["float32", "float64"]
TOL = {"float32": dict(rtol=1e-5, atol=1e-6), "float64": dict(rtol=1e-12, atol=1e-14)}
# matmul and reductions sum many terms; BLAS and numpy may order them differently.
SUM_TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "float64": dict(rtol=1e-12, atol=1e-12)}


def rand(shape, dtype, seed=0, low=-2.0, high=2.0):
    return np.random.default_rng(seed).uniform(low, high, size=shape).astype(dtype)


def run_graph(build, feeds, quota=2):
    """Build a graph with ``build()`` (which declares its outputs), compile, run once."""
    with af.Graph() as g:
        build()
    plan = af.compile(g, quota=quota)
    return af.run(plan, feeds)


def check(actual, expected, dtype, tol=TOL):
    assert actual.dtype == np.dtype(dtype), (actual.dtype, dtype)
    assert actual.shape == np.shape(expected), (actual.shape, np.shape(expected))
    np.testing.assert_allclose(actual, expected, **tol[dtype])


# -- module-level user kernels for af.ops.call (a Plan imports them by path) ------------


def square_then_sum_rows(a):
    """(n, m) -> (n,): summed in float64, returned in the input's dtype."""
    return (np.asarray(a, np.float64) ** 2).sum(axis=1).astype(a.dtype)


def square_then_sum_rows_in_float64(a):
    return (np.asarray(a, np.float64) ** 2).sum(axis=1)


def ones_2x3():
    return np.ones((2, 3))


def weighted(a, b, c):
    return a * 2 + b - c


# -- elementwise unary -------------------------------------------------------------------


def _gelu_ref(x):
    x64 = x.astype(np.float64)
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x64 * (1.0 + np.tanh(c * (x64 + 0.044715 * x64**3)))


UNARY = {
    "relu": (lambda x: np.maximum(x, 0), -2.0, 2.0),
    "gelu": (_gelu_ref, -4.0, 4.0),
    "tanh": (np.tanh, -3.0, 3.0),
    "exp": (np.exp, -3.0, 3.0),
    "log": (np.log, 0.05, 5.0),
}


@pytest.mark.parametrize("shape", [(7,), (4, 5), (2, 3, 4)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op, dtype, shape):
    ref, low, high = UNARY[op]
    xs = rand(shape, dtype, seed=1, low=low, high=high)

    def build():
        x = af.placeholder("x", shape, dtype)
        af.output("y", getattr(af.ops, op)(x))

    out = run_graph(build, {"x": xs})
    check(out["y"], ref(xs), dtype)


def test_relu_zeroes_exactly_the_negatives():
    xs = np.array([-3.0, -0.0, 0.0, 1e-30, -1e-30, 2.5], np.float32)

    def build():
        af.output("y", af.ops.relu(af.placeholder("x", xs.shape)))

    y = run_graph(build, {"x": xs})["y"]
    np.testing.assert_array_equal(y, np.array([0, 0, 0, 1e-30, 0, 2.5], np.float32))


def test_gelu_known_values():
    xs = np.array([0.0, 1.0, -1.0, 3.0], np.float64)

    def build():
        af.output("y", af.ops.gelu(af.placeholder("x", xs.shape, "float64")))

    y = run_graph(build, {"x": xs})["y"]
    # the tanh approximation, evaluated one scalar at a time with the math module
    c = math.sqrt(2 / math.pi)
    expected = [0.5 * v * (1 + math.tanh(c * (v + 0.044715 * v**3))) for v in xs.tolist()]
    np.testing.assert_allclose(y, expected, rtol=1e-12)
    np.testing.assert_allclose(y[:3], [0.0, 0.8411919906082768, -0.15880800939172324], rtol=1e-9)


# -- elementwise binary with broadcasting ---------------------------------------------------

BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
BROADCAST_PAIRS = [
    ((4, 5), (4, 5)),
    ((3, 1), (1, 4)),
    ((2, 3, 4), (4,)),
    ((5,), ()),
    ((2, 1, 4), (3, 1)),
]


@pytest.mark.parametrize("shapes", BROADCAST_PAIRS, ids=lambda s: f"{s[0]}-{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_broadcasting(op, dtype, shapes):
    sa, sb = shapes
    a = rand(sa, dtype, seed=2)
    # keep denominators away from zero
    b = rand(sb, dtype, seed=3, low=0.5, high=2.0) * np.where(rand(sb, dtype, seed=4) < 0, -1, 1).astype(
        dtype
    )

    def build():
        x = af.placeholder("a", sa, dtype)
        y = af.placeholder("b", sb, dtype)
        af.output("ab", getattr(af.ops, op)(x, y))
        af.output("ba", getattr(af.ops, op)(y, x))

    out = run_graph(build, {"a": a, "b": np.asarray(b, dtype)})
    check(out["ab"], BINARY[op](a, b), dtype)
    check(out["ba"], BINARY[op](b, a), dtype)


def test_binary_same_input_twice():
    xs = rand((3, 4), "float32", seed=5)

    def build():
        x = af.placeholder("x", (3, 4))
        af.output("y", af.ops.mul(x, x))

    check(run_graph(build, {"x": xs})["y"], xs * xs, "float32")


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_integer_binary(op):
    a = np.arange(12, dtype=np.int64).reshape(3, 4) - 5
    b = np.array([3, -1, 2, 7], np.int64)

    def build():
        af.output(
            "y", getattr(af.ops, op)(af.placeholder("a", (3, 4), "int64"), af.placeholder("b", (4,), "int64"))
        )

    y = run_graph(build, {"a": a, "b": b})["y"]
    assert y.dtype == np.int64
    np.testing.assert_array_equal(y, BINARY[op](a, b))


@pytest.mark.parametrize("op", ["div", "exp", "log", "tanh", "gelu", "softmax"])
def test_integer_input_to_float_op_gives_float64(op):
    xs = np.arange(1, 7, dtype=np.int32).reshape(2, 3)

    def build():
        x = af.placeholder("x", (2, 3), "int32")
        af.output("y", af.ops.div(x, x) if op == "div" else getattr(af.ops, op)(x))

    out = run_graph(build, {"x": xs})
    assert out["y"].dtype == np.float64
    ref = {
        "div": lambda v: v / v,
        "exp": np.exp,
        "log": np.log,
        "tanh": np.tanh,
        "gelu": _gelu_ref,
        "softmax": lambda v: np.exp(v) / np.exp(v).sum(-1, keepdims=True),
    }[op](xs.astype(np.float64))
    np.testing.assert_allclose(out["y"], ref, rtol=1e-6)


# -- matmul -----------------------------------------------------------------------------

MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((1, 8), (8, 1)),
    ((2, 3, 4), (4, 5)),
    ((3, 4), (2, 4, 5)),
    ((2, 3, 4), (2, 4, 5)),
    ((2, 1, 3, 4), (3, 4, 5)),
    ((16, 64), (64, 32)),
]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=lambda s: f"{s[0]}@{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul(dtype, shapes):
    sa, sb = shapes
    a, b = rand(sa, dtype, seed=6), rand(sb, dtype, seed=7)

    def build():
        af.output("y", af.ops.matmul(af.placeholder("a", sa, dtype), af.placeholder("b", sb, dtype)))

    out = run_graph(build, {"a": a, "b": b})
    check(out["y"], np.matmul(a, b), dtype, SUM_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_with_parameter_and_relu(dtype):
    xs = rand((8, 6), dtype, seed=8)
    w = rand((6, 3), dtype, seed=9)

    def build():
        x = af.placeholder("x", (8, 6), dtype)
        af.output("y", af.ops.relu(af.ops.matmul(x, af.parameter("w", w))))

    check(run_graph(build, {"x": xs})["y"], np.maximum(xs @ w, 0), dtype, SUM_TOL)


# -- bias_add, softmax ------------------------------------------------------------------


@pytest.mark.parametrize(
    "shapes", [((4, 5), (5,)), ((2, 3, 4), (4,)), ((2, 3, 4), (3, 4)), ((6,), (6,))], ids=str
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_add(dtype, shapes):
    sx, sb = shapes
    xs, bs = rand(sx, dtype, seed=10), rand(sb, dtype, seed=11)

    def build():
        af.output("y", af.ops.bias_add(af.placeholder("x", sx, dtype), af.parameter("b", bs)))

    check(run_graph(build, {"x": xs})["y"], xs + bs, dtype)


def _softmax_ref(x, axis):
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize(
    "shape,axis",
    [((5,), 0), ((4, 5), -1), ((4, 5), 0), ((2, 3, 4), 0), ((2, 3, 4), 1), ((2, 3, 4), 2), ((2, 3, 4), -2)],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax(dtype, shape, axis):
    xs = rand(shape, dtype, seed=12, low=-5, high=5)

    def build():
        af.output("y", af.ops.softmax(af.placeholder("x", shape, dtype), axis=axis))

    y = run_graph(build, {"x": xs})["y"]
    check(y, _softmax_ref(xs, axis), dtype)
    np.testing.assert_allclose(y.sum(axis=axis), 1.0, **TOL[dtype])


def test_softmax_default_axis_is_last_and_large_inputs_are_stable():
    xs = np.array([[1000.0, 1001.0, 1002.0], [-1000.0, -1000.0, -1000.0]], np.float32)

    def build():
        af.output("y", af.ops.softmax(af.placeholder("x", (2, 3))))

    y = run_graph(build, {"x": xs})["y"]
    assert np.all(np.isfinite(y))
    check(y, _softmax_ref(xs, -1), "float32")


# -- reductions -------------------------------------------------------------------------

REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max}


@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2), (2, 0), (1,), (0, 1, 2)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(REDUCE))
def test_reductions(op, dtype, axis, keepdims):
    shape = (2, 3, 4)
    xs = rand(shape, dtype, seed=13)

    def build():
        x = af.placeholder("x", shape, dtype)
        af.output("y", getattr(af.ops, op)(x, axis=axis, keepdims=keepdims))

    y = run_graph(build, {"x": xs})["y"]
    check(y, REDUCE[op](xs, axis=axis, keepdims=keepdims), dtype, SUM_TOL)


@pytest.mark.parametrize("op", sorted(REDUCE))
def test_reductions_of_2d_default_axis(op):
    xs = rand((5, 7), "float64", seed=14)

    def build():
        af.output("y", getattr(af.ops, op)(af.placeholder("x", (5, 7), "float64")))

    y = run_graph(build, {"x": xs})["y"]
    assert y.shape == ()
    check(y, REDUCE[op](xs), "float64", SUM_TOL)


@pytest.mark.parametrize("op", sorted(REDUCE))
def test_integer_reductions(op):
    xs = (np.arange(24, dtype=np.int32).reshape(2, 3, 4) * 7) % 11 - 5

    def build():
        af.output("y", getattr(af.ops, op)(af.placeholder("x", (2, 3, 4), "int32"), axis=1))

    y = run_graph(build, {"x": xs})["y"]
    expected = REDUCE[op](xs, axis=1)
    # mean of integers gives float64; sum and max keep the input dtype
    assert y.dtype == (np.float64 if op == "mean" else np.int32)
    np.testing.assert_allclose(y, expected, rtol=1e-12)


# -- reshape, transpose -----------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,new,expected",
    [
        ((2, 3, 4), (6, 4), (6, 4)),
        ((2, 3, 4), (-1,), (24,)),
        ((2, 3, 4), (4, -1), (4, 6)),
        ((12,), (2, 2, 3), (2, 2, 3)),
        ((1, 5), (5,), (5,)),
        ((6,), (1, 6, 1), (1, 6, 1)),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape(dtype, shape, new, expected):
    xs = rand(shape, dtype, seed=15)

    def build():
        y = af.ops.reshape(af.placeholder("x", shape, dtype), new)
        assert y.shape == expected
        af.output("y", y)

    check(run_graph(build, {"x": xs})["y"], xs.reshape(new), dtype)


@pytest.mark.parametrize(
    "shape,perm",
    [
        ((3, 4), None),
        ((3, 4), (1, 0)),
        ((2, 3, 4), None),
        ((2, 3, 4), (1, 0, 2)),
        ((2, 3, 4), (2, 0, 1)),
        ((5,), (0,)),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose(dtype, shape, perm):
    xs = rand(shape, dtype, seed=16)

    def build():
        af.output("y", af.ops.transpose(af.placeholder("x", shape, dtype), perm))

    y = run_graph(build, {"x": xs})["y"]
    check(y, np.transpose(xs, perm), dtype)
    assert y.flags.c_contiguous or y.ndim <= 1


# -- concat, split, slice -----------------------------------------------------------------


@pytest.mark.parametrize(
    "shapes,axis",
    [
        ([(2, 3), (4, 3), (1, 3)], 0),
        ([(2, 3), (2, 1), (2, 5)], 1),
        ([(2, 3), (2, 1), (2, 5)], -1),
        ([(2, 3, 4), (2, 2, 4)], 1),
        ([(3,)], 0),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_concat(dtype, shapes, axis):
    arrays = [rand(s, dtype, seed=17 + k) for k, s in enumerate(shapes)]

    def build():
        ts = [af.placeholder(f"x{k}", s, dtype) for k, s in enumerate(shapes)]
        af.output("y", af.ops.concat(ts, axis=axis))

    out = run_graph(build, {f"x{k}": a for k, a in enumerate(arrays)})
    check(out["y"], np.concatenate(arrays, axis=axis), dtype)


def test_concat_of_the_same_tensor_twice():
    xs = rand((2, 3), "float32", seed=20)

    def build():
        x = af.placeholder("x", (2, 3))
        af.output("y", af.ops.concat([x, x, x], axis=0))

    check(run_graph(build, {"x": xs})["y"], np.concatenate([xs, xs, xs]), "float32")


@pytest.mark.parametrize(
    "shape,sections,axis",
    [
        ((6, 4), 3, 0),
        ((6, 4), 2, 1),
        ((6, 4), 1, 0),
        ((2, 6, 3), 3, -2),
        ((10,), [3, 5, 2], 0),
        ((4, 7), [1, 6], 1),
        ((4, 7), [0, 7], 1),
        ((2, 3, 5), [2, 2, 1], 2),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_every_output(dtype, shape, sections, axis):
    xs = rand(shape, dtype, seed=21)
    indices = sections if isinstance(sections, int) else np.cumsum(sections)[:-1]
    expected = np.split(xs, indices, axis=axis)

    def build():
        parts = af.ops.split(af.placeholder("x", shape, dtype), sections, axis=axis)
        assert len(parts) == len(expected)
        for k, p in enumerate(parts):
            assert p.shape == expected[k].shape
            af.output(f"y{k}", p)

    out = run_graph(build, {"x": xs})
    assert sorted(out) == [f"y{k}" for k in range(len(expected))]
    for k, e in enumerate(expected):
        check(out[f"y{k}"], e, dtype)


@pytest.mark.parametrize("quota", [1, 2])
def test_split_with_only_some_outputs_used_over_iterations(quota):
    feeds = [{"x": rand((6, 2), "float32", seed=30 + i)} for i in range(5)]

    def build():
        a, b, c = af.ops.split(af.placeholder("x", (6, 2)), 3, axis=0)
        af.output("y", af.ops.add(c, a))  # the middle part is unused

    with af.Graph() as g:
        build()
    outs = af.run(af.compile(g, quota=quota), feeds)
    for f, out in zip(feeds, outs):
        check(out["y"], f["x"][4:6] + f["x"][0:2], "float32")


def test_split_then_concat_in_reverse_order():
    xs = rand((9, 2), "float64", seed=22)

    def build():
        parts = af.ops.split(af.placeholder("x", (9, 2), "float64"), [2, 3, 4])
        af.output("y", af.ops.concat(parts[::-1], axis=0))

    check(run_graph(build, {"x": xs})["y"], np.concatenate([xs[5:], xs[2:5], xs[:2]]), "float64")


@pytest.mark.parametrize(
    "shape,begin,end",
    [
        ((4, 5, 6), (1,), (3,)),  # partial: trailing dims taken whole
        ((4, 5, 6), (1, 2), (3, 5)),
        ((4, 5, 6), (0, 0, 0), (4, 5, 6)),  # the whole tensor
        ((4, 5, 6), (3, 4, 5), (4, 5, 6)),  # one element
        ((4, 5, 6), (), ()),  # nothing given: the whole tensor
        ((7,), (2,), (7,)),
        ((4, 5), (2, 1), (2, 4)),  # an empty slice
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_slice(dtype, shape, begin, end):
    xs = rand(shape, dtype, seed=23)
    index = tuple(slice(b, e) for b, e in zip(begin, end))

    def build():
        af.output("y", af.ops.slice(af.placeholder("x", shape, dtype), begin, end))

    check(run_graph(build, {"x": xs})["y"], xs[index], dtype)


# -- call ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_call_userfns(dtype):
    a, b = rand((3, 4), dtype, seed=24), rand((3, 4), dtype, seed=25)

    def build():
        x, y = af.placeholder("a", (3, 4), dtype), af.placeholder("b", (3, 4), dtype)
        af.output("id", af.ops.call(userfns.identity, x, shape=(3, 4), dtype=dtype))
        af.output("dbl", af.ops.call(userfns.double, x, shape=(3, 4), dtype=dtype))
        af.output("sum", af.ops.call(userfns.add_pair, x, y, shape=(3, 4), dtype=dtype))

    out = run_graph(build, {"a": a, "b": b})
    check(out["id"], a, dtype)
    check(out["dbl"], a * 2, dtype)
    check(out["sum"], a + b, dtype)


def test_call_with_a_new_shape():
    xs = rand((5, 3), "float32", seed=26)

    def build():
        x = af.placeholder("x", (5, 3))
        y = af.ops.call(square_then_sum_rows, x, shape=(5,), dtype="float32")
        assert (y.shape, y.dtype, y.device) == ((5,), "float32", "cpu:0")
        af.output("y", af.ops.mul(y, y))

    ref = (xs.astype(np.float64) ** 2).sum(axis=1).astype(np.float32)
    check(run_graph(build, {"x": xs})["y"], ref * ref, "float32")


def test_the_call_kernel_takes_arrays_of_its_dtype_and_casts_plain_values_within_a_kind():
    """An array of another dtype is refused (as another shape is), a plain Python value is
    cast within its kind, a float into an int register is refused rather than truncated,
    and None is reported as None."""
    from actorflow.ops import kernels

    out = np.zeros(3, np.float32)
    kernels.call([np.arange(3, dtype=np.float32)], [out], fn=lambda a: a * 2)
    np.testing.assert_array_equal(out, [0, 2, 4])
    with pytest.raises(af.KernelError, match=r"returned float64, but the graph declared float32\[3\]"):
        kernels.call([np.arange(3, dtype=np.float64)], [out], fn=lambda a: a + 0.5)
    kernels.call([np.arange(3, dtype=np.float64)], [out], fn=lambda a: (a + 0.5).tolist())
    np.testing.assert_array_equal(out, [0.5, 1.5, 2.5])
    with pytest.raises(af.KernelError, match="returned float64, but the graph declared int64"):
        kernels.call(
            [np.arange(3, dtype=np.float64)], [np.zeros(3, np.int64)], fn=lambda a: (a + 0.5).tolist()
        )
    with pytest.raises(af.KernelError, match=r"returned None, but the graph declared float32\[3\]"):
        kernels.call([np.arange(3, dtype=np.float32)], [out], fn=lambda a: None)


def test_call_three_inputs_then_builtin_ops():
    a, b, c = (rand((2, 5), "float64", seed=27 + k) for k in range(3))

    def build():
        ts = [af.placeholder(n, (2, 5), "float64") for n in "abc"]
        z = af.ops.call(weighted, *ts, shape=(2, 5), dtype="float64")
        af.output("y", af.ops.tanh(z))

    check(run_graph(build, {"a": a, "b": b, "c": c})["y"], np.tanh(a * 2 + b - c), "float64")


def test_call_without_inputs_on_a_given_device():
    xs = rand((2, 3), "float64", seed=29)

    def build():
        ones = af.ops.call(ones_2x3, shape=(2, 3), dtype="float64", device="cpu:1")
        assert ones.device == "cpu:1"
        x = af.ops.to_device(af.placeholder("x", (2, 3), "float64"), "cpu:1")
        af.output("y", af.ops.add(x, ones))

    check(run_graph(build, {"x": xs})["y"], xs + 1, "float64")


# -- devices: to_device chains, graphs on two devices --------------------------------------


def test_to_device_same_device_is_the_same_tensor():
    with af.Graph():
        x = af.placeholder("x", (2,), device="cpu:1")
        assert af.ops.to_device(x, "cpu:1") is x
        assert af.ops.to_device(x, " cpu:01 ") is x  # canonicalized


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "chain",
    [["cpu:1"], ["cpu:1", "cpu:2"], ["cpu:1", "cpu:2", "cpu:3", "cpu:0"], ["cpu:3", "cpu:0", "cpu:3"]],
    ids=str,
)
def test_to_device_chain(chain, dtype):
    xs = rand((3, 4), dtype, seed=31)

    def build():
        t = af.placeholder("x", (3, 4), dtype, "cpu:0")
        for k, d in enumerate(chain):
            t = af.ops.to_device(t, d)
            assert t.device == d
            t = af.ops.add(t, af.parameter(f"c{k}", np.full((), k + 1, dtype), device=d))
            af.output(f"at{k}", t)

    out = run_graph(build, {"x": xs})
    expected = xs
    for k in range(len(chain)):
        expected = expected + (k + 1)
        check(out[f"at{k}"], expected, dtype)


def test_output_on_another_device_without_compute():
    xs = rand((4,), "float32", seed=32)

    def build():
        x = af.placeholder("x", (4,), device="cpu:2")
        af.output("copy", af.ops.to_device(af.ops.to_device(x, "cpu:0"), "cpu:3"))
        af.output("raw", x)

    out = run_graph(build, {"x": xs})
    np.testing.assert_array_equal(out["copy"], xs)
    np.testing.assert_array_equal(out["raw"], xs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_stage_mlp_on_two_devices(dtype):
    xs = rand((8, 16), dtype, seed=33)
    w1, b1 = rand((16, 32), dtype, seed=34), rand((32,), dtype, seed=35)
    w2, b2 = rand((32, 4), dtype, seed=36), rand((4,), dtype, seed=37)

    def build():
        x = af.placeholder("x", (8, 16), dtype, "cpu:0")
        h = af.ops.gelu(
            af.ops.bias_add(
                af.ops.matmul(x, af.parameter("w1", w1, "cpu:0")), af.parameter("b1", b1, "cpu:0")
            )
        )
        h = af.ops.to_device(h, "cpu:1")
        z = af.ops.bias_add(
            af.ops.matmul(h, af.parameter("w2", w2, "cpu:1")), af.parameter("b2", b2, "cpu:1")
        )
        af.output("y", af.ops.softmax(z, axis=-1))
        af.output("h", h)

    out = run_graph(build, {"x": xs})
    h_ref = _gelu_ref(xs @ w1 + b1).astype(dtype)
    check(out["h"], h_ref, dtype, SUM_TOL)
    check(out["y"], _softmax_ref(h_ref @ w2 + b2, -1), dtype, SUM_TOL)


def test_branches_on_two_devices_joined():
    """Both devices compute at once from the same input; the results meet on cpu:0."""
    xs = rand((6, 6), "float64", seed=38)
    w0, w1 = rand((6, 6), "float64", seed=39), rand((6, 6), "float64", seed=40)

    def build():
        x = af.placeholder("x", (6, 6), "float64", "cpu:0")
        left = af.ops.tanh(af.ops.matmul(x, af.parameter("w0", w0, "cpu:0")))
        x1 = af.ops.to_device(x, "cpu:1")
        right = af.ops.exp(af.ops.matmul(x1, af.parameter("w1", w1, "cpu:1")))
        right_sum = af.ops.sum(right, axis=0, keepdims=True)
        joined = af.ops.div(left, af.ops.to_device(right_sum, "cpu:0"))
        af.output("y", af.ops.concat([joined, left], axis=1))
        af.output("r", right_sum)

    out = run_graph(build, {"x": xs})
    left = np.tanh(xs @ w0)
    right_sum = np.exp(xs @ w1).sum(axis=0, keepdims=True)
    check(out["r"], right_sum, "float64", SUM_TOL)
    check(out["y"], np.concatenate([left / right_sum, left], axis=1), "float64", SUM_TOL)


def test_round_trip_between_devices_many_hops():
    xs = rand((3, 3), "float32", seed=41)

    def build():
        t = af.placeholder("x", (3, 3))
        for k in range(6):
            d = f"cpu:{(k + 1) % 2}"
            t = af.ops.mul(af.ops.to_device(t, d), af.parameter(f"s{k}", np.float32(2.0), device=d))
        af.output("y", t)

    check(run_graph(build, {"x": xs})["y"], xs * 64, "float32")


# -- several iterations -------------------------------------------------------------------


def _pipeline_graph(dtype):
    w = rand((8, 8), dtype, seed=42)
    with af.Graph() as g:
        x = af.placeholder("x", (4, 8), dtype, "cpu:0")
        h = af.ops.relu(af.ops.matmul(x, af.parameter("w", w, "cpu:0")))
        h1 = af.ops.to_device(h, "cpu:1")
        y = af.ops.softmax(af.ops.add(h1, af.ops.to_device(x, "cpu:1")), axis=1)
        af.output("y", y)
        af.output("m", af.ops.max(h, axis=0))
    return g, w


def _pipeline_ref(xs, w):
    h = np.maximum(xs @ w, 0)
    return {"y": _softmax_ref(h + xs, 1), "m": h.max(axis=0)}


@pytest.mark.parametrize("quota", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_iterations_give_per_iteration_results(dtype, quota):
    g, w = _pipeline_graph(dtype)
    plan = af.compile(g, quota=quota)
    feeds = [{"x": rand((4, 8), dtype, seed=100 + i)} for i in range(6)]
    outs = af.run(plan, feeds)
    assert isinstance(outs, list) and len(outs) == len(feeds)
    for f, out in zip(feeds, outs):
        ref = _pipeline_ref(f["x"], w)
        assert sorted(out) == ["m", "y"]
        check(out["y"], ref["y"].astype(dtype), dtype, SUM_TOL)
        check(out["m"], ref["m"], dtype, SUM_TOL)


def test_iterations_single_dict_vs_list_of_one():
    g, w = _pipeline_graph("float64")
    plan = af.compile(g)
    xs = rand((4, 8), "float64", seed=7)
    one = af.run(plan, {"x": xs})
    listed = af.run(plan, [{"x": xs}])
    assert isinstance(one, dict) and isinstance(listed, list) and len(listed) == 1
    for k in ("y", "m"):
        np.testing.assert_array_equal(one[k], listed[0][k])
    assert af.run(plan, []) == []


def test_returned_outputs_are_not_overwritten_by_later_iterations():
    """Fetched arrays are copies: buffers are reused across iterations under a quota of 1."""
    with af.Graph() as g:
        af.output("y", af.ops.mul(af.placeholder("x", (3,)), af.parameter("two", np.float32(2))))
    plan = af.compile(g, quota=1)
    feeds = [{"x": np.full(3, i, np.float32)} for i in range(8)]
    outs = af.run(plan, feeds)
    ys = [o["y"] for o in outs]
    for i, y in enumerate(ys):
        np.testing.assert_array_equal(y, np.full(3, 2 * i, np.float32))
    assert len({id(y) for y in ys}) == len(ys)


def test_session_runs_again_with_the_same_results():
    g, w = _pipeline_graph("float32")
    plan = af.compile(g, quota=2)
    feeds = [{"x": rand((4, 8), "float32", seed=200 + i)} for i in range(3)]
    with af.Session(plan) as s:
        first = s.run(feeds)
        second = s.run(feeds[::-1])
    for f, a, b in zip(feeds, first, second[::-1]):
        ref = _pipeline_ref(f["x"], w)
        check(a["y"], ref["y"].astype(np.float32), "float32", SUM_TOL)
        np.testing.assert_array_equal(a["y"], b["y"])
        np.testing.assert_array_equal(a["m"], b["m"])


def test_plan_round_trip_runs_the_same():
    xs = rand((3, 4), "float32", seed=43)
    with af.Graph() as g:
        x = af.placeholder("x", (3, 4))
        s = af.ops.sum(x, axis=(0, 1), keepdims=True)
        a, b = af.ops.split(af.ops.call(userfns.double, x, shape=(3, 4)), [1, 3], axis=1)
        af.output("y", af.ops.sub(af.ops.slice(b, (1,), (3,)), s))
        af.output("a", af.ops.transpose(a, (1, 0)))
    plan = af.Plan.from_bytes(af.compile(g).to_bytes(), allow=["test_ops", "userfns"])
    out = af.run(plan, {"x": xs})
    check(out["y"], (xs * 2)[1:3, 1:] - xs.sum(keepdims=True), "float32", SUM_TOL)
    check(out["a"], (xs * 2)[:, :1].T, "float32")


# -- edge cases: no feeds, empty tensors, unusual feed arrays ----------------------------------


def test_graph_of_parameters_only_runs_without_feeds():
    p = np.array([-1.0, 0.5, 2.0])
    with af.Graph() as g:
        w = af.parameter("w", p, device="cpu:1")
        af.output("y", af.ops.exp(af.ops.relu(w)))
        af.output("w_out", w)
    plan = af.compile(g, quota=1)
    for out in [af.run(plan), af.run(plan, {}), *af.run(plan, [{}, {}, {}])]:
        check(out["y"], np.exp(np.maximum(p, 0)), "float64")
        np.testing.assert_array_equal(out["w_out"], p)


def test_zero_size_tensors():
    xs = np.zeros((0, 3), np.float32)

    def build():
        x = af.placeholder("x", (0, 3))
        af.output("s", af.ops.sum(af.ops.relu(x), axis=0))
        af.output("c", af.ops.concat([x, af.ops.to_device(af.ops.to_device(x, "cpu:1"), "cpu:0")], axis=0))

    out = run_graph(build, {"x": xs})
    check(out["s"], np.zeros(3, np.float32), "float32")
    assert out["c"].shape == (0, 3)


def test_non_contiguous_and_read_only_feeds():
    base = rand((4, 6), "float64", seed=44)
    view = base.T[::2]  # (3, 4), neither C- nor F-contiguous
    frozen = rand((3, 4), "float64", seed=45)
    frozen.setflags(write=False)

    def build():
        a = af.placeholder("a", (3, 4), "float64")
        b = af.placeholder("b", (3, 4), "float64")
        af.output("y", af.ops.sub(a, af.ops.to_device(af.ops.to_device(b, "cpu:1"), "cpu:0")))

    check(run_graph(build, {"a": view, "b": frozen})["y"], view - frozen, "float64")


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_matmul_reads_operands_transposed(ta, tb):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 4, 3) if ta else (2, 3, 4))
    b = rng.standard_normal((5, 4) if tb else (4, 5))
    with af.Graph() as g:
        x = af.placeholder("a", a.shape, "float64")
        y = af.placeholder("b", b.shape, "float64")
        af.output("c", af.ops.matmul(x, y, transpose_a=ta, transpose_b=tb))
    out = af.run(af.compile(g), {"a": a, "b": b})["c"]
    want = np.matmul(np.swapaxes(a, -1, -2) if ta else a, b.T if tb else b)
    np.testing.assert_allclose(out, want, rtol=1e-12)


def test_matmul_transposed_shape_errors_name_the_flags():
    with af.Graph():
        a = af.placeholder("a", (3, 4))
        b = af.placeholder("b", (4, 5))
        with pytest.raises(af.GraphError, match=r"matmul: inner dimensions differ.*transpose_a=True"):
            af.ops.matmul(a, b, transpose_a=True)
