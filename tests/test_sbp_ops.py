"""Ops on global tensors, one test per SBP signature (see ``parallel/signatures.py``).

Each test builds the same model twice: on n devices with the inputs' SBPs, and on cpu:0
alone with plain tensors (ops accept both). It checks the result's SBP, its value against
numpy, and that the values and the gradients of every parameter (``af.gradients`` of a
global loss, fetched whole) equal the one-device ones. Shapes are multiples of 12.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

import actorflow as af

TOL = dict(rtol=1e-10, atol=1e-12)
S0, S1, S2 = af.S(0), af.S(1), af.S(2)
B, P = af.B, af.P


def place(n: int) -> list[str]:
    return [f"cpu:{k}" for k in range(n)]


def value(name: str, shape, positive: bool = False) -> np.ndarray:
    """The same array for the same name, in every graph."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if positive:
        return rng.uniform(0.5, 2.0, size=shape)
    return rng.standard_normal(shape)


class Env:
    """Makes the inputs of a model: global tensors over ``n`` devices, or their one-device
    twins when ``n`` is None. ``values`` holds each input's logical value."""

    def __init__(self, n: int | None):
        self.n = n
        self.devices = place(n) if n else None
        self.params: list[tuple[str, object]] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.values: dict[str, np.ndarray] = {}

    @property
    def is_global(self) -> bool:
        return self.n is not None

    def param(self, name: str, shape, sbp, positive: bool = False):
        """A parameter of logical value ``value(name, shape)``; P: a matmul S(1) x S(0) of
        two parameters ``name.a`` and ``name.w`` whose product is that logical value."""
        if sbp == P:
            assert len(shape) == 2
            a = self.param(f"{name}.a", (shape[0], 12), S1, positive)
            w = self.param(f"{name}.w", (12, shape[1]), S0, positive)
            self.values[name] = self.values[f"{name}.a"] @ self.values[f"{name}.w"]
            t = af.ops.matmul(a, w)
            if self.is_global:
                assert t.sbp == P
            return t
        v = value(name, shape, positive)
        self.values[name] = v
        if self.is_global:
            t = af.parameter(name, v, self.devices, sbp)
        else:
            t = af.parameter(name, v, "cpu:0")
        self.params.append((name, t))
        return t

    def feed(self, name: str, v: np.ndarray, sbp):
        self.values[name] = v
        self.feeds[name] = v
        dtype = str(v.dtype)
        if self.is_global:
            return af.placeholder(name, v.shape, dtype, self.devices, sbp)
        return af.placeholder(name, v.shape, dtype, "cpu:0")

    def weighted_sum(self, y, tag: str = "c"):
        """sum(y * C) for a fed broadcast C: a scalar loss whose gradient is not trivial."""
        c = self.feed(tag, value(tag + str(y.shape), y.shape), B)
        return af.ops.reduce_sum(af.ops.mul(y, c))


class Result:
    def __init__(self, n, outs, plan, got, single):
        self.n = n
        self.outs = outs  # name -> GlobalTensor (the n-device model's results)
        self.plan = plan
        self.got = got  # name -> array, n devices
        self.single = single  # name -> array, one device

    @property
    def collectives(self) -> set[str]:
        return {c.op for c in self.plan.collectives}

    @property
    def reduces(self) -> bool:
        """Whether the plan all-reduces anything (fused with others or not)."""
        return any("all_reduce" in op for op in self.collectives)


def build(model, env: Env):
    with af.Graph() as g:
        outs = dict(model(env))
        names = [name for name, _ in env.params]
        grads = af.gradients(outs["loss"], [t for _, t in env.params]) if env.params else []
        for name, t in outs.items():
            af.output(name, t)
        for name, gr in zip(names, grads):
            if gr is not None:
                af.output(f"d_{name}", gr)
                if env.is_global:
                    outs[f"d_{name}"] = gr
    return g, outs


