"""A Runtime's life: entered once, runs only while open, unusable after a cancelled run,
shares the process's BLAS limit, and hands back the caller's own exceptions."""

import attrs
import numpy as np
import pytest
import trio
from threadpoolctl import threadpool_info

import actorflow as af
import userfns


def chain_plan(fn=userfns.identity):
    with af.Graph() as g:
        x = af.placeholder("x", (2,), "float64")
        af.output("y", af.ops.call(fn, af.ops.to_device(x, "cpu:1"), shape=(2,), dtype="float64"))
    return af.compile(g)


def blas_threads():
    return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]


async def test_run_outside_async_with_raises_instead_of_hanging():
    with trio.fail_after(10):
        rt = af.Runtime(chain_plan())
        with pytest.raises(RuntimeError, match="open Runtime"):
            await rt.run({"x": np.zeros(2)})
        async with rt:
            await rt.run({"x": np.zeros(2)})
        with pytest.raises(RuntimeError, match="open Runtime"):
            await rt.run({"x": np.zeros(2)})
        with pytest.raises(RuntimeError, match="entered once"):
            async with rt:
                pass


async def test_a_cancelled_run_makes_the_next_one_fail_not_lie():
    with trio.fail_after(10):
        userfns.arm_blocked()
        async with af.Runtime(chain_plan(userfns.blocked)) as rt:
            try:
                with trio.CancelScope() as scope:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(userfns.cancel_once_entered, scope)
                        await rt.run([{"x": np.full(2, k, np.float64)} for k in range(3)])
                assert scope.cancelled_caught
                with pytest.raises(RuntimeError, match="cancelled"):
                    await rt.run({"x": np.zeros(2)})
            finally:
                userfns.release()


def test_an_empty_plan_runs_at_once():
    with af.Graph() as g:
        af.parameter("unused", np.zeros(2))
    with pytest.warns(UserWarning, match="no outputs") as warned:
        plan = af.compile(g)
    assert warned[0].filename == __file__  # the caller's line, past compile's own frames
    assert plan.actors == ()
    assert af.run(plan) == {}
    assert af.run(plan, [{}, {}]) == [{}, {}]


@pytest.mark.parametrize("bad", [0, -1, None, "5"])
def test_stall_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match="stall_timeout"):
        af.Runtime(chain_plan(), stall_timeout=bad)


def test_blas_limit_is_shared_and_restored_when_the_last_runtime_closes():
    before = blas_threads()
    a = af.Session(chain_plan())
    b = af.Session(chain_plan(userfns.record_blas_threads))
    a.close()
    userfns.blas_threads.clear()
    b.run({"x": np.zeros(2)})
    assert userfns.blas_threads == [1]
    b.close()
    assert blas_threads() == before


def test_a_kernel_error_keeps_its_cause():
    with pytest.raises(ValueError, match="the effect") as info:
        af.run(chain_plan(userfns.fail_with_cause), {"x": np.zeros(2)})
    assert isinstance(info.value.__cause__, KeyError)


async def test_the_callers_own_exception_is_not_replaced():
    with trio.fail_after(10):
        with pytest.raises(LookupError, match="mine"):
            async with af.Runtime(chain_plan(userfns.fail)) as rt:
                try:
                    await rt.run({"x": np.zeros(2)})
                except ZeroDivisionError:
                    raise LookupError("mine") from None


def test_a_small_move_does_not_wait_behind_a_long_kernel():
    """A short kernel whose completion frees the feed's buffer, then a long one: the next
    feed (a small move, run on the compute stream's thread ahead of its other work) is
    made before the long kernel ends, not after."""
    with af.Graph() as g:
        x = af.placeholder("x", (2,), "float64", "cpu:0")
        y = af.ops.call(userfns.identity, x, shape=(2,), dtype="float64", name="short")
        z = af.ops.call(userfns.slow, y, shape=(2,), dtype="float64", name="long")
        af.output("z", z)
    plan = af.compile(g, quota=1, fuse_kernels=False)
    with af.Session(plan, trace=True) as s:
        s.run([{"x": np.zeros(2)}] * 2)
        s.recorder.clear()
        s.run([{"x": np.zeros(2)}] * 2)
        spans = {(sp.args["actor"], sp.args["iteration"]): sp for sp in s.recorder.kernels()}
    # trace iterations count across the session: this run's are 2 and 3. The second feed
    # needs the first feed's buffer back (quota 1), freed when "short" ends.
    assert spans[("x", 3)].start < spans[("long", 2)].end


async def test_a_crash_in_the_runtimes_own_tasks_is_raised_as_itself_not_as_a_cancellation():
    """A plan edited in memory (nothing checks it, unlike one read by from_bytes) whose
    parameter names a register of two buffers: the runtime allocates it one, and a driver
    fails with IndexError. That error comes out of ``async with``, and the caller's other
    tasks go on: a Cancelled leaking out would cancel the caller's own scope instead."""
    with af.Graph() as g:
        x = af.placeholder("x", (2,), "float64")
        af.output("y", af.ops.add(x, af.parameter("w", np.ones(2)), name="sum"))
    plan = af.compile(g)
    added = next(r.id for r in plan.registers if r.name == "sum")
    bad = attrs.evolve(plan, parameters=(attrs.evolve(plan.parameters[0], register=added),))
    sibling_done = trio.Event()

    async def sibling():
        await trio.sleep(0.2)
        sibling_done.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sibling)
            with pytest.raises(IndexError):
                async with af.Runtime(bad) as rt:
                    await rt.run([{"x": np.zeros(2)} for _ in range(4)])
        assert sibling_done.is_set()
