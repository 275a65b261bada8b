"""The compiler passes, one at a time, on small graphs."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import actorflow as af
import actorflow.compiler
import userfns
from actorflow.compiler import expand
from actorflow.compiler.collective_order import order_collectives
from actorflow.compiler.streams import assign_streams
from graphs import two_collective_graph


def by_name(plan: af.Plan) -> dict:
    return {a.name: a for a in plan.actors}


def reg(plan: af.Plan, name: str):
    (r,) = [r for r in plan.registers if r.name == name]
    return r


def stream_name(plan: af.Plan, actor) -> str:
    return plan.streams[actor.stream].name


def sync_of(plan: af.Plan, consumer: str, producer: str) -> str:
    """How ``consumer``'s input from ``producer`` is kept in order (``Input.sync``)."""
    actors = by_name(plan)
    c = actors[consumer]
    syncs = [i.sync for i in c.inputs if plan.registers[i.register].producer == actors[producer].id]
    assert len(syncs) == 1, f"{consumer} has {len(syncs)} inputs from {producer}"
    return syncs[0]


def two_device_graph():
    """x -> matmul(w) -> relu on cpu:0, copied to cpu:1, all-reduced, then a user call."""
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 8), dtype="float32", device="cpu:0")
        w = af.parameter("w", np.ones((8, 3), np.float32), device="cpu:0")
        h = af.ops.relu(af.ops.matmul(x, w, name="mm"), name="h")
        af.ops.tanh(h, name="dead")  # no output depends on it
        h1 = af.ops.to_device(h, "cpu:1", name="cp")
        r = af.ops.all_reduce([h, h1], op="sum", name="ar")
        z = af.ops.call(userfns.double, r[1], shape=(4, 3), dtype="float32", name="z")
        af.output("y", z)
    return g


# -- expand ------------------------------------------------------------------------------


def test_expand_makes_a_copy_actor_for_a_cross_device_edge():
    plan = expand(two_device_graph())
    cp = by_name(plan)["cp"]
    assert cp.kind == "copy"
    assert cp.op == "copy"
    assert cp.device == "cpu:1"
    (i,) = cp.inputs
    src = plan.registers[i.register]
    assert src.device == "cpu:0"
    assert plan.actors[src.producer].name == "h"
    (o,) = cp.outputs
    assert plan.registers[o].device == "cpu:1"


def test_expand_makes_one_actor_per_collective_participant():
    plan = expand(two_device_graph())
    (coll,) = plan.collectives
    assert coll.name == "ar"
    assert coll.op == "all_reduce"
    members = [plan.actors[a] for a in coll.actors]
    assert [m.name for m in members] == ["ar[cpu:0]", "ar[cpu:1]"]
    assert [m.device for m in members] == ["cpu:0", "cpu:1"]
    for m in members:
        assert m.kind == "collective"
        assert m.group == coll.id
        assert m.attrs == {"op": "sum"}
        assert len(m.inputs) == 1 and len(m.outputs) == 1
        assert plan.registers[m.inputs[0].register].device == m.device
        assert plan.registers[m.outputs[0]].device == m.device
    # non-collective actors belong to no group
    assert all(a.group == -1 for a in plan.actors if a.kind != "collective")


def test_expand_keeps_every_participant_when_one_result_is_used():
    with af.Graph() as g:
        x0 = af.placeholder("x0", shape=(2,), device="cpu:0")
        x1 = af.placeholder("x1", shape=(2,), device="cpu:1")
        x2 = af.placeholder("x2", shape=(2,), device="cpu:2")
        r = af.ops.all_gather([x0, x1, x2], name="ag")
        af.output("y", r[2])
    plan = expand(g)
    (coll,) = plan.collectives
    assert [plan.actors[a].device for a in coll.actors] == ["cpu:0", "cpu:1", "cpu:2"]
    assert {f.name for f in plan.feeds} == {"x0", "x1", "x2"}


