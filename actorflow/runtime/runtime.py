"""The Runtime: executes a Plan inside the caller's trio loop, iteration after iteration.

It allocates every register buffer once, starts one thread per stream, which runs that
stream's driver (its actors' message loop) and kernels, and then serves ``run`` calls:
trio only starts a run, waits for its end, and hears of failures. Any failure (a
kernel's exception, a stall, a cancelled run) stops the streams and is re-raised from
``run`` as the original exception, with a note naming the actor, stream and iteration;
the Runtime can't run again after it.
A kernel that never returns can't be stopped: its thread is left behind, with a warning.

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
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np
import trio

from ..collector import cyclic_gc_paused
from ..errors import FeedError, RankError, StallError
from ..plan import Actor, Plan, transfer_peers
from ..trace.recorder import TRACE_LIMIT, Recorder, Span
from .actor_state import ActorState
from .blas import single_threaded_blas
from .collectives import across_ranks, channel_of, ranks_of
from .debug import ActorLog, debug_flags, lacking
from .driver import KICK, Driver, InputSpec, Member, OutputSpec, Unit, step_order
from .logical import assemble, feed_names, split_feeds
from .stall import WaitChain, wait_for_chain
from .transport import QUERY, REPLY, Transport

Feeds = Mapping[str, Any]
ASK_TIMEOUT = 2.0
HOSTED_MOVE_BYTES = 1 << 18  # copied in about the time it takes to wake a thread
HOSTED_PRIORITY = -1  # ahead of every priority the compiler gives


class CheckedFeeds(NamedTuple):
    """A run's feeds as ``Runtime.check`` leaves them: one array per local placeholder."""

    single: bool
    feeds: list[dict[str, np.ndarray]]


