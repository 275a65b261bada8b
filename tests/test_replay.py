"""Replay (``runtime.program``, ``runtime.replay``): the order a simulated run decided, replayed by each
stream, computes what the drivers compute, on the plans it takes, for runs of any length."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actorflow as af
import graph_strategies as gs
import userfns
from actorflow.config import load_config
from actorflow.runtime import program
from actorflow.runtime.program import Program, replayable, schedule
from actorflow.runtime.replay import Replay
from actorflow.runtime.virtual import simulate
from actorflow.runtime.wiring import wire
from actorflow.training.runner import compile_config

REPO = Path(__file__).resolve().parent.parent


def chain(devices: int, quota: int) -> af.Plan:
    with af.Graph() as g:
        h = af.placeholder("x", (3,), "float64", "cpu:0")
        for d in range(devices):
            h = af.ops.to_device(h, f"cpu:{d}") if d else h
            h = af.ops.add(af.ops.relu(h), h)
        af.output("y", h)
    return af.compile(g, quota=quota, fuse_kernels=False)


def training(schedule_: str, micro_batches: int, quota: int = 2) -> tuple[gs.TrainRecipe, af.Plan]:
    recipe = gs.TrainRecipe(
        stages=("cpu:0", "cpu:1"),
        layer_stage=(0, 0, 1),
        widths=(5, 7, 6, 3),
        bias=(True, False, True),
        activations=("tanh", "relu", "none"),
        loss="mse",
        optimizer=("sgd", 0.05, 0.9),
        micro_batches=micro_batches,
        rows=4,
        steps=3,
        schedule=schedule_,
        seed=7,
    )
    plan = af.compile(
        gs.build_training(recipe),
        quota=quota,
        micro_batches=micro_batches,
        stages=list(recipe.stages),
        schedule=schedule_,
    )
    return recipe, plan


def run(plan: af.Plan, feeds: list[dict], order: str, runs: int = 1):
    with af.Session(plan, order=order, stall_timeout=20) as s:
        outs = [s.run(feeds) for _ in range(runs)]
        return outs, s.parameters(), s.register_stats()


def replays_as_the_drivers_run(plan: af.Plan, feeds: list[dict], runs: int = 1) -> dict:
    """Asserts each of ``runs`` replayed runs of ``feeds`` outputs the "y" a run on the
    drivers does; the replayed session's register stats."""
    replayed, _, stats = run(plan, feeds, "replay", runs=runs)
    dynamic, _, _ = run(plan, feeds, "dynamic")
    for outs in replayed:
        for got, want in zip(outs, dynamic[0]):
            np.testing.assert_array_equal(got["y"], want["y"])
    return stats


@pytest.mark.parametrize("quota", [1, 2, 3, 8])
@pytest.mark.parametrize("iterations", [1, 2, 7])
def test_a_replayed_chain_computes_what_the_drivers_compute(quota, iterations):
    plan = chain(3, quota)
    assert isinstance(schedule(plan, 0), Program)
    feeds = [{"x": np.arange(3.0) - k} for k in range(iterations)]
    stats = replays_as_the_drivers_run(plan, feeds, runs=3)
    assert all(s["max_held"] <= s["quota"] for s in stats.values())
    assert max(s["max_held"] for s in stats.values()) >= 1


@pytest.mark.parametrize("schedule_", ["gpipe", "1f1b", "zb1"])
@pytest.mark.parametrize("micro_batches", [1, 2, 4])
def test_replayed_pipelined_training_equals_the_drivers_bit_for_bit(schedule_, micro_batches):
    recipe, plan = training(schedule_, micro_batches)
    assert replayable(plan) is None and isinstance(schedule(plan, 0), Program)
    feeds = gs.micro_batch_feeds(recipe, gs.training_batches(recipe))
    replayed, params, stats = run(plan, feeds, "replay")
    dynamic, want, _ = run(plan, feeds, "dynamic")
    assert [float(o["loss"]) for o in replayed[0]] == [float(o["loss"]) for o in dynamic[0]]
    for name, value in want.items():
        np.testing.assert_array_equal(params[name], value, err_msg=name)
    assert all(s["max_held"] <= s["quota"] for s in stats.values())