def _frozen(value):
    """A hashable stand-in for a node attribute or a feed, equal only for equal values."""
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in sorted(value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _graph_key(graph: af.Graph, feeds: dict[str, np.ndarray]) -> tuple:
    """What a graph's result depends on: its nodes but for the lines they were built at
    (attributes, parameter values, kernels by identity), and the feeds."""
    nodes = tuple((n.name, n.op, n.inputs, _frozen(n.attrs), n.outputs, n.backward) for n in graph.nodes)
    return nodes, tuple(graph.logical), _frozen(graph.sbp), _frozen(feeds)


_ONE_DEVICE: dict[tuple, dict[str, np.ndarray]] = {}
"""The one-device results, by ``_graph_key``: every SBP signature of an op has the same
one-device twin (the values follow the inputs' names and shapes), so each is run once."""


def one_device(graph: af.Graph, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    key = _graph_key(graph, feeds)
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = af.run(af.compile(graph), feeds)
    return _ONE_DEVICE[key]


def both(model, n: int, fetch_gradients: bool = True) -> Result:
    """Run ``model`` on n devices and on one; check the values and gradients agree."""
    genv, senv = Env(n), Env(None)
    gg, outs = build(model, genv)
    sg, _ = build(model, senv)
    plan = af.compile(gg)
    got = af.run(plan, genv.feeds)
    single = one_device(sg, senv.feeds)
    assert set(got) == set(single)
    for name in single:
        assert got[name].shape == single[name].shape, name
        np.testing.assert_allclose(got[name], single[name], **TOL, err_msg=name)
    # Gradients of broadcast parameters are partial, of split ones split the same way.
    params = dict(genv.params)
    for name, t in outs.items():
        if name.startswith("d_"):
            p = params[name[2:]]
            assert t.sbp == (P if p.sbp == B else p.sbp), name
            assert t.shape == p.shape
    assert any(name.startswith("d_") for name in got) or not genv.params
    res = Result(n, outs, plan, got, single)
    res.values = genv.values
    return res


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, **TOL)


def gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


# -- elementwise unary -------------------------------------------------------------------

ELEMENTWISE_N = [2, 3]
"""Device counts for the elementwise and fallback ops, whose SBP rules and kernels do not
depend on the count (2 and 3: an even and an odd one); reductions, matmul and softmax,
whose partial sums and gathers do, also run on 4."""

UNARY = {"relu": lambda x: np.maximum(x, 0), "gelu": gelu, "tanh": np.tanh, "exp": np.exp, "log": np.log}


@pytest.mark.parametrize("n", ELEMENTWISE_N)
@pytest.mark.parametrize("sbp", [S0, S1, B, P], ids=repr)
@pytest.mark.parametrize("op", list(UNARY))
def test_unary(op, sbp, n):
    def model(env):
        x = env.param("x", (12, 24), sbp, positive=(op == "log"))
        y = getattr(af.ops, op)(x)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == (B if sbp == P else sbp)
    assert r.outs["y"].shape == (12, 24)
    close(r.got["y"], UNARY[op](r.values["x"]))
    # Nonlinear ops box P to B (an all-reduce); on S and B they are local.
    assert r.reduces == (sbp == P)


# -- elementwise binary ------------------------------------------------------------------

BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}

# (a's shape and SBP, b's shape and SBP, the result's SBP)
BINARY_CASES = [
    ((12, 24), S0, (12, 24), S0, S0),
    ((12, 24), S1, (12, 24), S1, S1),
    ((12, 24), B, (12, 24), B, B),
    ((12, 24), S0, (12, 24), B, S0),
    ((12, 24), B, (12, 24), S1, S1),
    # a 1-D broadcast operand against a split 2-D one, either side
    ((12, 24), S0, (24,), B, S0),
    ((12, 24), S1, (24,), B, S1),
    ((24,), B, (12, 24), S0, S0),
    ((24,), B, (12, 24), S1, S1),
    # size-1 dims broadcast along the split axis or not
    ((12, 24), S0, (12, 1), B, S0),
    ((12, 24), S1, (1, 24), B, S1),
    ((12, 24), S0, (1, 24), B, S0),
    # a split 1-D operand against a broadcast 2-D one: the split lines up with axis 1
    ((24,), S0, (12, 24), B, S1),
    # 3-D split against a broadcast 2-D trailing operand
    ((12, 12, 24), S1, (12, 24), B, S1),
    ((12, 12, 24), S2, (12, 24), B, S2),
    ((12, 12, 24), S0, (12, 24), B, S0),
    # splits along different axes: the second is gathered (and sliced), the first keeps its split
    ((12, 24), S0, (12, 24), S1, S0),
]


