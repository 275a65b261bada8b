"""Collective fusion (compiler/fusion.py): sum and mean all-reduces bucketed in
gradient-ready order into one fused all-reduce per bucket.

Fusion changes where the arithmetic runs, never the arithmetic: every test compares the
fused plan's results bitwise with ``fusion=False`` (and, where simple, with numpy), and
checks that the fused plan is consistent (ids equal indexes, every input slot named by
its register's consumers and the other way round, producers owning their registers).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import actorflow as af
import graph_strategies as gs
from actorflow.compiler.expand import expand
from actorflow.compiler.fusion import fuse_collectives
from actorflow.compiler.topology import ready_order, unit_of
from actorflow.compiler.updates import order_updates
from actorflow.ops import kernels
from actorflow.ops.fusion_kernels import fused_all_reduce

F64 = 8  # bytes per float64 element


def dev(k: int) -> str:
    return f"cpu:{k}"


def rng_values(shape, dtype="float64", seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-50, 50, size=shape).astype(dtype)
    return rng.uniform(-1.0, 1.0, size=shape).astype(dtype)


# -- checks ------------------------------------------------------------------------------


def assert_consistent(plan: af.Plan, ordered: bool = True) -> None:
    """The Plan's cross-references agree with each other."""
    for k, a in enumerate(plan.actors):
        assert a.id == k
    for k, r in enumerate(plan.registers):
        assert r.id == k
        if r.producer >= 0:
            assert r.id in plan.actors[r.producer].outputs, r
        for c in r.consumers:
            assert plan.actors[c.actor].inputs[c.slot].register == r.id, (r, c)
    for a in plan.actors:
        for o in a.outputs:
            assert plan.registers[o].producer == a.id
        for slot, i in enumerate(a.inputs):
            assert af.plan.Consumer(a.id, slot) in plan.registers[i.register].consumers, (a.name, slot)
    grouped = {}
    ids = [coll.id for coll in plan.collectives]
    # ids are indexes until order_collectives puts the collectives in their run order
    assert (sorted(ids) if ordered else ids) == list(range(len(ids)))
    for coll in plan.collectives:
        for a in coll.actors:
            assert plan.actors[a].group == coll.id
            assert plan.actors[a].kind == "collective"
            grouped[a] = coll.id
    for a in plan.actors:
        assert (a.id in grouped) == (a.kind == "collective")
        if a.id not in grouped:
            assert a.group == -1
    for f in plan.feeds:
        assert plan.actors[f.actor].kind == "feed" and plan.actors[f.actor].name == f.name
    for o in plan.outputs:
        assert plan.actors[o.actor].kind == "fetch" and plan.actors[o.actor].name == o.name


def buckets(plan: af.Plan) -> list[list[str]]:
    """The all-reduce nodes each fused collective holds, in bucket order."""
    found = []
    for coll in plan.collectives:
        first = plan.actors[coll.actors[0]]
        if first.kernel is fused_all_reduce:
            assert coll.name.startswith("fused_all_reduce_") and coll.op == "all_reduce"
            names = [plan.registers[o].name for o in first.outputs[:-1]]
            found.append([n.rsplit(":", 1)[0] for n in names])
    return found


def fused_compile(g, **kw) -> tuple[af.Plan, af.Plan]:
    """The graph compiled with fusion (checked for consistency) and without."""
    fused = af.compile(g, **kw)
    assert_consistent(fused)
    plain = af.compile(g, fusion=False, **{k: v for k, v in kw.items() if not k.startswith("bucket")})
    assert not buckets(plain)
    return fused, plain


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k, strict=True)


def run_both(fused: af.Plan, plain: af.Plan, feeds):
    out_f, out_p = af.run(fused, feeds), af.run(plain, feeds)
    if not isinstance(feeds, list):
        out_f, out_p = [out_f], [out_p]
    for a, b in zip(out_f, out_p, strict=True):
        assert_same(a, b)
    return out_f