class Runtime:
    """``async with Runtime(plan) as rt: outputs = await rt.run(feeds)``.

    trace: record a span per kernel (see ``recorder``); trace_iterations: only these
    iterations (steps), to keep long runs' traces small; trace_limit: the most spans held
    (the latest whole iterations; None: no bound); stall_timeout: seconds without
    any actor acting before the run fails with a StallError that says who waits on what.
    The ``ACTORFLOW_DEBUG`` environment variable is read here (see ``debug``).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        trace: bool = False,
        trace_iterations: Collection[int] | None = None,
        trace_limit: int | None = TRACE_LIMIT,
        stall_timeout: float = 60.0,
    ) -> None:
        if not isinstance(stall_timeout, (int, float)) or not stall_timeout > 0:
            raise ValueError(f"stall_timeout is a number of seconds > 0, not {stall_timeout!r}")
        self.plan = plan
        # None unless ACTORFLOW_DEBUG=actors: the drivers check it once per act attempt.
        self.actor_log = ActorLog(plan) if "actors" in debug_flags() else None
        self._state = "new"
        self.stall_timeout = stall_timeout
        self.units: list[Unit] = []
        self._members: dict[int, Member] = {}
        self._slots: dict[int, dict[int, int]] = {}
        self._output_index: dict[int, int] = {}
        self._feed_names = feed_names(plan)
        self._feed_parts = {part: lt.name for lt in plan.logical if lt.kind == "feed" for part in lt.parts}
        self._drivers: list[Driver] = []
        self._buffers: list[list[np.ndarray]] = []
        self._iterations = 0
        self._feeds: dict[int, Feeds] = {}
        self._results: list[dict[str, np.ndarray]] = []
        self._base = 0
        self._remaining = 0
        self._counting = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._done = trio.Event()
        self._running = False
        self._error: BaseException | None = None
        self._lock = trio.Lock()
        self._stack = contextlib.AsyncExitStack()
        self._nursery: trio.Nursery | None = None
        self._answer: tuple[str, tuple[int, int] | None] | None = None
        self._answered = trio.Event()
        self._transport = Transport(plan.world) if plan.world > 1 else None
        self.rank = self._transport.rank if self._transport else 0
        self.recorder = Recorder(trace, trace_iterations, self.rank if self._transport else None, trace_limit)
        self._span_args = {a.id: _span_args(plan, a, self.rank) for a in plan.actors} if trace else {}
        self._peers = transfer_peers(plan)
        self._local_feeds = [
            f.name for f in plan.feeds if plan.rank_of(plan.actors[f.actor].device) == self.rank
        ]

    async def __aenter__(self) -> Runtime:
        if self._state != "new":
            raise RuntimeError("a Runtime is entered once; make a new one to run again")
        self._state = "open"
        try:
            self._stack.enter_context(single_threaded_blas())
            self._token = trio.lowlevel.current_trio_token()
            if self._transport is not None:
                await self._transport.connect(_groups(self.plan), _digest(self.plan))
            self._build()
            self._stack.callback(self._stop_threads)
            if self._transport is not None:
                self._transport.on_failure = functools.partial(self._soon, self.fail)
                self._transport.on_query = functools.partial(self._soon, self._answer_query)
                self._transport.on_reply = functools.partial(self._soon, self._got_answer)
                self._transport.start()
            self._nursery = await self._stack.enter_async_context(trio.open_nursery())
            self._nursery.start_soon(self._watchdog)
            for driver in self._drivers:
                driver.start()
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

    # -- wiring ------------------------------------------------------------------

    @cyclic_gc_paused()
    def _build(self) -> None:
        plan = self.plan
        local = [a for a in plan.actors if plan.rank_of(a.device) == self.rank]
        mine = {a.id for a in local}
        held = {r.id for r in plan.registers if plan.rank_of(r.device) == self.rank}
        held |= {i.register for a in local for i in a.inputs}
        initial = {p.register: p.value for p in plan.parameters}
        self._buffers = [
            []
            if r.id not in held
            else [np.array(initial[r.id], dtype=r.dtype, copy=True)]
            if r.id in initial
            else [np.zeros(r.shape, r.dtype) for _ in range(r.quota)]
            for r in plan.registers
        ]
        # dicts, as a fused collective has thousands of inputs and outputs
        self._slots = {a.id: _protocol_slots(plan, a) for a in local}
        self._output_index = {o: k for a in plan.actors for k, o in enumerate(a.outputs)}
        for actor in local:
            periods = [plan.period(actor, o) for o in actor.outputs]
            slots = self._slots[actor.id]
            state = ActorState(
                len(slots),
                [plan.registers[o].quota for o in actor.outputs],
                [len(plan.registers[o].consumers) for o in actor.outputs],
                holds=[_hold(plan, actor, actor.inputs[k]) for k in slots],
                periods=periods,
                call_consumers=_call_consumers(plan, actor),
            )
            self._members[actor.id] = Member(actor, state, plan.phases(actor))
        for actor in local:
            self._wire(self._members[actor.id])

        groups = {a: coll for coll in plan.collectives for a in coll.actors}
        streams = [s for s in plan.streams if s.rank == self.rank]
        units_of_stream: dict[int, list[Unit]] = {s.id: [] for s in streams}
        for coll in plan.collectives:
            here = [plan.actors[a] for a in coll.actors if a in mine]
            if not here:
                continue
            unit = self._add_unit(coll.name, here, units_of_stream)
            if len(here) < len(coll.actors):
                assert self._transport is not None, "a collective spans ranks only over several"
                unit.kernel = across_ranks(plan, coll, self.rank, self._transport)
            if coll.seconds > 0:
                unit.kernel = functools.partial(_lasting, unit.kernel, coll.seconds)
        for actor in local:
            if actor.id not in groups:
                self._add_unit(actor.name, [actor], units_of_stream)
        for feed in plan.feeds:
            if feed.actor in mine:
                self._members[feed.actor].unit.feed = feed.name
        for out in plan.outputs:
            if out.actor in mine:
                self._members[out.actor].unit.fetch = out.name
        self._host_moves(units_of_stream)

        for stream in streams:
            units = units_of_stream[stream.id]
            order = step_order(units, plan.micro_batches) if stream.kind == "collective" else None
            if order is None:
                units.sort(key=lambda u: u.priority)
            transport = self._transport if stream.kind == "comm" else None
            self._drivers.append(Driver(self, stream.name, units, order, transport))
        if not plan.overlap:
            compute = {s.device: d for s, d in zip(streams, self._drivers) if s.kind == "compute"}
            for coll in plan.collectives:
                ids = [a for a in coll.actors if a in mine]
                if not ids:
                    continue
                unit = self._members[ids[0]].unit
                devices = dict.fromkeys(plan.actors[a].device for a in coll.actors)
                unit.fences = [compute[d] for d in devices if d in compute]

    def _host_moves(self, units_of_stream: dict[int, list[Unit]]) -> None:
        """Small moves within this process get no thread of their own: a copy between
        devices or a fetch runs on its producer's stream, a feed on its consumer's, ahead
        of that stream's other work (they are quick, and another stream waits for them).
        A hand-off between two devices is then one message, from the producer's thread to
        the consumer's. Moves of over ``HOSTED_MOVE_BYTES`` keep their copy stream, where
        they overlap compute."""
        plan = self.plan
        host: dict[int, int] = {}  # unit id -> the stream whose thread runs it

        def stream_of(unit: Unit) -> int:
            if unit.id not in host:
                host[unit.id] = unit.members[0].actor.stream
                partners = {stream_of(p) for p in _partners(plan, unit)}
                if len(partners) == 1 and plan.streams[stream := partners.pop()].kind in ("compute", "copy"):
                    host[unit.id] = stream
            return host[unit.id]

        for unit in self.units:
            actor, stream = unit.members[0].actor, stream_of(unit)
            if stream != actor.stream:
                units_of_stream[actor.stream].remove(unit)
                units_of_stream[stream].append(unit)
                unit.priority = HOSTED_PRIORITY

    def _wire(self, member: Member) -> None:
        plan, actor = self.plan, member.actor
        slot_of = self._slots[actor.id]
        for k, i in enumerate(actor.inputs):
            reg = plan.registers[i.register]
            if reg.is_parameter:
                member.inputs.append(InputSpec(param=self._buffers[reg.id][0]))
                continue
            producer = self._members[reg.producer]
            member.inputs.append(
                InputSpec(
                    slot=slot_of[k],
                    control=reg.control,
                    buffers=self._buffers[reg.id],
                    producer=producer,
                    out=self._output_index[reg.id],
                )
            )
        for o in actor.outputs:
            reg = plan.registers[o]
            consumers = [(self._members[c.actor], self._slots[c.actor][c.slot]) for c in reg.consumers]
            by_call = None
            if actor.calls > 1:
                by_call = [
                    [t for t, c in zip(consumers, reg.consumers) if c.call == j] for j in range(actor.calls)
                ]
            member.outputs.append(OutputSpec(self._buffers[o], consumers, reg.control, by_call))

    def _add_unit(self, name: str, actors: list, units_of_stream: dict[int, list[Unit]]) -> Unit:
        first = actors[0]
        kernel = functools.partial(first.kernel, **first.attrs) if first.attrs else first.kernel
        unit = Unit(len(self.units), name, first.priority, [self._members[a.id] for a in actors], kernel)
        self.units.append(unit)
        units_of_stream[first.stream].append(unit)
        return unit

    # -- running -------------------------------------------------------------------

    def check(self, feeds: Feeds | Sequence[Feeds] | CheckedFeeds | None = None) -> CheckedFeeds:
        """The feeds of a run, checked against the plan (names, shapes, dtypes, whole
        steps): what ``run`` does first. Synchronous and safe from any thread, so the sync
        API raises a FeedError before entering trio, with a traceback that is yours."""
        if isinstance(feeds, CheckedFeeds):
            return feeds
        batch: list[Any]
        single = feeds is None or isinstance(feeds, Mapping)
        if single:
            batch = [feeds or {}]
        elif isinstance(feeds, Sequence) and not isinstance(feeds, (str, bytes)):
            batch = list(feeds)
        else:
            raise FeedError(
                f"feeds are a dict of name -> array, or a list of such dicts, not {type(feeds).__name__}"
            )
        arrays = [self._check_feeds(f, k if not single else None) for k, f in enumerate(batch)]
        m = self.plan.micro_batches
        if self.plan.actors and len(arrays) % m:
            raise FeedError(
                f"this plan takes whole steps of {m} micro-batches (one feed dict each); "
                f"got {len(arrays)} feed dicts"
            )
        return CheckedFeeds(single, arrays)

    async def run(self, feeds: Feeds | Sequence[Feeds] | CheckedFeeds | None = None) -> Any:
        """Run one iteration per feed dict; a single dict gives one dict of outputs back,
        a list gives a list. Iterations pipeline as far as the quotas allow."""
        single, arrays = self.check(feeds)
        if self._state != "open":
            raise RuntimeError(
                "run needs an open Runtime: `async with Runtime(plan) as rt: await rt.run(...)`"
            )
        async with self._lock:
            self._raise_if_failed()
            if not self.plan.actors:
                return {} if single else [{} for _ in arrays]
            if not arrays:
                return []
            self._base = self._iterations
            self._iterations += len(arrays)
            for k, f in enumerate(arrays):
                self._feeds[self._base + k] = f
            self._results = [{} for _ in arrays]
            self._done = trio.Event()
            self._remaining = sum(
                any(m.acts(len(arrays)) for u in d.units for m in u.members) for d in self._drivers
            )
            self._running = True
            if not self._remaining:
                self._done.set()
            for driver in self._drivers:
                driver.post((KICK, len(arrays)))
            try:
                await self._done.wait()
            except BaseException:
                self.fail(RuntimeError("a run was cancelled midway; this Runtime can't run again"))
                raise
            finally:
                self._running = False
            self._raise_if_failed()
            results = [assemble(self.plan.logical, "output", r) for r in self._results]
            return results[0] if single else results

    def feed_value(self, name: str, iteration: int) -> np.ndarray:
        return self._feeds[iteration][name]

    def completed(
        self, unit: Unit, iteration: int, result: Any, start: float, end: float, taken: list
    ) -> None:
        """A kernel ended, told by its stream's thread. ``iteration``: the unit's own act
        number; an actor acting once per step of m micro-batches (``every`` m) does act n
        for micro-batches n*m .. n*m + m - 1. ``taken``: the output buffers per member."""
        actor = unit.members[0].actor
        if unit.fetch is not None:
            self._results[_last_micro_batch(iteration, actor.every) - self._base][unit.fetch] = result
        if self.recorder.enabled:
            step = iteration // actor.calls * actor.every // self.plan.micro_batches
            register = taken[0][0] if taken[0] else None
            self.recorder.record(step, self._span, unit, iteration, step, start, end, register)

    def stream_finished(self) -> None:
        """A stream's thread completed its acts of this run; the last one wakes trio."""
        with self._counting:
            self._remaining -= 1
            finished = self._remaining == 0
        if finished:
            self._feeds.clear()
            self._soon(self._done.set)

    @property
    def progress(self) -> int:
        """Launches and completions so far, for the stall watchdog."""
        return sum(d.acted for d in self._drivers)

    def _span(
        self, unit: Unit, act: int, iteration: int, start: float, end: float, register: int | None
    ) -> Span:
        """A kernel's span: ``iteration`` (the step), micro-batch, buffer written, stage,
        rank, phase and the producer acts it read, for flow arrows (made when the trace
        is read, see ``trace.recorder``)."""
        actor = unit.members[0].actor
        stream = self.plan.streams[actor.stream]
        m, every = self.plan.micro_batches, actor.every
        call, step = act % actor.calls, act // actor.calls  # a reused subgraph acts once a call
        args: dict[str, Any] = {"actor": unit.name, "op": actor.op, "iteration": iteration, "act": act}
        args |= self._span_args[actor.id]
        if actor.calls > 1:
            args["call"] = call
        if m > 1 and every == 1:
            args["micro_batch"] = step % m
        if register is not None:
            args["register"] = register
        args["inputs"] = [
            [
                spec.producer.unit.name,
                self._producer_act(member.actor, slot, spec, _last_micro_batch(step, every)),
            ]
            for member in unit.members
            for slot, spec in enumerate(member.inputs)
            if spec.param is None and (actor.calls == 1 or slot == call)  # a call reads its own input
        ]
        if actor.kind == "recv":  # its act n receives the send's act n, on another rank
            args["inputs"].append([self._peers[actor.id].name, act])
        return Span(stream.device, stream.name, unit.name, actor.kind, start, end, args)

    def _producer_act(self, actor: Actor, slot: int, spec: InputSpec, micro_batch: int) -> int:
        """The act of ``spec``'s producer that made what input ``slot`` of ``actor`` read at
        ``micro_batch``: a reused subgraph's acts count its calls."""
        producer = spec.producer.actor
        made = micro_batch // producer.every
        if producer.calls == 1:
            return made
        reg = self.plan.registers[producer.outputs[spec.out]]
        return made * producer.calls + next(
            c.call for c in reg.consumers if (c.actor, c.slot) == (actor.id, slot)
        )

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

    def fail_kernel_soon(self, exc: BaseException, unit: Unit, iteration: int) -> None:
        """``fail_kernel``, from a stream's thread."""
        self._soon(self.fail_kernel, exc, unit, iteration)

    def fail_kernel(self, exc: BaseException, unit: Unit, iteration: int) -> None:
        actor = unit.members[0].actor
        stream = self.plan.streams[actor.stream].name
        on_rank = f" on rank {self.rank}" if self._transport is not None else ""
        exc.add_note(
            f"actorflow: raised by actor {unit.name!r} (op {actor.op}) on stream {stream!r}{on_rank} "
            f"at {_act_text(actor, iteration, self._base)} of this run "
            f"({iteration // actor.calls} since the runtime opened); "
            f"the op was built at {actor.where}"
        )
        self.fail(exc)

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
            elif self._transport is not None:
                # said at once, in one write: mpiexec -disable-auto-cleanup was seen to kill
                # a survivor of a killed rank as soon as it wrote anything, mid-traceback
                sys.stderr.write(f"actorflow: rank {self.rank} stops: {exc}\n")
                sys.stderr.flush()
        for driver in self._drivers:
            driver.close()
        self._done.set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _stop_threads(self, grace: float = 10.0) -> None:
        for driver in self._drivers:
            driver.close()
        if self._transport is not None:
            self._transport.close()
        deadline = time.monotonic() + grace
        threads = [d.thread for d in self._drivers]
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

    async def _watchdog(self) -> None:
        seen, since = -1, trio.current_time()
        while not self.failed:
            await trio.sleep(min(1.0, self.stall_timeout / 4))
            now = trio.current_time()
            if not self._running or self.progress != seen:
                seen, since = self.progress, now
            elif now - since >= self.stall_timeout:
                report = self.stall_report(now - since)
                if self._transport is not None:
                    report = "\n".join([report, *await self._chain_across_ranks()])
                self.fail(StallError(report))
                return

    async def _chain_across_ranks(self) -> list[str]:
        """Where this rank's wait-for chain ends at another rank, the chain there, asked of
        that rank (and so on, each rank once)."""
        assert self._transport is not None
        remote = self._chain().remote
        lines, seen = [], {self.rank}
        while remote is not None and remote[0] not in seen:
            rank, actor = remote
            seen.add(rank)
            self._answer, self._answered = None, trio.Event()
            self._transport.tell(rank, QUERY, msgpack.packb(actor))
            with trio.move_on_after(ASK_TIMEOUT):
                await self._answered.wait()
            if self._answer is None:
                lines.append(f"  on rank {rank}: no answer within {ASK_TIMEOUT} s")
                return lines
            text, remote = self._answer
            lines.append(f"  on rank {rank}: {text}")
        if remote is not None:
            lines.append(f"  back on rank {remote[0]}: a cycle across ranks")
        return lines

    def _answer_query(self, asker: int, payload: bytes) -> None:
        """Another rank's stall chain reached one of this rank's actors: the chain from it."""
        actor = msgpack.unpackb(payload)
        if actor in self._members:
            chain = self._chain(actor)
            answer = [chain.text, chain.remote]
        else:
            answer = [f"actor {actor} is not on rank {self.rank}", None]
        assert self._transport is not None, "queries come only over ranks"
        self._transport.tell(asker, REPLY, msgpack.packb(answer))

    def _got_answer(self, payload: bytes) -> None:
        text, remote = msgpack.unpackb(payload)
        self._answer = (text, tuple(remote) if remote is not None else None)
        self._answered.set()

    def _chain(self, start: int | None = None) -> WaitChain:
        return wait_for_chain(self.plan, self._members, self._drivers, self._base, start)

    # -- inspection ----------------------------------------------------------------

    def stall_report(self, idle: float) -> str:
        """Every actor with acts left and what it lacks, what each stream is doing, and the
        wait-for chain from a waiting actor to the one everything waits on."""
        plan = self.plan
        lines = [
            f"no actor acted for {idle:.1f} s (stall_timeout={self.stall_timeout} s); "
            f"the run has {self._iterations - self._base} iterations. Waiting actors:"
        ]
        for member in self._members.values():
            actor, state = member.actor, member.state
            if state.acts_left == 0:
                continue
            stream = plan.streams[actor.stream].name
            lines.append(
                f"  {actor.name} on {stream}, {_act_text(actor, state.iteration, self._base)}: "
                + ("; ".join(lacking(plan, member)) or "can act, waiting for its turn")
            )
        for driver in self._drivers:
            ex = driver.executor
            if ex.running is not None:
                unit, iteration = ex.running[0], ex.running[1]
                lines.append(
                    f"  stream {driver.name} is still running {unit.name!r} "
                    f"(iteration {iteration - self._base})"
                )
            if ex.submitted > ex.done:
                lines.append(
                    f"  stream {driver.name}: {ex.submitted - ex.done} launched kernels not finished"
                )
            if driver.order:
                unit = driver.order[driver.cursor]
                lines.append(f"  stream {driver.name}: next in collective order is {unit.name!r}")
        lines.append(self._chain().text)
        return "\n".join(lines)

    def parameters(self) -> dict[str, np.ndarray]:
        """The current value of every model parameter, by name (copies; no optimizer state;
        a parameter on several devices as one logical array). Over ranks: this rank's
        devices' parameters (a logical one only where this rank holds all its parts)."""
        plan = self.plan
        values = {
            p.name: self._buffers[p.register][0].copy()
            for p in plan.parameters
            if not p.state and plan.rank_of(plan.registers[p.register].device) == self.rank
        }
        return assemble(self.plan.logical, "parameter", values)

    def threads(self) -> dict[str, str]:
        """Per actor (by name), the stream thread that runs it: its own stream's, or for a
        small move within the process its partner's (see ``_host_moves``)."""
        return {m.actor.name: m.unit.driver.name for m in self._members.values()}

    def register_stats(self) -> dict[str, dict[str, int]]:
        """Per register: its quota and the most buffers held at once (taken, not yet freed)."""
        stats = {}
        for member in self._members.values():
            for k, o in enumerate(member.actor.outputs):
                reg = self.plan.registers[o]
                stats[reg.name] = {"quota": reg.quota, "max_held": member.state.max_held[k]}
        return stats

    def _check_feeds(self, feeds: Any, iteration: int | None) -> dict[str, np.ndarray]:
        """This rank's feeds, checked: each placeholder of its devices must be given, by its
        own name or, for a part of a logical feed, by the logical name (split here). Feeds
        of other ranks' devices are accepted and left alone."""
        where = "" if iteration is None else f"iteration {iteration}: "
        if not isinstance(feeds, Mapping):
            raise FeedError(f"{where}feeds are a dict of name -> array, not {type(feeds).__name__}")
        parts = self._feed_parts
        whole = {parts.get(name, name) for name in self._local_feeds if name not in feeds}
        missing = sorted(whole - set(feeds))
        extra = sorted(set(feeds) - self._feed_names - parts.keys())
        if missing or extra:
            raise FeedError(
                f"{where}feeds do not match the placeholders: missing {missing}, unknown {extra} "
                f"(expected {sorted(self._feed_names)})"
            )
        split = split_feeds(self.plan, {k: v for k, v in feeds.items() if k in whole}, where)
        specs = {f.name: f for f in self.plan.feeds}
        arrays = {}
        for name in self._local_feeds:
            spec = specs[name]
            array = np.asarray(feeds[name] if name in feeds else split[name])
            if array.shape != spec.shape or array.dtype.name != spec.dtype:
                raise FeedError(
                    f"{where}feed {name!r} is {array.dtype.name}{list(array.shape)}, "
                    f"the placeholder wants {spec.dtype}{list(spec.shape)}"
                )
            arrays[name] = array
        return arrays