def test_expand_broadcast_source_participates_without_an_output():
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 2), device="cpu:0")
        b = af.ops.broadcast(x, ["cpu:1", "cpu:2"], name="bc")
        af.output("y", b[1])
    plan = expand(g)
    (coll,) = plan.collectives
    members = [plan.actors[a] for a in coll.actors]
    assert [m.device for m in members] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [len(m.inputs) for m in members] == [1, 0, 0]
    assert [len(m.outputs) for m in members] == [0, 1, 1]


def test_expand_drops_dead_ops():
    plan = expand(two_device_graph())
    names = set(by_name(plan))
    assert "dead" not in names
    assert "dead" not in {r.name for r in plan.registers}
    assert names == {"x", "mm", "h", "cp", "ar[cpu:0]", "ar[cpu:1]", "z", "y"}


def test_expand_drops_dead_parameters_but_keeps_every_placeholder():
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2, 2), device="cpu:0")
        af.placeholder("unused", shape=(2, 2), device="cpu:0")
        af.parameter("unused_w", np.zeros((2, 2), np.float32), device="cpu:0")
        af.output("y", af.ops.relu(x))
    plan = expand(g)
    assert [f.name for f in plan.feeds] == ["x", "unused"]
    assert plan.parameters == ()
    assert {r.name for r in plan.registers} == {"x", "unused", "relu_3"}


def test_an_unused_placeholder_is_still_fed():
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2, 2), device="cpu:0")
        af.placeholder("unused", shape=(2, 2), device="cpu:1")
        af.output("y", af.ops.relu(x))
    xs = np.array([[-1, 2], [3, -4]], np.float32)
    outs = af.run(af.compile(g), [{"x": xs, "unused": xs}] * 3)
    for out in outs:
        np.testing.assert_array_equal(out["y"], np.maximum(xs, 0))


def test_expand_parameters_become_registers_with_no_producer():
    plan = expand(two_device_graph())
    (p,) = plan.parameters
    assert p.name == "w"
    np.testing.assert_array_equal(p.value, np.ones((8, 3), np.float32))
    r = plan.registers[p.register]
    assert r.name == "w"
    assert r.producer == -1
    assert r.is_parameter
    assert (r.shape, r.dtype, r.device) == ((8, 3), "float32", "cpu:0")
    assert "w" not in by_name(plan)  # no actor for a parameter
    mm = by_name(plan)["mm"]
    assert [c.actor for c in r.consumers] == [mm.id]
    assert mm.inputs[r.consumers[0].slot].register == r.id


def test_expand_feeds_fetches_and_consumers():
    plan = expand(two_device_graph())
    actors = by_name(plan)
    (feed,) = plan.feeds
    assert (feed.name, feed.shape, feed.dtype) == ("x", (4, 8), "float32")
    assert plan.actors[feed.actor].kind == "feed"
    (out,) = plan.outputs
    assert out.name == "y"
    fetch = plan.actors[out.actor]
    assert fetch.kind == "fetch"
    assert fetch.device == "cpu:1"
    assert fetch.outputs == ()
    # every register knows its consumers, and they point back at it
    for r in plan.registers:
        for c in r.consumers:
            assert plan.actors[c.actor].inputs[c.slot].register == r.id
    h = reg(plan, "h")
    assert {plan.actors[c.actor].name for c in h.consumers} == {"cp", "ar[cpu:0]"}
    assert actors["z"].attrs["fn"] is userfns.double
    # the expanded plan has no streams yet
    assert plan.streams == ()
    assert all(a.stream == -1 for a in plan.actors)


# -- assign_streams -------------------------------------------------------------------------


def test_assign_streams_by_kind_and_device():
    plan = af.compile(two_device_graph(), fuse_kernels=False)
    actors = by_name(plan)
    assert stream_name(plan, actors["mm"]) == "cpu:0/compute"
    assert stream_name(plan, actors["h"]) == "cpu:0/compute"
    assert stream_name(plan, actors["z"]) == "cpu:1/compute"
    assert stream_name(plan, actors["x"]) == "cpu:0/copy"  # feed
    assert stream_name(plan, actors["cp"]) == "cpu:1/copy"  # copy: the destination's
    assert stream_name(plan, actors["y"]) == "cpu:1/copy"  # fetch
    assert stream_name(plan, actors["ar[cpu:0]"]) == "rank0/collective"
    assert stream_name(plan, actors["ar[cpu:1]"]) == "rank0/collective"


