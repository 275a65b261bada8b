"""The streams' programs of a replayed run ("thick compile, thin runtime", as MindSpore's
execution order, DeepSpeed's pipe instructions, Ray Compiled Graphs' schedules and
torch pipelining's action lists do): the protocol runs once, ahead of time, on a virtual
clock, and each stream's order of acts becomes the program it replays (``replay``).

``schedule`` simulates a few steps of a Plan on the virtual clock (``virtual``: the very
protocol, wiring and launch choice the stream threads' drivers use), every act taking
one tick, which records for each act what it waited on. The steps of
the simulation repeat (every ``period`` steps, the same acts in the same order on each
stream, with the same buffers): one period becomes each stream's program. A dependency
on another stream becomes a wait on that stream's count of finished instructions, like
a CUDA stream waiting on an event another recorded; on its own stream, order implies it.

Over ranks, every rank simulates the whole plan the same way, its sends meeting their
receives as MPI's synchronous sends do, and keeps its own streams' programs: what one
rank waits for of another, MPI carries. Its communication stream's instructions end in
any order, so a wait on one of them is a wait on that one alone.

Plans the simulation can't turn into such a program run on the drivers instead
(``schedule`` says why).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import attrs

from ..collector import cyclic_gc_paused
from ..plan import Plan
from .virtual import Entry, Timing, meets, simulate
from .wiring import Member, StreamWiring, Wiring, acts_in, wire

MAX_PERIOD = 16
"""Steps within which a schedule must repeat to be replayed."""
SHORT_LEAD = 2
"""The steps before the blocks a schedule's simulation first checks (2 periods back, the
block, 1 on). It checks as it goes: as soon as every stream has run a step past those
blocks, then one step later, and so on up to a lead of a period and 2 steps, and ends at
the first that repeats (the shipped configs' do at the first; a fifth of the random plans
of the property tests need a later one). Its length leaves a tail of a period and 4 steps
after the last. It once simulated 2 steps past the first check's blocks, and afresh for
the second check with the full tail."""
NOT_YET = "its simulation has not run that far"
"""Why a check found no program yet: some stream's acts stop short of its blocks."""
STALLS = "it can stall (its simulation did)"
"""Why a plan whose simulation stalled is not replayed (the drivers will say where)."""
MAX_SIMULATED_ACTS = 300_000
"""The most acts a simulation may take (about 3 s): a larger plan runs on the drivers,
so that opening a Runtime stays quick."""