@pytest.mark.parametrize("n", ELEMENTWISE_N)
@pytest.mark.parametrize(
    "a_shape,a_sbp,b_shape,b_sbp,out_sbp",
    BINARY_CASES,
    ids=[f"{a}{list(sa)}-{b}{list(sb)}" for sa, a, sb, b, _ in BINARY_CASES],
)
@pytest.mark.parametrize("op", list(BINARY))
def test_binary(op, a_shape, a_sbp, b_shape, b_sbp, out_sbp, n):
    def model(env):
        a = env.param("a", a_shape, a_sbp)
        b = env.param("b", b_shape, b_sbp, positive=(op == "div"))
        y = getattr(af.ops, op)(a, b)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == out_sbp
    want = BINARY[op](r.values["a"], r.values["b"])
    assert r.outs["y"].shape == want.shape
    close(r.got["y"], want)


# P operands: add/sub keep P, mul/div by B keep P, B * P keeps P; the rest box P to B.
PARTIAL_CASES = [
    ("add", P, P, P, False),
    ("sub", P, P, P, False),
    ("mul", P, B, P, False),
    ("div", P, B, P, False),
    ("mul", B, P, P, False),
    ("add", P, B, B, True),
    ("sub", B, P, B, True),
    ("mul", P, P, B, True),
    ("div", B, P, B, True),
    ("add", P, S0, S0, True),
    ("mul", S1, P, S1, True),
]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize(
    "op,a_sbp,b_sbp,out_sbp,reduces", PARTIAL_CASES, ids=[f"{o}-{a}-{b}" for o, a, b, *_ in PARTIAL_CASES]
)
def test_binary_with_partial(op, a_sbp, b_sbp, out_sbp, reduces, n):
    def model(env):
        a = env.param("a", (12, 24), a_sbp, positive=True)
        b = env.param("b", (12, 24), b_sbp, positive=True)
        y = getattr(af.ops, op)(a, b)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == out_sbp
    close(r.got["y"], BINARY[op](r.values["a"], r.values["b"]))
    # The backward pass of a P result is local too (the gradient of a B operand is P),
    # so an all-reduce anywhere in the plan means a P operand was boxed to B.
    assert r.reduces == reduces


@pytest.mark.parametrize("n", [2, 4])
def test_partial_times_broadcast_vector(n):
    """P * a 1-D B operand (broadcast along rows) stays P."""

    def model(env):
        a = env.param("a", (12, 24), P)
        b = env.param("b", (24,), B)
        y = af.ops.mul(a, b)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == P
    close(r.got["y"], r.values["a"] * r.values["b"])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_binary_same_split_on_operands_of_different_rank(n):
    def model(env):
        a = env.param("a", (12, 24), S0)
        b = env.param("b", (24,), S0)
        y = af.ops.add(a, b)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    close(r.got["y"], r.values["a"] + r.values["b"])


def test_binary_same_split_on_operands_of_different_rank_value():
    a_v, b_v = value("a", (8, 4)), value("b", (4,))
    with af.Graph() as g:
        a = af.placeholder("a", (8, 4), "float64", place(4), S0)
        b = af.placeholder("b", (4,), "float64", place(4), S0)
        af.output("y", af.ops.add(a, b))
    close(af.run(af.compile(g), {"a": a_v, "b": b_v})["y"], a_v + b_v)


# -- matmul ------------------------------------------------------------------------------