def independent_graph(specs, devices=None, *, with_inputs=False):
    """One all-reduce per spec (name, shape, dtype, op[, devices]) over placeholders; every
    result is an output. Returns the graph and the feed names per spec."""
    inputs = {}
    with af.Graph() as g:
        for spec in specs:
            name, shape, dtype, op = spec[:4]
            devs = spec[4] if len(spec) > 4 else devices
            xs = [af.placeholder(f"{name}_x{k}", shape, dtype, d) for k, d in enumerate(devs)]
            inputs[name] = [x.name for x in xs]
            outs = af.ops.all_reduce(xs, op, name=name)
            for k, y in enumerate(outs):
                af.output(f"{name}_y{k}", y)
    return (g, inputs) if with_inputs else g


def feeds_for(g_inputs, specs, seed=0):
    feeds = {}
    for j, spec in enumerate(specs):
        name, shape, dtype = spec[:3]
        for k, feed in enumerate(g_inputs[name]):
            feeds[feed] = rng_values(shape, dtype, seed + 100 * j + k)
    return feeds


# -- results -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_fused_results_equal_unfused_and_numpy(n, op):
    shapes = [(3, 4), (5,), (), (2, 3, 2), (1, 7), (0, 3)]
    specs = [(f"ar{j}", s, "float64", op) for j, s in enumerate(shapes)]
    g, names = independent_graph(specs, [dev(k) for k in range(n)], with_inputs=True)
    fused, plain = fused_compile(g)
    assert buckets(fused) == [[f"ar{j}" for j in range(len(shapes))]]
    assert len(fused.collectives) == 1 and len(plain.collectives) == len(shapes)
    feeds = [feeds_for(names, specs, seed) for seed in range(3)]
    outs = run_both(fused, plain, feeds)
    for f, out in zip(feeds, outs):
        for name, _, _, _ in specs:
            xs = [f[x] for x in names[name]]
            want = xs[0]
            for x in xs[1:]:
                want = want + x  # the kernel's order: bitwise equal in float64
            if op == "mean":
                want = want / n
            for k in range(n):
                np.testing.assert_array_equal(out[f"{name}_y{k}"], want, strict=True)


@pytest.mark.parametrize(
    "dtype,op",
    [("float32", "sum"), ("float32", "mean"), ("int32", "sum"), ("int64", "mean"), ("float16", "sum")],
)
def test_other_dtypes_are_bitwise_equal_to_unfused(dtype, op):
    specs = [(f"ar{j}", s, dtype, op) for j, s in enumerate([(4, 3), (6,), (2, 2)])]
    g, names = independent_graph(specs, [dev(k) for k in range(3)], with_inputs=True)
    fused, plain = fused_compile(g)
    assert buckets(fused) == [["ar0", "ar1", "ar2"]]
    flat = fused.registers[fused.actors[fused.collectives[0].actors[0]].outputs[-1]]
    assert flat.shape == (12 + 6 + 4,)
    assert flat.dtype == ("float64" if op == "mean" and dtype.startswith("int") else dtype)
    run_both(fused, plain, [feeds_for(names, specs, seed) for seed in range(2)])


@pytest.mark.parametrize("quota", [1, 3])
def test_many_pipelined_iterations(quota):
    specs = [(f"ar{j}", (4, j + 1), "float64", "sum") for j in range(5)]
    g, names = independent_graph(specs, [dev(0), dev(1)], with_inputs=True)
    fused, plain = fused_compile(g, quota=quota)
    run_both(fused, plain, [feeds_for(names, specs, seed) for seed in range(8)])


def test_kernel_matches_all_reduce_kernel():
    """The fused kernel against ops.kernels.all_reduce, member by member."""
    rng = np.random.default_rng(7)
    shapes = [(3,), (2, 2), (), (0,)]
    for op in ("sum", "mean"):
        ins = [rng.standard_normal(s) for d in range(3) for s in shapes]  # device-major
        outs = []
        for _ in range(3):
            outs += [np.empty(s) for s in shapes] + [np.empty(sum(int(np.prod(s)) for s in shapes))]
        fused_all_reduce(ins, outs, op=op, members=len(shapes))
        for m, s in enumerate(shapes):
            want = [np.empty(s) for _ in range(3)]
            kernels.all_reduce([ins[d * len(shapes) + m] for d in range(3)], want, op=op)
            for d in range(3):
                np.testing.assert_array_equal(outs[d * (len(shapes) + 1) + m], want[d], strict=True)


# -- buckets -----------------------------------------------------------------------------