def test_each_stream_runs_its_acts_in_the_simulated_order():
    """The trace of a replayed run shows every stream's kernels in its block's order,
    block after block, the acts of steps outside the run skipped."""
    recipe, plan = training("1f1b", 4)
    program = schedule(plan, 0)
    assert isinstance(program, Program)
    feeds = gs.micro_batch_feeds(recipe, gs.training_batches(recipe))
    steps = len(feeds) // plan.micro_batches
    with af.Session(plan, trace=True) as s:
        s.run(feeds)
        spans = s.recorder.kernels()
    stream_of = {e.unit.name: k for k, block in enumerate(program.blocks) for e in block}
    ran: dict[int, list] = {}
    for span in sorted(spans, key=lambda sp: sp.start):
        ran.setdefault(stream_of[span.name], []).append((span.name, span.args["act"]))
    for k, block in enumerate(program.blocks):
        want = [
            (
                e.unit.name,
                (e.step + b * program.period) * e.unit.members[0].acts(plan.micro_batches) + e.offset,
            )
            for b in program.span(k, steps)
            for e in block
            if 0 <= e.step + b * program.period < steps
        ]
        assert ran.get(k, []) == want


@pytest.mark.usefixtures("collectives_in_order")
def test_a_plan_that_can_stall_is_left_to_the_drivers_which_say_where():
    with af.Graph() as g:
        xs = [af.placeholder(f"x{d}", (2,), "float32", f"cpu:{d}") for d in range(2)]
        a = af.ops.all_reduce([af.ops.relu(x) for x in xs], name="ar1")
        b = af.ops.all_reduce([af.ops.relu(y) for y in a], name="ar2")
        for d, y in enumerate(b):
            af.output(f"y{d}", y)
    plan = af.compile(g)
    bad = attrs.evolve(plan, collectives=plan.collectives[::-1])
    assert simulate(wire(bad, 0, allocate=False), bad.micro_batches, 1) is None
    assert schedule(bad, 0) == "it can stall (its simulation did)"
    feeds = {"x0": np.ones(2, np.float32), "x1": np.ones(2, np.float32)}
    with af.Session(bad, stall_timeout=0.3) as s:
        assert s.ordered_by == "dynamic: it can stall (its simulation did)"
        with pytest.raises(af.StallError, match="Waiting actors"):
            s.run(feeds)


@pytest.mark.parametrize(("micro_batches", "period"), [(1, 4), (2, 2), (3, 4), (4, 1), (6, 2)])
def test_a_replayed_block_is_as_many_steps_as_bring_every_buffer_round(micro_batches, period):
    """At quota 4, each micro-batch takes the next buffer of every register: at m
    micro-batches a step, they come round every 4 / gcd(4, m) steps, which the block
    spans; replayed so, 7 steps give what the drivers give."""
    with af.Graph() as g:
        h = af.placeholder("x", (12, 3), "float64", "cpu:0")
        h = af.ops.to_device(af.ops.add(af.ops.relu(h), h), "cpu:1")
        af.output("y", af.ops.relu(h))
    plan = af.compile(g, quota=4, micro_batches=micro_batches, fuse_kernels=False)
    got = schedule(plan, 0)
    assert isinstance(got, Program) and got.period == period
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((12, 3))} for _ in range(7 * micro_batches)]
    stats = replays_as_the_drivers_run(plan, feeds)
    assert all(s["max_held"] <= s["quota"] for s in stats.values())


def trained_over_two_devices() -> af.Plan:
    """A parameter's product, sent to a second device and summed, trained by SGD: its order
    settles a step later than a chain's."""
    with af.Graph() as g:
        x = af.placeholder("x", (4, 3), "float64", "cpu:0")
        w = af.parameter("w", np.linspace(-1, 1, 9).reshape(3, 3), "cpu:0")
        loss = af.ops.sum(af.ops.to_device(af.ops.relu(af.ops.matmul(x, w)), "cpu:1"))
        af.minimize(loss, af.optim.SGD(lr=0.1))
        af.output("y", loss)
    return af.compile(g)


