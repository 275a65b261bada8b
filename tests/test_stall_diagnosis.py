"""Stall diagnosis: ACTORFLOW_DEBUG=actors logs what each act attempt waits on, and a
StallError's wait-for chain ends at the actor that everything waits on."""

from __future__ import annotations

import logging
import threading

import attrs
import numpy as np
import pytest
import trio

import actorflow as af
from graphs import two_collective_graph

release = threading.Event()


def hang(a):
    """Identity that blocks until the test sets ``release`` (10 s at most), so a stalled
    stream thread ends as soon as the test has its StallError."""
    release.wait(10)
    return a


@pytest.fixture
def actor_logger():
    """The ``actorflow.actors`` logger, with its level and handlers put back afterwards."""
    logger = logging.getLogger("actorflow.actors")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def starved_plan(with_fast_consumer: bool = False) -> af.Plan:
    """x on cpu:0 -> relu 'h' -> copy 'cp' to cpu:1 -> call(hang) 'sloth'; optionally 'h' is
    also read by 'fast' on its own stream, first of its consumers."""
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2, 3), device="cpu:0")
        h = af.ops.relu(x, name="h")
        if with_fast_consumer:
            af.output("f", af.ops.relu(h, name="fast"))
        c = af.ops.to_device(h, "cpu:1", name="cp")
        af.output("y", af.ops.call(hang, c, shape=(2, 3), name="sloth"))
    return af.compile(g, quota=2, fuse_kernels=False)


async def stall_message(plan: af.Plan, feeds, order="dynamic") -> str:
    """The StallError's message; by default as the drivers diagnose it, actor by actor
    (``order="dynamic"``), which is what most tests here look at."""
    release.clear()
    with trio.fail_after(10):
        async with af.Runtime(plan, stall_timeout=0.3, order=order) as rt:
            try:
                with pytest.raises(af.StallError) as info:
                    await rt.run(feeds)
            finally:
                release.set()
    return str(info.value)


def chain_of(message: str) -> tuple[list[str], str]:
    """(the actors of the wait-for chain, what its last one waits on)."""
    (line,) = [line for line in message.splitlines() if line.startswith("wait-for chain: ")]
    chain, _, end = line.removeprefix("wait-for chain: ").partition(", ")
    return chain.split(" -> "), end


X6 = [{"x": np.ones((2, 3), np.float32)}] * 6

# -- ACTORFLOW_DEBUG=actors --------------------------------------------------------------------


def small_run() -> None:
    """x on cpu:0 -> relu 'h' -> copy to cpu:1 -> relu 'z', quota 1: every actor waits now
    on an input, now on a credit."""
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2, 3), device="cpu:0")
        h = af.ops.relu(x, name="h")
        af.output("y", af.ops.relu(af.ops.to_device(h, "cpu:1", name="cp"), name="z"))
    af.run(af.compile(g, quota=1), [{"x": np.ones((2, 3), np.float32)}] * 3)


def test_debug_actors_logs_each_act_attempt(monkeypatch, caplog, actor_logger):
    monkeypatch.setenv("ACTORFLOW_DEBUG", "actors")
    small_run()
    lines = [r.getMessage() for r in caplog.records if r.name == "actorflow.actors"]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "actorflow.actors")
    for act in range(3):
        assert f"actor h on cpu:0/compute, act {act}: acts" in lines
        assert f"actor z on cpu:1/compute, act {act}: acts" in lines
    # small moves run on their partner's thread, first: the copy is tried before 'h' acted
    assert "actor x on cpu:0/copy (run by cpu:0/compute), act 0: acts" in lines
    assert (
        "actor cp on cpu:1/copy (run by cpu:0/compute), act 0: waits: input 'h' from 'h' not ready" in lines
    )
    assert "actor y on cpu:1/copy (run by cpu:1/compute), act 0: waits: input 'z' from 'z' not ready" in lines
    # h's last act frees x's buffer: x is tried once more (before cp's last act, which
    # the end of the run waits for; lines of later tries may come after the run ended)
    assert "actor x on cpu:0/copy (run by cpu:0/compute), act 3: has no acts left in this run" in lines


def test_no_debug_lines_without_the_flag(monkeypatch, caplog, actor_logger):
    monkeypatch.delenv("ACTORFLOW_DEBUG", raising=False)
    caplog.set_level(logging.DEBUG, logger="actorflow.actors")
    small_run()
    assert [r for r in caplog.records if r.name == "actorflow.actors"] == []


def test_debug_lines_reach_stderr_when_logging_is_not_configured(monkeypatch, capsys, actor_logger):
    monkeypatch.setenv("ACTORFLOW_DEBUG", "actors")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in a script without logging setup
    actor_logger.setLevel(logging.NOTSET)
    actor_logger.handlers[:] = []
    small_run()
    assert "actor h on cpu:0/compute, act 0: acts" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["actor", "actors,verbose"])
def test_unknown_debug_flag_is_a_value_error_naming_the_accepted_ones(monkeypatch, value):
    monkeypatch.setenv("ACTORFLOW_DEBUG", value)
    with pytest.raises(ValueError, match="unknown flag .*; the accepted flags are actors"):
        af.Runtime(starved_plan())


# -- wait-for chains -----------------------------------------------------------------------------


async def test_chain_of_a_hanging_kernel_ends_at_it():
    message = await stall_message(starved_plan(), X6)
    chain, end = chain_of(message)
    assert chain == ["h", "cp", "sloth"]
    assert end == "which waits on nothing: its stream cpu:1/compute is running 'sloth' (iteration 0)"
    assert "  h on cpu:0/compute, iteration 4: no credit on output 'h' (all 2 held by 'cp')" in message