def bucket_graph(elements, op="sum"):
    """float64 all-reduces ``ar<j>`` of ``elements[j]`` elements over two devices."""
    specs = [(f"ar{j}", (n,), "float64", op) for j, n in enumerate(elements)]
    return independent_graph(specs, [dev(0), dev(1)])


def bucket_feeds(elements, seed=0):
    return {
        f"ar{j}_x{k}": rng_values((n,), seed=seed + 10 * j + k)
        for j, n in enumerate(elements)
        for k in range(2)
    }


def test_first_bucket_closes_at_first_bytes_then_cap():
    g = bucket_graph([64] * 9)  # 512 bytes each
    fused, _ = fused_compile(g, bucket_first=1024, bucket_cap=2048)
    assert buckets(fused) == [["ar0", "ar1"], ["ar2", "ar3", "ar4", "ar5"], ["ar6", "ar7", "ar8"]]
    assert [c.name for c in fused.collectives] == [f"fused_all_reduce_{k}" for k in range(3)]


def test_first_bucket_of_one_tensor_stays_unfused():
    g = bucket_graph([256, 64, 64, 64])  # 2048, then 512 bytes each
    fused, _ = fused_compile(g, bucket_first=1024, bucket_cap=1024)
    assert buckets(fused) == [["ar1", "ar2"]]
    assert sorted(c.name for c in fused.collectives) == ["ar0", "ar3", "fused_all_reduce_0"]


def test_tensor_bigger_than_the_cap_gets_its_own_bucket():
    g = bucket_graph([64, 64, 64, 1000, 64, 64])
    fused, plain = fused_compile(g, bucket_first=1024, bucket_cap=2048)
    assert buckets(fused) == [["ar0", "ar1"], ["ar4", "ar5"]]
    names = sorted(c.name for c in fused.collectives)
    assert names == ["ar2", "ar3", "fused_all_reduce_0", "fused_all_reduce_1"]
    run_both(fused, plain, bucket_feeds([64, 64, 64, 1000, 64, 64]))


def test_first_bucket_respects_the_cap_too():
    g = bucket_graph([64] * 5)
    fused, _ = fused_compile(g, bucket_first=10_000, bucket_cap=1024)
    assert buckets(fused) == [["ar0", "ar1"], ["ar2", "ar3"]]


def test_bucket_first_zero_leaves_the_first_tensor_alone():
    g = bucket_graph([8] * 4)
    fused, _ = fused_compile(g, bucket_first=0)
    assert buckets(fused) == [["ar1", "ar2", "ar3"]]


def test_defaults_are_ddps():
    # 1 MiB first bucket: 2 x 64 Ki float64 = 1 MiB closes it; then 25 MiB of the rest
    g = bucket_graph([64 * 1024, 64 * 1024, 1024, 1024, 1024])
    fused = af.compile(g)
    assert buckets(fused) == [["ar0", "ar1"], ["ar2", "ar3", "ar4"]]
    # the first bucket takes 24 MiB more to reach 1 MiB, since that stays under the cap
    g = bucket_graph([1024] * 3 + [3 << 20, 1024, 1024])
    assert buckets(af.compile(g)) == [["ar0", "ar1", "ar2", "ar3"], ["ar4", "ar5"]]
    # but 32 MiB would take it past the cap: it closes, and 32 MiB goes alone
    g = bucket_graph([1024] * 3 + [4 << 20, 1024, 1024])
    assert buckets(af.compile(g)) == [["ar0", "ar1", "ar2"], ["ar4", "ar5"]]


def test_buckets_are_runs_of_the_topological_order():
    """In a backward pass with many all-reduces, each bucket is a run of consecutive
    fusible all-reduces of its group in gradient-ready order (``ready_order``)."""
    g = sharded_weights_graph(2)
    plain = af.compile(g, fusion=False)
    order, unit = ready_order(plain), unit_of(plain)
    ready: dict[str, list[str]] = {}  # op -> the all-reduces of that op, in gradient-ready order
    for c in sorted(plain.collectives, key=lambda c: order[unit[c.actors[0]]]):
        ready.setdefault(plain.actors[c.actors[0]].attrs["op"], []).append(c.name)
    op_of = {name: op for op, names in ready.items() for name in names}
    for first, cap, expected in [(64, 256, 3), (1 << 20, 25 << 20, 4)]:
        fused, _ = fused_compile(g, bucket_first=first, bucket_cap=cap)
        assert len(buckets(fused)) == expected
        for bucket in buckets(fused):
            run = ready[op_of[bucket[0]]]
            at = [run.index(m) for m in bucket]
            assert at == list(range(at[0], at[0] + len(at)))


