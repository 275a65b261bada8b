"""Replay: each stream's thread replays the program ``program.schedule`` decided for it,
step after step.

``ReplayStream`` runs one stream's program on its own thread: wait on the other streams'
counts, call the kernel, count, and wake the streams that wait on this instruction
(each has an inbox of wake-ups, a ``SimpleQueue``: a wake-up only says "look at the
counts again"). A stream is woken only when it sleeps on this stream's count and the
count now reaches what it waits for (it says so in ``waiting`` before it looks at the
count a last time and sleeps): a wake-up it does not need would cost a thread switch (a
hop of ``benchmarks/overhead.py`` (d) went from 2.2-2.5x to 2.0-2.1x the bare
pipeline's). No message, no heap, no protocol call per act: what is left per act is the
kernel, its waits and the count of buffers held.

Over ranks, what one rank waits for of another, MPI carries (a receive ends when the
data came; a send when the receiver posted its receive; a collective when every rank
joined). The rank's communication stream (``CommReplay``) runs on the transport's
thread: it starts its sends and receives in order, each once what it waits on ended,
and they end in any order, so a wait on one of them is a wait on that one alone. A
2-stage pipeline over 2 ranks went from 37,000-43,000 to 47,000-51,000 samples/s
(``actorflow launch -n 2 -- actorflow run configs/default.yaml``), its critical path
from 53-56% to 36% between kernels.

Where the rank replays a compute stream (``_rider``: its first), that stream's thread
drives the communication stream itself (it "rides" it): it starts its sends and receives
when their turn comes, ends those that completed (polling them after a kernel, at most
every ``POLL_EVERY``), and waits for the first of them to end when it has nothing else
to run (``ReplayStream._ride``). Before, the transport's thread polled beside the
kernels and took the rank's one core from them (a stage's kernels ran up to twice as
long); the same run went from 26-30k to 39-42k samples/s, against 65-69k for the same
stages in a bare MPI pipeline of one thread a rank.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from ..errors import RankError
from ..plan import Plan
from ..plan_check import transfer_peers
from ..text import count
from .cuda import Gpus
from .device import WaitChain
from .driver import Host
from .program import Program, rider
from .protocol import Act
from .transport import Transport
from .virtual import Entry
from .wiring import Unit, Wiring, arrays


class Special:
    """What an instruction does besides its kernel: read a feed, hand its result to the
    host (a fetch, or a traced span). Its act number in a run whose first step is
    ``first``, in block b: (first + b * period + step) * per_step + offset."""

    __slots__ = ("unit", "per_step", "offset", "feed", "report", "fetch", "acts")

    def __init__(self, unit: Unit, entry: Entry, acts: list[Act], recording: bool) -> None:
        self.unit = unit
        self.per_step = entry.per_step
        self.offset = entry.offset
        self.feed = unit.feed
        self.fetch = unit.fetch is not None
        self.report = recording or self.fetch
        self.acts = acts


POLL_EVERY = 200e-6
"""The most often a rider polls its sends and receives between kernels, where no other
stream waits on them (``Replay.poll_every``). Polled after each kernel, the default
config's stage 0 over 2 ranks polled 54 times a step, 20 µs each (MPI's progress, mostly
finding nothing new): a sixth of its thread's time. Its kernels take about 80 µs, so
now about every other one; a transfer the rider waits on, it waits for in MPI. 38.2k ->
43.1k samples/s, medians of five alternating pairs."""

WAKE = ()
"""What a stream puts in the inbox of one that waits on it: "look at the counts again"."""


class Replay:
    """Every stream of a replayed plan: its thread, its instructions, the counts they
    wait on, and the buffers held per register (``peaks``). Over ranks, the rank's
    communication stream (``CommReplay``) runs on the ``transport``'s thread, or on its
    ``rider``'s."""

    def __init__(
        self,
        plan: Plan,
        wiring: Wiring,
        program: Program,
        host: Host,
        recording: bool,
        gpus: Gpus | None = None,
        transport: Transport | None = None,
        traced: frozenset[int] | None = None,
    ) -> None:
        self.host = host
        self.traced = traced
        """Recording, the steps whose acts are timed and told to the host (None: all):
        the others' cost nothing more than an untraced run's."""
        self.gpus = gpus
        self.program = program
        self.plan = plan
        self.sizes = [len(block) for block in program.blocks]
        self.counts = [0] * len(self.sizes)
        """Per stream: instructions finished (or skipped) since the runtime opened; for a
        communication stream, those before its first unfinished one."""
        self.marks: list[int] = []
        """Per output with consumers, the buffers it took; per input, the ones it released."""
        self.peaks: dict[tuple[int, int], int] = {}
        """(actor id, output) -> the most buffers held at once."""
        self.inboxes: list[queue.SimpleQueue] = [
            transport.inbox if transport is not None and s.stream.kind == "comm" else queue.SimpleQueue()
            for s in wiring.streams
        ]
        self.closed = False
        self.steps = 0
        """Steps run since the runtime opened."""
        taken, released, released_by = self._held_slots(wiring)
        events = _events(wiring, program, gpus)
        self.comm = -1
        """The index of the communication stream (-1: none)."""
        self.rider = _rider(wiring, program, transport, gpus)
        """The index of the stream whose thread drives the communication stream (-1: the
        transport's thread does)."""
        self.poked = False
        """Another stream reached what the rider or its communication stream waits for,
        since the rider last looked (``poke``)."""
        self.sleeping = False
        """The rider sleeps on its inbox (nothing of its communication stream in flight)."""
        self.transport = transport
        self.ended: set[int] = set()
        """The communication stream's instructions past its count that ended."""
        self.streams: list[ReplayStream] = []
        for k, s in enumerate(wiring.streams):
            instructions = []
            units = []
            for j, entry in enumerate(program.blocks[k]):
                unit, acts = _local(wiring, entry)
                units.append(unit)
                ins, outs = arrays(unit, acts)
                kernel = unit.kernel
                if gpus is not None:
                    gpu_waits = [
                        events[w][(c - 1) % self.sizes[w]] for w, c in program.waits[k][j] if events[w]
                    ]
                    kernel = gpus.replayed(
                        kernel, s.stream.id, gpu_waits, events[k][j] if events[k] else None
                    )
                special = None
                if unit.feed is not None or unit.fetch is not None or recording:
                    special = Special(unit, entry, acts, recording)
                takes = []
                frees: list[int] = []
                for member, act in zip(unit.members, acts):
                    for out in act.takes:
                        key = (member.actor.id, out)
                        self.peaks.setdefault(key, 0)
                        if key in taken:
                            slots = released[key]
                            takes.append((taken[key], slots[0] if len(slots) == 1 else tuple(slots), key))
                        else:  # nobody reads it: one buffer, free again after its last write
                            self.peaks[key] = 1
                    frees.extend(released_by[(member.actor.id, slot)] for slot in act.releases)
                instructions.append(
                    (
                        kernel,
                        ins,
                        outs,
                        program.waits[k][j],
                        program.wakes[k][j],
                        special,
                        tuple(takes),
                        tuple(frees),
                        entry.step,
                    )
                )
            if s.stream.kind == "comm" and transport is not None:
                self.comm = k
                stream: ReplayStream = CommReplay(
                    self, k, s.stream.id, s.stream.name, instructions, units, transport, self.rider >= 0
                )
            else:
                stream = ReplayStream(self, k, s.stream.id, s.stream.name, instructions, units)
            self.streams.append(stream)
        others = (waits for k, block in enumerate(program.waits) if k != self.rider for waits in block)
        self.poll_every = 0.0 if any(s == self.comm for waits in others for s, _ in waits) else POLL_EVERY
        """How often at most the rider polls its sends and receives between kernels: after
        every kernel where another stream waits on one of them (it learns of the end so)."""
        self.kernel_streams = [
            self.streams[k]
            for k, s in enumerate(wiring.streams)
            if s.stream.kind in ("compute", "copy") and self.sizes[k]
        ]
        """The compute and copy streams with work: the threads a rank's transport keeps cores
        for (one with none stays idle)."""
        self.collective_streams = [
            self.streams[k] for k, s in enumerate(wiring.streams) if s.stream.kind == "collective"
        ]
        """The collective streams: a rider leaves MPI to them (``Transport.collective_ready``)."""

    def _held_slots(self, wiring: Wiring) -> tuple[dict, dict, dict]:
        """Places in ``marks``: per output with consumers, its count of buffers taken, and
        the counts of its consumers' inputs released (each written by one thread)."""
        taken: dict[tuple[int, int], int] = {}
        released: dict[tuple[int, int], list[int]] = {}
        released_by: dict[tuple[int, int], int] = {}
        for member in wiring.members.values():
            for k, output in enumerate(member.outputs):
                if not output.consumers:
                    continue
                taken[(member.actor.id, k)] = len(self.marks)
                self.marks.append(0)
                released[(member.actor.id, k)] = []
                for consumer, slot in output.consumers:
                    released_by[(consumer.actor.id, slot)] = len(self.marks)
                    released[(member.actor.id, k)].append(len(self.marks))
                    self.marks.append(0)
        return taken, released, released_by

    def start(self) -> None:
        for stream in self.streams:
            if stream.index != self.comm:  # the transport starts its thread
                stream.thread.start()

    def threads(self) -> list[threading.Thread]:
        """The streams' own threads (not the transport's)."""
        return [s.thread for s in self.streams if s.index != self.comm and s.thread.ident is not None]

    def working(self) -> bool:
        """Whether a compute or copy stream is running a kernel or can run its next one (a
        rank's ``Transport.busy``)."""
        return any(not s.idle and s.waiting is None for s in self.kernel_streams)

    def collective_ready(self) -> bool:
        """Whether a collective stream runs a collective or can start its next one: it does
        not wait, or what it waits for is reached (it may not have woken yet)."""
        for s in self.collective_streams:
            waiting = s.waiting
            if not s.idle and (waiting is None or self.reached(*waiting)):
                return True
        return False

    def reached(self, stream: int, need: int) -> bool:
        """Whether ``stream``'s count reached ``need``, or, on the communication stream,
        whose instructions end in any order, its instruction ``need - 1`` ended."""
        return self.counts[stream] >= need or (stream == self.comm and need - 1 in self.ended)

    def busy(self) -> int:
        """How many streams have work in a run (each tells ``Host.stream_finished``)."""
        return sum(1 for n in self.sizes if n)

    def run(self, steps: int) -> None:
        """Start a run of ``steps`` steps on every stream that has work."""
        spans = [self.program.span(k, steps) for k in range(len(self.sizes))]
        bases = list(self.counts)
        first = self.steps
        self.steps += steps
        starts = [s.start for s in spans]
        # a ridden stream's run first: its rider picks it up as it starts its own part
        for stream in sorted(self.streams, key=lambda s: s.index != self.rider_comm):
            if self.sizes[stream.index]:
                stream.hand(Run(steps, first, bases, starts, spans[stream.index]))

    def poke(self) -> None:
        """From a stream's thread other than the rider's: the rider or the communication
        stream it drives may go on; wake the rider wherever it waits (its inbox, or MPI)."""
        self.poked = True
        if self.sleeping:
            self.inboxes[self.rider].put(WAKE)
        assert self.transport is not None, "a rider drives a rank's communication stream"
        self.transport.wake(collectives=False)

    def is_poked(self) -> bool:
        """Whether a poke came since the rider last looked (its waits end on one)."""
        return self.poked

    @property
    def rider_comm(self) -> int:
        """The communication stream's index where a stream's thread drives it, else -1."""
        return self.comm if self.rider >= 0 else -1

    def close(self) -> None:
        """Stop every stream after its kernel in progress; wakes each wherever it waits
        (a rider waiting inside MPI too)."""
        self.closed = True
        for stream in self.streams:
            if stream.index != self.comm:  # the transport's thread stops with the transport
                stream.commands.put(None)
                self.inboxes[stream.index].put(None)
        if self.rider >= 0:
            self.poke()

    def release(self) -> None:
        """Let go of the instructions, and the buffers they name (``Wiring.release``),
        once every stream's thread ended."""
        for stream in self.streams:
            stream.instructions.clear()

    @property
    def progress(self) -> int:
        return sum(self.counts)

    def report(self) -> list[str]:
        """What each stream is doing: running a kernel, waiting on another stream's, or
        idle (for a StallError)."""
        return [f"  stream {stream.name} {stream.doing()}" for stream in self.streams]

    def chain(self, start: int | None = None) -> WaitChain:
        """``wait-for chain: a -> b -> c, which waits on ...``: from the next act of the
        first waiting stream (of actor ``start``'s stream, if given), to the act it waits
        for, to what that one's stream is doing, and so on: to a kernel running, or to
        another rank (a send or receive in flight waits on its peer, a collective over
        ranks on the participants there)."""
        lead = "" if start is not None else "wait-for chain: "
        at = self._chain_start(start)
        if at is None:
            return WaitChain(lead + "none: no stream waits and none is running a kernel")
        names: list[str] = []
        seen: set[int] = set()
        while True:
            k, g = at
            stream = self.streams[k]
            unit, number = stream._act(stream, g)
            names.append(unit.name)
            text = lead + " -> ".join(names)
            if k in seen:
                return WaitChain(text + " (a cycle)")
            seen.add(k)
            if isinstance(stream, CommReplay) and g < stream.started:  # in flight
                peer = transfer_peers(self.plan)[unit.actor.id]
                return WaitChain.across(
                    self.plan, text, peer.id, f"its {unit.actor.kind} waits on {peer.name!r}"
                )
            if stream.waiting is None:
                here = {m.actor.id for m in unit.members}  # a collective's participants on this rank
                elsewhere = [
                    a
                    for c in self.plan.collectives
                    if unit.actor.id in c.actors
                    for a in c.actors
                    if a not in here
                ]
                if elsewhere:
                    name = self.plan.actors[elsewhere[0]].name
                    return WaitChain.across(
                        self.plan, text, elsewhere[0], f"its collective waits on {name!r}"
                    )
                return WaitChain(
                    f"{text}, which waits on nothing: its stream {stream.name} is running "
                    f"{unit.name!r} (act {number})"
                )
            if isinstance(stream, CommReplay) and g != stream.started:  # behind the one it waits to start
                names.append(stream._act(stream, stream.started)[0].name)
            waited, count = stream.waiting
            at = (waited, count - 1 if isinstance(self.streams[waited], CommReplay) else self.counts[waited])

    def _chain_start(self, start: int | None) -> tuple[int, int] | None:
        """(stream, instruction) where a chain starts: see ``chain``."""
        if start is not None:
            stream = next(
                (s for s in self.streams if any(start in (m.actor.id for m in u.members) for u in s.units)),
                None,
            )
            if stream is None or stream.head() is None:
                return None
            if isinstance(stream, CommReplay):
                return stream.index, stream.pending(start)
            return stream.index, self.counts[stream.index]
        for streams in ([s for s in self.streams if s.waiting is not None], self.streams):
            for stream in streams:
                if stream.head() is not None:
                    return stream.index, self.counts[stream.index]
        return None


