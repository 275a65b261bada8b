"""Compiling for several ranks (no processes started): where devices go, what becomes a
send and a receive, which streams each rank gets and how their inputs are synced."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import actorflow as af
import graph_strategies as gs
from actorflow import plan_check
from actorflow.compiler.ranks import place_ranks
from actorflow.world import launched
from test_compiler import by_name, stream_name, two_device_graph


def test_devices_spread_over_ranks_in_contiguous_blocks():
    devices = ["cpu:0", "cpu:1", "cpu:2", "cpu:10"]
    assert place_ranks(devices, 2) == ({"cpu:0": 0, "cpu:1": 0, "cpu:2": 1, "cpu:10": 1}, 2)
    assert place_ranks(devices, 4)[0] == {"cpu:0": 0, "cpu:1": 1, "cpu:2": 2, "cpu:10": 3}
    assert place_ranks(devices, 1) == (dict.fromkeys(devices, 0), 1)
    assert place_ranks(["cpu:0", "cpu:1"], [["cpu:1"], [], "cpu:0"]) == ({"cpu:1": 0, "cpu:0": 2}, 3)


def test_by_default_as_many_ranks_as_the_launcher_started(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "2")
    assert launched() == (1, 2)
    plan = af.compile(two_device_graph())
    assert (plan.world, plan.ranks) == (2, {"cpu:0": 0, "cpu:1": 1})
    monkeypatch.delenv("PMI_RANK")
    monkeypatch.delenv("PMI_SIZE")
    assert af.compile(two_device_graph()).world == 1


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        (3, "3 ranks but the plan has 2 devices"),
        (0, "at least 1"),
        (True, "a number of ranks or a list"),
        ("cpu:0", "a number of ranks or a list"),
        ([["cpu:0"]], "['cpu:1'] are on no rank"),
        ([["cpu:0", "cpu:1"], ["cpu:1"]], "cpu:1 is listed on rank 0 and rank 1"),
    ],
)
def test_impossible_rank_placements_are_compile_errors(ranks, message):
    with pytest.raises(af.CompileError, match="ranks: .*" + message.replace("[", r"\[").replace("]", r"\]")):
        af.compile(two_device_graph(), ranks=ranks)


def test_a_copy_to_another_rank_becomes_a_send_and_a_receive():
    plan = af.compile(two_device_graph(), ranks=2)
    actors = by_name(plan)
    send, recv = actors["h->rank1"], actors["cp"]  # the copy itself receives
    assert (send.kind, recv.kind) == ("send", "recv")
    assert send.attrs == {"peer": 1, "tag": recv.attrs["tag"]} and recv.attrs["peer"] == 0
    assert (stream_name(plan, send), stream_name(plan, recv)) == ("rank0/comm", "rank1/comm")
    assert recv.inputs == () and plan.registers[recv.outputs[0]].name == "cp"
    # the all-reduce stays one collective, each participant on its rank's collective stream
    (coll,) = plan.collectives
    assert sorted(stream_name(plan, plan.actors[a]) for a in coll.actors) == [
        "rank0/collective",
        "rank1/collective",
    ]


def test_every_rank_gets_the_outputs():
    plan = af.compile(two_device_graph(), ranks=2)
    fetches = [o for o in plan.outputs if o.name == "y"]
    assert sorted(plan.rank_of(plan.actors[o.actor].device) for o in fetches) == [0, 1]


def test_the_summary_names_each_streams_rank():
    summary = af.compile(two_device_graph(), ranks=2).summary()
    assert "over 2 ranks" in summary.splitlines()[0]
    assert "stream rank1/comm (rank 1," in summary


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_over_ranks_every_edge_stays_on_its_rank_and_every_send_has_its_receive(data):
    recipe = data.draw(gs.recipes(min_devices=2), label="recipe")
    owner = [data.draw(st.integers(0, 2), label=f"rank of {d}") for d in recipe.devices]
    ranks = [[d for d, r in zip(recipe.devices, owner) if r == k] for k in range(3)]
    graph, _ = gs.build(recipe)
    one = af.compile(graph, quota=2, ranks=1)
    plan = af.compile(graph, quota=2, ranks=ranks)
    rank_of = {a.id: plan.rank_of(a.device) for a in plan.actors}
    assert plan.world == 3
    for reg in plan.registers:
        if not reg.is_parameter:
            assert {rank_of[c.actor] for c in reg.consumers} <= {rank_of[reg.producer]}, reg
    for actor in plan.actors:
        assert plan.streams[actor.stream].rank == rank_of[actor.id]
    sends = {a.attrs["tag"]: a for a in plan.actors if a.kind == "send"}
    recvs = {a.attrs["tag"]: a for a in plan.actors if a.kind == "recv"}
    assert sends.keys() == recvs.keys()
    for tag, send in sends.items():
        recv = recvs[tag]
        assert (send.attrs["peer"], recv.attrs["peer"]) == (rank_of[recv.id], rank_of[send.id])
        assert rank_of[send.id] != rank_of[recv.id] and send.every == recv.every
    comm = {s.id for s in plan.streams if s.kind == "comm"}
    for actor in plan.actors:
        for i in actor.inputs:
            producer = plan.registers[i.register].producer
            if producer >= 0 and (actor.stream in comm or plan.actors[producer].stream in comm):
                assert i.sync == "completion", (actor.name, i)
    check_implied_on_the_same_rank(plan, rank_of)
    # each output reaches every rank; the rest of the plan is the one-process plan's
    assert Counter(o.name for o in plan.outputs) == {o.name: 3 for o in one.outputs}
    moving = ("send", "recv", "fetch", "copy")
    assert Counter(a.kind for a in plan.actors if a.kind not in moving) == Counter(
        a.kind for a in one.actors if a.kind not in moving
    )


def test_a_participant_waits_for_its_own_inputs_whatever_other_ranks_wait_for():
    """copy_2 reaches copy_9 (through the first all-reduce), but copy_9 is read on rank 1:
    rank 0's participant of the second all-reduce must wait on copy_2 itself (a run gave
    wrong results 15 times in 40 when it did not)."""
    with af.Graph() as g:
        x = af.placeholder("x", (2, 3), "float64", "cpu:2")
        on0, on1, on3 = (af.ops.to_device(x, d) for d in ("cpu:0", "cpu:1", "cpu:3"))
        total = af.ops.all_reduce([on0, x, on1, on3], op="sum")
        later = af.ops.to_device(af.ops.relu(total[2]), "cpu:3")
        af.output("y", af.ops.all_reduce([later, on1, on0], op="mean")[2])
    plan = af.compile(g, ranks=[["cpu:0", "cpu:2"], ["cpu:1", "cpu:3"], []])
    check_implied_on_the_same_rank(plan, {a.id: plan.rank_of(a.device) for a in plan.actors})


def check_implied_on_the_same_rank(plan: af.Plan, rank_of: dict[int, int]) -> None:
    """An input left without its own wait ("implied") must be covered by a wait on its
    rank: by another input, of the actor or of a participant of its collective on the same
    rank, whose producer the input's producer reaches (a participant on another rank waits
    only for itself)."""
    unit = {a.id: a.id for a in plan.actors}
    for coll in plan.collectives:
        for a in coll.actors:
            unit[a] = coll.actors[0]
    after: dict[int, set[int]] = {u: set() for u in unit.values()}
    for reg in plan.registers:
        if not reg.is_parameter:
            after[unit[reg.producer]].update(
                unit[c.actor] for c in reg.consumers if unit[c.actor] != unit[reg.producer]
            )

    def reaches(u: int, v: int) -> bool:
        stack, seen = list(after[u]), set()
        while stack:
            w = stack.pop()
            if w == v:
                return True
            if w not in seen:
                seen.add(w)
                stack.extend(after[w])
        return False

    for actor in plan.actors:
        here = [a for a in plan.actors if unit[a.id] == unit[actor.id] and rank_of[a.id] == rank_of[actor.id]]
        waits = [
            (plan.registers[i.register].producer, i.register)
            for a in here
            for i in a.inputs
            if i.sync != "implied"
        ]
        for i in actor.inputs:
            if i.sync != "implied":
                continue
            producer = plan.registers[i.register].producer
            covered = any(
                register == i.register or reaches(unit[producer], unit[other])
                for other, register in waits
                if other >= 0
            )
            assert covered, (
                f"{actor.name} reads {plan.registers[i.register].name} implied by no wait on its rank"
            )


def test_a_dependency_through_another_rank_orders_the_collectives():
    """all_reduce b reads what went from cpu:1 to cpu:0 and back after all_reduce a: b
    depends on a only through two sends and their receives, and the collective order
    must see it (every rank runs its collectives in that order; b first hangs). The plan
    check refuses the order reversed."""
    with af.Graph() as g:
        x0 = af.placeholder("x0", (2, 2), "float64", "cpu:0")
        x1 = af.placeholder("x1", (2, 2), "float64", "cpu:1")
        a = af.ops.all_reduce([af.ops.relu(x0), af.ops.relu(x1)], name="a")
        there = af.ops.tanh(af.ops.to_device(af.ops.relu(a[1]), "cpu:0"))
        back = af.ops.to_device(there, "cpu:1")
        b = af.ops.all_reduce([af.ops.tanh(x0), back], name="b")
        af.output("y0", af.ops.add(a[0], b[0]))
        af.output("y1", b[1])
    plan = af.compile(g, ranks=[["cpu:0"], ["cpu:1"]])
    assert [c.name for c in plan.collectives] == ["a", "b"]
    reversed_order = attrs.evolve(plan, collectives=plan.collectives[::-1])
    with pytest.raises(af.DeadlockError, match="collective order"):
        plan_check.validate(reversed_order)