def test_groups_never_mix():
    d01, d10, d012 = (dev(0), dev(1)), (dev(1), dev(0)), (dev(0), dev(1), dev(2))
    specs = [
        ("a0", (3,), "float64", "sum", d01),
        ("b0", (3,), "float32", "sum", d01),
        ("c0", (3,), "float64", "mean", d01),
        ("d0", (3,), "float64", "max", d01),
        ("e0", (3,), "float64", "sum", d10),
        ("f0", (3,), "float64", "sum", d012),
        ("g0", (3,), "int32", "mean", d01),
        ("h0", (3,), "float64", "mean", d01),  # int32 mean is float64 too, but not float64 in
        ("a1", (2,), "float64", "sum", d01),
        ("b1", (2,), "float32", "sum", d01),
        ("c1", (2,), "float64", "mean", d01),
        ("d1", (2,), "float64", "max", d01),
        ("e1", (2,), "float64", "sum", d10),
        ("f1", (2,), "float64", "sum", d012),
        ("g1", (2,), "int32", "mean", d01),
    ]
    g, names = independent_graph(specs, with_inputs=True)
    fused, plain = fused_compile(g)
    got = sorted(sorted(b) for b in buckets(fused))
    assert got == [["a0", "a1"], ["b0", "b1"], ["c0", "c1", "h0"], ["e0", "e1"], ["f0", "f1"], ["g0", "g1"]]
    assert sorted(c.name for c in fused.collectives if not c.name.startswith("fused")) == ["d0", "d1"]
    run_both(fused, plain, feeds_for(names, specs))


def test_other_collectives_are_left_alone():
    with af.Graph() as g:
        xs = [af.placeholder(f"x{k}", (4, 2), "float64", dev(k)) for k in range(2)]
        outs = [
            af.ops.all_gather(xs)[0],
            af.ops.all_gather(xs)[1],
            af.ops.reduce_scatter(xs)[0],
            af.ops.broadcast(xs[0], [dev(1)])[0],
            af.ops.all_to_all(xs)[1],
        ]
        for k, y in enumerate(outs):
            af.output(f"y{k}", y)
    fused, plain = fused_compile(g)
    assert fused == plain


# -- dependencies ------------------------------------------------------------------------


def test_dependent_all_reduces_are_not_fused():
    with af.Graph() as g:
        xs = [af.placeholder(f"x{k}", (3, 2), "float64", dev(k)) for k in range(3)]
        a = af.ops.all_reduce(xs, name="ar1")
        b = af.ops.all_reduce([af.ops.tanh(t) for t in a], name="ar2")
        c = af.ops.all_reduce([af.ops.relu(t) for t in b], name="ar3")
        for k in range(3):
            af.output(f"y{k}", c[k])
    fused, plain = fused_compile(g)
    assert buckets(fused) == []
    assert fused == plain


def test_a_dependent_tensor_starts_the_next_bucket():
    """ar0 and ar1 are independent; ar3's inputs are ready before ar2's (which reads ar0's
    result), so gradient-ready order is ar0, ar3, ar1, ar2 (ar3's tanh chain and ar1's exp
    read only the feeds, so they could start at once: the deeper first): ar2 depends on
    the open bucket, closes it and is left alone."""
    with af.Graph() as g:
        xs = [af.placeholder(f"x{k}", (3,), "float64", dev(k)) for k in range(2)]
        a0 = af.ops.all_reduce(xs, name="ar0")
        a1 = af.ops.all_reduce([af.ops.exp(x) for x in xs], name="ar1")
        chain = [af.ops.tanh(af.ops.tanh(af.ops.tanh(x))) for x in xs]
        a2 = af.ops.all_reduce([af.ops.relu(t) for t in a0], name="ar2")
        a3 = af.ops.all_reduce(chain, name="ar3")
        for name, outs in [("a0", a0), ("a1", a1), ("a2", a2), ("a3", a3)]:
            af.output(name, outs[1])
    fused, plain = fused_compile(g)
    assert buckets(fused) == [["ar0", "ar3", "ar1"]]
    run_both(fused, plain, {"x0": rng_values((3,), seed=1), "x1": rng_values((3,), seed=2)})