def _local(wiring: Wiring, entry: Entry) -> tuple[Unit, list[Act]]:
    """The unit of ``wiring`` that runs a simulated act, found by its actors (the
    simulation wired its own), and its members' acts: a collective over ranks was
    simulated as one unit of every participant."""
    acts = {m.actor.id: act for m, act in zip(entry.unit.members, entry.acts)}
    unit = next(wiring.members[a].unit for a in acts if a in wiring.members)
    return unit, [acts[m.actor.id] for m in unit.members]


def _events(wiring: Wiring, program: Program, gpus: Gpus | None) -> list[list[Any]]:
    """Per stream of a GPU, per instruction another stream waits on, the CUDA event it
    records after it; an empty list for a host stream. An instruction's event is recorded
    again in every block; a stream that comes to wait on it after the next record waits
    for more than it must, never less, and never on work queued after its own."""
    if gpus is None:
        return [[] for _ in program.blocks]
    return [
        [gpus.event() if wakes else None for wakes in program.wakes[k]] if gpus.on_gpu(s.stream.id) else []
        for k, s in enumerate(wiring.streams)
    ]


class Run(NamedTuple):
    """A run, as each stream is handed it: its steps, the first one's number since the
    runtime opened, every stream's count and first block when it began, and this
    stream's blocks."""

    steps: int
    first: int
    bases: list[int]
    starts: list[int]
    blocks: range


