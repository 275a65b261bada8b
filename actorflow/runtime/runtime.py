"""The Runtime: runs a Plan on this rank's devices, inside the caller's trio loop,
iteration after iteration.

Opening it wires the Plan (``wiring``: every register buffer allocated once, each
actor's protocol state and routing) and starts one thread per stream, which runs that
stream's driver (``driver``: its actors' message loop) and kernels. Then it serves
``run`` calls: trio only starts a run, waits for its end, and hears of failures (a
``Session``'s run skips even that: ``run_from_thread``). Any
failure (a kernel's exception, a stall, a cancelled run) stops the streams and is
re-raised from ``run`` as the original exception, with a note naming the actor, stream
and iteration; the Runtime can't run again after it. A kernel that never returns can't
be stopped: its thread is left behind, with a warning. Beside the hot path, and off it
unless asked for: the stall watchdog (``stall``), traced spans (``spans``) and the
actor log (``debug``).

A Plan over several ranks (``Plan.world``) runs one Runtime per rank, each on its own
devices' actors, with the ranks' transport (``transport``) for what crosses them. A
failure on one rank stops every rank: the others raise a ``RankError`` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sys
import threading
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any, Literal

import numpy as np
import trio

from ..arrays import copy_into, to_host
from ..collector import full_collections_paused
from ..debug_flags import debug_flags
from ..errors import KernelError, RankError, RankLost
from ..plan import Plan
from ..trace.recorder import TRACE_LIMIT, Recorder
from ..world import LOST_AFTER
from .blas import single_threaded_blas
from .collectives import across_ranks, channel_of
from .cuda import Gpus
from .debug import ActorLog
from .device import Programs
from .driver import Driver, Start
from .feeds import CheckedFeeds, FeedCheck, Feeds
from .logical import assemble
from .program import Program, schedule
from .protocol import Act, act_text, last_micro_batch
from .replay import Replay
from .spans import SpanMaker
from .stall import Watchdog
from .transport import Transport
from .wiring import Member, Unit, Wiring, ranks_of, wire

Order = Literal["replay", "dynamic"]

LOOK_EVERY = 0.5
"""Seconds between looks, while a thread waits for a run, at whether the Runtime closed
(and while it waits for its turn, whether it failed)."""


class Runtime:
    """``async with Runtime(plan) as rt: outputs = await rt.run(feeds)``.

    trace: record a span per kernel (see ``recorder``); trace_iterations: only these
    iterations (steps), to keep long runs' traces small; trace_limit: the most spans held
    (the latest whole iterations; None: no bound); stall_timeout: seconds without
    any actor acting before the run fails with a StallError that says who waits on what;
    lost_after: over ranks, seconds without word from another rank before it counts as
    lost (long enough for a paused process, a GC or a swap, to come back; short enough to
    stop a dead job soon); losable: the ranks whose loss fails this Runtime with a
    ``RankLost`` that the program may survive (``mpi_world.regroup``), not a RankError;
    order: "replay" (the default) runs each stream in the order a simulated run decided
    once (``replay``), where the plan allows it; "dynamic" decides every act as the run
    goes (``driver``), which adapts to kernels whose times vary, at a higher host cost.
    The ``ACTORFLOW_DEBUG`` environment variable is read here (see ``debug``). Once
    closed, it holds no buffer but its parameters' and their optimizer state's
    (``values()`` still reads them), and no output it handed back.
    """

    def __init__(
        self,
        plan: Plan,
        *,
        trace: bool = False,
        trace_iterations: Collection[int] | None = None,
        trace_limit: int | None = TRACE_LIMIT,
        stall_timeout: float = 60.0,
        lost_after: float = LOST_AFTER,
        losable: frozenset[int] = frozenset(),
        order: Order = "replay",
    ) -> None:
        for name, seconds in (("stall_timeout", stall_timeout), ("lost_after", lost_after)):
            if not isinstance(seconds, (int, float)) or not seconds > 0:
                raise ValueError(f"{name} is a number of seconds > 0, not {seconds!r}")
        if order not in ("replay", "dynamic"):
            raise ValueError(f"order is 'replay' or 'dynamic', not {order!r}")
        self.order = order
        self.ordered_by: str = order
        """How this Runtime orders its acts once open: "replay", or "dynamic: " and why."""
        self.plan = plan
        self.stall_timeout = stall_timeout
        self._state = "new"
        self._transport = Transport(plan.world, lost_after, losable) if plan.world > 1 else None
        self.rank = self._transport.rank if self._transport else 0
        self.recorder = Recorder(trace, trace_iterations, self.rank if self._transport else None, trace_limit)
        self._feed_check = FeedCheck(plan, self.rank)
        self._spans = SpanMaker(plan, self.rank) if trace else None
        # None unless ACTORFLOW_DEBUG=actors: the drivers check it once per act attempt.
        self._actor_log = ActorLog(plan) if "actors" in debug_flags() else None
        self._wiring: Wiring | None = None
        self._gpus: Gpus | None = None  # where this rank has cuda devices
        self._drivers: dict[int, Driver] = {}  # by plan stream id, where the drivers run it
        self._replay: Programs | None = None  # where it is replayed
        self._watchdog: Watchdog | None = None
        self._feeds: dict[int, dict[str, np.ndarray]] = {}
        self._results: list[dict[str, np.ndarray]] = []
        self._base = 0  # the current run's first iteration
        self._iterations = 0  # iterations run since the runtime opened
        self._remaining = 0
        self._counting = threading.Lock()
        self._wake: Callable[[], None] = _nothing  # tells the run's waiter it ended
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop_thread: int | None = None  # the thread trio's loop runs on
        self._error: BaseException | None = None
        self._lock = trio.Lock()  # runs of trio tasks queue up
        self._one_run = threading.Lock()  # a run of a trio task or of another thread
        self._stack = contextlib.AsyncExitStack()
        self._nursery: trio.Nursery | None = None

    async def __aenter__(self) -> Runtime:
        if self._state != "new":
            raise RuntimeError("a Runtime is entered once; make a new one to run again")
        self._state = "open"
        try:
            self._stack.enter_context(single_threaded_blas())
            self._token = trio.lowlevel.current_trio_token()
            self._loop_thread = threading.get_ident()
            if self._transport is not None:
                await self._transport.connect(_groups(self.plan), _digest(self.plan))
            watchdog = self._open()
            self._stack.enter_context(full_collections_paused())
            self._stack.callback(self._stop_threads)
            if self._transport is not None:
                self._transport.on_failure = functools.partial(self._soon, self.fail)
                self._transport.on_query = functools.partial(self._soon, watchdog.answer_query)
                self._transport.on_reply = functools.partial(self._soon, watchdog.got_answer)
                self._transport.start()
            self._nursery = await self._stack.enter_async_context(trio.open_nursery())
            self._nursery.start_soon(watchdog.watch, lambda: self.failed, self.fail)
            for driver in self._drivers.values():
                driver.start()
            if self._replay is not None:
                self._replay.start()
        except BaseException:
            self._state = "closed"
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: Any) -> bool:
        self._state = "closed"
        assert self._nursery is not None, "entered, so the nursery is open"
        self._nursery.cancel_scope.cancel()
        try:
            return bool(await self._stack.__aexit__(*exc_info))
        except BaseExceptionGroup as group:
            body = exc_info[1]
            if body is None or isinstance(body, trio.Cancelled):
                # the body was cancelled from outside, or because a task of the runtime's
                # own crashed: then that crash is the error, not a Cancelled leaking out
                crashed = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
                body = crashed[0] if crashed else body
            error = body or self._error or _only_error(group)
            raise error from error.__cause__

    def _open(self) -> Watchdog:
        """Wire the plan and make a driver per stream of this rank (threads not started)."""
        plan = self.plan
        transport = self._transport
        across = None if transport is None else functools.partial(across_ranks, plan, self.rank, transport)
        gpus = self._gpus = Gpus.of(plan, self.rank)
        wiring = self._wiring = wire(plan, self.rank, across, gpus=gpus)
        if gpus is not None:
            gpus.prepare(plan, wiring.units, traced=self._spans is not None)
        if self.order == "dynamic":
            program: Program | str = "order='dynamic' was asked for"
        elif self._actor_log is not None:
            program = "ACTORFLOW_DEBUG=actors logs every act attempt"
        else:
            program = schedule(plan, self.rank)
        self.ordered_by = "replay" if isinstance(program, Program) else f"dynamic: {program}"
        if isinstance(program, Program):
            program.forget_deps()
            replay = self._replay = Replay(
                plan, wiring, program, self, self.recorder.enabled, gpus, transport, self.recorder.iterations
            )
            if transport is not None:  # a collective over ranks waits in MPI while these are idle
                transport.busy = replay.working
                transport.collective_ready = replay.collective_ready
                transport.threads = len(replay.kernel_streams)
        else:
            for s in wiring.streams:
                comm = transport if s.stream.kind == "comm" else None
                make_stream = gpus.make_stream(s.stream) if gpus is not None else None
                self._drivers[s.stream.id] = Driver(
                    self,
                    s.stream.name,
                    s.units,
                    s.order,
                    comm,
                    self.recorder.enabled,
                    self._actor_log,
                    make_stream,
                )
            for driver in self._drivers.values():
                driver.peers = self._drivers
            if transport is not None:  # a collective over ranks waits in MPI while these are idle
                working = [
                    self._drivers[s.stream.id] for s in wiring.streams if s.stream.kind in ("compute", "copy")
                ]
                transport.busy = lambda: not all(d.idle for d in working)
                transport.threads = len(working)
        self._watchdog = Watchdog(
            plan,
            wiring.members,
            self._drivers,
            self.stall_timeout,
            self._transport,
            lambda: (self._base, self._iterations),
            self._replay,
        )
        return self._watchdog

    # -- running -------------------------------------------------------------------

    def check(self, feeds: Feeds | Sequence[Feeds] | CheckedFeeds | None = None) -> CheckedFeeds:
        """The feeds of a run, checked against the plan (see ``feeds``): what ``run`` does
        first. Synchronous and safe from any thread."""
        return self._feed_check.check(feeds)

    async def run(self, feeds: Feeds | Sequence[Feeds] | CheckedFeeds | None = None) -> Any:
        """Run one iteration per feed dict; a single dict gives one dict of outputs back,
        a list gives a list. Iterations pipeline as far as the quotas allow."""
        single, arrays = self.check(feeds)
        async with self._lock:
            self._enter_run()
            if not self._one_run.acquire(blocking=False):
                raise RuntimeError("a run is in progress from another thread")
            try:
                self.raise_if_failed()
                if not self.plan.actors or not arrays:
                    return {} if single else [{} for _ in arrays]
                done = trio.Event()
                self._begin(arrays, lambda: self._soon(done.set))
                try:
                    await done.wait()
                except BaseException:
                    self.fail(RuntimeError("a run was cancelled midway; this Runtime can't run again"))
                    raise
                return self._outputs(single)
            finally:
                self._leave_run()

    def run_from_thread(self, feeds: Feeds | Sequence[Feeds] | CheckedFeeds | None = None) -> Any:
        """``run``, from a thread other than trio's (``Session``): the run starts on this
        thread and its last stream wakes it, with no round trip through trio's loop
        (a one-iteration run took 132-136 µs against 266-303 µs through it), which still
        watches for stalls and hears of failures. Runs from several threads take turns."""
        single, arrays = self.check(feeds)
        self._enter_run()
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("run_from_thread is for other threads than trio's: there, await run()")
        while not self._one_run.acquire(timeout=LOOK_EVERY):  # another thread's run
            self._enter_run()
            self.raise_if_failed()
        ended = False
        try:
            self.raise_if_failed()
            if not self.plan.actors or not arrays:
                ended = True
                return {} if single else [{} for _ in arrays]
            done = threading.Event()
            self._begin(arrays, done.set)
            try:
                while not done.wait(LOOK_EVERY):
                    if self._state == "closed":  # trio's loop ended under the run
                        raise RuntimeError("the Runtime closed while a run was in progress")
            except BaseException as exc:
                # as ``run`` when cancelled; the turn is not given back, so no run starts
                # before the failure lands
                left = f"a run was left midway with {type(exc).__name__}; this Runtime can't run again"
                self._soon(self.fail, RuntimeError(left))
                raise
            ended = True
            return self._outputs(single)
        finally:
            if ended:
                self._leave_run()

    def _enter_run(self) -> None:
        """Refuse a run of a Runtime that is not open."""
        if self._state != "open":
            raise RuntimeError(
                "run needs an open Runtime: `async with Runtime(plan) as rt: await rt.run(...)`"
            )

    def _leave_run(self) -> None:
        """A run's turn ends: nobody waits for it any more."""
        self._wake = _nothing
        self._one_run.release()

    def _begin(self, arrays: list[dict[str, np.ndarray]], wake: Callable[[], None]) -> None:
        """Hand a run of ``arrays``' iterations to the streams; ``wake()`` once it ended,
        from the thread that ended it (the last stream's, or trio's on a failure)."""
        self._base = self._iterations
        self._iterations += len(arrays)
        for k, f in enumerate(arrays):
            self._feeds[self._base + k] = f
        self._results = [{} for _ in arrays]
        self._wake = wake
        # ``fail`` sets the error, then wakes whom ``_wake`` names: one of the two saw the other
        if self.failed:  # and stopped the streams
            wake()
            return
        replay = self._replay
        self._remaining = sum(
            any(m.acts(len(arrays)) for u in d.units for m in u.members) for d in self._drivers.values()
        ) + (replay.busy() if replay is not None else 0)
        assert self._watchdog is not None, "an open Runtime has its watchdog"
        self._watchdog.running = True
        if self._gpus is not None and self._spans is not None:
            self._gpus.mark()
        if not self._remaining:
            wake()
        for driver in self._drivers.values():
            driver.post(Start(len(arrays)))
        if replay is not None:
            replay.run(len(arrays) // self.plan.micro_batches)

    def _outputs(self, single: bool) -> Any:
        """The ended run's outputs, or the error that stopped this Runtime."""
        assert self._watchdog is not None, "an open Runtime has its watchdog"
        self._watchdog.running = False
        self.raise_if_failed()
        ended, self._results = self._results, []  # the caller's alone
        results = [assemble(self.plan.logical, "output", r) for r in ended]
        return results[0] if single else results

    # -- what the drivers tell (driver.Host) --------------------------------------------

    def feed_value(self, name: str, iteration: int) -> np.ndarray:
        return self._feeds[iteration][name]

    def completed(
        self, unit: Unit, number: int, result: Any, start: float, end: float, acts: list[Act]
    ) -> None:
        """A fetched or traced kernel ended, told by its stream's thread. ``number``: the
        unit's act number; an actor acting once per step of m micro-batches (``every`` m)
        does act n for micro-batches n*m .. n*m + m - 1."""
        actor = unit.actor
        if unit.fetch is not None:
            self._results[last_micro_batch(number, actor.every) - self._base][unit.fetch] = result
        if self._spans is not None:  # tracing
            gpus = self._gpus
            if gpus is not None and gpus.on_gpu(unit.stream):  # timed on the GPU, read when spans are
                begun, ended = gpus.timing[unit.stream]
                at = gpus.time(begun, start), gpus.time(ended, end)
                self._spans.record(self.recorder, unit, number, *at, acts)
            else:
                self._spans.record(self.recorder, unit, number, start, end, acts)

    def stream_finished(self) -> None:
        """A stream's thread completed its acts of this run; the last one wakes the run's
        waiter (a trio task, or the thread of ``run_from_thread``)."""
        with self._counting:
            self._remaining -= 1
            finished = self._remaining == 0
        if finished:
            self._feeds.clear()
            self._wake()

    def _soon(self, fn: Any, *args: Any) -> None:
        """Call ``fn(*args)`` on the trio thread, from a stream's or the transport's thread,
        unless the run has ended (``run_sync_soon`` then raises ``RunFinishedError``: at
        shutdown, nobody is left to tell)."""
        assert self._token is not None, "other threads run only inside an open Runtime"
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    def fail_soon(self, exc: BaseException) -> None:
        """``fail``, from a stream's thread."""
        self._soon(self.fail, exc)

    def fail_kernel_soon(self, exc: BaseException, unit: Unit, number: int) -> None:
        """``fail_kernel``, from a stream's thread."""
        self._soon(self.fail_kernel, exc, unit, number)

    def fail_kernel(self, exc: BaseException, unit: Unit, number: int) -> None:
        actor = unit.actor
        stream = self.plan.streams[actor.stream].name
        on_rank = f" on rank {self.rank}" if self._transport is not None else ""
        exc.add_note(
            f"actorflow: raised by actor {unit.name!r} (op {actor.op}) on stream {stream!r}{on_rank} "
            f"at {act_text(actor.calls, number, self._base)} of this run "
            f"({number // actor.calls} since the runtime opened); "
            f"the op was built at {actor.where}{self._input_named(exc, unit)}"
        )
        self.fail(exc)

    def _input_named(self, exc: BaseException, unit: Unit) -> str:
        """For a kernel that wrote into an input: which register that input is."""
        if not isinstance(exc, KernelError) or exc.input is None:
            return ""
        registers = self.plan.registers
        data = [i.register for i in unit.actor.inputs if not registers[i.register].control]
        return f"; its input {exc.input} is register {registers[data[exc.input]].name!r}"

    def fail(self, exc: BaseException) -> None:
        """Stop everything; the waiting ``run`` re-raises ``exc``. Over ranks, tell the
        other ranks (unless the failure came from one of them).

        The nursery's cancel scope is not touched: it was opened in ``__aenter__``, so it
        also wraps the caller's own code inside ``async with``. Drivers and the watchdog
        end on their own once they see ``failed``.
        """
        if self._error is None:
            self._error = exc
            if self._transport is not None and not isinstance(exc, RankError):
                notes = "".join(f"\n{note}" for note in getattr(exc, "__notes__", ()))
                self._transport.announce(f"rank {self.rank} failed: {type(exc).__name__}: {exc}{notes}")
            elif self._transport is not None and not isinstance(exc, RankLost):
                # said at once, in one write: mpiexec -disable-auto-cleanup was seen to kill
                # a survivor of a killed rank as soon as it wrote anything, mid-traceback
                sys.stderr.write(f"actorflow: rank {self.rank} stops: {exc}\n")
                sys.stderr.flush()
        for driver in self._drivers.values():
            driver.close()
        if self._replay is not None:
            self._replay.close()
        self._wake()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def raise_if_failed(self) -> None:
        """Raise the error that stopped this Runtime, if one did."""
        if self._error is not None:
            raise self._error

    def _stop_threads(self, grace: float = 10.0) -> None:
        """Stop the streams' threads and the transport's, waiting up to ``grace`` seconds
        for them to end; once all have, let go of the buffers (``Wiring.release``)."""
        for driver in self._drivers.values():
            driver.close()
        if self._replay is not None:
            self._replay.close()
        if self._transport is not None:
            self._transport.close()
        deadline = time.monotonic() + grace
        threads = list(dict.fromkeys(d.thread for d in self._drivers.values()))
        if self._replay is not None:
            threads += self._replay.threads()
        if self._transport is not None and self._transport.thread not in threads:
            threads.append(self._transport.thread)
        for thread in threads:
            if thread.is_alive():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            warnings.warn(
                f"stream threads {stuck} are still in a kernel {grace:.0f} s after the runtime closed; "
                "they are daemon threads and are left behind",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if self._gpus is not None:  # no kernel queued on a GPU may still use a buffer let go
            self._gpus.synchronize()
        if self._replay is not None:
            self._replay.release()
        if self._wiring is not None:  # parameters and optimizer state stay readable (values())
            self._wiring.release({p.register for p in self.plan.parameters_of(self.rank)})

    # -- inspection ----------------------------------------------------------------

    def stall_report(self, idle: float) -> str:
        """What a StallError would say now (see ``stall.Watchdog.report``)."""
        assert self._watchdog is not None, "an open Runtime has its watchdog"
        return self._watchdog.report(idle)

    def parameters(self) -> dict[str, np.ndarray]:
        """The current value of every model parameter, by name (copies; no optimizer state;
        a parameter on several devices as one logical array). Over ranks: this rank's
        devices' parameters (a logical one only where this rank holds all its parts)."""
        return assemble(self.plan.logical, "parameter", self._host_values(state=False))

    def values(self) -> dict[str, np.ndarray]:
        """This rank's parameters and optimizer state, by their plan names (one per device:
        ``w0[cpu:1]``, ``w0[cpu:1].momentum``), copies: all a run keeps across steps."""
        return self._host_values(state=True)

    def _host_values(self, state: bool) -> dict[str, np.ndarray]:
        """Host copies of this rank's parameters (and their optimizer ``state``)."""
        assert self._wiring is not None, "an open Runtime is wired"
        buffers = self._wiring.buffers
        held = self.plan.parameters_of(self.rank)
        return {p.name: to_host(buffers[p.register][0]) for p in held if state or not p.state}

    def load(self, values: dict[str, np.ndarray]) -> None:
        """Set this rank's parameters and optimizer state to ``values`` (as ``values``
        gives them: every one, with its shape and dtype; a ValueError names the first that
        differs), between runs. The buffers are written in place, so the kernels' views of
        them stay valid."""
        if not self._one_run.acquire(blocking=False):
            raise RuntimeError("load runs between runs, not during one")
        try:
            self._load(values)
        finally:
            self._one_run.release()

    def _load(self, values: dict[str, np.ndarray]) -> None:
        assert self._wiring is not None, "an open Runtime is wired"
        held = {p.name: self._wiring.buffers[p.register][0] for p in self.plan.parameters_of(self.rank)}
        if values.keys() != held.keys():
            differ = sorted(values.keys() ^ held.keys())[0]
            whose = "the plan" if differ in held else "the values"
            raise ValueError(f"parameter {differ!r} is only in {whose}")
        for name, buffer in held.items():
            value = values[name]
            if (value.shape, value.dtype) != (buffer.shape, buffer.dtype):
                raise ValueError(
                    f"parameter {name!r} is {value.dtype}{list(value.shape)}, "
                    f"the plan's {buffer.dtype}{list(buffer.shape)}"
                )
        for name, buffer in held.items():
            copy_into(buffer, values[name])
        if self._gpus is not None:
            self._gpus.synchronize()

    def device_stream(self, name: str) -> Any:
        """The CUDA stream (a ``cupy.cuda.Stream``) that plan stream ``name`` runs on, or
        None for a host stream."""
        assert self._wiring is not None, "an open Runtime is wired"
        ids = {s.stream.name: s.stream.id for s in self._wiring.streams}
        if name not in ids:
            raise KeyError(f"no stream {name!r} on this rank; it has {sorted(ids)}")
        return self._gpus.streams.get(ids[name]) if self._gpus is not None else None

    def threads(self) -> dict[str, str]:
        """Per actor (by name), the stream thread that runs it: its own stream's, or for a
        small move within the process its partner's (see ``_host_moves``)."""
        assert self._wiring is not None, "an open Runtime is wired"
        names = {s.stream.id: s.stream.name for s in self._wiring.streams}
        return {m.actor.name: names[m.unit.stream] for m in self._wiring.members.values()}

    def register_stats(self) -> dict[str, dict[str, int]]:
        """Per register: its quota and the most buffers held at once (taken, not yet freed)."""
        assert self._wiring is not None, "an open Runtime is wired"
        return register_stats(self.plan, self._wiring.members, self._replay.peaks if self._replay else None)


def register_stats(
    plan: Plan, members: dict[int, Member], peaks: dict[tuple[int, int], int] | None = None
) -> dict[str, dict[str, int]]:
    """Per register of ``members``' outputs: its quota and the most buffers held at once,
    as a replay counted them (``peaks``) or else as the protocol did."""
    stats = {}
    for member in members.values():
        for k, o in enumerate(member.actor.outputs):
            reg = plan.registers[o]
            held = peaks.get((member.actor.id, k), 0) if peaks is not None else member.state.max_held[k]
            stats[reg.name] = {"quota": reg.quota, "max_held": held}
    return stats


def _groups(plan: Plan) -> list[tuple[tuple, tuple[int, ...]]]:
    """(communicator key, ranks) for each collective stream that spans ranks, in plan order."""
    groups = ((channel_of(plan, c), ranks_of(plan, c)) for c in plan.collectives)
    return list(dict.fromkeys(g for g in groups if len(g[1]) > 1))


def _digest(plan: Plan) -> bytes:
    """What every rank's plan must agree on: its structure and its parameters' values."""
    h = hashlib.sha256(plan.summary().encode())
    for p in plan.parameters:
        h.update(np.ascontiguousarray(p.value).tobytes())
    return h.digest()


def _nothing() -> None:
    """No run is waited for."""


def _only_error(group: BaseExceptionGroup) -> BaseException:
    """The one real error inside a (nested) group; a group of several is kept as it is."""
    leaves = _leaves(group)
    return leaves[0] if len(leaves) == 1 else group


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside a (nested) group, in order."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]