def replayable(plan: Plan) -> str | None:
    """Why ``plan`` runs on the drivers instead, or None if it can be replayed."""
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
    there" (c counts from its block 0's start, and may point into earlier blocks); on a
    communication stream, whose instructions end in any order: "its instruction c - 1
    of that block ended"; ``wakes[k][j]``: the streams that wait on instruction j of stream k."""

    period: int
    blocks: list[list[Entry]]
    waits: list[list[tuple[tuple[int, int], ...]]]
    wakes: list[list[tuple[int, ...]]]
    edges: list[tuple[int, int] | None] = attrs.field(init=False)
    """Per stream, the first and last step its block 0 runs an act for (None: no acts),
    which every run's ``span`` reads (worked out at each run, a 1-step run's fifth)."""

    @edges.default
    def _edges(self) -> list[tuple[int, int] | None]:
        return [(min(e.step for e in b), max(e.step for e in b)) if b else None for b in self.blocks]

    def forget_deps(self) -> None:
        """Empty the acts' ``deps``, which the waits were worked out from: they lead back
        through the whole simulation, which would live as long as the program (a runtime
        that replays it drops them; a 399-actor plan's run left 54.8k objects of cyclic
        garbage with them, 35.6k without)."""
        for block in self.blocks:
            for entry in block:
                entry.deps = []

    def span(self, k: int, steps: int) -> range:
        """The blocks of stream k a run of ``steps`` steps runs (some of their acts,
        at the edges, fall outside the run and are skipped)."""
        edges = self.edges[k]
        if edges is None:
            return range(0)
        lo, hi = edges
        return range(-(hi // self.period), (steps - 1 - lo) // self.period + 1)


@cyclic_gc_paused()
def schedule(plan: Plan, rank: int | None) -> Program | str:
    """The streams' program for ``plan`` on ``rank`` (None: every rank's streams, as
    ``actorflow simulate`` runs them), or why there is none: the plan is not
    ``replayable``, or too large to simulate quickly, or its simulation stalls before
    its order repeats, or the order does not settle within ``MAX_PERIOD`` steps a period
    (a replay runs the repeating blocks alone, acts outside the run skipped, so how a
    simulation would have ended does not matter).

    A plan over ranks is simulated whole, every rank the same way, its sends meeting
    their receives as MPI's synchronous sends do (``virtual.meets``); each rank keeps
    its own streams' acts (a collective over ranks on the stream of its participants
    here) and waits only on them: MPI carries what one rank waits for of another."""
    if (why := replayable(plan)) is not None:
        return why
    period = steps_to_repeat(plan)
    if period > MAX_PERIOD:
        return f"its quotas and phases repeat every {period} steps, more than {MAX_PERIOD}"
    whole = plan.world > 1 or rank is None
    simulated = [a for a in plan.actors if whole or plan.rank_of(a.device) == rank]
    if sum(acts_in(a, _steps(period) * plan.micro_batches) for a in simulated) > MAX_SIMULATED_ACTS:
        return f"simulating it would take over {MAX_SIMULATED_ACTS} acts"
    found = _programs(plan, None if whole else rank, period)
    if isinstance(found, str):
        return found
    return found[0 if rank is None or plan.world == 1 else 1 + rank]


def _steps(period: int) -> int:
    """The steps a simulation runs: a lead of a period and 2, the 4 periods ``_repeats``
    checks, a tail of a period and 4."""
    return (period + 2) + 4 * period + (period + 4)


def _programs(plan: Plan, rank: int | None, period: int) -> list[Program] | str:
    """One simulation of ``plan`` (``rank``'s part of it, None: the whole), from the
    protocol's state afresh, checked as it goes (``SHORT_LEAD``), and at its end at the
    leads not checked yet: the whole plan's program and, over ranks, every rank's (each
    rank checks them all, so that all replay or none does), or why there are none."""
    wiring = wire(plan, rank, allocate=False)
    ticks = Timing([1.0] * len(wiring.units), meets=meets(plan, wiring))
    per_step = [sum(acts_in(u.actor, plan.micro_batches) for u in s.units) for s in wiring.streams]
    landing = _landing(plan, wiring) if plan.world > 1 else None
    leads = range(SHORT_LEAD, period + 3)
    verdicts: list[list[Program] | str] = []  # per lead checked
    short = 0  # the stream found short last time: asked first
    more = 0  # steps more to wait for, where a rank's stream was short

    def settled(ran: list[list[Entry]], waiting: bool = True) -> bool:
        nonlocal short, more
        while not verdicts or isinstance(verdicts[-1], str):
            if len(verdicts) == len(leads):
                return False
            lead = leads[len(verdicts)]
            past = lead + 4 * period + 1 + more  # a step past its blocks
            if waiting and len(ran[short]) < past * per_step[short]:
                return False
            for k, (entries, n) in enumerate(zip(ran, per_step) if waiting else ()):
                if len(entries) < past * n:
                    short = k
                    return False
            verdict = _check(plan, wiring, landing, ran, per_step, period, lead)
            if verdict == NOT_YET:  # a rank's stream gathers several simulated ones' acts
                more += 1
                return False
            more = 0
            verdicts.append(verdict)
        return True

    ran = simulate(wiring, plan.micro_batches, _steps(period), timing=ticks, enough=settled)
    if ran is None:
        return STALLS
    settled(ran, waiting=False)
    return verdicts[-1]


def _check(
    plan: Plan,
    wiring: Wiring,
    landing: _Landing | None,
    ran: list[list[Entry]],
    per_step: list[int],
    period: int,
    lead: int,
) -> list[Program] | str:
    """The programs of a simulation's acts so far (``ran``; ``per_step``: each stream's
    acts a step; ``landing``: where they land over ranks), from blocks ``lead`` steps in,
    or why there are none (``NOT_YET``: a stream has not run past them)."""
    kept = _kept(landing, ran) if landing is not None else []
    programs = []
    for r, (streams, counts) in [(None, (ran, per_step)), *enumerate(kept)]:
        if any(len(entries) < (lead + 4 * period) * n for entries, n in zip(streams, counts)):
            return NOT_YET
        starts = _repeats(streams, counts, period, lead)
        if starts is None:
            return "its simulated order does not repeat"
        comm = [w.stream.kind == "comm" for w in _streams(plan, wiring, r)]
        program = _program(period, streams, starts, comm)
        if isinstance(program, str):
            return program
        programs.append(program)
    return programs


def steps_to_repeat(plan: Plan) -> int:
    """Every how many steps a run's acts come back with the same buffers and phases: an
    output of quota q taken t times a step cycles through its buffers every q / gcd(q, t)
    steps (taken in turn), and an actor's acts through its phases likewise. Counting
    quotas and phases as steps made the default config's plan repeat every 4 steps; its
    buffers come round every 2 (those of quota 2 taken once a step), so opening a
    runtime simulates 18 steps instead of 30 (54 against 110 ms here; the transformer
    at 8 micro-batches, 0.9 against 3.3 s). And 4 stages under 1F1B at 8 micro-batches
    (quotas 4, 3, 2, 1) repeat every 6 steps, where 24 was past ``MAX_PERIOD``: they
    replay, where the drivers ran them (the default config so, 7.8-8.3k -> 13.4-15.2k
    samples/s, the same losses)."""
    cycles = [1]
    for actor in plan.actors:
        acts = acts_in(actor, plan.micro_batches)  # a step's
        cycles.append(_cycle(plan.phases(actor), acts))
        for out in actor.outputs:
            register = plan.registers[out]
            if not register.is_parameter:
                cycles.append(_cycle(register.quota, acts // plan.period(actor, out)))
    return math.lcm(*cycles)


def _cycle(length: int, per_step: int) -> int:
    """Steps until ``per_step`` turns a step through a cycle of ``length`` come back to its
    start."""
    return length // math.gcd(length, per_step) if per_step else 1


def _program(
    period: int, streams: list[list[Entry]], starts: list[tuple[int, int]], comm: list[bool]
) -> Program | str:
    """The program of ``streams``' simulated acts, from each one's repeating block
    (``_repeats``' ``starts``): an act waits on the last act it needs of a stream whose
    acts end in order, on each act it needs of a communication stream (``comm``: its
    acts end in any order), and on none of another rank's; or why there is none (an act
    needs one further back than the repetition was checked)."""
    where = {
        id(entry): (k, i - start)
        for k, (entries, (start, _)) in enumerate(zip(streams, starts))
        for i, entry in enumerate(entries)
    }
    blocks = [entries[start : start + size] for entries, (start, size) in zip(streams, starts)]
    waits: list[list[tuple[tuple[int, int], ...]]] = []
    wakes: list[list[set[int]]] = [[set() for _ in block] for block in blocks]
    for k, block in enumerate(blocks):
        waits.append([])
        for entry in block:
            need: dict[int, int] = {}  # per stream whose acts end in order, the last one waited on
            each: set[tuple[int, int]] = set()  # on a comm stream, whose acts end in any order: each
            for dep in entry.deps:
                if id(dep) not in where:  # another rank's act
                    continue
                stream, place = where[id(dep)]
                if stream == k and not comm[k]:  # order implies it
                    continue
                if place < -2 * starts[stream][1]:
                    return "its simulated acts wait further back than the order was checked"
                if comm[stream]:
                    each.add((stream, place + 1))
                else:
                    need[stream] = max(need.get(stream, place + 1), place + 1)
            for stream, c in (*need.items(), *each):
                wakes[stream][(c - 1) % starts[stream][1]].add(k)
            waits[k].append(tuple(sorted((*need.items(), *each))))
    return Program(period, blocks, waits, [[tuple(sorted(w)) for w in block] for block in wakes])


def _repeats(
    streams: list[list[Entry]], per_step: list[int], period: int, lead: int
) -> list[tuple[int, int]] | None:
    """Per stream of a simulation (``per_step``: its acts a step), (its block's first act,
    the block's acts), where its acts repeat every ``period`` steps from 2 periods before
    the block (``lead`` steps in) to one after (the same units, inputs and outputs,
    ``period`` steps on); None if some stream's don't."""
    starts = []
    for entries, n in zip(streams, per_step):
        size = n * period
        start = (lead + 2 * period) * n
        for i in range(start - 2 * size, start + size):
            if not entries[i].repeated_by(entries[i + size], period):
                return None
        starts.append((start, size))
    return starts


def _streams(plan: Plan, wiring: Wiring, rank: int | None) -> list[StreamWiring]:
    """The simulated streams ``rank`` runs (all of them for None)."""
    return [s for s in wiring.streams if rank is None or plan.world == 1 or s.stream.rank == rank]


@attrs.frozen
class _Landing:
    """Where a simulation's acts land over ranks, the same at every check: ``places[u]``,
    (rank, its stream's place among the rank's streams) for each rank unit u runs on (a
    collective over ranks, simulated as one act on the stream of its first participant,
    runs on each participant's rank); ``per_step[r][k]``: stream k of rank r's acts a step."""

    places: dict[int, list[tuple[int, int]]]
    per_step: list[list[int]]


def _landing(plan: Plan, wiring: Wiring) -> _Landing:
    index = [{s.stream.id: k for k, s in enumerate(_streams(plan, wiring, r))} for r in range(plan.world)]
    places: dict[int, list[tuple[int, int]]] = {}
    per_step = [[0] * len(ix) for ix in index]
    for unit in wiring.units:
        here: dict[int, list[Member]] = collections.defaultdict(list)
        for m in unit.members:
            here[plan.rank_of(m.actor.device)].append(m)
        places[unit.id] = [
            (r, index[r][unit.stream if len(ms) == len(unit.members) else ms[0].actor.stream])
            for r, ms in here.items()
        ]
        for r, k in places[unit.id]:
            per_step[r][k] += acts_in(unit.actor, plan.micro_batches)
    return _Landing(places, per_step)


def _kept(landing: _Landing, ran: list[list[Entry]]) -> list[tuple[list[list[Entry]], list[int]]]:
    """Per rank, per stream of it, in the order they started, the simulated acts it runs:
    its own, and those of the collectives over ranks it takes part in; and how many of
    them a step."""
    kept: list[list[list[tuple[float, int, int, Entry]]]] = [[[] for _ in n] for n in landing.per_step]
    for k, entries in enumerate(ran):
        for i, entry in enumerate(entries):
            for r, place in landing.places[entry.unit.id]:
                kept[r][place].append((entry.start, k, i, entry))
    return [
        ([[entry for *_, entry in sorted(acts)] for acts in streams], counts)
        for streams, counts in zip(kept, landing.per_step)
    ]


def rider(kinds: Sequence[str | None]) -> int:
    """Which of a rank's streams (``kinds``: each one's kind, None where it has nothing to
    run) rides the rank's communication stream (``replay.ReplayStream._ride``): its first
    compute stream, where its communication stream has work too; else -1 (the
    transport's thread runs the communication stream, polling beside the kernels). A rank
    of several devices has several: the others wake the rider when they reach what it
    waits for, as a copy stream does (2x2.yaml over 2 ranks, two devices a rank: 15.6-18.6k
    samples/s with the transport's thread polling, 19.0-23.1k with the first riding)."""
    compute = [k for k, kind in enumerate(kinds) if kind == "compute"]
    return compute[0] if compute and "comm" in kinds else -1
