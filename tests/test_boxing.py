"""Boxing: every SBP transition of ``af.box`` against numpy, on 2, 3 and 4 devices.

For each transition the test checks the logical value fetched whole, the resulting
GlobalTensor's SBP, shape and placement, which collective the Plan uses for it, and every
device's part fetched on its own (a part is an ordinary tensor, so it can be an output).
Shapes are multiples of 12 so that 2, 3 and 4 devices all split them evenly.
"""

from __future__ import annotations

import numpy as np
import pytest

import actorflow as af

TOL = dict(rtol=1e-10, atol=1e-12)
DEVICES = [2, 3, 4]
M, K, N = 12, 24, 36  # P tensors are (M, K) @ (K, N); others are (M, N)

RNG = np.random.default_rng(1234)
A = RNG.standard_normal((M, K))
W = RNG.standard_normal((K, N))
V = RNG.standard_normal((M, N))
PRODUCT = A @ W


def place(n: int) -> list[str]:
    return [f"cpu:{k}" for k in range(n)]


def sbp_of(code: str):
    return {"B": af.B, "P": af.P, "S0": af.S(0), "S1": af.S(1), "S2": af.S(2)}[code]


def source(code: str, n: int, how: str = "matmul"):
    """A global tensor with SBP ``code`` over ``n`` devices, its logical value, its feeds,
    and each device's part as numpy. P comes from a matmul S(1) x S(0) (real partial sums
    on every device) or from boxing a B tensor to P (``how="box"``)."""
    devices = place(n)
    if code == "P" and how == "matmul":
        a = af.placeholder("a", A.shape, "float64", devices, af.S(1))
        w = af.parameter("w", W, devices, af.S(0))
        t = af.ops.matmul(a, w)
        parts = [a_part @ w_part for a_part, w_part in zip(np.split(A, n, axis=1), np.split(W, n, axis=0))]
        return t, PRODUCT, {"a": A}, parts
    if code == "P":
        t = af.box(af.placeholder("v", V.shape, "float64", devices, af.B), af.P)
        return t, V, {"v": V}, [V] + [np.zeros_like(V)] * (n - 1)
    t = af.placeholder("v", V.shape, "float64", devices, sbp_of(code))
    return t, V, {"v": V}, expected_parts(V, code, n)


def expected_parts(value: np.ndarray, code: str, n: int) -> list[np.ndarray]:
    """Each device's part of ``value`` under S or B (P parts depend on the producer)."""
    if code.startswith("S"):
        return np.split(value, n, axis=int(code[1:]))
    assert code == "B"
    return [value] * n


def output_with_parts(name: str, t) -> None:
    """Fetch ``t`` as ``name`` and each of its per-device parts as part0, part1, ..."""
    af.output(name, t)
    for k, part in enumerate(t.locals):
        af.output(f"part{k}", part)


def assert_parts(out: dict, wants) -> None:
    for k, want in enumerate(wants):
        np.testing.assert_allclose(out[f"part{k}"], want, **TOL)


def run_box(frm: str, to: str, n: int, how: str = "matmul"):
    with af.Graph() as g:
        x, value, feeds, src_parts = source(frm, n, how)
        y = af.box(x, sbp_of(to))
        output_with_parts("y", y)
    plan = af.compile(g)
    return x, y, value, src_parts, plan, af.run(plan, feeds)


def collective_ops(plan) -> list[str]:
    return sorted(c.op for c in plan.collectives)


