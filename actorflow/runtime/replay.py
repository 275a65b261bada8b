"""Replay: the protocol runs once, ahead of time, on a virtual clock, and each stream
then replays the order it decided ("thick compile, thin runtime", as MindSpore's
execution order, DeepSpeed's pipe instructions, Ray Compiled Graphs' schedules and
torch pipelining's action lists do).

``schedule`` simulates a few steps of a Plan on the virtual clock (``virtual``: the very
protocol, wiring and launch choice the stream threads' drivers use), every act taking
one tick, which records for each act what it waited on. The steps of
the simulation repeat (every ``period`` steps, the same acts in the same order on each
stream, with the same buffers): one period becomes each stream's program. A dependency
on another stream becomes a wait on that stream's count of finished instructions, like
a CUDA stream waiting on an event another recorded; on its own stream, order implies it.

``ReplayStream`` runs one stream's program on its own thread, step after step: wait on
the other streams' counts, call the kernel, count, and wake the streams that wait on
this instruction (each has an inbox of wake-ups, a ``SimpleQueue``: a wake-up only says
"look at the counts again"). A stream is woken only when it sleeps on this stream's
count and the count now reaches what it waits for (it says so in ``waiting`` before it
looks at the count a last time and sleeps): a wake-up it does not need would cost a
thread switch (a hop of ``benchmarks/overhead.py`` (d) went from 2.2-2.5x to 2.0-2.1x
the bare pipeline's). No message, no heap, no protocol call per act: what is left per
act is the kernel, its waits and the count of buffers held.

Plans the simulation can't turn into such a program run on the drivers instead
(``schedule`` says why).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from typing import Any, NamedTuple

import attrs

from ..plan import Plan
from .cuda import Gpus
from .driver import Host
from .virtual import Entry, simulate
from .wiring import Unit, Wiring, acts_in, arrays, wire

MAX_PERIOD = 16
"""Steps within which a schedule must repeat to be replayed."""
MAX_SIMULATED_ACTS = 300_000
"""The most acts a simulation may take (about 3 s): a larger plan runs on the drivers,
so that opening a Runtime stays quick."""


def replayable(plan: Plan) -> str | None:
    """Why ``plan`` runs on the drivers instead, or None if it can be replayed."""
    if plan.world > 1:
        return "it spans ranks"
    if not plan.overlap:
        return "collectives hold their compute streams (overlap off)"
    if any(a.calls > 1 for a in plan.actors):
        return "it reuses communication subgraphs"
    if any(plan.as_arriving(a) for a in plan.actors):
        return "its updates apply gradients as they arrive (async parameter servers)"
    return None


@attrs.frozen
class Program:
    """Per stream, one block of instructions: the acts the stream runs in ``period``
    steps, in the simulation's order, which repeats block after block with every act's
    step advanced by ``period``. ``blocks[k][j]``: the simulation's act at place j of
    stream k's block 0 (its ``step`` is the one block 0 runs it for); ``waits[k][j]``:
    (stream, c): "that stream has finished c instructions of this block's counterpart
    there" (c counts from its block 0's start, and may point into earlier blocks);
    ``wakes[k][j]``: the streams that wait on instruction j of stream k."""

    period: int
    blocks: list[list[Entry]]
    waits: list[list[tuple[tuple[int, int], ...]]]
    wakes: list[list[tuple[int, ...]]]

    def span(self, k: int, steps: int) -> range:
        """The blocks of stream k a run of ``steps`` steps runs (some of their acts,
        at the edges, fall outside the run and are skipped)."""
        block = self.blocks[k]
        if not block:
            return range(0)
        lo, hi = min(e.step for e in block), max(e.step for e in block)
        return range(-(hi // self.period), (steps - 1 - lo) // self.period + 1)


def schedule(plan: Plan, rank: int) -> Program | str:
    """The streams' program for ``plan`` on ``rank``, or why there is none: the plan is
    not ``replayable``, or too large to simulate quickly, or its simulation stalls or
    does not settle into a repeating order within ``MAX_PERIOD`` steps a period."""
    if (why := replayable(plan)) is not None:
        return why
    quotas = [r.quota for r in plan.registers if not r.is_parameter] or [1]
    period = math.lcm(*quotas, *(plan.phases(a) for a in plan.actors))
    if period > MAX_PERIOD:
        return f"its quotas and phases repeat every {period} steps, more than {MAX_PERIOD}"
    total = 6 * period + 6  # a lead of up to a period at both ends, the block checked 2 back and 1 on
    local = [a for a in plan.actors if plan.rank_of(a.device) == rank]
    if sum(acts_in(a, total * plan.micro_batches) for a in local) > MAX_SIMULATED_ACTS:
        return f"simulating it would take over {MAX_SIMULATED_ACTS} acts"
    ran = simulate(wire(plan, rank, allocate=False), plan.micro_batches, total)
    if ran is None:
        return "it can stall (its simulation did)"
    starts = []
    for entries in ran:
        per_step = len(entries) // total  # the stream's acts a step
        size = per_step * period
        start = (3 * period + 2) * per_step
        for i in range(start - 2 * size, start + size):
            here, there = entries[i], entries[i + size]
            if here.key() != there.key() or there.step != here.step + period:
                return "its simulated order does not repeat"
        for i, entry in enumerate(entries):
            entry.place = i - start
        starts.append((start, size))
    blocks = [entries[start : start + size] for entries, (start, size) in zip(ran, starts)]
    waits: list[list[tuple[tuple[int, int], ...]]] = []
    wakes: list[list[set[int]]] = [[set() for _ in block] for block in blocks]
    for k, block in enumerate(blocks):
        waits.append([])
        for entry in block:
            need: dict[int, tuple[int, Entry]] = {}
            for dep in entry.deps:
                if dep.stream == k:
                    continue
                if dep.place < -2 * starts[dep.stream][1]:
                    return "its simulated acts wait further back than the order was checked"
                c = dep.place + 1
                if dep.stream not in need or c > need[dep.stream][0]:
                    need[dep.stream] = (c, dep)
            for stream, (_, dep) in need.items():
                wakes[stream][dep.place % starts[stream][1]].add(k)
            waits[k].append(tuple((s, c) for s, (c, _) in sorted(need.items())))
    return Program(period, blocks, waits, [[tuple(sorted(w)) for w in block] for block in wakes])


class Special:
    """What an instruction does besides its kernel: read a feed, hand its result to the
    host (a fetch, or a traced span). Its act number in a run whose first step is
    ``first``, in block b: (first + b * period + step) * per_step + offset."""

    __slots__ = ("unit", "per_step", "offset", "feed", "report", "acts")

    def __init__(self, unit: Unit, entry: Entry, recording: bool) -> None:
        self.unit = unit
        self.per_step = entry.per_step
        self.offset = entry.offset
        self.feed = unit.feed
        self.report = recording or unit.fetch is not None
        self.acts = entry.acts


class Replay:
    """Every stream of a replayed plan: its thread, its instructions, the counts they
    wait on, and the buffers held per register (``peaks``)."""

    def __init__(
        self, wiring: Wiring, program: Program, host: Host, recording: bool, gpus: Gpus | None = None
    ) -> None:
        self.host = host
        self.gpus = gpus
        self.program = program
        self.sizes = [len(block) for block in program.blocks]
        self.counts = [0] * len(self.sizes)
        """Per stream: instructions finished (or skipped) since the runtime opened."""
        self.marks: list[int] = []
        """Per output with consumers, the buffers it took; per input, the ones it released."""
        self.peaks: dict[tuple[int, int], int] = {}
        """(actor id, output) -> the most buffers held at once."""
        self.inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.sizes]
        self.closed = False
        self.steps = 0
        """Steps run since the runtime opened."""
        taken, released, released_by = self._held_slots(wiring)
        events = _events(wiring, program, gpus)
        self.streams: list[ReplayStream] = []
        for k, s in enumerate(wiring.streams):
            instructions = []
            units = []
            for j, entry in enumerate(program.blocks[k]):
                unit = wiring.units[entry.unit.id]  # the real unit of the simulated one
                units.append(unit)
                ins, outs = arrays(unit, entry.acts)
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
                    special = Special(unit, entry, recording)
                takes = []
                frees: list[int] = []
                for member, act in zip(unit.members, entry.acts):
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
            self.streams.append(ReplayStream(self, k, s.stream.id, s.stream.name, instructions, units))

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
            stream.thread.start()

    def threads(self) -> list[threading.Thread]:
        return [s.thread for s in self.streams if s.thread.ident is not None]

    def busy(self) -> int:
        """How many streams have work in a run (each tells ``Host.stream_finished``)."""
        return sum(1 for n in self.sizes if n)

    def run(self, steps: int) -> None:
        """Start a run of ``steps`` steps on every stream that has work."""
        spans = [self.program.span(k, steps) for k in range(len(self.sizes))]
        bases = list(self.counts)
        first = self.steps
        self.steps += steps
        for stream in self.streams:
            if self.sizes[stream.index]:
                stream.commands.put(Run(steps, first, bases, [s.start for s in spans], spans[stream.index]))

    def close(self) -> None:
        """Stop every stream after its kernel in progress; wakes each wherever it waits."""
        self.closed = True
        for stream in self.streams:
            stream.commands.put(None)
            self.inboxes[stream.index].put(None)

    @property
    def progress(self) -> int:
        return sum(self.counts)

    def report(self) -> list[str]:
        """What each stream is doing (running a kernel, or waiting on another stream's),
        and the wait-for chain from the first waiting stream to the kernel everything
        waits on."""
        return [f"  stream {stream.name} {stream.doing()}" for stream in self.streams] + [self.chain()]

    def chain(self) -> str:
        """``wait-for chain: a -> b -> c, which waits on nothing: ...``: from the next act of
        the first waiting stream, to the act it waits for, to what that one's stream is
        doing, and so on."""
        stream = next((s for s in self.streams if s.waiting is not None), None)
        if stream is None:
            stream = next((s for s in self.streams if s.head() is not None), None)
            if stream is None:
                return "wait-for chain: none: no stream waits and none is running a kernel"
        names: list[str] = []
        seen: set[int] = set()
        while True:
            head = stream.head()
            assert head is not None, "a waiting or running stream has its next act"
            names.append(head[0].name)
            if stream.index in seen:
                return "wait-for chain: " + " -> ".join(names) + " (a cycle)"
            seen.add(stream.index)
            if stream.waiting is None:
                unit, number = head
                return (
                    "wait-for chain: " + " -> ".join(names) + ", which waits on nothing: "
                    f"its stream {stream.name} is running {unit.name!r} (act {number})"
                )
            stream = self.streams[stream.waiting[0]]


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
        self.plan_stream = plan_stream
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def _serve(self) -> None:
        replay = self.replay
        if replay.gpus is not None:
            replay.gpus.use(self.plan_stream)
        while (run := self.commands.get()) is not None and not replay.closed:
            self.current = run
            try:
                self._run(run)
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the host
                unit, number = self._act(self, replay.counts[self.index])
                replay.host.fail_kernel_soon(exc, unit, number)
                return
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
        steps, bases, starts = run.steps, run.bases, run.starts
        clock = time.perf_counter
        done = counts[me]
        for block in run.blocks:
            at = [b + (block - start) * n for b, start, n in zip(bases, starts, sizes)]
            shift = block * period
            for kernel, ins, outs, waits, wakes, special, takes, frees, step in self.instructions:
                if 0 <= step + shift < steps:  # else an act of a step outside this run: skipped
                    for s, c in waits:
                        need = at[s] + c
                        if counts[s] < need:
                            self.waiting = (s, need)
                            while counts[s] < need:
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
                        number = (run.first + shift + step) * special.per_step + special.offset
                        args = ins if special.feed is None else [*ins, host.feed_value(special.feed, number)]
                        if special.report:
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
                        inboxes[w].put(None)

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