def test_assign_streams_makes_one_stream_per_kind_and_device():
    plan = af.compile(two_device_graph())
    names = [s.name for s in plan.streams]
    assert sorted(names) == sorted(
        ["cpu:0/compute", "cpu:0/copy", "cpu:1/compute", "cpu:1/copy", "rank0/collective"]
    )
    assert [s.id for s in plan.streams] == list(range(len(plan.streams)))
    kinds = {s.name: (s.kind, s.device) for s in plan.streams}
    assert kinds["cpu:0/compute"] == ("compute", "cpu:0")
    assert kinds["cpu:1/copy"] == ("copy", "cpu:1")
    assert kinds["rank0/collective"] == ("collective", "rank0")
    for a in plan.actors:
        assert plan.streams[a.stream].device in (a.device, "rank0")


def test_assign_streams_only_for_used_streams():
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2,), device="cpu:3")
        af.output("y", af.ops.exp(x))
    plan = assign_streams(expand(g))
    assert sorted(s.name for s in plan.streams) == ["cpu:3/compute", "cpu:3/copy"]


# -- insert_events -------------------------------------------------------------------------


def test_same_stream_and_parameter_inputs_sync_by_stream_order():
    plan = af.compile(two_device_graph(), fuse_kernels=False)
    for a in plan.actors:
        for i in a.inputs:
            r = plan.registers[i.register]
            if r.is_parameter or plan.actors[r.producer].stream == a.stream:
                assert i.sync == "stream", (a.name, r.name)
                assert not i.event
            else:
                assert i.sync in ("event", "implied", "completion"), (a.name, r.name)
    assert sync_of(plan, "h", "mm") == "stream"  # both on cpu:0/compute
    assert by_name(plan)["mm"].inputs[1].sync == "stream"  # the parameter w


def test_events_only_across_streams():
    plan = af.compile(two_device_graph())
    assert len(plan.events) > 0
    for p, c in plan.events:
        assert plan.actors[p].stream != plan.actors[c].stream
    # Plan.events lists exactly the inputs whose sync is "event"
    want = {
        (plan.registers[i.register].producer, a.id)
        for a in plan.actors
        for i in a.inputs
        if i.sync == "event"
    }
    assert set(plan.events) == want


def test_stream_fed_by_one_other_stream_waits_on_events():
    plan = af.compile(two_device_graph(), fuse_kernels=False)
    assert sync_of(plan, "mm", "x") == "event"  # cpu:0/compute is fed by cpu:0/copy only
    assert sync_of(plan, "z", "ar[cpu:1]") == "event"  # cpu:1/compute: by the collective stream only


def test_stream_fed_by_several_streams_gets_inputs_at_completion():
    plan = af.compile(two_device_graph(), fuse_kernels=False)
    # cpu:1/copy carries the copy from cpu:0/compute and the fetch from cpu:1/compute
    assert sync_of(plan, "cp", "h") == "completion"
    assert sync_of(plan, "y", "z") == "completion"


def test_the_ordered_collective_stream_waits_on_events_whatever_feeds_it():
    """Nothing queued behind a collective may run before it, so waiting costs nothing."""
    plan = af.compile(two_device_graph(), fuse_kernels=False)
    # the collective stream is fed by cpu:0/compute and cpu:1/copy; cp is a copy of h, so
    # the collective's wait on cp covers h too
    assert sync_of(plan, "ar[cpu:1]", "cp") == "event"
    assert sync_of(plan, "ar[cpu:0]", "h") == "implied"