def test_buckets_of_two_groups_cannot_close_a_cycle():
    """A (2 devices) -> B (3 devices) and C (3 devices) -> D (2 devices): {A, D} may fuse,
    but then C reaches B through the fused A+D, so {C, B} must not."""
    d01, d012 = [dev(0), dev(1)], [dev(0), dev(1), dev(2)]
    with af.Graph() as g:
        xa = [af.placeholder(f"a{k}", (3,), "float64", d) for k, d in enumerate(d01)]
        xc = [af.placeholder(f"c{k}", (3,), "float64", d) for k, d in enumerate(d012)]
        a = af.ops.all_reduce(xa, name="A")
        c = af.ops.all_reduce(xc, name="C")
        b = af.ops.all_reduce(
            [af.ops.tanh(a[0]), af.ops.tanh(a[1]), af.ops.to_device(a[0], dev(2))], name="B"
        )
        d = af.ops.all_reduce([af.ops.exp(c[0]), af.ops.exp(c[1])], name="D")
        for k in range(2):
            af.output(f"b{k}", b[k])
            af.output(f"d{k}", d[k])
    fused, plain = fused_compile(g)
    got = [sorted(b) for b in buckets(fused)]
    assert len(got) == 1 and got[0] in (["A", "D"], ["B", "C"])
    feeds = {f"a{k}": rng_values((3,), seed=k) for k in range(2)}
    feeds |= {f"c{k}": rng_values((3,), seed=5 + k) for k in range(3)}
    run_both(fused, plain, [feeds, feeds])


def test_consumers_of_results_and_inputs_stay_wired():
    """Inputs from parameters, a tensor reduced twice, results read by several ops on
    other streams, a result nobody reads."""
    with af.Graph() as g:
        p = [af.parameter(f"p{k}", rng_values((2, 2), seed=k), dev(k)) for k in range(2)]
        xs = [af.placeholder(f"x{k}", (2, 2), "float64", dev(k)) for k in range(2)]
        r1 = af.ops.all_reduce(p, name="r1")
        r2 = af.ops.all_reduce(xs, name="r2")
        r3 = af.ops.all_reduce(xs, "mean", name="r3")
        r4 = af.ops.all_reduce([xs[0], p[1]], name="r4")
        af.output("s", af.ops.add(r1[0], af.ops.to_device(r2[1], dev(0))))
        af.output("t", af.ops.mul(r2[0], r4[0]))
        af.output("u", r3[1])
        af.output("v", r4[0])
    fused, plain = fused_compile(g)
    assert sorted(map(sorted, buckets(fused))) == [["r1", "r2", "r4"]]
    feeds = {"x0": rng_values((2, 2), seed=3), "x1": rng_values((2, 2), seed=4)}
    run_both(fused, plain, [feeds, feeds])


# -- plans -------------------------------------------------------------------------------


def test_the_pass_keeps_ids_equal_to_indexes():
    """Right after the pass (before order_collectives reorders the collectives), actor,
    register and collective ids are their indexes, and the fused actors are collectives."""
    g = sharded_weights_graph(3)
    before = order_updates(expand(g))
    after = fuse_collectives(before, 64, 256)
    assert_consistent(after, ordered=False)
    assert len(after.collectives) < len(before.collectives)
    assert len(after.registers) == len(before.registers) + 3 * len(buckets(after))
    fused_actors = sum(len(c.actors) for c in after.collectives if c.name.startswith("fused"))
    removed = len(before.actors) - len(after.actors) + fused_actors
    assert removed == 3 * sum(len(b) for b in buckets(after))
    for coll in after.collectives:
        if coll.name.startswith("fused"):
            members = [after.actors[a] for a in coll.actors]
            assert [a.device for a in members] == ["cpu:0", "cpu:1", "cpu:2"]
            assert all(a.attrs["members"] == len(a.inputs) == len(a.outputs) - 1 for a in members)