def _span_args(plan: Plan, actor: Actor, rank: int) -> dict[str, Any]:
    """What every span of ``actor`` carries besides its act: its stage (where the plan has
    stages), its rank and its phase (see ``trace.recorder``)."""
    stage = plan.stage_of(actor.device)
    return ({} if stage is None else {"stage": stage}) | {"rank": rank, "phase": _phase(actor)}


def _phase(actor: Actor) -> str:
    if actor.kind in ("update", "variable"):
        return "update"
    if actor.kind == "compute":
        return "weight" if actor.weight_grad else "backward" if actor.backward else "forward"
    return "communication"


def _last_micro_batch(act: int, every: int) -> int:
    """The last micro-batch that act ``act`` of an actor acting every ``every`` serves:
    where its result is fetched, and what its inputs' producers made it from."""
    return (act + 1) * every - 1


def _protocol_slots(plan: Plan, actor: Actor) -> dict[int, int]:
    """Input k -> its place among ``actor``'s inputs that take part in the credit protocol
    (a parameter's does not), in input order."""
    produced = [k for k, i in enumerate(actor.inputs) if not plan.registers[i.register].is_parameter]
    return {k: place for place, k in enumerate(produced)}


def _hold(plan: Plan, actor, i) -> int:
    """How many of ``actor``'s acts one register of input ``i`` serves (a once-per-step register's m)."""
    producer = plan.actors[plan.registers[i.register].producer]
    return max(1, producer.every // actor.every)


def _partners(plan: Plan, unit: Unit) -> list[Unit]:
    """The units on whose stream a small move within the process may run (see
    ``_host_moves``): a copy's or a fetch's producer, a feed's consumers; none where it
    keeps its own stream."""
    if len(unit.members) > 1:
        return []
    member = unit.members[0]
    actor = member.actor
    if actor.kind not in ("copy", "fetch", "feed") or not member.state.uniform:  # uniform: one call
        return []
    moved = [plan.registers[o] for o in actor.outputs] or [plan.registers[i.register] for i in actor.inputs]
    if sum(r.nbytes for r in moved) > HOSTED_MOVE_BYTES:
        return []
    if actor.kind == "feed":
        return [c.unit for o in member.outputs for c, _ in o.consumers]
    inputs = [s for s in member.inputs if s.param is None]
    return [inputs[0].producer.unit] if len(inputs) == 1 else []


def _lasting(kernel, seconds: float, ins: list, outs: list) -> Any:
    """Run ``kernel``, then wait out the rest of ``seconds`` (an emulated link's time)."""
    start = time.perf_counter()
    result = kernel(ins, outs)
    rest = seconds - (time.perf_counter() - start)
    if rest > 0:
        time.sleep(rest)
    return result


def _act_text(actor: Actor, act: int, base: int) -> str:
    """An actor's act as people count it: the iteration (from ``base``) and, for a reused
    communication subgraph, which call of it."""
    if actor.calls == 1:
        return f"iteration {act - base}"
    return f"iteration {act // actor.calls - base}, call {act % actor.calls}"


def _call_consumers(plan: Plan, actor: Actor) -> list[list[int]] | None:
    """Per output of a reused communication subgraph's participant, its consumers per call."""
    if actor.calls == 1:
        return None
    counts = [[0] * actor.calls for _ in actor.outputs]
    for k, o in enumerate(actor.outputs):
        for c in plan.registers[o].consumers:
            counts[k][c.call] += 1
    return counts


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


def _only_error(group: BaseExceptionGroup) -> BaseException:
    """The one real error inside a (nested) group; a group of several is kept as it is."""
    leaves = _leaves(group)
    return leaves[0] if len(leaves) == 1 else group


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside a (nested) group, in order."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]