def test_redundant_event_is_pruned_for_a_consumer_on_cpu1():
    # C on cpu:1/compute reads P (a copy from cpu:0, on cpu:1/copy) and Q = relu(P) on its
    # own stream: Q already waited on P, so C needs no event of its own on P.
    with af.Graph() as g:
        x = af.placeholder("x", shape=(3, 3), device="cpu:0")
        p = af.ops.to_device(af.ops.exp(x, name="e"), "cpu:1", name="P")
        q = af.ops.relu(p, name="Q")
        af.output("y", af.ops.add(p, q, name="C"))
    plan = af.compile(g)
    assert by_name(plan)["C"].device == "cpu:1"
    assert sync_of(plan, "Q", "P") == "event"
    assert sync_of(plan, "C", "Q") == "stream"
    assert sync_of(plan, "C", "P") == "implied"  # implied by Q
    ids = by_name(plan)
    assert (ids["P"].id, ids["C"].id) not in plan.events
    assert (ids["P"].id, ids["Q"].id) in plan.events
    out = af.run(plan, {"x": np.full((3, 3), 0.5, np.float32)})
    e = np.exp(np.float32(0.5))
    np.testing.assert_allclose(out["y"], np.full((3, 3), 2 * e), rtol=1e-6)


def test_redundant_event_is_pruned_across_devices():
    # P on cpu:0 feeds a broadcast Q to cpu:1 and an all-reduce C over (P, Q): Q waited on
    # P's event, C runs after Q on the collective stream, so C's wait on P is implied.
    with af.Graph() as g:
        x = af.placeholder("x", shape=(3, 3), device="cpu:0")
        p = af.ops.relu(x, name="P")
        q = af.ops.broadcast(p, ["cpu:1"], name="Q")
        r = af.ops.all_reduce([p, q[0]], name="C")
        af.output("y", r[1])
    plan = af.compile(g)
    assert sync_of(plan, "Q[cpu:0]", "P") == "event"
    assert sync_of(plan, "C[cpu:0]", "P") == "implied"
    assert sync_of(plan, "C[cpu:1]", "Q[cpu:1]") == "stream"
    out = af.run(plan, {"x": np.ones((3, 3), np.float32)})
    np.testing.assert_array_equal(out["y"], np.full((3, 3), 2, np.float32))


def test_independent_events_are_both_kept():
    with af.Graph() as g:
        a = af.placeholder("a", shape=(2,), device="cpu:0")
        b = af.placeholder("b", shape=(2,), device="cpu:0")
        af.output("y", af.ops.add(a, b, name="C"))
    plan = af.compile(g)
    assert sync_of(plan, "C", "a") == "event"
    assert sync_of(plan, "C", "b") == "event"


@pytest.mark.parametrize("graph", ["two_device", "two_collective", "priority"])
def test_every_implied_input_is_covered_by_another_input(graph):
    from actorflow.compiler.topology import data_edges, reachable, unit_of

    plan = af.compile(
        {"two_device": two_device_graph, "two_collective": two_collective_graph, "priority": priority_graph}[
            graph
        ]()
    )
    unit = unit_of(plan)
    edges = data_edges(plan)
    for coll_or_actor in plan.actors:
        for i in coll_or_actor.inputs:
            if i.sync != "implied":
                continue
            p = unit[plan.registers[i.register].producer]
            members = [a for a in plan.actors if unit[a.id] == unit[coll_or_actor.id]]
            others = {
                unit[plan.registers[j.register].producer]
                for m in members
                for j in m.inputs
                if not plan.registers[j.register].is_parameter
            } - {p}
            assert reachable(edges, [(p, y) for y in others])


# -- order_collectives ---------------------------------------------------------------------


def test_collective_order_follows_dependencies():
    plan = af.compile(two_collective_graph())
    assert [c.name for c in plan.collectives] == ["ar1", "ar2"]


def test_order_collectives_repairs_a_shuffled_order():
    plan = af.compile(two_collective_graph())
    shuffled = attrs.evolve(plan, collectives=plan.collectives[::-1])
    assert [c.name for c in order_collectives(shuffled).collectives] == ["ar1", "ar2"]