class ReplayStream:
    """One stream's thread, replaying its block of ``instructions`` for each run it is
    handed; ``units``: for each, the unit it launches."""

    def __init__(
        self,
        replay: Replay,
        index: int,
        plan_stream: int,
        name: str,
        instructions: list[tuple],
        units: list[Unit],
    ) -> None:
        self.replay = replay
        self.index = index
        self.name = name
        self.instructions = instructions
        self.units = units
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.current = Run(0, 0, [0] * len(replay.sizes), [0] * len(replay.sizes), range(0))
        self.waiting: tuple[int, int] | None = None
        """(stream, count) it waits for, while it waits."""
        self.idle = True
        """Between runs."""
        self.plan_stream = plan_stream
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def hand(self, run: Run) -> None:
        """Give this stream a run to replay."""
        self.commands.put(run)

    def _serve(self) -> None:
        replay = self.replay
        if replay.gpus is not None:
            replay.gpus.use(self.plan_stream)
        while (run := self.commands.get()) is not None and not replay.closed:
            self.current = run
            self.idle = False
            try:
                self._run(run)
            except RankError as exc:  # a rider's sends and receives failed, or the transport closed
                replay.host.fail_soon(exc)
                return
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the host
                unit, number = self._act(self, replay.counts[self.index])
                replay.host.fail_kernel_soon(exc, unit, number)
                return
            self.idle = True
            if replay.closed:
                return
            if replay.gpus is not None:
                try:
                    replay.gpus.finish(self.plan_stream)
                except BaseException as exc:  # noqa: BLE001 - a CUDA error of the run's work
                    replay.host.fail_soon(exc)
                    return
            replay.host.stream_finished()

    def _run(self, run: Run) -> None:
        replay = self.replay
        counts, marks, peaks, inboxes = replay.counts, replay.marks, replay.peaks, replay.inboxes
        inbox, streams = inboxes[self.index], replay.streams
        host, sizes, me, period = replay.host, replay.sizes, self.index, replay.program.period
        comm = replay.comm
        ended = replay.ended
        traced = replay.traced
        steps, bases, starts = run.steps, run.bases, run.starts
        clock = time.perf_counter
        rider = replay.rider
        ridden = streams[comm] if rider == me else None
        assert ridden is None or isinstance(ridden, CommReplay), "a rider drives a CommReplay"
        if ridden is not None:
            ridden.turn()
        poll_every = replay.poll_every
        polled = 0.0  # a rider polls its requests after a kernel, at most every poll_every
        done = counts[me]
        for block in run.blocks:
            at = [b + (block - start) * n for b, start, n in zip(bases, starts, sizes)]
            shift = block * period
            for kernel, ins, outs, waits, wakes, special, takes, frees, step in self.instructions:
                if 0 <= step + shift < steps:  # else an act of a step outside this run: skipped
                    for s, c in waits:
                        need = at[s] + c
                        if counts[s] < need and not (s == comm and need - 1 in ended):
                            self.waiting = (s, need)
                            if ridden is not None:
                                if not self._ride(ridden, s, need, s == comm):
                                    return
                                polled = clock() + poll_every  # its ride just polled
                            while counts[s] < need and not (s == comm and need - 1 in ended):
                                inbox.get()
                                if replay.closed:
                                    return
                            self.waiting = None
                    for slot, read, key in takes:
                        n = marks[slot] + 1
                        marks[slot] = n
                        held = n - (marks[read] if read.__class__ is int else min([marks[r] for r in read]))
                        if held > peaks[key]:
                            peaks[key] = held
                    if special is None:
                        kernel(ins, outs)
                    else:
                        iteration = run.first + shift + step
                        number = iteration * special.per_step + special.offset
                        args = ins if special.feed is None else [*ins, host.feed_value(special.feed, number)]
                        if special.report and (special.fetch or traced is None or iteration in traced):
                            start = clock()
                            result = kernel(args, outs)
                            host.completed(special.unit, number, result, start, clock(), special.acts)
                        else:
                            kernel(args, outs)
                    for f in frees:
                        marks[f] += 1
                done += 1
                counts[me] = done
                for w in wakes:
                    waiting = streams[w].waiting
                    if waiting is not None and waiting[0] == me and done >= waiting[1]:
                        if rider < 0 or w not in (comm, rider):
                            inboxes[w].put(WAKE)
                        elif ridden is not None:
                            ridden.turn()
                        else:
                            replay.poke()
                if ridden is not None:
                    news = replay.poked
                    if ridden.live and (now := clock()) >= polled:
                        polled = now + poll_every
                        news = ridden.poll() or news
                    if news:
                        ridden.turn()  # what ended, or another stream, may let it start more
        if ridden is not None:  # the run's sends and receives end before this stream's part
            self.waiting = (comm, ridden.end)
            finished = self._ride(ridden, comm, ridden.end, False)
            self.waiting = None
            if not finished:
                return

    def _ride(self, ridden: CommReplay, stream: int, need: int, alone: bool) -> bool:
        """The rider's wait for ``stream``'s count to reach ``need`` (``alone``: or for
        its instruction ``need - 1`` alone to end, as a wait on a communication stream's
        instruction is), driving its communication stream meanwhile: it starts what can
        start, ends what completed, and waits for one of
        its requests in flight as a collective does (``Transport.wait``: inside MPI while
        the rank has a core for it, else polling with back-off), or on its inbox where
        none is; another stream's thread that reaches what either waits for ``poke``s it.
        False if the replay closed meanwhile."""
        replay = self.replay
        inbox, counts, ended = replay.inboxes[self.index], replay.counts, replay.ended
        while True:
            replay.poked = False
            if ridden.live:
                ridden.poll()
            ridden.turn()
            if replay.closed:
                return False
            if counts[stream] >= need or (alone and need - 1 in ended):
                return True
            if ridden.live:
                ridden.wait(replay.is_poked)
                continue
            replay.sleeping = True
            if not replay.poked:
                inbox.get()
            replay.sleeping = False

    def _act(self, stream: ReplayStream, count: int) -> tuple[Unit, int]:
        """The unit and act number of ``stream``'s instruction ``count`` (counted since the
        runtime opened), in the current run."""
        run = self.current
        block, place = divmod(count - run.bases[stream.index], self.replay.sizes[stream.index])
        entry = self.replay.program.blocks[stream.index][place]
        step = entry.step + (run.starts[stream.index] + block) * self.replay.program.period
        return stream.units[place], (run.first + step) * entry.per_step + entry.offset

    def head(self) -> tuple[Unit, int] | None:
        """The unit and act number of the instruction this stream runs or waits to run,
        or None when it is done with the current run."""
        replay = self.replay
        at = replay.counts[self.index] - self.current.bases[self.index]
        if at >= len(self.current.blocks) * replay.sizes[self.index]:
            return None
        return self._act(self, replay.counts[self.index])

    def doing(self) -> str:
        """For the stall report: the kernel it runs, the kernel of another stream it waits
        for, or that it is idle."""
        head = self.head()
        if head is None:
            return "is idle"
        if self.waiting is not None:
            stream, count = self.waiting
            other = self.replay.streams[stream]
            unit, number = self._act(other, count - 1)
            return f"waits to run {head[0].name!r}: on stream {other.name}, for {unit.name!r} (act {number})"
        return f"is still running {head[0].name!r} (act {head[1]})"