# (a's SBP, b's SBP, the result's SBP, the collectives the forward pass needs)
MATMUL_CASES = [
    (S0, B, S0, set()),
    (B, S1, S1, set()),
    (S1, S0, P, set()),
    (P, B, P, set()),
    (B, P, P, set()),
    (B, B, B, set()),
    # mismatches that need boxing
    (S1, B, B, {"all_gather"}),
    (B, S0, B, {"all_gather"}),
    (S0, S1, S0, {"all_gather"}),
    (S0, S0, S0, {"all_gather"}),
    (S1, S1, S1, {"all_gather"}),
    (P, S1, S1, {"all_reduce"}),
    (S0, P, S0, {"all_reduce"}),
    (P, P, B, {"all_reduce"}),
]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize(
    "a_sbp,b_sbp,out_sbp,needs", MATMUL_CASES, ids=[f"{a}x{b}" for a, b, *_ in MATMUL_CASES]
)
def test_matmul(a_sbp, b_sbp, out_sbp, needs, n):
    def model(env):
        a = env.param("a", (12, 24), a_sbp)
        b = env.param("b", (24, 36), b_sbp)
        y = af.ops.matmul(a, b)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == out_sbp
    assert r.outs["y"].shape == (12, 36)
    close(r.got["y"], r.values["a"] @ r.values["b"])
    # the forward pass alone
    with af.Graph() as g:
        env = Env(n)
        af.output("y", af.ops.matmul(env.param("a", (12, 24), a_sbp), env.param("b", (24, 36), b_sbp)))
    assert {c.op for c in af.compile(g).collectives} == needs


@pytest.mark.parametrize("n", [2, 4])
def test_matmul_chain_of_model_parallel_layers(n):
    """Megatron-style: B x S(1) -> S(1), then S(1) x S(0) -> P; one all-reduce to B."""

    def model(env):
        x = env.param("x", (12, 24), B)
        h = af.ops.relu(af.ops.matmul(x, env.param("w1", (24, 36), S1)))
        y = af.ops.matmul(h, env.param("w2", (36, 12), S0))
        if env.is_global:
            assert (h.sbp, y.sbp) == (S1, P)
        z = af.ops.tanh(y)
        return {"y": y, "z": z, "loss": env.weighted_sum(z)}

    r = both(model, n)
    assert r.outs["z"].sbp == B
    v = r.values
    close(r.got["z"], np.tanh(np.maximum(v["x"] @ v["w1"], 0) @ v["w2"]))


@pytest.mark.parametrize("sbp", [S0, B])
def test_batched_matmul_keeps_a_batch_split(sbp):
    """More batched signatures in test_transformer_ops."""

    def model(env):
        a = env.param("a", (12, 12, 24), sbp)
        b = env.param("b", (24, 12), B)
        y = af.ops.matmul(a, b)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, 3)
    assert r.outs["y"].sbp == sbp
    close(r.got["y"], r.values["a"] @ r.values["b"])


# -- bias_add ----------------------------------------------------------------------------

BIAS_CASES = [
    ((12, 24), S0, (24,), B, S0),
    ((12, 24), S1, (24,), B, S1),  # the bias is sliced along the split
    ((12, 24), B, (24,), B, B),
    ((12, 24), P, (24,), B, B),
    ((12, 24), S1, (24,), S0, S1),  # a split bias is boxed first
    ((12, 12, 24), S1, (12, 24), B, S1),
    ((12, 12, 24), S2, (24,), B, S2),
    ((12, 12, 24), S0, (12, 24), B, S0),
]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize(
    "x_shape,x_sbp,b_shape,b_sbp,out_sbp",
    BIAS_CASES,
    ids=[f"{a}{list(sa)}-{b}{list(sb)}" for sa, a, sb, b, _ in BIAS_CASES],
)
def test_bias_add(x_shape, x_sbp, b_shape, b_sbp, out_sbp, n):
    def model(env):
        x = env.param("x", x_shape, x_sbp)
        bias = env.param("bias", b_shape, b_sbp)
        y = af.ops.bias_add(x, bias)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == out_sbp
    close(r.got["y"], r.values["x"] + r.values["bias"])


# -- softmax -----------------------------------------------------------------------------