def test_collective_order_is_consistent_with_a_longer_chain():
    with af.Graph() as g:
        x0 = af.placeholder("x0", shape=(4,), device="cpu:0")
        x1 = af.placeholder("x1", shape=(4,), device="cpu:1")
        # an independent collective built last, and a chain c1 -> c2 -> c3
        c1 = af.ops.all_reduce([x0, x1], name="c1")
        c2 = af.ops.all_reduce([af.ops.exp(c1[0]), af.ops.exp(c1[1])], op="max", name="c2")
        c3 = af.ops.all_gather([af.ops.tanh(c2[0]), af.ops.tanh(c2[1])], name="c3")
        solo = af.ops.broadcast(af.ops.relu(x1), ["cpu:0"], name="solo")
        af.output("y", c3[0])
        af.output("s", solo[0])
    plan = af.compile(g)
    order = [c.name for c in plan.collectives]
    assert sorted(order) == ["c1", "c2", "c3", "solo"]
    assert order.index("c1") < order.index("c2") < order.index("c3")
    # and the reverse of it is repaired
    fixed = order_collectives(attrs.evolve(plan, collectives=plan.collectives[::-1]))
    order = [c.name for c in fixed.collectives]
    assert order.index("c1") < order.index("c2") < order.index("c3")


# -- plan_registers ------------------------------------------------------------------------


def test_default_quota_applies_to_every_register_but_parameters():
    plan = af.compile(two_device_graph(), fuse_kernels=False)
    for r in plan.registers:
        assert r.quota == (1 if r.is_parameter else 2)
    plan = af.compile(two_device_graph(), quota=3, fuse_kernels=False)
    assert {r.quota for r in plan.registers if not r.is_parameter} == {3}
    assert reg(plan, "w").quota == 1


def test_quota_overrides_by_name_and_by_tensor():
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 8), device="cpu:0")
        h = af.ops.relu(x, name="h")
        e = af.ops.exp(h, name="e")
        af.output("y", e)
    plan = af.compile(g, quota=2, quotas={"h": 1, e: 4})
    assert reg(plan, "x").quota == 2
    assert reg(plan, "h").quota == 1
    assert reg(plan, "e").quota == 4


def test_quota_override_of_a_collective_result():
    g = two_device_graph()
    plan = af.compile(g, quota=2, quotas={"ar:1": 3})
    assert reg(plan, "ar:1").quota == 3
    assert reg(plan, "ar:0").quota == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_default_quota_is_a_compile_error(bad):
    with pytest.raises(af.CompileError, match="quota"):
        af.compile(two_device_graph(), quota=bad)


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_override_quota_is_a_compile_error(bad):
    with pytest.raises(af.CompileError, match="'h'|h:"):
        af.compile(two_device_graph(), quotas={"h": bad})


@pytest.mark.parametrize("name", ["nope", "dead", "w"])
def test_override_of_an_unknown_tensor_is_a_compile_error(name):
    # "dead" was dropped and "w" is a parameter: neither has a register to size
    with pytest.raises(af.CompileError, match=name) as info:
        af.compile(two_device_graph(), quotas={name: 2})
    assert "h" in str(info.value)  # it lists the known names


def test_memory_per_device_is_registers_times_quota_plus_parameters():
    plan = af.compile(two_device_graph(), quota=3, quotas={"cp": 1}, fuse_kernels=False)
    f32 = 4
    # cpu:0: x (4x8) x3, mm (4x3) x3, h (4x3) x3, ar:0 (4x3) x3, w (8x3) once
    cpu0 = 32 * f32 * 3 + 12 * f32 * 3 * 3 + 24 * f32
    # cpu:1: cp (4x3) x1, ar:1 (4x3) x3, z (4x3) x3
    cpu1 = 12 * f32 * 1 + 12 * f32 * 3 * 2
    assert plan.memory == {"cpu:0": cpu0, "cpu:1": cpu1}
    for device, total in plan.memory.items():
        assert total == sum(r.nbytes * r.quota for r in plan.registers if r.device == device)