# (from, to, the collective the plan uses or None)
TRANSITIONS = [
    ("P", "B", "all_reduce"),
    ("P", "S0", "reduce_scatter"),
    ("P", "S1", "reduce_scatter"),
    ("S0", "B", "all_gather"),
    ("S1", "B", "all_gather"),
    ("S0", "S1", "all_to_all"),
    ("S1", "S0", "all_to_all"),
    ("B", "S0", None),
    ("B", "S1", None),
    ("B", "P", None),
    ("S0", "P", "all_gather"),  # via B: gather, then keep device 0's copy
    ("S1", "P", "all_gather"),
]


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("frm,to,collective", TRANSITIONS, ids=[f"{a}->{b}" for a, b, _ in TRANSITIONS])
def test_transition(frm, to, collective, n):
    x, y, value, _, plan, out = run_box(frm, to, n)
    # (b) the GlobalTensor: SBP, logical shape, placement, local shapes
    assert y.sbp == sbp_of(to)
    assert y.shape == x.shape == value.shape
    assert y.devices == tuple(place(n))
    assert y.dtype == "float64"
    local = list(value.shape)
    if to.startswith("S"):
        local[int(to[1:])] //= n
    assert [t.shape for t in y.locals] == [tuple(local)] * n
    assert [t.device for t in y.locals] == place(n)
    # (a) the logical value
    assert out["y"].shape == value.shape
    np.testing.assert_allclose(out["y"], value, **TOL)
    # (c) the collective
    assert collective_ops(plan) == ([collective] * len(plan.collectives) if collective else [])
    if collective:
        assert len(plan.collectives) == 1
        (c,) = plan.collectives
        assert sorted(plan.actors[a].device for a in c.actors) == place(n)
    # (d) each device's part
    parts = [out[f"part{k}"] for k in range(n)]
    if to == "P":
        # B -> P keeps the whole on the first device and zeros elsewhere
        np.testing.assert_allclose(parts[0], value, **TOL)
        for p in parts[1:]:
            np.testing.assert_array_equal(p, np.zeros_like(value))
    else:
        for got, want in zip(parts, expected_parts(value, to, n)):
            np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("to", ["B", "S0", "S1"])
def test_partial_made_by_boxing_a_broadcast_tensor(to, n):
    """A P tensor made with box(B, P) (whole on device 0, zeros elsewhere) boxes back."""
    _, y, value, src_parts, plan, out = run_box("P", to, n, how="box")
    assert y.sbp == sbp_of(to)
    np.testing.assert_allclose(out["y"], value, **TOL)
    assert_parts(out, expected_parts(value, to, n))
    assert collective_ops(plan) == ["all_reduce" if to == "B" else "reduce_scatter"]


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("code", ["B", "S0", "S1", "P"])
def test_identity_is_the_same_tensor(code, n):
    with af.Graph() as g:
        x, value, feeds, src_parts = source(code, n)
        y = af.box(x, sbp_of(code))
        assert y is x
        output_with_parts("y", y)
    plan = af.compile(g)
    assert plan.collectives == ()
    out = af.run(plan, feeds)
    np.testing.assert_allclose(out["y"], value, **TOL)
    assert_parts(out, src_parts)


def test_partial_parts_are_the_partial_products():
    """The P source really is partial: no device holds the whole product."""
    with af.Graph() as g:
        x, value, feeds, src_parts = source("P", 3)
        assert x.sbp == af.P and x.shape == (M, N)
        output_with_parts("x", x)
    plan = af.compile(g)
    assert plan.collectives == ()
    out = af.run(plan, feeds)
    np.testing.assert_allclose(out["x"], PRODUCT, **TOL)
    for k, want in enumerate(src_parts):
        np.testing.assert_allclose(out[f"part{k}"], want, **TOL)
        assert not np.allclose(out[f"part{k}"], PRODUCT)


# -- three dimensions: splits along the last axis ---------------------------------------

T3 = RNG.standard_normal((12, 12, 24))

