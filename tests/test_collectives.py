"""Every collective against numpy on 1, 2, 3 and 4 devices (cpu:0 .. cpu:3).

Inputs are made on each device either as a placeholder there ("feeds") or as a
placeholder on cpu:0 copied over with to_device and scaled there by a per-device
parameter ("copies"). "Device k" is the k-th tensor in the list handed to the collective,
and results come back in that order.
"""

from __future__ import annotations

import numpy as np
import pytest

import actorflow as af

NS = [1, 2, 3, 4]
DTYPES = ["float32", "float64"]
TOL = {"float32": dict(rtol=1e-5, atol=1e-6), "float64": dict(rtol=1e-12, atol=1e-14)}
SOURCES = ["feeds", "copies"]


def devices(n):
    return [f"cpu:{k}" for k in range(n)]


def rand(shape, dtype, seed):
    return np.random.default_rng(seed).uniform(-2, 2, size=shape).astype(dtype)


def make_inputs(n, shape, dtype, source, seed=0):
    """Declare one input per device (inside a graph); return (tensors, feeds, arrays on devices)."""
    arrays = [rand(shape, dtype, seed + k) for k in range(n)]
    feeds = {f"x{k}": a for k, a in enumerate(arrays)}
    if source == "feeds":
        tensors = [af.placeholder(f"x{k}", shape, dtype, d) for k, d in enumerate(devices(n))]
        return tensors, feeds, arrays
    tensors = []
    for k, d in enumerate(devices(n)):
        x = af.placeholder(f"x{k}", shape, dtype, "cpu:0")
        scale = af.parameter(f"scale{k}", np.asarray(k + 1, dtype), device=d)
        t = af.ops.mul(af.ops.to_device(x, d), scale)
        assert t.device == d
        tensors.append(t)
    return tensors, feeds, [a * np.asarray(k + 1, dtype) for k, a in enumerate(arrays)]


def compile_run(g, feeds, quota=2):
    return af.run(af.compile(g, quota=quota), feeds)