class CommReplay(ReplayStream):
    """A rank's communication stream (its sends and receives over MPI), replayed on the
    transport's thread between its polls (``Transport.serve``), or by its rider
    (``turn``, ``poll``; ``ReplayStream._ride``): it starts each
    instruction in its program's order once what it waits on has ended, and their
    requests end in any order. ``replay.counts`` holds the instructions before its first
    unfinished one, ``ended`` those past it that ended: a stream waiting on one of its
    instructions waits for that one alone."""

    def __init__(
        self,
        replay: Replay,
        index: int,
        plan_stream: int,
        name: str,
        instructions: list[tuple],
        units: list[Unit],
        transport: Transport,
        ridden: bool,
    ) -> None:
        super().__init__(replay, index, plan_stream, name, instructions, units)
        self.transport = transport
        self.thread = transport.thread
        self.commands = transport.inbox
        self.ended = replay.ended
        self.runs: collections.deque[Run] = collections.deque()
        self.started = 0
        """Instructions started (or skipped) since the runtime opened."""
        self.end = 0
        """``replay.counts`` once the current run ended."""
        self.ridden = ridden
        """Driven by a stream's thread (``Replay.rider``), not the transport's."""
        self.live: dict[int, tuple[Any, Callable[[BaseException | None], None]]] = {}
        """Ridden: instruction -> its MPI request in flight and what ends it."""
        if not ridden:
            transport.serve(self._turn)

    def pending(self, actor: int) -> int:
        """Its first unfinished instruction of ``actor`` in the current run (or the next
        to start, if none)."""
        run, size = self.current, self.replay.sizes[self.index]
        for g in range(self.replay.counts[self.index], self.end):
            if g not in self.ended and any(
                m.actor.id == actor for m in self.units[(g - run.bases[self.index]) % size].members
            ):
                return g
        return self.started

    def hand(self, run: Run) -> None:
        """Give this stream a run: through the transport's inbox, or to its rider, who
        picks it up at its next ``turn``."""
        if self.ridden:
            self.runs.append(run)
        else:
            self.commands.put(run)

    def turn(self) -> None:
        """On its rider's thread: start what can start (a run handed over included)."""
        self._turn(())

    def poll(self) -> bool:
        """On its rider's thread: end the instructions whose requests completed; whether
        any did."""
        live = self.live
        with self._mpi_failures():
            self.transport.MPI.Request.Testsome([request for request, _ in live.values()])
        ended = [(g, done) for g, (request, done) in live.items() if not request]  # MPI nulls them
        for g, done in ended:
            del live[g]
            done(None)
        return bool(ended)

    def wait(self, until: Callable[[], bool]) -> None:
        """On its rider's thread: wait until one of its requests in flight completed, or
        ``until()``, as a collective waits (``Transport.wait``)."""
        with self._mpi_failures():
            self.transport.wait([request for request, _ in self.live.values()], until, every=False)

    @contextlib.contextmanager
    def _mpi_failures(self) -> Iterator[None]:
        """An MPI error on the rider's thread fails the rank, as on the transport's."""
        MPI = self.transport.MPI
        try:
            yield
        except MPI.Exception as exc:
            raise RankError(f"rank {self.transport.rank}: MPI failed: {exc}") from None

    def _turn(self, messages: Iterable[Any]) -> None:
        """A turn of the transport's loop that heard news (runs handed over, wake-ups, ended
        requests), or of its rider: start what can start."""
        self.runs.extend(m for m in messages if m.__class__ is Run)
        while not self.replay.closed:
            if self.idle:
                if not self.runs:
                    return
                run = self.current = self.runs.popleft()
                self.idle = False
                self.end = run.bases[self.index] + len(run.blocks) * self.replay.sizes[self.index]
                self._finish()  # a run with no instruction here ends at once
            if self.idle or not self._advance():
                return

    def doing(self) -> str:
        """For the stall report: its requests in flight, and the instruction it waits to
        start."""
        head = self.head()
        if head is None:
            return "is idle"
        flight = self.started - self.replay.counts[self.index] - len(self.ended)
        text = f"has {count(flight, 'send or receive', 'sends and receives')} in flight"
        if flight:
            text += f", the first {head[0].name!r} (act {head[1]})"
        if self.waiting is not None:
            unit, number = self._act(self, self.started)
            stream, need = self.waiting
            other = self.replay.streams[stream]
            waited, waited_number = self._act(other, need - 1)
            text += (
                f"; waits to start {unit.name!r} (act {number}): on stream {other.name}, "
                f"for {waited.name!r} (act {waited_number})"
            )
        return text

    def _advance(self) -> bool:
        """Start the current run's instructions, in order, while what they wait on has
        ended; whether the run ended meanwhile."""
        replay, run, me = self.replay, self.current, self.index
        sizes, period, marks, peaks = replay.sizes, replay.program.period, replay.marks, replay.peaks
        traced = replay.traced
        while self.started < self.end:
            g = self.started
            b, j = divmod(g - run.bases[me], sizes[me])
            block = run.blocks.start + b
            kernel, ins, outs, waits, wakes, special, takes, frees, step = self.instructions[j]
            if 0 <= step + block * period < run.steps:
                for s, c in waits:
                    need = run.bases[s] + (block - run.starts[s]) * sizes[s] + c
                    if not self.replay.reached(s, need):
                        self.waiting = (s, need)  # then look again: a stream reads it after its count
                        if not self.replay.reached(s, need):
                            return False
                    self.waiting = None
                for slot, read, key in takes:
                    marks[slot] += 1
                    held = marks[slot] - (
                        marks[read] if read.__class__ is int else min([marks[r] for r in read])
                    )
                    peaks[key] = max(peaks[key], held)
                number = -1
                if special is not None:  # recording: a send or receive is never fed or fetched
                    iteration = run.first + block * period + step
                    if traced is None or iteration in traced:
                        number = iteration * special.per_step + special.offset
                    else:
                        special = None  # an untraced step's: not told to the host
                self._start(g, kernel, ins, outs, wakes, frees, special, number)
            else:
                self._ended(g, wakes)
            self.started += 1
        return self.idle

    def _start(
        self,
        g: int,
        kernel: Callable,
        ins: list,
        outs: list,
        wakes: tuple[int, ...],
        frees: tuple[int, ...],
        special: Special | None,
        number: int,
    ) -> None:
        began = time.perf_counter()
        replay, transport = self.replay, self.transport

        def done(error: BaseException | None) -> None:
            if error is not None:
                replay.host.fail_kernel_soon(error, *self._act(self, g))
                return
            for f in frees:
                replay.marks[f] += 1
            if special is not None:
                replay.host.completed(special.unit, number, None, began, time.perf_counter(), special.acts)
            self._ended(g, wakes)

        if not self.ridden:
            transport.submit(lambda: kernel(ins, outs, transport.data), done, moving=bool(ins))
            return
        try:
            request = kernel(ins, outs, transport.data)
        except Exception as exc:  # noqa: BLE001 - the host hears of it
            done(exc)
            return
        self.live[g] = (request, done)

    def _ended(self, g: int, wakes: tuple[int, ...]) -> None:
        """Instruction g ended: count it, wake the streams that wait on it, and end the run
        with its last."""
        replay, me, counts = self.replay, self.index, self.replay.counts
        if g == counts[me]:
            c = g + 1
            while c in self.ended:
                c += 1
            counts[me] = c  # before they leave ``ended``: a reader sees one or the other
            for x in range(g + 1, c):
                self.ended.discard(x)
        else:
            self.ended.add(g)
        for w in wakes:
            waiting = replay.streams[w].waiting
            if (
                waiting is not None
                and waiting[0] == me
                and self.replay.reached(me, waiting[1])
                and w not in (replay.rider, replay.rider_comm)
            ):
                replay.inboxes[w].put(WAKE)
        self._finish()

    def _finish(self) -> None:
        """End the current run if all its instructions ended."""
        if not self.idle and self.replay.counts[self.index] >= self.end:
            self.idle = True
            self.replay.host.stream_finished()


def _rider(wiring: Wiring, program: Program, transport: Transport | None, gpus: Gpus | None) -> int:
    """The stream whose thread drives the rank's communication stream, or -1 (its
    transport's thread does; ``program.rider``). Where the rank runs a stream of kernels
    (a stage of a pipeline over ranks; the first, of a rank of several devices), that
    stream's thread starts the sends and receives as their turn comes and, when it waits
    on one, waits inside MPI, as a bare MPI program's one thread does: no hand-off to the
    transport's thread and back per transfer, and no thread polling beside the kernels.
    Not over GPUs, nor where this rank may survive the loss of another (the transport's
    thread tells a lost peer's failed request from other MPI errors). The other streams'
    threads (another device's compute stream, a copy stream's large moves) wait on the
    communication stream as before."""
    if transport is None or gpus is not None or transport.losable:
        return -1
    return rider([s.stream.kind if program.blocks[k] else None for k, s in enumerate(wiring.streams)])