def np_softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# (SBP, axis as passed, how it is passed, the result's SBP)
SOFTMAX_CASES = [
    (S0, -1, "default", S0),
    (S0, 1, "kw", S0),
    (S0, 1, "pos", S0),
    (S1, 0, "kw", S1),
    (S1, -1, "default", B),  # along the split axis: gathered first
    (S0, 0, "pos", B),
    (B, 1, "kw", B),
    (P, -1, "default", B),
    (P, 0, "kw", B),
]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize(
    "sbp,axis,how,out_sbp", SOFTMAX_CASES, ids=[f"{s}-{a}-{h}" for s, a, h, _ in SOFTMAX_CASES]
)
def test_softmax(sbp, axis, how, out_sbp, n):
    def model(env):
        x = env.param("x", (12, 24), sbp)
        if how == "default":
            y = af.ops.softmax(x)
        elif how == "kw":
            y = af.ops.softmax(x, axis=axis)
        else:
            y = af.ops.softmax(x, axis)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == out_sbp
    close(r.got["y"], np_softmax(r.values["x"], axis))
    if sbp in (S0, S1) and out_sbp == sbp:
        assert r.collectives == set()


def test_softmax_along_a_middle_axis_of_a_3d_split():
    def model(env):
        x = env.param("x", (12, 12, 24), S2)
        y = af.ops.softmax(x, axis=1)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, 4)
    assert r.outs["y"].sbp == S2
    close(r.got["y"], np_softmax(r.values["x"], 1))


# -- reductions --------------------------------------------------------------------------

REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max}
AXES = [None, 0, 1, 2, -1, (0, 2), (1, 2)]


def reduced_sbp(op: str, sbp, axes, keepdims: bool, ndim: int = 3):
    """The signature: sum/mean over the split axis give P (max: B); over other axes the
    split stays (its axis shifted down past the dropped ones); P stays P (max: B)."""
    if sbp == B:
        return B
    if sbp == P:
        return B if op == "max" else P
    axes = (
        set(range(ndim))
        if axes is None
        else {a % ndim for a in (axes if isinstance(axes, tuple) else (axes,))}
    )
    if sbp.axis in axes:
        return B if op == "max" else P
    return af.S(sbp.axis - (0 if keepdims else sum(a < sbp.axis for a in axes)))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("sbp", [S0, S1, S2, B], ids=repr)
@pytest.mark.parametrize("op", list(REDUCE))
def test_reduce_3d(op, sbp, n):
    """Every axis choice and keepdims in one graph per (op, SBP, devices); 4 devices are
    covered by the 2-d reductions, whose split rules are the same."""
    cases = [(axis, keepdims) for axis in AXES for keepdims in (False, True)]

    def model(env):
        x = env.param("x", (12, 12, 24), sbp)
        outs = {}
        loss = None
        for i, (axis, keepdims) in enumerate(cases):
            y = getattr(af.ops, op)(x, axis=axis, keepdims=keepdims)
            outs[f"y{i}"] = y
            if env.is_global:
                assert y.sbp == reduced_sbp(op, sbp, axis, keepdims), (axis, keepdims)
            part = env.weighted_sum(y, tag=f"c{i}")
            loss = part if loss is None else af.ops.add(loss, part)
        outs["loss"] = loss
        return outs

    r = both(model, n)
    x = r.values["x"]
    for i, (axis, keepdims) in enumerate(cases):
        want = REDUCE[op](x, axis=axis, keepdims=keepdims)
        assert r.outs[f"y{i}"].shape == np.shape(want)
        close(r.got[f"y{i}"], want)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", list(REDUCE))
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reduce_partial(op, axis, keepdims, n):
    def model(env):
        x = env.param("x", (12, 24), P)
        y = getattr(af.ops, op)(x, axis, keepdims)  # axis and keepdims positional
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == (B if op == "max" else P)
    close(r.got["y"], REDUCE[op](r.values["x"], axis=axis, keepdims=keepdims))


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_reduce_over_the_split_axis_needs_no_collective(op):
    with af.Graph() as g:
        x = af.placeholder("x", (12, 24), "float64", place(3), S0)
        y = getattr(af.ops, op)(x, axis=0)
        assert y.sbp == P and y.shape == (24,)
        af.output("y", y)
        for k, part in enumerate(y.locals):
            af.output(f"p{k}", part)
    plan = af.compile(g)
    assert plan.collectives == ()
    xv = value("x", (12, 24))
    out = af.run(plan, {"x": xv})
    close(out["y"], REDUCE[op](xv, axis=0))
    # each device reduces its own rows (mean: scaled by 1/n so the parts sum to the mean)
    for k, rows in enumerate(np.split(xv, 3)):
        close(out[f"p{k}"], rows.sum(axis=0) if op == "sum" else rows.mean(axis=0) / 3)