async def test_a_replayed_stall_chain_ends_at_the_hanging_kernel():
    """Replayed, the chain goes from stream to stream: each one's next act, waiting on
    another stream's, to the kernel everything waits on."""
    message = await stall_message(starved_plan(), X6, order="replay")
    assert "Streams, replaying their order:" in message
    assert "  stream cpu:1/compute is still running 'sloth' (act 0)" in message
    chain, end = chain_of(message)
    assert chain[-1] == "sloth" and len(chain) >= 2
    assert end == "which waits on nothing: its stream cpu:1/compute is running 'sloth' (act 0)"


async def test_credit_starvation_chain_passes_through_the_consumer_holding_the_credit():
    # 'h' lacks credit; 'fast' (same stream) freed its buffers at launch, 'cp' holds them
    # ready but untaken, since it lacks credit itself, held by 'sloth'.
    message = await stall_message(starved_plan(with_fast_consumer=True), X6)
    assert (
        "  h on cpu:0/compute, iteration 4: no credit on output 'h' (all 2 held by 'fast', 'cp')" in message
    )
    assert "  cp on cpu:1/copy, iteration 2: no credit on output 'cp' (all 2 held by 'sloth')" in message
    chain, end = chain_of(message)
    assert chain == ["h", "cp", "sloth"]
    assert end.startswith("which waits on nothing: its stream cpu:1/compute is running 'sloth'")


async def test_chain_of_a_hang_in_the_only_iteration_goes_from_the_fetch_to_it():
    message = await stall_message(starved_plan(), X6[:1])
    assert chain_of(message) == (
        ["y", "sloth"],
        "which waits on nothing: its stream cpu:1/compute is running 'sloth' (iteration 0)",
    )


@pytest.mark.usefixtures("collectives_in_order")
async def test_chain_of_a_collective_out_of_order_ends_at_the_blocked_collective(
    monkeypatch, caplog, actor_logger
):
    monkeypatch.setenv("ACTORFLOW_DEBUG", "actors")
    plan = af.compile(two_collective_graph())
    bad = attrs.evolve(plan, collectives=plan.collectives[::-1])  # check() would refuse it
    feeds = {"x0": np.ones((2, 3), np.float32), "x1": np.ones((2, 3), np.float32)}
    message = await stall_message(bad, feeds)
    chain, end = chain_of(message)
    assert chain[-1] in ("ar1[cpu:0]", "ar1[cpu:1]")
    assert f"  {chain[0]} on " in message
    assert end == (
        "which waits on nothing: it can act, but its stream rank0/collective launches "
        "collectives in plan order and 'ar2' comes first"
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "actorflow.actors"]
    assert (
        "actor ar1 on rank0/collective, act 0: waits for its turn: 'ar2' is next in collective order" in lines
    )
    assert (
        "actor ar2 on rank0/collective, act 0: waits: ar2[cpu:0]: input 'r0' from 'r0' not ready; "
        "ar2[cpu:1]: input 'r1' from 'r1' not ready"
    ) in lines


def hang_kernel(ins: list, outs: list) -> None:
    release.wait(10)


async def test_chain_with_every_act_launched_starts_at_the_running_kernel():
    # a training step with no outputs: once its update hangs, no actor is left to act
    with af.Graph() as g:
        x = af.placeholder("x", (8, 3), "float64", "cpu:0")
        w = af.parameter("w", np.ones((3, 2)), "cpu:0")
        af.minimize(af.ops.relu(af.ops.matmul(x, w)), af.optim.SGD(lr=0.1))
    plan = af.compile(g)
    hung = attrs.evolve(
        plan,
        actors=tuple(
            attrs.evolve(a, kernel=hang_kernel, attrs={}) if a.kind == "update" else a for a in plan.actors
        ),
    )
    message = await stall_message(hung, {"x": np.ones((8, 3))})
    assert "Waiting actors:\n  stream" in message  # none
    assert chain_of(message) == (
        ["w.sgd_update"],
        "which waits on nothing: its stream cpu:0/compute is running 'w.sgd_update' (iteration 0)",
    )


def test_a_stall_behind_a_reused_subgraph_ends_at_the_kernel_everything_waits_on():
    """The chain passes a reused communication subgraph, whose acts count its calls."""
    devices = ["cpu:0", "cpu:1"]
    with af.Graph() as g:
        xs = [af.placeholder(f"x[{d}]", (2, 3), "float64", d) for d in devices]
        reduced = [af.ops.all_reduce([af.ops.relu(x) for x in xs], op="sum")[0] for _ in range(3)]
        # the last built all-reduce is the subgraph's first call: of collectives whose
        # inputs could be made at once, the deeper goes first (``topology.ready_order``)
        slow = af.ops.call(hang, reduced[2], shape=(2, 3), dtype="float64", name="sloth")
        af.output("y", af.ops.add(slow, af.ops.add(reduced[1], reduced[0])))
    plan = af.compile(g, max_ops_per_stream=1, fusion=False, comm_reuse=-1)
    assert plan.labels == 4
    message = trio.run(stall_message, plan, {f"x[{d}]": np.ones((2, 3)) for d in devices})
    assert message.splitlines()[-1].startswith("wait-for chain: comm_subgraph_0[cpu:0] -> sloth,"), message
    assert "comm_subgraph_0[cpu:0] on rank0/collective, iteration 0, call 2: no credit" in message