def test_fusion_off_leaves_the_plan_as_it_was():
    g = bucket_graph([8] * 6)
    plain = af.compile(g, fusion=False)
    assert plain == af.compile(g, fusion=False, bucket_first=1, bucket_cap=1)
    assert len(plain.collectives) == 6 and not buckets(plain)
    # and the pass returns a plan it can't fuse as it is
    assert fuse_collectives(plain, 0, 0) is plain


def test_fused_plan_round_trips():
    g = bucket_graph([8, 16, 24, 32])
    fused = af.compile(g, bucket_first=100, bucket_cap=500)
    assert buckets(fused) == [["ar0", "ar1"], ["ar2", "ar3"]]
    same = af.Plan.from_bytes(fused.to_bytes())
    assert same == fused
    feeds = bucket_feeds([8, 16, 24, 32])
    assert_same(af.run(same, feeds), af.run(af.compile(g, fusion=False), feeds))


def test_summary_shows_one_collective():
    g = bucket_graph([4, 5, 6])
    text = af.compile(g).summary()
    assert "1 collectives" in text
    assert "  0. fused_all_reduce_0 (all_reduce over 2 devices, 240 bytes an act)" in text  # 15 float64 each
    assert "1. " not in text.split("collective order")[1]
    assert "fused_all_reduce_0[cpu:0]/flat: float64[15]" in text
    plain = af.compile(g, fusion=False).summary()
    assert "3 collectives" in plain and "fused" not in plain


def test_flat_registers_count_in_planned_memory():
    g = bucket_graph([16, 16])
    fused, plain = fused_compile(g, quota=2)
    for d in (dev(0), dev(1)):
        assert fused.memory[d] == plain.memory[d] + 32 * F64 * 2


def test_quota_overrides_still_name_the_results():
    g = bucket_graph([4, 4])
    fused = af.compile(g, quotas={"ar0:1": 3})
    assert buckets(fused) == [["ar0", "ar1"]]
    assert {r.name: r.quota for r in fused.registers}["ar0:1"] == 3


def test_fused_kernel_runs_with_link_emulation():
    g = bucket_graph([16, 16])
    fused, plain = fused_compile(g, link_bandwidth=1e9, link_latency=1e-6)
    assert fused.link == plain.link and len(fused.collectives) == 1
    run_both(fused, plain, bucket_feeds([16, 16]))


def test_bad_bucket_sizes_are_refused():
    g = bucket_graph([4, 4])
    for kw in ({"bucket_first": -1}, {"bucket_cap": -5}, {"bucket_cap": 1.5}, {"bucket_first": True}):
        (option,) = kw
        with pytest.raises(af.CompileError, match=f"^{option}: an int >= 0"):
            af.compile(g, **kw)


# -- gradients ---------------------------------------------------------------------------


def tensor_parallel_graph(n: int):
    """Row-parallel layers: each device holds a slice of the input and of each weight; the
    partial products are all-reduced (sum) and the losses' mean over devices (mean). Its
    backward pass holds many all-reduces, mostly a chain: few of them fuse."""
    with af.Graph() as g:
        xs = [af.placeholder(f"x{k}", (4, 3), "float64", dev(k)) for k in range(n)]
        w1 = [af.parameter(f"w1_{k}", rng_values((3, 5), seed=10 + k), dev(k)) for k in range(n)]
        w2 = [af.parameter(f"w2_{k}", rng_values((5, 2), seed=20 + k), dev(k)) for k in range(n)]
        b = [af.parameter(f"b_{k}", rng_values((5,), seed=30 + k), dev(k)) for k in range(n)]
        h = af.ops.all_reduce([af.ops.matmul(x, w) for x, w in zip(xs, w1)], "sum")
        h = [af.ops.tanh(af.ops.bias_add(t, bk)) for t, bk in zip(h, b)]
        z = af.ops.all_reduce([af.ops.matmul(t, w) for t, w in zip(h, w2)], "mean")
        losses = [af.ops.sum(af.ops.mul(t, t)) for t in z]
        loss = af.ops.all_reduce(losses, "mean")[0]
        params = [*w1, *w2, *b, *xs]
        grads = af.gradients(loss, params)
        for p, d in zip(params, grads):
            af.output(f"d_{p.name}", d)
        af.output("loss", loss)
    return g