# -- losses ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("loss", ["mse", "xent"])
def test_loss_on_a_split_batch_is_partial_and_equals_one_device(loss, n):
    labels = np.random.default_rng(5).integers(0, 12, 24)

    def model(env):
        x = env.feed("x", value("xin", (24, 12)), S0)
        w = env.param("w", (12, 12), B)
        bias = env.param("bias", (12,), B)
        logits = af.ops.bias_add(af.ops.matmul(x, w), bias)
        if loss == "mse":
            y = af.ops.mse_loss(logits, env.feed("t", value("t", (24, 12)), S0))
        else:
            y = af.ops.softmax_cross_entropy(logits, env.feed("labels", labels, S0))
        return {"loss": y, "logits": logits}

    r = both(model, n)
    assert r.outs["logits"].sbp == S0
    assert r.outs["loss"].sbp == P and r.outs["loss"].shape == ()
    assert r.collectives == set()  # the gradients of w and b stay partial
    v = r.values
    logits = v["x"] @ v["w"] + v["bias"]
    if loss == "mse":
        want = np.mean((logits - v["t"]) ** 2)
        dlogits = 2 * (logits - v["t"]) / logits.size
    else:
        p = np_softmax(logits, 1)
        want = -np.mean(np.log(p[np.arange(24), labels]))
        dlogits = (p - np.eye(12)[labels]) / 24
    close(r.got["loss"], want)
    close(r.got["d_w"], v["x"].T @ dlogits)
    close(r.got["d_bias"], dlogits.sum(axis=0))


@pytest.mark.parametrize("pred_sbp,target_sbp", [(B, B), (S0, B), (B, S0), (S1, S1), (P, S0)], ids=repr)
def test_mse_loss_otherwise_is_broadcast(pred_sbp, target_sbp):
    def model(env):
        pred = env.param("pred", (24, 12), pred_sbp)
        target = env.param("target", (24, 12), target_sbp)
        y = af.ops.mse_loss(pred, target)
        return {"loss": y}

    r = both(model, 3)
    assert r.outs["loss"].sbp == B
    close(r.got["loss"], np.mean((r.values["pred"] - r.values["target"]) ** 2))


def test_cross_entropy_with_broadcast_labels_is_broadcast():
    labels = np.random.default_rng(6).integers(0, 12, 24)

    def model(env):
        logits = env.param("logits", (24, 12), S0)
        return {"loss": af.ops.softmax_cross_entropy(logits, env.feed("labels", labels, B))}

    r = both(model, 2)
    assert r.outs["loss"].sbp == B
    p = np_softmax(r.values["logits"], 1)
    close(r.got["loss"], -np.mean(np.log(p[np.arange(24), labels])))


@pytest.mark.parametrize("n", [2, 4])
def test_mean_of_a_split_batch_loss_chain(n):
    """A whole data-parallel step: split batch, broadcast weights, gelu, softmax, mean."""

    def model(env):
        x = env.feed("x", value("xin", (24, 12)), S0)
        h = af.ops.gelu(af.ops.matmul(x, env.param("w1", (12, 24), B)))
        y = af.ops.softmax(af.ops.matmul(h, env.param("w2", (24, 12), B)))
        loss = af.ops.mean(af.ops.mul(y, y))
        if env.is_global:
            assert (h.sbp, y.sbp, loss.sbp) == (S0, S0, P)
        return {"loss": loss}

    both(model, n)


# -- reshape and transpose: a split follows its dim ---------------------------------------