def test_memory_counts_dtype_sizes():
    with af.Graph() as g:
        x = af.placeholder("x", shape=(5,), dtype="float64", device="cpu:0")
        i = af.placeholder("i", shape=(5,), dtype="int8", device="cpu:0")
        af.output("x2", af.ops.exp(x))
        af.output("i2", af.ops.relu(i))
    plan = af.compile(g, quota=1)
    assert plan.memory == {"cpu:0": 2 * 5 * 8 + 2 * 5 * 1}


# -- priorities ---------------------------------------------------------------------------


def priority_graph(fed: bool = False):
    """after_ar needs the all-reduce, indep does not. With parameters as inputs cpu:1's
    compute stream is fed by the collective stream alone, so after_ar is launched early
    and waits on the collective's event; with placeholders (fed) the feeds come in too,
    and after_ar gets the result at the collective's completion."""
    with af.Graph() as g:
        if fed:
            x0 = af.placeholder("x0", shape=(2, 3), device="cpu:0")
            x1 = af.placeholder("x1", shape=(2, 3), device="cpu:1")
        else:
            x0 = af.parameter("x0", np.full((2, 3), -1.0, np.float32), device="cpu:0")
            x1 = af.parameter("x1", np.full((2, 3), 2.0, np.float32), device="cpu:1")
        a = af.ops.all_reduce([af.ops.relu(x0, name="r0"), af.ops.relu(x1, name="r1")], name="ar")
        c = af.ops.tanh(a[1], name="after_ar")  # waits on the collective
        d = af.ops.exp(af.ops.relu(x1, name="r2"), name="indep")  # does not
        af.output("y", af.ops.add(c, d, name="sum"))
    return g


def waits_on_collective(plan: af.Plan, actor) -> bool:
    coll = {s.id for s in plan.streams if s.kind == "collective"}
    return actor.stream not in coll and any(
        not plan.registers[i.register].is_parameter
        and plan.actors[plan.registers[i.register].producer].stream in coll
        for i in actor.inputs
    )


def test_consumer_of_a_collective_goes_after_independent_compute():
    plan = af.compile(priority_graph(), fuse_kernels=False)
    actors = by_name(plan)
    late = actors["after_ar"]
    for name in ("r1", "r2", "indep", "sum"):
        other = actors[name]
        assert other.stream == late.stream
        assert late.priority > other.priority, name


def test_compute_first_puts_a_consumer_waiting_on_a_collective_event_last():
    plan = af.compile(priority_graph())
    late = [a for a in plan.actors if waits_on_collective(plan, a)]
    assert [a.name for a in late] == ["after_ar"]
    assert [i.sync for i in late[0].inputs] == ["event"]
    others = [a for a in plan.actors if not waits_on_collective(plan, a)]
    assert min(a.priority for a in late) > max(a.priority for a in others)


def test_a_consumer_given_the_collective_result_at_completion_goes_last_too():
    """Its input arrives once the collective is done, but a replayed stream (or a GPU
    stream) waits in its place for it: compute first puts it after every other actor of
    its stream, so independent compute never waits behind it."""
    plan = af.compile(priority_graph(fed=True), fuse_kernels=False)
    after = by_name(plan)["after_ar"]
    assert [i.sync for i in after.inputs] == ["completion"]
    others = [a for a in plan.actors if a.stream == after.stream and a is not after]
    assert others and all(after.priority > a.priority for a in others)