TRANSITIONS_3D = [
    ("S0", "S2", "all_to_all"),
    ("S2", "S0", "all_to_all"),
    ("S1", "S2", "all_to_all"),
    ("S2", "B", "all_gather"),
    ("B", "S2", None),
    ("S2", "P", "all_gather"),
]


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("frm,to,collective", TRANSITIONS_3D, ids=[f"{a}->{b}" for a, b, _ in TRANSITIONS_3D])
def test_transition_3d(frm, to, collective, n):
    with af.Graph() as g:
        x = af.placeholder("t", T3.shape, "float64", place(n), sbp_of(frm))
        y = af.box(x, sbp_of(to))
        output_with_parts("y", y)
    plan = af.compile(g)
    out = af.run(plan, {"t": T3})
    assert y.sbp == sbp_of(to) and y.shape == T3.shape
    np.testing.assert_allclose(out["y"], T3, **TOL)
    assert collective_ops(plan) == ([collective] if collective else [])
    assert_parts(out, [T3] + [np.zeros_like(T3)] * (n - 1) if to == "P" else expected_parts(T3, to, n))


# -- chains and other placements ---------------------------------------------------------


@pytest.mark.parametrize("n", DEVICES)
def test_a_chain_of_boxings_round_trips(n):
    chain = ["S1", "B", "P", "S0", "S1", "P", "B", "S0"]
    with af.Graph() as g:
        x, value, feeds, _ = source("S0", n)
        t = x
        for code in chain:
            t = af.box(t, sbp_of(code))
            assert t.sbp == sbp_of(code) and t.shape == value.shape
        af.output("y", t)
    out = af.run(af.compile(g), feeds)
    np.testing.assert_allclose(out["y"], value, **TOL)


def test_placement_in_another_order():
    """Part k lives on the k-th device of the placement, whatever its name."""
    devices = ["cpu:2", "cpu:0", "cpu:3"]
    with af.Graph() as g:
        x = af.placeholder("v", V.shape, "float64", devices, af.S(0))
        y = af.box(x, af.S(1))
        z = af.box(y, af.B)
        assert [part.device for part in y.locals] == devices
        output_with_parts("y", y)
        af.output("z", z)
    out = af.run(af.compile(g), {"v": V})
    np.testing.assert_allclose(out["y"], V, **TOL)
    np.testing.assert_allclose(out["z"], V, **TOL)
    assert_parts(out, np.split(V, 3, axis=1))


def test_boxing_on_one_device_needs_no_collective():
    with af.Graph() as g:
        x = af.placeholder("v", V.shape, "float64", ["cpu:1"], af.S(0))
        y = af.box(af.box(x, af.S(1)), af.B)
        af.output("y", y)
    plan = af.compile(g)
    np.testing.assert_allclose(af.run(plan, {"v": V})["y"], V, **TOL)


@pytest.mark.parametrize("frm,to", [("S0", "B"), ("S1", "S0"), ("P", "B"), ("P", "S1"), ("B", "S0")])
def test_boxing_is_pipelined_over_iterations(frm, to):
    """Several iterations at quota 2: each one boxes its own feed."""
    n = 3
    with af.Graph() as g:
        x, _, _, _ = source(frm, n)
        af.output("y", af.box(x, sbp_of(to)))
    plan = af.compile(g, quota=2)
    name = "a" if frm == "P" else "v"
    base = A if frm == "P" else V
    feeds = [{name: base * (i + 1)} for i in range(4)]
    outs = af.run(plan, feeds)
    for i, out in enumerate(outs):
        want = (A * (i + 1)) @ W if frm == "P" else V * (i + 1)
        np.testing.assert_allclose(out["y"], want, **TOL)


# -- gradients through boxing ------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "frm,to",
    [("B", "S0"), ("B", "S1"), ("B", "P"), ("S0", "B"), ("S1", "B"), ("S0", "S1"), ("S1", "S0"), ("S0", "P")],
)
def test_gradient_through_boxing(frm, to, n):
    """loss = sum(box(v) * C): d loss / d v = C whatever the boxing in between."""
    c = RNG.standard_normal(V.shape)
    with af.Graph() as g:
        v = af.parameter("v", V, place(n), sbp_of(frm))
        cc = af.placeholder("c", V.shape, "float64", place(n), af.B)
        loss = af.ops.reduce_sum(af.ops.mul(af.box(v, sbp_of(to)), cc))
        (dv,) = af.gradients(loss, [v])
        assert dv.sbp == (af.P if frm == "B" else sbp_of(frm))
        assert dv.shape == V.shape
        af.output("loss", loss)
        af.output("dv", dv)
    out = af.run(af.compile(g), {"c": c})
    np.testing.assert_allclose(out["loss"], np.sum(V * c), **TOL)
    np.testing.assert_allclose(out["dv"], c, **TOL)