def sharded_weights_graph(n: int):
    """Each device holds a shard of every weight; the full weights are their all-reduce
    (sum, or mean for the bias) and each device runs its batch shard through them. The
    forward all-reduces read parameters only and the backward ones (one per weight)
    don't read each other: both fuse."""
    with af.Graph() as g:
        xs = [af.placeholder(f"x{k}", (4, 3), "float64", dev(k)) for k in range(n)]
        w1 = [af.parameter(f"w1_{k}", rng_values((3, 5), seed=10 + k), dev(k)) for k in range(n)]
        w2 = [af.parameter(f"w2_{k}", rng_values((5, 2), seed=20 + k), dev(k)) for k in range(n)]
        b = [af.parameter(f"b_{k}", rng_values((5,), seed=30 + k), dev(k)) for k in range(n)]
        W1, W2 = af.ops.all_reduce(w1, "sum"), af.ops.all_reduce(w2, "sum")
        B = af.ops.all_reduce(b, "mean")
        losses = []
        for k in range(n):
            h = af.ops.tanh(af.ops.bias_add(af.ops.matmul(xs[k], W1[k]), B[k]))
            z = af.ops.matmul(h, W2[k])
            losses.append(af.ops.sum(af.ops.mul(z, z)))
        loss = af.ops.all_reduce(losses, "mean")[0]
        params = [*w1, *w2, *b, *xs]
        for p, d in zip(params, af.gradients(loss, params)):
            af.output(f"d_{p.name}", d)
        af.output("loss", loss)
    return g


@pytest.mark.parametrize("graph", [tensor_parallel_graph, sharded_weights_graph])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_gradients_with_fusion_equal_gradients_without(graph, n):
    g = graph(n)
    fused, plain = fused_compile(g)
    assert buckets(fused), "the backward pass should hold fusible all-reduces"
    assert len(fused.collectives) < len(plain.collectives)
    feeds = [{f"x{k}": rng_values((4, 3), seed=100 * s + k) for k in range(n)} for s in range(3)]
    run_both(fused, plain, feeds)
    # and with small buckets: more of them, same values
    small, _ = fused_compile(g, bucket_first=64, bucket_cap=128)
    run_both(small, plain, feeds)


def test_data_parallel_training_with_fusion_matches_without():
    """Replicated parameters, one batch shard per device, gradients all-reduced (mean) per
    parameter and applied with momentum SGD: losses and trained parameters match bitwise."""
    n = 3

    def build():
        with af.Graph() as g:
            losses, grads_by_param = [], {}
            for k in range(n):
                x = af.placeholder(f"x{k}", (4, 3), "float64", dev(k))
                y = af.placeholder(f"y{k}", (4, 2), "float64", dev(k))
                w1 = af.parameter(f"w1_{k}", rng_values((3, 6), seed=1), dev(k))
                b1 = af.parameter(f"b1_{k}", rng_values((6,), seed=2), dev(k))
                w2 = af.parameter(f"w2_{k}", rng_values((6, 2), seed=3), dev(k))
                h = af.ops.tanh(af.ops.bias_add(af.ops.matmul(x, w1), b1))
                loss = af.ops.mse_loss(af.ops.matmul(h, w2), y)
                losses.append(loss)
                for p, d in zip([w1, b1, w2], af.gradients(loss, [w1, b1, w2])):
                    grads_by_param.setdefault(p.name.split("_")[0], []).append((p, d))
            for name, pairs in grads_by_param.items():
                reduced = af.ops.all_reduce([d for _, d in pairs], "mean", name=f"grad_{name}")
                for (p, _), d in zip(pairs, reduced):
                    af.optim.SGD(lr=0.1, momentum=0.9).update(p, d)
            af.output("loss", af.ops.all_reduce(losses, "mean", name="loss_mean")[0])
        return g

    g = build()
    fused, plain = fused_compile(g)
    # the loss's mean is independent of the gradients' means: one bucket, in the order the
    # tensors are ready (the loss, then the last layer's gradients first; of the first
    # layer's, which read the same output gradient, the weight's, as it is launched first)
    assert buckets(fused) == [["loss_mean", "grad_w2", "grad_w1", "grad_b1"]]
    batches = [
        {
            **{f"x{k}": rng_values((4, 3), seed=50 * s + k) for k in range(n)},
            **{f"y{k}": rng_values((4, 2), seed=50 * s + 10 + k) for k in range(n)},
        }
        for s in range(4)
    ]
    with af.Session(fused) as s1, af.Session(plain) as s2:
        l1, l2 = s1.run(batches), s2.run(batches)
        for a, b in zip(l1, l2):
            assert_same(a, b)
        assert_same(s1.parameters(), s2.parameters())
        assert l1[-1]["loss"] < l1[0]["loss"]