@pytest.mark.parametrize("n", ELEMENTWISE_N)
@pytest.mark.parametrize(
    "sbp, shape, expected",
    [
        (S0, (24, 12), S0),  # rows stay contiguous runs
        (S1, (12, 6, 4), S1),  # heads split after a column split: [n, h*d] -> [n, h, d]
        (S1, (288,), B),  # a column split is no contiguous run of the flat tensor
        (B, (24, 12), B),
        (P, (24, 12), P),
    ],
    ids=["S0-rows", "S1-heads", "S1-flat", "B", "P"],
)
def test_reshape_keeps_a_split_whose_dim_keeps_its_leading_elements(sbp, shape, expected, n):
    def model(env):
        y = af.ops.reshape(env.param("x", (12, 24), sbp), shape)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == expected
    close(r.got["y"], r.values["x"].reshape(shape))


@pytest.mark.parametrize("n", ELEMENTWISE_N)
@pytest.mark.parametrize("sbp, expected", [(S0, S2), (S1, S0), (S2, S1), (B, B)], ids=repr)
def test_transpose_moves_a_split_with_its_dim(sbp, expected, n):
    def model(env):
        y = af.ops.transpose(env.param("x", (12, 24, 12), sbp), (1, 2, 0))
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == expected
    close(r.got["y"], r.values["x"].transpose(1, 2, 0))


# -- ops without a rule: run on broadcast inputs ----------------------------------------


@pytest.mark.parametrize("n", ELEMENTWISE_N)
@pytest.mark.parametrize("sbp", [S0, S1, B, P], ids=repr)
@pytest.mark.parametrize("op", ["concat", "slice", "split"])
def test_op_without_a_rule_falls_back_to_broadcast(op, sbp, n):
    def model(env):
        x = env.param("x", (12, 24), sbp)
        if op == "concat":
            y = af.ops.concat([x, env.param("z", (12, 24), S0)], axis=1)
        elif op == "slice":
            y = af.ops.slice(x, [2, 3], [10, 20])
        else:
            first, second = af.ops.split(x, [10, 14], axis=1)
            y = af.ops.mul(first, af.ops.slice(second, [0, 0], [12, 10]))
            if env.is_global:
                assert first.sbp == second.sbp == B
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == B
    x = r.values["x"]
    want = {
        "concat": lambda: np.concatenate([x, r.values["z"]], axis=1),
        "slice": lambda: x[2:10, 3:20],
        "split": lambda: x[:, :10] * x[:, 10:20],
    }[op]()
    close(r.got["y"], want)


# -- how ops are called -----------------------------------------------------------------


def test_a_name_names_every_part():
    with af.Graph() as g:
        x = af.placeholder("x", (12, 24), "float64", place(3), S0)
        y = af.ops.relu(x, name="r")
        assert [t.name for t in y.locals] == ["r[cpu:0]", "r[cpu:1]", "r[cpu:2]"]
        assert y.name == "r"
        af.output("y", y)
    xv = value("x", (12, 24))
    close(af.run(af.compile(g), {"x": xv})["y"], np.maximum(xv, 0))


# Tensors passed by keyword work on one device; the SBP rules should accept them too.
KEYWORD_CALLS = {
    "add": lambda x, w, bias, labels: af.ops.add(x, b=w),
    "mul": lambda x, w, bias, labels: af.ops.mul(a=x, b=w),
    "matmul": lambda x, w, bias, labels: af.ops.matmul(x, b=w),
    "relu": lambda x, w, bias, labels: af.ops.relu(x=x),
    "softmax": lambda x, w, bias, labels: af.ops.softmax(x=x, axis=0),
    "sum": lambda x, w, bias, labels: af.ops.reduce_sum(x=x, axis=1),
    "bias_add": lambda x, w, bias, labels: af.ops.bias_add(x, bias=bias),
    "mse_loss": lambda x, w, bias, labels: af.ops.mse_loss(x, target=w),
    "softmax_cross_entropy": lambda x, w, bias, labels: af.ops.softmax_cross_entropy(x, labels=labels),
}


