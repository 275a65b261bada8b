"""The transformer ops (embedding, layer_norm, causal_softmax, batched matmul): each
against a numpy reference in float64, each gradient by central finite differences
(``check_gradients``), their build errors, and each SBP signature against the one-device
op, gradients included (``both``, as in test_sbp_ops)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import actorflow as af
from test_gradients import check_gradients, rand
from test_sbp_ops import S0, S1, S2, B, Env, P, both, close

S3 = af.S(3)


def run(build, feeds):
    """Outputs of a graph that ``build`` fills from placeholders named like ``feeds``."""
    with af.Graph() as g:
        t = {n: af.placeholder(n, v.shape, v.dtype.name) for n, v in feeds.items()}
        for name, y in build(t).items():
            af.output(name, y)
    return af.run(af.compile(g), feeds)


def np_layer_norm(x, gamma, beta, axis=-1, eps=1e-5):
    shape = [-1 if k == axis % x.ndim else 1 for k in range(x.ndim)]
    mean = x.mean(axis=axis, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axis, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma.reshape(shape) + beta.reshape(shape)


def np_causal_softmax(x):
    s = x.shape[-1]
    masked = np.where(np.arange(s)[None, :] > np.arange(s)[:, None], -np.inf, x)
    e = np.exp(masked - masked.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def ids_of(shape, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, size=shape)


# -- against numpy -----------------------------------------------------------------------


@pytest.mark.parametrize("ids_shape", [(), (5,), (2, 3), (2, 2, 3)], ids=str)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_embedding(ids_shape, dtype):
    table = rand((6, 4), 1).astype(dtype)
    ids = ids_of(ids_shape, 6, 2)
    with af.Graph() as g:
        t = af.parameter("table", table)
        y = af.ops.embedding(af.placeholder("ids", ids_shape, "int64"), t)
        assert (y.shape, y.dtype) == ((*ids_shape, 4), dtype)
        af.output("y", y)
    np.testing.assert_array_equal(af.run(af.compile(g), {"ids": ids})["y"], table[ids])


def test_embedding_ids_out_of_range_raise_when_run():
    with af.Graph() as g:
        ids = af.placeholder("ids", (3,), "int32")
        af.output("y", af.ops.embedding(ids, af.parameter("table", rand((4, 2), 3))))
    plan = af.compile(g)
    for bad in ([0, 4, 1], [-1, 0, 0]):
        with pytest.raises(ValueError, match=r"embedding: ids must be rows of the table, in \[0, 4\)"):
            af.run(plan, {"ids": np.array(bad, np.int32)})


def test_embedding_grad_adds_repeated_ids():
    dy, ids = rand((2, 3, 4), 4), np.array([[0, 2, 0], [5, 2, 0]])
    out = run(lambda t: {"d": af.ops.embedding_grad(t["dy"], t["ids"], 6)}, {"dy": dy, "ids": ids})
    want = np.zeros((6, 4))
    np.add.at(want, ids.ravel(), dy.reshape(-1, 4))
    close(out["d"], want)
    np.testing.assert_array_equal(out["d"][[1, 3, 4]], 0)


# (x's shape, the normalized axis)
LAYER_NORM_CASES = [((7,), -1), ((3, 5), -1), ((3, 5), 0), ((2, 3, 4), -1), ((2, 3, 4), 1)]


@pytest.mark.parametrize("shape,axis", LAYER_NORM_CASES, ids=str)
def test_layer_norm(shape, axis):
    x = rand(shape, 5, -3, 3) + 2.0
    n = shape[axis]
    gamma, beta = rand((n,), 6), rand((n,), 7)
    feeds = {"x": x, "g": gamma, "b": beta}
    out = run(
        lambda t: {
            "y": af.ops.layer_norm(t["x"], t["g"], t["b"], axis=axis),
            "eps": af.ops.layer_norm(t["x"], t["g"], t["b"], axis, 0.5),
        },
        feeds,
    )
    close(out["y"], np_layer_norm(x, gamma, beta, axis))
    close(out["eps"], np_layer_norm(x, gamma, beta, axis, 0.5))


def test_layer_norm_standardizes_and_keeps_float32():
    x = (rand((4, 16), 8) * 100 + 50).astype(np.float32)
    with af.Graph() as g:
        d = 16
        one, zero = af.parameter("one", np.ones(d, np.float32)), af.parameter("zero", np.zeros(d, np.float32))
        y = af.ops.layer_norm(af.placeholder("x", x.shape, "float32"), one, zero)
        assert y.dtype == "float32"
        af.output("y", y)
    y = af.run(af.compile(g), {"x": x})["y"]
    assert y.dtype == np.float32
    np.testing.assert_allclose(y.mean(axis=-1), 0, atol=1e-5)
    np.testing.assert_allclose(y.std(axis=-1), 1, rtol=1e-4)


@pytest.mark.parametrize("shape", [(1, 1), (3, 3), (2, 4, 4), (2, 3, 5, 5)], ids=str)
def test_causal_softmax(shape):
    x = rand(shape, 9, -5, 5)
    y = run(lambda t: {"y": af.ops.causal_softmax(t["x"])}, {"x": x})["y"]
    close(y, np_causal_softmax(x))
    s = shape[-1]
    future = np.triu(np.ones((s, s), bool), 1)
    assert (y[..., future] == 0).all()
    np.testing.assert_array_equal(y[..., 0, 0], 1)
    close(y.sum(axis=-1), np.ones(shape[:-1]))


def test_causal_softmax_is_stable_and_ignores_the_future():
    x = rand((2, 4, 4), 10) * 1e3
    future = np.triu(np.ones((4, 4), bool), 1)
    spoiled = np.where(future, np.nan, x)
    out = run(lambda t: {"y": af.ops.causal_softmax(t["x"])}, {"x": x})["y"]
    out_spoiled = run(lambda t: {"y": af.ops.causal_softmax(t["x"])}, {"x": spoiled})["y"]
    assert np.isfinite(out).all()
    close(out, np_causal_softmax(x))
    close(out_spoiled, out)


def test_causal_softmax_of_integers_is_float64():
    x = np.arange(9).reshape(3, 3)
    with af.Graph() as g:
        y = af.ops.causal_softmax(af.placeholder("x", (3, 3), "int64"))
        assert y.dtype == "float64"
        af.output("y", y)
    close(af.run(af.compile(g), {"x": x})["y"], np_causal_softmax(x.astype(float)))


# (a's shape, b's shape, transpose_b): attention's scores and mixing, broadcast batch dims
BATCHED = [
    ((2, 3, 4, 5), (2, 3, 4, 5), True),  # q @ k^T: [b, h, s, d] x [b, h, s, d]^T
    ((2, 3, 4, 4), (2, 3, 4, 5), False),  # probs @ v
    ((1, 3, 4, 5), (2, 1, 5, 6), False),
    ((2, 3, 4, 5), (5, 6), False),
    ((4, 5), (2, 3, 5, 6), False),
    ((2, 1, 4, 5), (3, 6, 5), True),
]


@pytest.mark.parametrize("sa,sb,tb", BATCHED, ids=str)
def test_batched_matmul(sa, sb, tb):
    a, b = rand(sa, 11), rand(sb, 12)
    y = run(lambda t: {"y": af.ops.matmul(t["a"], t["b"], transpose_b=tb)}, {"a": a, "b": b})["y"]
    close(y, a @ (np.swapaxes(b, -1, -2) if tb else b))


# -- gradients by finite differences -----------------------------------------------------


@pytest.mark.parametrize("ids_shape", [(5,), (2, 3)], ids=str)
def test_embedding_gradient(ids_shape):
    ids = np.array([0, 3, 0, 2, 3, 3])[: math.prod(ids_shape)].reshape(ids_shape)
    check_gradients(
        lambda t: af.ops.embedding(t["ids"], t["table"]), {"table": rand((5, 3), 13)}, fixed={"ids": ids}
    )


def test_embedding_ids_get_no_gradient():
    with af.Graph():
        ids = af.placeholder("ids", (3,), "int64")
        table = af.parameter("table", rand((4, 2), 14))
        d_ids, d_table = af.gradients(af.ops.sum(af.ops.embedding(ids, table)), [ids, table])
    assert d_ids is None
    assert d_table is not None and d_table.shape == (4, 2)


@pytest.mark.parametrize("shape,axis", LAYER_NORM_CASES, ids=str)
def test_layer_norm_gradient(shape, axis):
    n = shape[axis]
    check_gradients(
        lambda t: af.ops.layer_norm(t["x"], t["g"], t["b"], axis=axis),
        {"x": rand(shape, 15), "g": rand((n,), 16), "b": rand((n,), 17)},
    )


def test_layer_norm_gradient_of_x_alone_and_of_gamma_alone():
    """The fused backward op gives all three gradients; each is right when asked alone."""
    x, g, b = rand((3, 4), 18), rand((4,), 19), rand((4,), 20)
    check_gradients(lambda t: af.ops.layer_norm(t["x"], t["g"], t["b"]), {"x": x}, fixed={"g": g, "b": b})
    check_gradients(lambda t: af.ops.layer_norm(t["x"], t["g"], t["b"]), {"g": g}, fixed={"x": x, "b": b})


@pytest.mark.parametrize("shape", [(3, 3), (2, 2, 4, 4)], ids=str)
def test_causal_softmax_gradient(shape):
    check_gradients(lambda t: af.ops.causal_softmax(t["x"]), {"x": rand(shape, 21)})


@pytest.mark.parametrize("sa,sb,tb", BATCHED, ids=str)
def test_batched_matmul_gradient(sa, sb, tb):
    check_gradients(
        lambda t: af.ops.matmul(t["a"], t["b"], transpose_b=tb), {"a": rand(sa, 22), "b": rand(sb, 23)}
    )


def attention_block(t, heads=2):
    """embedding -> layer norm -> causal self-attention over ``heads`` -> GELU MLP, with
    residuals: every transformer op in one graph."""
    ids = t["ids"]
    batch, seq = ids.shape
    d = t["table"].shape[1]
    x = af.ops.embedding(ids, t["table"])
    h = af.ops.layer_norm(x, t["g"], t["b"])
    qkv = af.ops.matmul(h, t["wqkv"])
    q, k, v = (
        af.ops.transpose(af.ops.reshape(part, (batch, seq, heads, d // heads)), (0, 2, 1, 3))
        for part in af.ops.split(qkv, 3, axis=-1)
    )
    scores = af.ops.scale(af.ops.matmul(q, k, transpose_b=True), 1 / math.sqrt(d // heads))
    mixed = af.ops.matmul(af.ops.causal_softmax(scores), v)
    x = af.ops.add(x, af.ops.reshape(af.ops.transpose(mixed, (0, 2, 1, 3)), (batch, seq, d)))
    return af.ops.add(x, af.ops.matmul(af.ops.gelu(af.ops.layer_norm(x, t["g2"], t["b2"])), t["w"]))


def test_attention_block_gradients():
    d = 4
    inputs = {
        "table": rand((5, d), 24),
        "g": rand((d,), 25),
        "b": rand((d,), 26),
        "wqkv": rand((d, 3 * d), 27, -1, 1),
        "g2": rand((d,), 28),
        "b2": rand((d,), 29),
        "w": rand((d, d), 30, -1, 1),
    }
    check_gradients(attention_block, inputs, fixed={"ids": np.array([[0, 4, 4], [2, 1, 0]])}, params=("w",))


def test_attention_block_against_numpy():
    d, ids = 4, np.array([[0, 4, 4], [2, 1, 0]])
    v = {
        n: rand(s, 31 + k)
        for k, (n, s) in enumerate([("table", (5, d)), ("wqkv", (d, 3 * d)), ("w", (d, d))])
    }
    v.update(g=rand((d,), 40), b=rand((d,), 41), g2=rand((d,), 42), b2=rand((d,), 43))
    y = run(lambda t: {"y": attention_block(t)}, {**v, "ids": ids})["y"]

    x = v["table"][ids]
    qkv = np_layer_norm(x, v["g"], v["b"]) @ v["wqkv"]
    q, k, vv = (p.reshape(2, 3, 2, 2).transpose(0, 2, 1, 3) for p in np.split(qkv, 3, axis=-1))
    p = np_causal_softmax(q @ k.swapaxes(-1, -2) / math.sqrt(2))
    x = x + (p @ vv).transpose(0, 2, 1, 3).reshape(2, 3, d)
    close(y, x + gelu(np_layer_norm(x, v["g2"], v["b2"])) @ v["w"])


def test_every_transformer_op_has_a_rule():
    from actorflow.autodiff.registry import rule_for

    assert all(rule_for(op) for op in ("embedding", "layer_norm", "causal_softmax", "gelu", "matmul"))
    assert not any(rule_for(op) for op in ("embedding_grad", "layer_norm_grad"))


# -- build errors ------------------------------------------------------------------------


def test_build_errors():
    with af.Graph():
        x = af.placeholder("x", (2, 3), "float64")
        x32 = af.placeholder("x32", (2, 3), "float32")
        xi = af.placeholder("xi", (2, 3), "int64")
        ids = af.placeholder("ids", (2,), "int64")
        g3 = af.placeholder("g3", (3,), "float64")
        g2 = af.placeholder("g2", (2,), "float64")
        e0, g0 = af.placeholder("e0", (0, 3), "float64"), af.placeholder("g0", (0,), "float64")
        bad = {
            r"embedding: ids must be integers, got float64": lambda: af.ops.embedding(x, x),
            r"embedding: ids must be integers, got bool": lambda: af.ops.embedding(
                af.placeholder("flags", (2,), "bool"), x
            ),
            r"embedding: the table must be \(vocab, d\), got shape \(3,\)": lambda: af.ops.embedding(ids, g3),
            r"embedding: the table must be floating-point, got int64": lambda: af.ops.embedding(ids, xi),
            r"embedding: .*different devices": lambda: af.ops.embedding(
                af.placeholder("ids1", (2,), "int64", "cpu:1"), x
            ),
            r"embedding_grad: dy \(2, 3\) should be the ids' shape \(3,\)": lambda: af.ops.embedding_grad(
                x, af.placeholder("ids3", (3,), "int64"), 4
            ),
            r"embedding_grad: vocab 0 is not a positive int": lambda: af.ops.embedding_grad(x, ids, 0),
            r"layer_norm: gamma and beta must be \(3,\), axis 1 of x \(2, 3\), got \(2,\)": lambda: (
                af.ops.layer_norm(x, g2, g3)
            ),
            r"layer_norm: gamma \(3,\) and beta \(2,\) differ": lambda: af.ops.layer_norm(x, g3, g2),
            r"layer_norm: x must be floating-point, got int64": lambda: af.ops.layer_norm(xi, g3, g3),
            r"layer_norm: axis 2 is out of range": lambda: af.ops.layer_norm(x, g3, g3, axis=2),
            r"layer_norm: eps 0 is not a positive finite": lambda: af.ops.layer_norm(x, g3, g3, eps=0),
            r"layer_norm: eps nan is not a positive finite": lambda: af.ops.layer_norm(
                x, g3, g3, eps=math.nan
            ),
            r"layer_norm: inputs have different dtypes": lambda: af.ops.layer_norm(x32, g3, g3),
            r"layer_norm: axis 0 of x \(0, 3\) is empty": lambda: af.ops.layer_norm(e0, g0, g0, axis=0),
            r"layer_norm_grad: dy \(3, 2\) and x \(2, 3\) differ": lambda: af.ops.layer_norm_grad(
                af.placeholder("dyt", (3, 2), "float64"), x, g3
            ),
            r"causal_softmax: needs scores \[\.\.\., s, s\] .*got shape \(2, 3\)": lambda: (
                af.ops.causal_softmax(x)
            ),
            r"causal_softmax: needs scores .*got shape \(3,\)": lambda: af.ops.causal_softmax(g3),
            r"causal_softmax: needs at least one position": lambda: af.ops.causal_softmax(
                af.placeholder("z", (2, 0, 0), "float64")
            ),
            r"matmul: batch dimensions of \(2, 3, 4, 5\) @ \(3, 3, 5, 4\) do not broadcast": lambda: (
                af.ops.matmul(
                    af.placeholder("qa", (2, 3, 4, 5), "float64"),
                    af.placeholder("qb", (3, 3, 5, 4), "float64"),
                )
            ),
        }
        for message, make in bad.items():
            with pytest.raises(af.GraphError, match=message) as info:
                make()
            assert "\n" not in str(info.value)
            assert "test_transformer_ops.py" in str(info.value), message


# -- SBP signatures: n devices against one ---------------------------------------------


def param(env, name, shape, sbp):
    """``env.param``, where P (of any rank) is a broadcast parameter boxed to P: the whole
    on the first device, zeros on the others."""
    if sbp != P:
        return env.param(name, shape, sbp)
    x = env.param(name, shape, B)
    return af.box(x, P) if env.is_global else x


# (ids' SBP, the table's SBP, the result's SBP, the forward pass's collectives)
EMBEDDING_CASES = [
    (S0, B, S0, set()),  # data parallel
    (S1, B, S1, set()),
    (B, S1, S2, set()),  # the embedding dim split
    (B, B, B, set()),
    (B, P, P, set()),  # linear in the table
    (S0, S1, S2, {"all_gather"}),  # the ids gathered, the table kept
    (S0, P, P, {"all_gather"}),
    (S0, S0, S0, {"all_gather"}),  # vocab-parallel is not a signature: the table is gathered
]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize(
    "ids_sbp,table_sbp,out_sbp,needs", EMBEDDING_CASES, ids=[f"{a}-{b}" for a, b, *_ in EMBEDDING_CASES]
)
def test_embedding_sbp(ids_sbp, table_sbp, out_sbp, needs, n):
    ids = ids_of((12, 12), 24, 50)

    def model(env):
        table = env.param("table", (24, 12), table_sbp)
        y = af.ops.embedding(env.feed("ids", ids, ids_sbp), table)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == out_sbp
    assert r.outs["y"].shape == (12, 12, 12)
    close(r.got["y"], r.values["table"][ids])
    with af.Graph() as g:
        env = Env(n)
        af.output(
            "y", af.ops.embedding(env.feed("ids", ids, ids_sbp), env.param("table", (24, 12), table_sbp))
        )
    forward = {c.op for c in af.compile(g).collectives}
    assert forward == needs


# (x's SBP, the normalized axis, gamma's SBP, the result's SBP)
LAYER_NORM_SBP = [
    (S0, -1, B, S0),
    (S1, -1, B, S1),
    (S2, 1, B, S2),
    (S0, 2, S0, S0),  # a split gamma is gathered
    (S2, -1, B, B),  # split along the normalized axis: gathered first
    (B, -1, B, B),
    (P, -1, B, B),
]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize(
    "x_sbp,axis,g_sbp,out_sbp", LAYER_NORM_SBP, ids=[f"{x}-{a}-{g}" for x, a, g, _ in LAYER_NORM_SBP]
)
def test_layer_norm_sbp(x_sbp, axis, g_sbp, out_sbp, n):
    def model(env):
        x = param(env, "x", (12, 12, 24), x_sbp)
        size = (12, 12, 24)[axis]
        y = af.ops.layer_norm(x, env.param("g", (size,), g_sbp), env.param("b", (size,), B), axis)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == out_sbp
    v = r.values
    close(r.got["y"], np_layer_norm(v["x"], v["g"], v["b"], axis))
    if out_sbp == x_sbp and g_sbp == B:
        # the backward pass's all-reduces of the gamma and beta gradients only
        assert all("all_reduce" in op for op in r.collectives)
        with af.Graph() as g:
            env = Env(n)
            size = (12, 12, 24)[axis]
            gb = env.param("g", (size,), B), env.param("b", (size,), B)
            af.output("y", af.ops.layer_norm(env.param("x", (12, 12, 24), x_sbp), *gb, axis))
        assert af.compile(g).collectives == ()


# (x's shape, SBP, the result's SBP)
CAUSAL_SBP = [
    ((12, 12, 12), S0, S0),  # batch split
    ((12, 12, 6, 6), S1, S1),  # heads split
    ((12, 12, 6, 6), S0, S0),
    ((12, 12, 12), S1, B),  # queries split: gathered
    ((12, 12, 12), S2, B),
    ((12, 12, 12), B, B),
    ((12, 12, 12), P, B),
]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("shape,sbp,out_sbp", CAUSAL_SBP, ids=[f"{len(s)}d-{x}" for s, x, _ in CAUSAL_SBP])
def test_causal_softmax_sbp(shape, sbp, out_sbp, n):
    def model(env):
        y = af.ops.causal_softmax(param(env, "x", shape, sbp))
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == out_sbp
    close(r.got["y"], np_causal_softmax(r.values["x"]))
    if out_sbp == sbp:
        assert r.collectives == set()


# (a's shape and SBP, b's shape and SBP, transpose_b, the result's SBP, the forward
# pass's collectives); q, k, v are [batch, heads, seq, head_dim]
Q, SCORES = (12, 12, 6, 12), (12, 12, 6, 6)
BATCHED_SBP = [
    (Q, S1, Q, S1, True, S1, set()),  # heads split: Megatron attention, q @ k^T
    (SCORES, S1, Q, S1, False, S1, set()),  # probs @ v
    (Q, S0, Q, S0, True, S0, set()),  # batch split
    (Q, S1, Q, B, True, S1, set()),  # k sliced to its heads
    (Q, B, Q, S1, True, S1, set()),
    (Q, S2, Q, B, True, S2, set()),  # a's rows
    (Q, B, Q, S2, True, S3, set()),  # k^T's columns
    (Q, S3, Q, S3, True, P, set()),  # the contracted head dim
    (Q, S0, (12, 24), B, False, S0, set()),  # a 2-D weight
    (Q, S1, (12, 6, 12), B, True, S1, set()),  # a 3-D b whose batch axis lines up with heads
    (Q, S0, (12, 6, 12), B, True, S0, set()),  # ... and broadcasts along the batch
    (Q, S1, Q, S0, True, S1, {"all_to_all"}),  # mismatched batch splits: b re-split
    (Q, S3, Q, B, True, B, {"all_gather"}),  # contracted split alone: gathered
    (Q, S2, (12, 12, 12, 6), S2, False, S2, {"all_gather"}),  # b's contracted split is gathered
]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(
    "sa,a_sbp,sb,b_sbp,tb,out_sbp,needs",
    BATCHED_SBP,
    ids=[f"{a}{list(sa)}x{b}{list(sb)}{'T' if t else ''}" for sa, a, sb, b, t, *_ in BATCHED_SBP],
)
def test_batched_matmul_sbp(sa, a_sbp, sb, b_sbp, tb, out_sbp, needs, n):
    def model(env):
        y = af.ops.matmul(env.param("a", sa, a_sbp), env.param("b", sb, b_sbp), transpose_b=tb)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    assert r.outs["y"].sbp == out_sbp
    a, b = r.values["a"], r.values["b"]
    want = a @ (np.swapaxes(b, -1, -2) if tb else b)
    assert r.outs["y"].shape == want.shape
    close(r.got["y"], want)
    with af.Graph() as g:
        env = Env(n)
        af.output("y", af.ops.matmul(env.param("a", sa, a_sbp), env.param("b", sb, b_sbp), transpose_b=tb))
    assert {c.op for c in af.compile(g).collectives} == needs


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("partial", ["a", "b"])
def test_batched_matmul_partial_beside_broadcast(partial, n):
    def model(env):
        a = param(env, "a", (12, 4, 6, 12), P if partial == "a" else B)
        b = param(env, "b", (12, 4, 12, 6), P if partial == "b" else B)
        y = af.ops.matmul(a, b)
        if env.is_global:
            assert y.sbp == P
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    close(r.got["y"], r.values["a"] @ r.values["b"])


@pytest.mark.parametrize("n", [2, 4])
def test_attention_with_heads_split(n):
    """Megatron attention: per-head projections [h, d, hd] split by heads (S(0)) turn the
    broadcast x [b, 1, s, d] into q, k, v [b, h, s, hd] split by heads (S(1)); scores,
    causal softmax and mixing stay local; the output projection [h, hd, d], split the
    same, gives per-head outputs whose sum over heads is P: one all-reduce, in the layer
    norm, and the backward pass's for the broadcast x and layer-norm parameters."""
    b, s, heads, hd, d = 4, 6, 4, 3, 12

    def model(env):
        x = af.ops.reshape(env.param("x", (b, s, d), B), (b, 1, s, d))
        q, k, v = (af.ops.matmul(x, env.param(w, (heads, d, hd), S0)) for w in ("wq", "wk", "wv"))
        p = af.ops.causal_softmax(af.ops.matmul(q, k, transpose_b=True))
        per_head = af.ops.matmul(af.ops.matmul(p, v), env.param("wo", (heads, hd, d), S0))
        mixed = af.ops.sum(per_head, axis=1)
        y = af.ops.layer_norm(mixed, env.param("g", (d,), B), env.param("bt", (d,), B))
        if env.is_global:
            assert (q.sbp, p.sbp, per_head.sbp, mixed.sbp, y.sbp) == (S1, S1, S1, P, B)
        return {"y": y, "loss": env.weighted_sum(y)}

    r = both(model, n)
    v = r.values
    x = v["x"][:, None]
    q, k, vv = (x @ v[w] for w in ("wq", "wk", "wv"))
    p = np_causal_softmax(q @ k.swapaxes(-1, -2))
    close(r.got["y"], np_layer_norm((p @ vv @ v["wo"]).sum(axis=1), v["g"], v["bt"]))
    assert r.reduces and all("all_reduce" in op for op in r.collectives)