def test_a_replayed_data_parallel_step_runs_its_backward_pass_before_its_updates():
    """With gradients all-reduced, each update reads a collective's result: the compute
    stream's program runs the whole backward pass of a step, then its updates (an update
    between backward ops held the backward pass for its all-reduce)."""
    from actorflow.runtime.program import schedule

    rng = np.random.default_rng(0)
    with af.Graph() as g:
        devices = ["cpu:0", "cpu:1"]
        x = af.placeholder("x", (8, 4), "float32", devices, af.S(0))
        h = x
        for k in range(3):
            w = af.parameter(f"w{k}", rng.standard_normal((4, 4)).astype(np.float32), devices, af.B)
            h = af.ops.tanh(af.ops.matmul(h, w))
        loss = af.ops.reduce_mean(af.ops.mul(h, h), axis=None, keepdims=False)
        af.minimize(loss, af.optim.SGD(lr=0.1))
        af.output("loss", loss)
    plan = af.compile(g, fusion=False)
    program = schedule(plan, 0)
    assert not isinstance(program, str), program
    (k,) = [k for k, s in enumerate(plan.streams) if s.name == "cpu:0/compute"]
    block, period = program.blocks[k], program.period
    last = max(e.step for e in block)  # its acts: an entry of step t, in block (last - t) / period
    acts = sorted(
        ((last - e.step) // period, j, e) for j, e in enumerate(block) if (last - e.step) % period == 0
    )
    kinds = [e.unit.actor.kind for *_, e in acts if e.unit.actor.kind != "variable"]
    assert "update" in kinds and "compute" in kinds
    first_update = kinds.index("update")
    assert set(kinds[first_update:]) == {"update"}, kinds


def test_priority_false_turns_compute_first_off():
    on = af.compile(priority_graph())
    off = af.compile(priority_graph(), priority=False)
    by_on, by_off = by_name(on), by_name(off)
    # the collective's consumer is no longer put after everything else on its stream
    late = by_off["after_ar"]
    assert any(a.priority > late.priority for a in off.actors if a.stream == late.stream and a is not late)
    # with it on, what a collective reads goes first on its stream
    collective_streams = {s.id for s in on.streams if s.kind == "collective"}
    feeders = {
        a.name
        for a in on.actors
        if any(
            on.actors[c.actor].stream in collective_streams
            for o in a.outputs
            for c in on.registers[o].consumers
        )
        and a.stream not in collective_streams
    }
    assert feeders
    for name in feeders:
        actor = by_on[name]
        others = [a for a in on.actors if a.stream == actor.stream and a.name not in feeders]
        assert all(actor.priority < a.priority for a in others)
    # and apart from those, the launch order is the same
    rest = [n for n in by_on if n != "after_ar" and n not in feeders]
    assert sorted(rest, key=lambda n: by_on[n].priority) == sorted(rest, key=lambda n: by_off[n].priority)


@pytest.mark.parametrize("priority", [True, False])
def test_priorities_are_distinct_and_deterministic(priority):
    plan = af.compile(two_device_graph(), priority=priority)
    assert sorted(a.priority for a in plan.actors) == list(range(len(plan.actors)))
    again = af.compile(two_device_graph(), priority=priority)
    assert [a.priority for a in again.actors] == [a.priority for a in plan.actors]


@pytest.mark.parametrize("priority", [True, False])
def test_plans_run_the_same_with_and_without_compute_first(priority):
    plan = af.compile(priority_graph(fed=True), priority=priority)
    x0 = np.full((2, 3), -1.0, np.float32)
    x1 = np.full((2, 3), 2.0, np.float32)
    outs = af.run(plan, [{"x0": x0, "x1": x1}] * 3)
    want = np.tanh(np.maximum(x0, 0) + np.maximum(x1, 0)) + np.exp(np.maximum(x1, 0))
    for out in outs:
        np.testing.assert_allclose(out["y"], want, rtol=1e-6)


# -- check ----------------------------------------------------------------------------------


def test_compiled_plans_pass_check():
    for g in (two_device_graph(), two_collective_graph(), priority_graph()):
        plan = af.compile(g)
        assert actorflow.compiler.check(plan) is plan


def test_reversed_collective_order_is_a_deadlock_naming_the_cycle():
    plan = af.compile(two_collective_graph())
    bad = attrs.evolve(plan, collectives=plan.collectives[::-1])
    with pytest.raises(af.DeadlockError) as info:
        actorflow.compiler.check(bad)
    message = str(info.value)
    assert isinstance(info.value, af.CompileError)
    assert "cycle" in message
    assert "collective order" in message
    assert "ar1 -(data)->" in message  # collectives are named, not their first participant
    assert "-(collective order)-> ar1" in message
    assert "r0" in message or "r1" in message


def test_check_refuses_an_actor_without_a_stream():
    plan = af.compile(two_device_graph())
    actors = list(plan.actors)
    actors[2] = attrs.evolve(actors[2], stream=-1)
    with pytest.raises(af.CompileError, match=repr(actors[2].name)):
        actorflow.compiler.check(attrs.evolve(plan, actors=tuple(actors)))


def test_check_refuses_a_zero_quota():
    plan = af.compile(two_device_graph())
    registers = list(plan.registers)
    k = next(r.id for r in registers if r.name == "h")
    registers[k] = attrs.evolve(registers[k], quota=0)
    with pytest.raises(af.CompileError, match="'h'"):
        actorflow.compiler.check(attrs.evolve(plan, registers=tuple(registers)))


def test_a_register_read_twice_is_waited_on_once():
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2, 2), device="cpu:0")
        af.output("y", af.ops.add(x, x, name="twice"))
    plan = af.compile(g)
    syncs = [i.sync for i in by_name(plan)["twice"].inputs]
    assert syncs == ["event", "implied"]
    assert len(plan.events) == 1