@pytest.mark.parametrize("to", ["B", "S0", "S1"])
def test_gradient_through_boxing_a_partial(to):
    """P -> B / S from a matmul: the gradients of both factors are the one-device ones."""
    n = 3
    c = RNG.standard_normal((M, N))
    with af.Graph() as g:
        a = af.parameter("a", A, place(n), af.S(1))
        w = af.parameter("w", W, place(n), af.S(0))
        cc = af.placeholder("c", c.shape, "float64", place(n), af.B)
        loss = af.ops.reduce_sum(af.ops.mul(af.box(af.ops.matmul(a, w), sbp_of(to)), cc))
        da, dw = af.gradients(loss, [a, w])
        assert (da.sbp, dw.sbp) == (af.S(1), af.S(0))
        af.output("da", da)
        af.output("dw", dw)
    out = af.run(af.compile(g), {"c": c})
    np.testing.assert_allclose(out["da"], c @ W.T, **TOL)
    np.testing.assert_allclose(out["dw"], A.T @ c, **TOL)


# -- boxing that cannot be done ----------------------------------------------------------


def test_partial_to_split_that_does_not_divide_is_refused():
    with af.Graph():
        a = af.placeholder("a", (6, 12), "float64", place(4), af.S(1))
        w = af.parameter("w", np.ones((12, 6)), place(4), af.S(0))
        with pytest.raises(af.GraphError):
            af.box(af.ops.matmul(a, w), af.S(0))


def test_split_to_split_that_does_not_divide_is_refused():
    with af.Graph():
        x = af.placeholder("x", (6, 8), "float64", place(4), af.S(1))
        with pytest.raises(af.GraphError):
            af.box(x, af.S(0))


def test_broadcast_to_split_that_does_not_divide_is_refused():
    with af.Graph():
        x = af.parameter("x", np.arange(36.0).reshape(6, 6), place(4), af.B)
        with pytest.raises(af.GraphError):
            af.box(x, af.S(0))


def test_broadcast_to_split_along_a_missing_axis_is_refused():
    with af.Graph():
        x = af.placeholder("x", (12, 12), "float64", place(2), af.B)
        with pytest.raises(af.GraphError):
            af.box(x, af.S(2))


def test_integer_split_to_partial_by_a_reduction():
    """An integer P made by summing over the split axis boxes back to B."""
    ints = np.arange(12 * 24).reshape(12, 24)
    with af.Graph() as g:
        x = af.placeholder("x", ints.shape, "int64", place(3), af.S(0))
        s = af.ops.reduce_sum(x, axis=0)
        assert s.sbp == af.P and s.dtype == "int64"
        af.output("s", af.box(s, af.B))
    out = af.run(af.compile(g), {"x": ints})["s"]
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, ints.sum(axis=0))


@pytest.mark.parametrize("frm", ["B", "S0"])
def test_integer_tensor_to_partial(frm):
    ints = np.arange(12 * 24).reshape(12, 24)
    with af.Graph() as g:
        x = af.placeholder("x", ints.shape, "int64", place(2), sbp_of(frm))
        y = af.box(x, af.P)
        af.output("y", y)
    np.testing.assert_array_equal(af.run(af.compile(g), {"x": ints})["y"], ints)


@pytest.mark.parametrize("frm", ["S0", "P"])
def test_split_along_a_missing_axis_is_refused(frm):
    with af.Graph():
        x, _, _, _ = source(frm, 2)
        with pytest.raises(af.GraphError):
            af.box(x, af.S(2))