def check(actual, expected, dtype):
    assert actual.dtype == np.dtype(dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    np.testing.assert_allclose(actual, expected, **TOL[dtype])


def output_all(results, prefix="y"):
    for k, r in enumerate(results):
        af.output(f"{prefix}{k}", r)


# -- references ---------------------------------------------------------------------------


def ref_all_reduce(xs, op):
    stack = np.stack(xs)
    return {"sum": stack.sum(0), "mean": stack.mean(0), "max": stack.max(0)}[op].astype(xs[0].dtype)


def ref_reduce_scatter(xs, axis):
    return np.split(np.sum(np.stack(xs), axis=0), len(xs), axis=axis)


def ref_all_to_all(xs, split_axis, concat_axis):
    n = len(xs)
    chunks = [np.split(x, n, axis=split_axis) for x in xs]
    return [np.concatenate([chunks[i][k] for i in range(n)], axis=concat_axis) for k in range(n)]


# -- all_reduce -------------------------------------------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("n", NS)
def test_all_reduce(n, op, dtype, source):
    with af.Graph() as g:
        ts, feeds, xs = make_inputs(n, (3, 5), dtype, source, seed=10 * n)
        rs = af.ops.all_reduce(ts, op=op)
        assert [r.device for r in rs] == devices(n)
        assert all(r.shape == (3, 5) and r.dtype == dtype for r in rs)
        output_all(rs)
    out = compile_run(g, feeds)
    expected = ref_all_reduce(xs, op)
    for k in range(n):
        check(out[f"y{k}"], expected, dtype)


def test_all_reduce_default_op_is_sum_and_integers_work():
    xs = [np.arange(6, dtype=np.int64).reshape(2, 3) * (k + 1) - k for k in range(3)]
    with af.Graph() as g:
        ts = [af.placeholder(f"x{k}", (2, 3), "int64", d) for k, d in enumerate(devices(3))]
        output_all(af.ops.all_reduce(ts), "s")
        output_all(af.ops.all_reduce(ts, op="max"), "m")
    out = compile_run(g, {f"x{k}": x for k, x in enumerate(xs)})
    for k in range(3):
        assert out[f"s{k}"].dtype == np.int64
        np.testing.assert_array_equal(out[f"s{k}"], sum(xs))
        np.testing.assert_array_equal(out[f"m{k}"], np.maximum.reduce(xs))


def test_all_reduce_mean_of_integers():
    xs = [np.array([1, 2, 3, 4], np.int32), np.array([3, 2, 1, 0], np.int32)]
    with af.Graph() as g:
        ts = [af.placeholder(f"x{k}", (4,), "int32", d) for k, d in enumerate(devices(2))]
        try:
            rs = af.ops.all_reduce(ts, op="mean")
        except af.GraphError:
            return  # refusing it while building would be fine too
        output_all(rs)
    out = compile_run(g, {"x0": xs[0], "x1": xs[1]})
    np.testing.assert_allclose(out["y0"], [2, 2, 2, 2])


# -- all_gather -------------------------------------------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("axis", [0, 1, -1, 2])
@pytest.mark.parametrize("n", NS)
def test_all_gather(n, axis, source):
    dtype = "float32"
    with af.Graph() as g:
        ts, feeds, xs = make_inputs(n, (2, 3, 4), dtype, source, seed=20 + n)
        rs = af.ops.all_gather(ts, axis=axis)
        output_all(rs)
    out = compile_run(g, feeds)
    expected = np.concatenate(xs, axis=axis)
    for k in range(n):
        check(out[f"y{k}"], expected, dtype)


@pytest.mark.parametrize("n", [2, 4])
def test_all_gather_float64(n):
    with af.Graph() as g:
        ts, feeds, xs = make_inputs(n, (5,), "float64", "feeds", seed=3)
        output_all(af.ops.all_gather(ts))
    out = compile_run(g, feeds)
    for k in range(n):
        check(out[f"y{k}"], np.concatenate(xs), "float64")


# -- reduce_scatter ---------------------------------------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("n", NS)
def test_reduce_scatter(n, axis, dtype, source):
    with af.Graph() as g:
        ts, feeds, xs = make_inputs(n, (12, 24), dtype, source, seed=30 + n)
        rs = af.ops.reduce_scatter(ts, axis=axis)
        output_all(rs)
    out = compile_run(g, feeds)
    expected = ref_reduce_scatter(xs, axis)
    for k in range(n):
        check(out[f"y{k}"], expected[k], dtype)


# -- broadcast --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["first", "last", "outside"])
@pytest.mark.parametrize("n", NS)
def test_broadcast(n, where, dtype):
    targets = devices(n)
    source = {"first": "cpu:0", "last": f"cpu:{n - 1}", "outside": f"cpu:{n}"}[where]
    xs = rand((4, 3), dtype, seed=40 + n)
    with af.Graph() as g:
        x = af.placeholder("x", (4, 3), dtype, source)
        y = af.ops.tanh(x)  # computed on the source device
        rs = af.ops.broadcast(y, targets)
        assert [r.device for r in rs] == targets
        output_all(rs)
    out = compile_run(g, {"x": xs})
    assert sorted(out) == sorted(f"y{k}" for k in range(n))
    for k in range(n):
        check(out[f"y{k}"], np.tanh(xs), dtype)


@pytest.mark.parametrize(
    "targets",
    [["cpu:2", "cpu:0", "cpu:1"], ["cpu:3", "cpu:1"], ["cpu:1", "cpu:3", "cpu:0", "cpu:2"]],
    ids=str,
)
def test_broadcast_to_unsorted_targets_then_compute_per_device(targets):
    xs = rand((6,), "float64", seed=50)
    with af.Graph() as g:
        x = af.placeholder("x", (6,), "float64", "cpu:1")
        rs = af.ops.broadcast(x, targets)
        for k, r in enumerate(rs):
            assert r.device == targets[k]
            c = af.parameter(f"c{k}", np.float64(k + 1), device=r.device)
            af.output(f"y{k}", af.ops.mul(r, c))
    out = compile_run(g, {"x": xs})
    for k in range(len(targets)):
        check(out[f"y{k}"], xs * (k + 1), "float64")


# -- all_to_all -------------------------------------------------------------------------------


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize(
    "split_axis,concat_axis", [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (-2, -1), (0, 2)], ids=str
)
@pytest.mark.parametrize("n", NS)
def test_all_to_all(n, split_axis, concat_axis, source):
    dtype = "float32"
    shape = (12, 12, 3)
    with af.Graph() as g:
        ts, feeds, xs = make_inputs(n, shape, dtype, source, seed=60 + n)
        rs = af.ops.all_to_all(ts, split_axis=split_axis, concat_axis=concat_axis)
        output_all(rs)
    out = compile_run(g, feeds)
    expected = ref_all_to_all(xs, split_axis, concat_axis)
    for k in range(n):
        check(out[f"y{k}"], expected[k], dtype)


@pytest.mark.parametrize("n", [2, 3])
def test_all_to_all_float64_default_axes(n):
    with af.Graph() as g:
        ts, feeds, xs = make_inputs(n, (6, 2), "float64", "feeds", seed=70)
        output_all(af.ops.all_to_all(ts))
    out = compile_run(g, feeds)
    expected = ref_all_to_all(xs, 0, 0)
    for k in range(n):
        check(out[f"y{k}"], expected[k], "float64")


def test_all_to_all_twice_transposes_back():
    """Splitting on 0 and concatenating on 1, then the reverse, gives each device its input back."""
    n = 3
    with af.Graph() as g:
        ts, feeds, xs = make_inputs(n, (6, 4), "float64", "feeds", seed=71)
        mid = af.ops.all_to_all(ts, split_axis=0, concat_axis=1)
        output_all(af.ops.all_to_all(mid, split_axis=1, concat_axis=0))
    out = compile_run(g, feeds)
    for k in range(n):
        check(out[f"y{k}"], xs[k], "float64")


# -- list order -----------------------------------------------------------------------------


def test_device_k_is_the_kth_tensor_in_the_list():
    """Tensors handed over as cpu:2, cpu:0, cpu:1: gather order, scatter chunks and results
    follow the list, not the device numbers."""
    order = ["cpu:2", "cpu:0", "cpu:1"]
    xs = [rand((3, 2), "float64", seed=80 + k) for k in range(3)]
    with af.Graph() as g:
        ts = [af.placeholder(f"x{k}", (3, 2), "float64", d) for k, d in enumerate(order)]
        gathered = af.ops.all_gather(ts, axis=0)
        scattered = af.ops.reduce_scatter(ts, axis=0)
        swapped = af.ops.all_to_all(ts, split_axis=0, concat_axis=1)
        for name, rs in [("g", gathered), ("s", scattered), ("a", swapped)]:
            assert [r.device for r in rs] == order
            output_all(rs, name)
    out = compile_run(g, {f"x{k}": x for k, x in enumerate(xs)})
    sums = ref_reduce_scatter(xs, 0)
    swaps = ref_all_to_all(xs, 0, 1)
    for k in range(3):
        check(out[f"g{k}"], np.concatenate(xs), "float64")
        check(out[f"s{k}"], sums[k], "float64")
        check(out[f"a{k}"], swaps[k], "float64")


# -- collectives in a row, and feeding compute --------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_reduce_scatter_then_all_gather_is_all_reduce(n):
    with af.Graph() as g:
        ts, feeds, xs = make_inputs(n, (12, 5), "float64", "copies", seed=90)
        parts = af.ops.reduce_scatter(ts, axis=0)
        output_all(af.ops.all_gather(parts, axis=0), "rg")
        output_all(af.ops.all_reduce(ts, op="sum"), "ar")
    out = compile_run(g, feeds)
    expected = ref_all_reduce(xs, "sum")
    for k in range(n):
        check(out[f"rg{k}"], expected, "float64")
        check(out[f"ar{k}"], expected, "float64")


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collective_feeds_compute_feeds_collective(n):
    """all_reduce -> matmul + relu on each device -> all_gather -> softmax on one device."""
    dtype = "float32"
    ws = [rand((6, 4), dtype, seed=100 + k) for k in range(n)]
    with af.Graph() as g:
        ts, feeds, xs = make_inputs(n, (5, 6), dtype, "feeds", seed=95)
        summed = af.ops.all_reduce(ts, op="mean")
        hs = [
            af.ops.relu(af.ops.matmul(s, af.parameter(f"w{k}", ws[k], device=s.device)))
            for k, s in enumerate(summed)
        ]
        gathered = af.ops.all_gather(hs, axis=1)
        af.output("y", af.ops.softmax(gathered[n - 1], axis=1))
        af.output("m", af.ops.max(gathered[0], axis=0))
    out = compile_run(g, feeds)
    mean = ref_all_reduce(xs, "mean")
    h = np.concatenate([np.maximum(mean @ w, 0) for w in ws], axis=1)
    e = np.exp(h - h.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out["y"], e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["m"], h.max(axis=0), rtol=1e-5, atol=1e-5)


def test_every_kind_of_collective_in_one_chain():
    n = 4
    with af.Graph() as g:
        ts, feeds, xs = make_inputs(n, (8, 4), "float64", "copies", seed=110)
        a = af.ops.all_reduce(ts, op="max")
        b = af.ops.all_to_all(a, split_axis=0, concat_axis=1)  # each (2, 16)
        c = af.ops.reduce_scatter(b, axis=1)  # each (2, 4)
        d = af.ops.broadcast(af.ops.exp(c[2]), ["cpu:3", "cpu:0"])
        e = af.ops.all_gather([d[1], af.ops.to_device(d[0], "cpu:1")], axis=0)  # on cpu:0, cpu:1
        af.output("y", af.ops.sum(e[1], axis=1))
    out = compile_run(g, feeds)
    a_ref = ref_all_reduce(xs, "max")
    b_ref = ref_all_to_all([a_ref] * n, 0, 1)
    c_ref = ref_reduce_scatter(b_ref, 1)
    d_ref = np.exp(c_ref[2])
    check(out["y"], np.concatenate([d_ref, d_ref]).sum(axis=1), "float64")


def test_independent_collectives_on_overlapping_devices():
    with af.Graph() as g:
        xs = [rand((4, 4), "float32", seed=120 + k) for k in range(4)]
        ts = [af.placeholder(f"x{k}", (4, 4), "float32", f"cpu:{k}") for k in range(4)]
        left = af.ops.all_reduce(ts[:2], op="sum")  # cpu:0, cpu:1
        right = af.ops.all_reduce(ts[1:], op="max")  # cpu:1, cpu:2, cpu:3
        af.output("y", af.ops.sub(left[1], right[0]))  # both on cpu:1
    out = compile_run(g, {f"x{k}": x for k, x in enumerate(xs)})
    check(out["y"], (xs[0] + xs[1]) - np.maximum.reduce(xs[1:]), "float32")


# -- iterations, unused results, parameters ---------------------------------------------------


@pytest.mark.parametrize("quota", [1, 2])
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_over_several_iterations(n, quota):
    with af.Graph() as g:
        ts = [af.placeholder(f"x{k}", (6, 3), "float32", d) for k, d in enumerate(devices(n))]
        rs = af.ops.all_reduce([af.ops.relu(t) for t in ts], op="sum")
        gs = af.ops.all_gather([af.ops.tanh(r) for r in rs], axis=0)
        output_all(gs)
    plan = af.compile(g, quota=quota)
    iters = [[rand((6, 3), "float32", seed=1000 + 10 * i + k) for k in range(n)] for i in range(5)]
    outs = af.run(plan, [{f"x{k}": x for k, x in enumerate(xs)} for xs in iters])
    assert len(outs) == len(iters)
    for xs, out in zip(iters, outs):
        expected = np.concatenate([np.tanh(sum(np.maximum(x, 0) for x in xs))] * n)
        for k in range(n):
            check(out[f"y{k}"], expected, "float32")


@pytest.mark.parametrize("quota", [1, 2])
def test_only_one_result_of_a_collective_used(quota):
    with af.Graph() as g:
        ts = [af.placeholder(f"x{k}", (4,), "float64", d) for k, d in enumerate(devices(3))]
        rs = af.ops.all_reduce(ts, op="sum")
        af.output("y", af.ops.exp(rs[1]))
    plan = af.compile(g, quota=quota)
    iters = [[rand((4,), "float64", seed=2000 + 10 * i + k) for k in range(3)] for i in range(4)]
    outs = af.run(plan, [{f"x{k}": x for k, x in enumerate(xs)} for xs in iters])
    for xs, out in zip(iters, outs):
        check(out["y"], np.exp(sum(xs)), "float64")


def test_collective_over_parameters_without_feeds():
    values = [np.full((2, 2), k + 1.0) + np.eye(2) * k for k in range(3)]
    with af.Graph() as g:
        ps = [af.parameter(f"p{k}", v, device=f"cpu:{k}") for k, v in enumerate(values)]
        output_all(af.ops.all_reduce(ps, op="mean"))
    plan = af.compile(g)
    for out in af.run(plan, [{}, {}]):
        for k in range(3):
            check(out[f"y{k}"], sum(values) / 3, "float64")


def test_single_device_collectives_are_identities_or_reductions_of_one():
    xs = rand((4, 6), "float64", seed=3000)
    with af.Graph() as g:
        x = af.placeholder("x", (4, 6), "float64", "cpu:2")
        af.output("ar", af.ops.all_reduce([x], op="mean")[0])
        af.output("ag", af.ops.all_gather([x], axis=1)[0])
        af.output("rs", af.ops.reduce_scatter([x], axis=1)[0])
        af.output("bc", af.ops.broadcast(x, ["cpu:2"])[0])
        af.output("aa", af.ops.all_to_all([x], split_axis=0, concat_axis=1)[0])
    out = compile_run(g, {"x": xs})
    for name in ("ar", "ag", "rs", "bc", "aa"):
        check(out[name], xs, "float64")