def test_a_copy_stream_with_feeds_gets_fetches_at_completion():
    """The host feeds that stream too: a fetch waiting on an event would hold up the next feed."""
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2, 2), device="cpu:0")
        af.output("y", af.ops.relu(x, name="r"))
    plan = af.compile(g)
    (fetch,) = [a for a in plan.actors if a.kind == "fetch"]
    assert [i.sync for i in fetch.inputs] == ["completion"]
    assert [i.sync for i in by_name(plan)["r"].inputs] == ["event"]


# -- options and the pass runner -----------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("quota", 0),
        ("quotas", {"h": 0}),
        ("priority", "yes"),
        ("link_bandwidth", 0),
        ("link_latency", -1.0),
        ("fusion", 1),
        ("fuse_kernels", None),
        ("bucket_first", -1),
        ("bucket_cap", 1.5),
        ("overlap", "no"),
        ("micro_batches", 0),
        ("stages", []),
        ("schedule", "zigzag"),
        ("ranks", 0),
        ("max_streams", 0),
        ("max_ops_per_stream", -2),
        ("max_labels", True),
        ("max_memory", 0),
        ("comm_reuse", "-1"),
    ],
)
def test_every_option_is_checked_before_any_pass(monkeypatch, option, value):
    def no_pass(*args, **kwargs):
        raise AssertionError("a pass ran before the options were checked")

    monkeypatch.setattr(actorflow.compiler, "expand", no_pass)
    with pytest.raises(af.CompileError, match=f"^{option}: "):
        af.compile(two_device_graph(), **{option: value})


def test_an_option_compile_does_not_have_is_a_compile_error():
    with pytest.raises(af.CompileError, match="compile has no option quotaa"):
        af.compile(two_device_graph(), quotaa=2)


def test_with_the_passes_flag_the_plan_is_checked_after_each_pass_and_compiles_the_same(monkeypatch):
    plain = af.compile(two_device_graph(), micro_batches=2, quota=3)
    monkeypatch.setenv("ACTORFLOW_DEBUG", "passes")
    assert af.compile(two_device_graph(), micro_batches=2, quota=3) == plain


def test_the_passes_flag_names_the_pass_that_broke_the_plan(monkeypatch):
    order_updates = actorflow.compiler.order_updates

    def forgets_a_consumer(plan):
        plan = order_updates(plan)
        read = next(r for r in plan.registers if r.consumers and not r.is_parameter)
        registers = list(plan.registers)
        registers[read.id] = attrs.evolve(read, consumers=read.consumers[1:])
        return attrs.evolve(plan, registers=tuple(registers))

    monkeypatch.setattr(actorflow.compiler, "order_updates", forgets_a_consumer)
    monkeypatch.setenv("ACTORFLOW_DEBUG", "passes")
    with pytest.raises(af.CompileError, match="^after pass order_updates: "):
        af.compile(two_device_graph())