@pytest.mark.parametrize("call", list(KEYWORD_CALLS))
def test_tensors_passed_by_keyword(call):
    labels = np.random.default_rng(7).integers(0, 12, 12)

    def model(env):
        x = env.param("x", (12, 12), S0)
        w = env.param("w", (12, 12), B)
        bias = env.param("bias", (12,), B)
        y = KEYWORD_CALLS[call](x, w, bias, env.feed("labels", labels, S0))
        return {"y": y, "loss": y if y.shape == () else env.weighted_sum(y)}

    both(model, 2)


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("other", [["cpu:1", "cpu:0"], ["cpu:2", "cpu:3"], ["cpu:0", "cpu:1", "cpu:2"]])
def test_global_tensors_on_different_placements_are_refused(other):
    with af.Graph():
        a = af.placeholder("a", (12, 12), "float64", ["cpu:0", "cpu:1"], S0)
        b = af.placeholder("b", (12, 12), "float64", other, S0)
        with pytest.raises(af.GraphError, match="different placements"):
            af.ops.add(a, b)
        with pytest.raises(af.GraphError, match="different placements"):
            af.ops.matmul(a, b)
        with pytest.raises(af.GraphError, match="different placements"):
            af.ops.concat([a, b])


def test_mixing_a_one_device_tensor_with_a_global_one_is_refused():
    with af.Graph():
        a = af.placeholder("a", (12, 12), "float64", ["cpu:0", "cpu:1"], B)
        b = af.placeholder("b", (12, 12), "float64", "cpu:0")
        for call in (
            lambda: af.ops.add(a, b),
            lambda: af.ops.add(b, a),
            lambda: af.ops.matmul(b, a),
            lambda: af.ops.concat([b, a]),
            lambda: af.ops.mse_loss(a, b),
        ):
            with pytest.raises(af.GraphError, match="one device"):
                call()


@pytest.mark.parametrize("builder", ["placeholder", "parameter"])
def test_partial_is_not_a_layout_for_inputs(builder):
    with af.Graph():
        with pytest.raises(af.GraphError, match="sbp"):
            if builder == "placeholder":
                af.placeholder("x", (12, 12), "float64", ["cpu:0", "cpu:1"], P)
            else:
                af.parameter("x", np.ones((12, 12)), ["cpu:0", "cpu:1"], P)


@pytest.mark.parametrize("builder", ["placeholder", "parameter"])
@pytest.mark.parametrize(
    "shape,sbp,n",
    [((10, 12), S0, 4), ((12, 10), S1, 3), ((12, 12), S2, 2), ((12,), S1, 2), ((12, 12), af.S(-1), 2)],
)
def test_a_shape_that_does_not_split_evenly_is_refused(builder, shape, sbp, n):
    with af.Graph():
        with pytest.raises(af.GraphError, match="split"):
            if builder == "placeholder":
                af.placeholder("x", shape, "float64", place(n), sbp)
            else:
                af.parameter("x", np.ones(shape), place(n), sbp)


@pytest.mark.parametrize("builder", ["placeholder", "parameter"])
@pytest.mark.parametrize("sbp", [S0, B, P], ids=repr)
def test_sbp_with_a_single_device_string_is_refused(builder, sbp):
    with af.Graph():
        with pytest.raises(af.GraphError, match="list of devices"):
            if builder == "placeholder":
                af.placeholder("x", (12, 12), "float64", "cpu:0", sbp)
            else:
                af.parameter("x", np.ones((12, 12)), "cpu:1", sbp)


@pytest.mark.parametrize("device,sbp", [(["cpu:0", "cpu:1"], P), (["cpu:0", "cpu:0"], S0), ([], B)])
def test_a_device_list_needs_distinct_devices_and_an_sbp_other_than_p(device, sbp):
    with af.Graph():
        with pytest.raises(af.GraphError):
            af.placeholder("x", (12, 12), "float64", device, sbp)


def test_gradients_of_a_split_tensor_are_refused():
    with af.Graph():
        w = af.parameter("w", np.ones((12, 12)), ["cpu:0", "cpu:1"], S0)
        with pytest.raises(af.GraphError, match="partial or broadcast"):
            af.gradients(af.ops.relu(w), [w])


def test_a_feed_that_does_not_split_is_refused_at_run_time():
    with af.Graph() as g:
        x = af.placeholder("x", (12, 12), "float64", place(2), S0)
        af.output("y", af.ops.relu(x))
    with pytest.raises(af.FeedError):
        af.run(af.compile(g), {"x": np.ones((11, 12))})