@pytest.mark.parametrize(
    ("make", "lead", "feed"),
    [
        (lambda: chain(2, 2), 2, lambda rng: {"x": rng.standard_normal(3)}),
        (lambda: chain(2, 8), 2, lambda rng: {"x": rng.standard_normal(3)}),
        (trained_over_two_devices, 3, lambda rng: {"x": rng.standard_normal((4, 3))}),
    ],
    ids=["chain at quota 2", "chain at quota 8", "trained over two devices"],
)
def test_a_schedule_simulates_until_its_order_repeats(monkeypatch, make, lead, feed):
    """One simulation, checked as it goes: it ends a step past the first blocks that
    repeat, ``lead`` steps in on its slowest stream (a chain at quota 8 settles 2 steps
    in, once no end of the simulation comes 2 steps after its blocks); the program
    replays as the drivers run."""
    plan = make()
    ran: list = []
    real = program.simulate
    monkeypatch.setattr(program, "simulate", lambda *a, **k: ran.append(real(*a, **k)) or ran[-1])
    got = schedule(plan, 0)
    assert isinstance(got, Program) and len(ran) == 1
    steps = min(len(acts) // sum(e.step == 0 for e in acts) for acts in ran[0] if acts)
    assert steps == lead + 4 * got.period + 1
    rng = np.random.default_rng(0)
    replays_as_the_drivers_run(plan, [feed(rng) for _ in range(11)])


def test_what_is_not_replayed_and_why(monkeypatch):
    plan = chain(2, 2)
    assert replayable(plan) is None
    with af.Session(plan) as s:
        assert s.ordered_by == "replay"
    with af.Session(plan, order="dynamic") as s:
        assert s.ordered_by == "dynamic: order='dynamic' was asked for"
    assert schedule(chain(2, 17), 0) == "its quotas and phases repeat every 17 steps, more than 16"
    monkeypatch.setattr(program, "MAX_SIMULATED_ACTS", 10)
    assert schedule(plan, 0) == "simulating it would take over 10 acts"
    assert (
        replayable(attrs.evolve(plan, overlap=False))
        == "collectives hold their compute streams (overlap off)"
    )
    with pytest.raises(ValueError, match="order is 'replay' or 'dynamic'"):
        af.Session(plan, order="fast")


def test_a_failing_kernel_in_a_replayed_run_names_its_act_and_stops_every_stream():
    with af.Graph() as g:
        x = af.placeholder("x", (2,), "float64", "cpu:0")
        h = af.ops.to_device(af.ops.relu(x), "cpu:1")
        af.output("y", af.ops.call(userfns.fail_on_five, h, shape=(2,), dtype="float64", name="picky"))
    plan = af.compile(g, fuse_kernels=False)
    before = set(threading.enumerate())
    feeds = [{"x": np.ones(2)}] * 3 + [{"x": np.full(2, 5.0)}]
    with pytest.raises(ValueError) as info:
        af.run(plan, feeds)
    assert "actor 'picky'" in "".join(getattr(info.value, "__notes__", []))
    assert "at iteration 3 of this run" in "".join(getattr(info.value, "__notes__", []))
    left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == []


@pytest.mark.parametrize(("config", "world"), [("default", 2), ("2x2", 4), ("parameter_server", 4)])
def test_over_ranks_a_rank_waits_on_each_act_it_needs_of_its_own_streams(config, world):
    """Each rank keeps its own streams' programs, and they cover every dependency the
    simulation recorded among its acts (``assert_rank_programs_cover``)."""
    plan = compile_config(load_config(str(REPO / "configs" / f"{config}.yaml")), ranks=world)
    assert_rank_programs_cover(plan)


def test_a_rank_whose_stream_lags_the_simulated_ones_is_checked_again_later(monkeypatch):
    """A rank's stream gathers several simulated streams' acts, so it may not have run
    past the blocks when they all have: that check waits for more acts instead of
    finding no repetition, and the program is the one found without the lag."""
    plan = compile_config(load_config(str(REPO / "configs" / "2x2.yaml")), ranks=4)
    want = schedule(plan, 1)
    assert isinstance(want, Program)
    kept = program._kept
    lagged = []

    def lagging(landing, ran):
        views = kept(landing, ran)
        if not lagged:  # the first check: each rank's streams two steps short
            lagged.append(True)
            return [
                ([acts[: len(acts) - 2 * n] for acts, n in zip(streams, counts)], counts)
                for streams, counts in views
            ]
        return views

    monkeypatch.setattr(program, "_kept", lagging)
    got = schedule(plan, 1)
    assert lagged and isinstance(got, Program)
    assert [[(e.unit.id, e.step) for e in block] for block in got.blocks] == [
        [(e.unit.id, e.step) for e in block] for block in want.blocks
    ]


def test_a_fetch_of_what_came_from_another_rank_runs_on_its_devices_compute_stream():
    """Over ranks, rank 0 fetches the loss rank 1 sent it: on cpu:0's compute thread (which
    rides the receive), not a copy thread of its own woken for each micro-batch."""
    plan = compile_config(load_config(str(REPO / "configs" / "default.yaml")), ranks=2)
    wiring = wire(plan, 0, allocate=False)
    (fetch,) = [u for u in wiring.units if u.name == "loss@rank0"]
    assert plan.streams[fetch.stream].name == "cpu:0/compute"
    assert [len(s.units) for s in wiring.streams if s.stream.kind == "copy"] == [0]


def test_a_collective_stream_is_ready_once_what_it_waits_for_is_reached_before_it_wakes():
    """``Replay.collective_ready``, which a rider reads before it waits in MPI: a collective
    stream between runs is not; one running, or whose wait is reached (on another
    stream's count, or on its own communication instruction's end), is."""
    replay = object.__new__(Replay)
    replay.counts, replay.comm, replay.ended = [4, 0, 7], 2, {9}

    def ready(idle: bool, waiting: tuple[int, int] | None) -> bool:
        replay.collective_streams = [SimpleNamespace(idle=idle, waiting=waiting)]
        return replay.collective_ready()

    assert not ready(True, None)
    assert ready(False, None)
    assert not ready(False, (0, 5)) and ready(False, (0, 4))
    assert not ready(False, (2, 9)) and ready(False, (2, 10))  # instruction 9 ended, 8 did not


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_plans_over_random_ranks_wait_on_each_act_they_need(data):
    """The same over random graphs and pipelined trainings, their devices on 2 or 3 ranks."""
    if data.draw(st.booleans(), label="training"):
        recipe = data.draw(gs.training_recipes(max_stages=3), label="training recipe")
        devices, stages = recipe.stages, list(recipe.stages)
        graph = gs.build_training(recipe)
        options = {"micro_batches": recipe.micro_batches, "stages": stages, "schedule": recipe.schedule}
    else:
        recipe = data.draw(
            gs.recipes(min_devices=2, call_fns=("identity", "double", "add_pair")), label="recipe"
        )
        devices, (graph, _), options = recipe.devices, gs.build(recipe), {}
    world = data.draw(st.integers(2, 3), label="world")
    placement = data.draw(gs.placements(devices, world), label="ranks")
    quota = data.draw(st.integers(1, 3), label="quota")
    plan = af.compile(graph, quota=quota, ranks=placement, **options)
    assert_rank_programs_cover(plan)


def test_ranks_agree_to_replay_where_one_rank_would_wait_further_back_than_checked():
    """Hypothesis found it: rank 0's program was fine, rank 1's waited further back than
    the repetition was checked, so rank 0 alone replayed. Every rank now checks every
    rank's program, and the whole plan's (as ``actorflow simulate`` predicts it)."""
    with af.Graph() as g:
        x0 = af.placeholder("x0", shape=(2, 2), dtype="float64", device="cpu:3")
        af.placeholder("x1", shape=(2, 2), dtype="float64", device="cpu:0")
        _, on3 = af.ops.all_reduce([af.ops.to_device(x0, "cpu:0"), x0], op="sum")
        h = af.ops.relu(on3)
        af.ops.relu(h)
        first, second = af.ops.split(h, [1, 1], axis=0)
        af.output("out0", second)
        af.output("out1", first)
    plan = af.compile(g, quota=3, ranks=[["cpu:0", "cpu:1", "cpu:2"], ["cpu:3"]])
    answers = [schedule(plan, rank) for rank in (None, 0, 1)]
    assert len({isinstance(a, Program) for a in answers}) == 1, answers
    assert_rank_programs_cover(plan)


def assert_rank_programs_cover(plan: af.Plan) -> None:
    """Each rank's program waits only on its own streams, and covers every dependency the
    simulation recorded among its acts: on a stream whose acts end in order, a wait on a
    later act covers an earlier one; on a communication stream, whose sends and receives
    end in any order, each act waited on has a wait of its own. The collectives over
    ranks come in the same order on every rank that runs them. A plan the replay does
    not take is left alone."""
    orders: dict[tuple, list[list[str]]] = {}
    for rank in range(plan.world):
        program = schedule(plan, rank)
        if not isinstance(program, Program):
            assert rank == 0, f"rank {rank} would not replay ({program}), rank 0 would"
            return
        streams = [s for s in plan.streams if s.rank == rank]
        assert len(program.blocks) == len(streams)
        period, sizes = program.period, [len(block) for block in program.blocks]
        where = {
            (e.unit.id, e.offset, e.step % period): (k, j, e.step)
            for k, block in enumerate(program.blocks)
            for j, e in enumerate(block)
        }
        for k, block in enumerate(program.blocks):
            for j, entry in enumerate(block):
                waits = program.waits[k][j]
                assert all(0 <= s < len(streams) for s, _ in waits)
                for dep in entry.deps:
                    if (dep.unit.id, dep.offset, dep.step % period) not in where:
                        continue  # an act of another rank: MPI carries it
                    s, i, step = where[(dep.unit.id, dep.offset, dep.step % period)]
                    c = i + (dep.step - step) // period * sizes[s] + 1
                    if streams[s].kind == "comm":
                        assert (s, c) in waits, (streams[k].name, entry.unit.name, dep.unit.name)
                    elif s != k:
                        assert any(w == s and n >= c for w, n in waits), (entry.unit.name, dep.unit.name)
        for k, stream in enumerate(streams):
            if stream.kind == "collective":
                names = [e.unit.name for e in program.blocks[k]]
                orders.setdefault((stream.group, stream.channel), []).append(names)
    for runs in orders.values():
        assert all(names == runs[0] for names in runs)