# -- random graphs -----------------------------------------------------------------------

SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@st.composite
def reduce_dags(draw):
    """A random DAG of all-reduces over random device groups, ops and dtypes, some reading
    (a tanh of) earlier results: a recipe of (name, devices, op, dtype, shape, sources),
    a source per device being None (a placeholder) or (all-reduce index, its device)."""
    n_dev = draw(st.integers(2, 4))
    devices = [dev(k) for k in range(n_dev)]
    groups = [
        tuple(draw(st.permutations(devices))[: draw(st.integers(2, n_dev))])
        for _ in range(draw(st.integers(1, 2)))
    ]
    nodes = []
    for j in range(draw(st.integers(3, 10))):
        devs = draw(st.sampled_from(groups))
        op = draw(st.sampled_from(["sum", "sum", "sum", "mean", "max"]))
        dtype = draw(st.sampled_from(["float64", "float64", "float64", "float32"]))
        shape = draw(st.sampled_from([(3,), (2, 3), (16,)]))
        sources = []
        for d in devs:
            earlier = [
                (i, d)
                for i, (_, ds, _, dt, sh, _) in enumerate(nodes)
                if d in ds and sh == shape and dt == dtype
            ]
            if earlier and draw(st.booleans()):
                sources.append(draw(st.sampled_from(earlier)))
            else:
                sources.append(None)
        nodes.append((f"ar{j}", tuple(devs), op, dtype, shape, tuple(sources)))
    return nodes


def build_dag(nodes):
    feeds = {}
    with af.Graph() as g:
        results = []
        for name, devs, op, dtype, shape, sources in nodes:
            ins = []
            for d, src in zip(devs, sources):
                if src is None:
                    x = af.placeholder(f"{name}_{d}", shape, dtype, d)
                    feeds[x.name] = rng_values(shape, dtype, seed=len(feeds))
                    ins.append(x)
                else:
                    i, sd = src
                    ins.append(af.ops.tanh(results[i][nodes[i][1].index(sd)]))
            outs = af.ops.all_reduce(ins, op, name=name)
            results.append(outs)
            for d, y in zip(devs, outs):
                af.output(f"{name}@{d}", y)
    return g, feeds


@settings(max_examples=50, **SETTINGS)
@given(
    nodes=reduce_dags(),
    first=st.sampled_from([0, 24, 100, 1 << 20]),
    cap=st.sampled_from([128, 512, 1 << 20, 1 << 20]),
)
def test_random_all_reduce_dags(nodes, first, cap):
    g, feeds = build_dag(nodes)
    fused, plain = fused_compile(g, bucket_first=first, bucket_cap=cap)
    by_name = {n[0]: n for n in nodes}
    event(f"{len(buckets(fused))} buckets")
    for bucket in buckets(fused):
        keys = {(by_name[m][1], by_name[m][2], by_name[m][3]) for m in bucket}
        assert len(keys) == 1 and by_name[bucket[0]][2] in ("sum", "mean")
    run_both(fused, plain, [feeds, feeds])


@settings(max_examples=20, **SETTINGS)
@given(
    recipe=gs.recipes(min_devices=2, call_fns=("identity", "double", "add_pair")),
    cap=st.sampled_from([0, 100, 1 << 20]),
)
def test_random_graphs_fused_equal_unfused(recipe, cap):
    graph, _ = gs.build(recipe)
    fused, plain = fused_compile(graph, bucket_first=cap, bucket_cap=cap)
    event(f"{len(buckets(fused))} buckets")
    names = {f.name for f in fused.feeds}
    feeds = [{k: v for k, v in f.items() if k in names} for f in gs.make_feeds(recipe, 2, 0)]
    run_both(fused, plain, feeds)
