"""The virtual clock: the third device beside the CPU threads (``device``) and CUDA
streams, where an act takes the time a cost model gives and nothing runs.

``simulate`` runs one rank's wiring (``wiring.wire``) with the very protocol and launch
choice the stream threads use (``protocol``, ``launching``) on a discrete-event clock:
each stream runs one act at a time; an act's end tells its own stream's units at once
and another stream's ``Timing.hop`` later (a thread's wake-up); a stream picks its next
unit as a driver does, or, for a replayed run, follows the order the replay decided
(``orders``). Every act is recorded with its start, its end and the acts it waited on
(the producer acts whose "ready" it took, the consumer acts whose "free" gave it its
buffer).

With a ``Host``, the streams are threads of processes on machines, as on CPUs:

- the acts running at once on a machine share its cores (each at ``cores / running`` of
  a core's speed when more run than it has);
- while n other acts of its process run, an act goes at ``1 / (1 + contention * g *
  n ** crowding)`` of its speed, g its share that holds the GIL (its Python part; a
  large matmul releases it and hardly slows down). With ``crowding`` 0, many acts at
  once slow each other down as much as two; with 1, each act more as much again (the
  measured runs of four devices in one process lie between). In a rank's process the
  transport thread polls beside the streams all along, so an act there never runs
  alone, but where the rank's compute stream rides its communication stream
  (``program.rider``) on a node with a core per rank;
- a thread that was idle and is woken while another thread of its process runs acts
  back to back waits for the GIL: CPython hands it over when the running thread blocks
  (goes idle), or after a while (the switch interval at most; sooner where a kernel
  releases it long enough). Measured here: a woken stream thread started, in the
  median, about when the busy one next went idle, not when its kernels released the
  GIL, which it mostly takes back first.

A rank's communication stream (``comm``: its sends and receives) launches whatever can
act without waiting for the last to end, as the transport does; a send and its
receive end together (``Timing.meets``).

Two callers: ``program.schedule`` times every act one tick (``Timing`` None) to decide each
stream's order ahead of a run; ``actorflow simulate`` times them by a cost model to
predict a run.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence

import attrs

from ..collector import cyclic_gc_paused
from ..plan import Plan
from .launching import LaunchQueue
from .protocol import Act
from .wiring import Member, Unit, Wiring, acts_in


@attrs.frozen
class Host:
    """Where the streams' threads run (see the module's docstring): ``process[k]`` and
    ``machine[k]`` are stream k's process (one GIL) and machine (``cores`` cores);
    ``handover``: the longest a woken thread waits for the GIL (CPython's switch interval
    at most); ``contention``: how much an act slows down, by its share that holds the
    GIL, while others of its process run, and ``crowding`` how that grows with their
    number; ``polled``: the processes where a thread of their own polls beside the
    streams all along (a rank's transport), so that an act there always runs beside
    another."""

    process: Sequence[int]
    machine: Sequence[int]
    cores: int
    handover: float = 0.005
    contention: float = 0.0
    polled: frozenset[int] = frozenset()
    crowding: float = 0.0


@attrs.frozen
class Timing:
    """How long things take on the virtual clock, in seconds: ``costs[u]`` an act of unit
    u; ``launch`` what a stream spends per act around its kernel; ``hop`` a message from
    one stream's thread to another's; ``between`` the host's time from a run's end to
    the next one's start; ``host``: the threads share cores and GILs (None: each stream
    runs as if alone); ``meets``: per unit that is one half of a transfer between ranks
    (a send, a receive), the key its other half has: an act of it ends ``costs[u]``
    after the later of the two halves' acts of the same number started (a synchronous
    send: MPI's ``Issend`` and ``Irecv``); ``gil[u]``: the share of an act of unit u,
    launch and kernel, that holds the GIL (all of it where None)."""

    costs: Sequence[float]
    launch: float = 0.0
    hop: float = 0.0
    between: float = 0.0
    host: Host | None = None
    meets: Mapping[int, Hashable] = attrs.Factory(dict)
    gil: Sequence[float] | None = None


class Entry:
    """One act of the simulation: its unit's act per member, its stream (index), its step
    and which of the unit's ``per_step`` acts a step it is (``offset``), its start and
    end on the clock, and the acts it waited on."""

    __slots__ = ("unit", "acts", "stream", "per_step", "step", "offset", "start", "end", "deps")

    def __init__(self, unit: Unit, acts: list[Act], stream: int, per_step: int, start: float) -> None:
        self.unit = unit
        self.acts = acts
        self.stream = stream
        self.per_step = per_step
        self.step, self.offset = divmod(acts[0].number, per_step)
        self.start = start
        self.end = start
        self.deps: list[Entry] = []

    def repeated_by(self, other: Entry, period: int) -> bool:
        """Whether ``other`` is this act again, ``period`` steps on: the same unit, place in
        its step, inputs and outputs."""
        return (
            other.unit is self.unit
            and other.offset == self.offset
            and other.step == self.step + period
            and all(a.inputs == b.inputs and a.outputs == b.outputs for a, b in zip(self.acts, other.acts))
        )


@cyclic_gc_paused()
def simulate(
    wiring: Wiring,
    micro_batches: int,
    steps: int,
    runs: int = 1,
    timing: Timing | None = None,
    orders: Sequence[list[Unit]] | None = None,
    deps: bool = True,
    enough: Callable[[list[list[Entry]]], bool] | None = None,
) -> list[list[Entry]] | None:
    """``runs`` runs of ``steps`` steps each, one after another (a run starts when the
    last ended), of ``wiring``'s actors on the virtual clock; the acts each stream ran, in
    order (None if some actor never got to act). ``timing`` None: one tick an act, no
    hop. ``orders``: per stream, the units it launches in a run, in order (a replayed
    run's), instead of choosing as a driver does. ``deps`` False: the entries' ``deps``
    stay empty (the replay's schedule needs them, a prediction does not: a quarter of its
    time). ``enough``: asked after each instant of the clock, with the acts so far; True
    ends the simulation there, with those acts."""
    index = {s.stream.id: k for k, s in enumerate(wiring.streams)}
    queues = [
        LaunchQueue(s.units, s.order if orders is None else orders[k]) for k, s in enumerate(wiring.streams)
    ]
    timing = timing or Timing([1.0] * len(wiring.units))
    costs, launch_s, hop, host = timing.costs, timing.launch, timing.hop, timing.host
    cpus = _Cpus(host, len(queues)) if host is not None else None
    per_step = {u.id: acts_in(u.actor, micro_batches) for u in wiring.units}
    home = {u.id: index[u.stream] for u in wiring.units}  # each unit's stream
    links = {m: _links(m, home) for m in wiring.members.values()}
    ready_from: dict[tuple[int, int, int], Entry] = {}
    freed_by: dict[tuple[int, int, int], list[Entry]] = defaultdict(list)
    ran: list[list[Entry]] = [[] for _ in queues]
    busy = [False] * len(queues)
    comm = [s.stream.kind == "comm" for s in wiring.streams]
    halves: dict[tuple[Hashable, int], Entry] = {}  # a send or receive whose other half did not start
    touched: set[int] = set()  # the streams that heard news or ended an act: those that may launch
    events: list[tuple[float, int, object, object]] = []  # (time, kind, order, what): ends, news, GIL
    sequence = 0
    ended = 0.0  # when the last act ended

    def launch(k: int, now: float) -> None:
        if comm[k]:
            while (unit := queues[k].pop()) is not None:
                start(k, unit, now)
            return
        if cpus is not None and cpus.waiting[k] is not None:
            return
        unit = queues[k].pop()
        if cpus is None:
            if unit is not None:
                start(k, unit, now)
        elif unit is None:
            for j in cpus.idle(k):
                start(j, cpus.admit(j), now)
        elif cpus.must_wait(k, unit):
            push(now + cpus.host.handover, 2, (k, cpus.tickets[k]))
        else:
            start(k, unit, now)

    def start(k: int, unit: Unit, now: float) -> None:
        nonlocal sequence
        acts = [m.state.take() for m in unit.members]
        queues[k].requeue(unit)
        entry = Entry(unit, acts, k, per_step[unit.id], now + launch_s)  # its kernel's start
        for member, act in zip(unit.members, acts) if deps else ():
            actor = member.actor.id
            for slot, buffer in enumerate(act.inputs):
                if buffer is not None:
                    entry.deps.append(ready_from[(actor, slot, buffer)])
            for out in act.takes:
                entry.deps.extend(freed_by.pop((actor, out, act.outputs[out]), ()))
        ran[k].append(entry)
        if unit.id in timing.meets:
            key = (timing.meets[unit.id], acts[0].number)
            other = halves.pop(key, None)
            if other is None:
                halves[key] = entry
            else:
                for half in (entry, other):
                    half.end = entry.start + costs[unit.id]
                    heapq.heappush(events, (half.end, 0, (half.stream, -1 - sequence), half))
                    sequence += 1
            return
        busy[k] = True
        if cpus is None:
            entry.end = entry.start + costs[unit.id]
            heapq.heappush(events, (entry.end, 0, (k, 0), entry))
        else:
            gil = 1.0 if timing.gil is None else timing.gil[unit.id]
            push_end(cpus.run(entry, launch_s, costs[unit.id], gil, now))

    def push_end(next_end: NextEnd | None) -> None:
        """Ordered among simultaneous ends by its stream."""
        if next_end is not None:
            when, key = next_end
            heapq.heappush(events, (when, 0, key, key))

    def push(when: float, kind: int, what: object) -> None:
        nonlocal sequence
        heapq.heappush(events, (when, kind, sequence, what))
        sequence += 1

    def tell(now: float, k: int, member: Member, out: int, buffer: int, slot: int, there: int) -> None:
        """From stream k, news for ``member`` (see ``hear``) on stream ``there``: at once
        on k itself, a ``hop`` later (a thread's wake-up) elsewhere."""
        if there == k or not hop:
            hear(member, out, buffer, slot, there)
        else:
            push(now + hop, 1, (member, out, buffer, slot, there))

    def hear(member: Member, out: int, buffer: int, slot: int, k: int) -> None:
        """News for ``member``, on stream k: buffer ``buffer`` of its output ``out`` is
        free again (``slot`` -1), or ready for its input ``slot``."""
        touched.add(k)
        if slot < 0:
            if member.state.on_free(out, buffer):
                queues[k].dirty(member.unit)
        else:
            member.state.on_ready(slot, buffer)
            queues[k].dirty(member.unit)

    def end(entry: Entry, now: float) -> None:
        nonlocal ended
        ended = now
        k = entry.stream
        for member, act in zip(entry.unit.members, entry.acts):
            producers, consumers = links[member]
            for slot in act.releases:
                producer, out, there, actor = producers[slot]
                buffer = act.inputs[slot]
                assert buffer is not None, "an act releases what it read"
                if deps:
                    freed_by[(actor, out, buffer)].append(entry)
                tell(now, k, producer, out, buffer, -1, there)
            for out in act.publishes:
                buffer = act.outputs[out]
                for consumer, slot, there, actor in consumers[out][act.call]:
                    if deps:
                        ready_from[(actor, slot, buffer)] = entry
                    tell(now, k, consumer, out, buffer, slot, there)
            member.state.complete()
        busy[k] = False
        touched.add(k)

    now = 0.0
    for run in range(runs):
        if run:
            now = ended + timing.between  # not the last event's time: a stale GIL wait or end may follow
        for unit in wiring.units:
            for member in unit.members:
                member.state.start(acts_in(member.actor, steps * micro_batches))
            queues[index[unit.stream]].dirty(unit)
        for k in range(len(queues)):
            launch(k, now)
        while events:
            now = events[0][0]
            while events and events[0][0] == now:
                _, kind, _, what = heapq.heappop(events)
                if kind == 0:
                    if cpus is None or not isinstance(what, tuple):
                        end(what, now)  # type: ignore[arg-type]
                    elif (done := cpus.ended(what, now)) is not None:
                        push_end(done[1])
                        end(done[0], now)
                elif kind == 1:
                    hear(*what)  # type: ignore[misc]
                elif cpus is not None and (woken := cpus.switched(*what)) is not None:  # type: ignore[misc]
                    start(woken, cpus.admit(woken), now)
            for k in sorted(touched):
                if not busy[k]:
                    launch(k, now)
            touched.clear()
            if enough is not None and enough(ran):
                return ran
        if any(m.state.acts_left for m in wiring.members.values()):
            return None  # it stalls: the drivers will say where, when it does
    return ran


def _links(member: Member, home: Mapping[int, int]) -> tuple[list[tuple], list[list[list[tuple]]]]:
    """What ``member``'s acts tell whom: per fed input, (its producer, the output, the
    producer's stream, its actor id); per output, per call, each consumer as (member,
    input slot, its stream, its actor id)."""
    producers = []
    for spec in member.fed:
        assert spec.producer is not None, "a fed input has a producer"
        producers.append((spec.producer, spec.out, home[spec.producer.unit.id], spec.producer.actor.id))
    consumers = [
        [[(c, slot, home[c.unit.id], c.actor.id) for c, slot in call] for call in spec.by_call]
        for spec in member.outputs
    ]
    return producers, consumers


def meets(plan: Plan, wiring: Wiring) -> dict[int, tuple[int, int, int]]:
    """Per send and receive unit, (from rank, to rank, tag): what its other half shares."""
    found = {}
    for unit in wiring.units:
        actor = unit.actor
        if actor.kind in ("send", "recv"):
            here, peer = plan.rank_of(actor.device), actor.attrs["peer"]
            found[unit.id] = (
                (here, peer, actor.attrs["tag"]) if actor.kind == "send" else (peer, here, actor.attrs["tag"])
            )
    return found


NextEnd = tuple[float, tuple[int, int]]
"""A machine's next end on the virtual clock: (when, (stream, version)); see ``_Cpus``."""


class _Cpus:
    """The ``Host``'s threads on the virtual clock (see the module's docstring): which
    stream threads hold their process's GIL (run acts back to back), which wait for it
    with the unit they will launch, and the acts running on each machine with the work
    each has left."""

    def __init__(self, host: Host, streams: int) -> None:
        self.host = host
        self.holding = [False] * streams
        self.holders: Counter[int] = Counter()  # per process, its streams holding the GIL
        self.waiting: list[Unit | None] = [None] * streams
        self.tickets = [0] * streams
        self.queue: dict[int, list[int]] = defaultdict(list)  # per process, the waiting streams in order
        self.running: dict[int, dict[int, list]] = defaultdict(dict)
        """Per machine, per stream running an act: [its entry, its work left, the contention
        times its share holding the GIL, its rate, its kernel's work]."""
        self.since: dict[int, float] = defaultdict(float)
        self.together: Counter[int] = Counter()  # per process, its acts running
        self.version = 0
        self.next_end: dict[int, int] = {}  # per machine, the version of its one end event that counts

    def must_wait(self, k: int, unit: Unit) -> bool:
        """Whether idle stream k, woken with ``unit`` to launch, waits for the GIL (then
        it is queued for it)."""
        process = self.host.process[k]
        if self.holding[k]:
            return False
        if not self.holders[process]:
            self._hold(k)
            return False
        self.waiting[k] = unit
        self.tickets[k] += 1
        self.queue[process].append(k)
        return True

    def switched(self, k: int, ticket: int) -> int | None:
        """The hand-over time since stream k began to wait for the GIL: k, if it still waits."""
        return k if self.waiting[k] is not None and self.tickets[k] == ticket else None

    def admit(self, k: int) -> Unit:
        """Stream k gets the GIL: the unit it waited to launch."""
        unit = self.waiting[k]
        assert unit is not None, "an admitted stream was waiting"
        self.waiting[k] = None
        self.queue[self.host.process[k]].remove(k)
        self._hold(k)
        return unit

    def _hold(self, k: int) -> None:
        self.holding[k] = True
        self.holders[self.host.process[k]] += 1

    def idle(self, k: int) -> list[int]:
        """Stream k has nothing to launch: it blocks, handing the GIL to the stream that
        waited longest, if it held it."""
        if not self.holding[k]:
            return []
        self.holding[k] = False
        self.holders[self.host.process[k]] -= 1
        waiting = self.queue[self.host.process[k]]
        return waiting[:1]

    def run(self, entry: Entry, launch: float, kernel: float, gil: float, now: float) -> NextEnd | None:
        """``entry`` starts ``launch`` then ``kernel`` seconds of a core, a share ``gil`` of
        them holding its process's GIL: its machine's next end (``_ends``)."""
        machine = self.host.machine[entry.stream]
        self._advance(machine, now)
        slowing = self.host.contention * gil
        self.running[machine][entry.stream] = [entry, launch + kernel, slowing, 0.0, kernel]
        self.together[self.host.process[entry.stream]] += 1
        return self._ends(machine, now)

    def ended(self, what: tuple[int, int], now: float) -> tuple[Entry, NextEnd | None] | None:
        """An end event: None where it is stale (its machine's acts changed since), else
        the act that ended and its machine's next end."""
        k, version = what
        machine = self.host.machine[k]
        if self.next_end.get(machine) != version:
            return None
        self._advance(machine, now)
        entry = self.running[machine].pop(k)[0]
        self.together[self.host.process[k]] -= 1
        entry.end = now
        return entry, self._ends(machine, now)

    def _advance(self, machine: int, now: float) -> None:
        """The running acts' work left, at the rates they ran at since the last change."""
        elapsed = now - self.since[machine]
        for slot in self.running[machine].values():
            slot[1] -= elapsed * slot[3]
        self.since[machine] = now

    def _ends(self, machine: int, now: float) -> NextEnd | None:
        """Each running act's rate (the share of a core's speed it gets), now that they
        changed, and the machine's next end: until the next change, the one end event of
        its acts that counts (None when nothing runs there). An act still in its launch
        has its kernel's start moved to where the launch ends at the new rate."""
        running = self.running[machine]
        self.version += 1
        if not running:
            self.next_end.pop(machine, None)
            return None
        share = min(1.0, self.host.cores / len(running))
        process, together = self.host.process, self.together
        polled, crowding = self.host.polled, self.host.crowding
        beside: dict[int, float] = {}  # per process: others**crowding, its others' acts (0: none)
        first, first_k = float("inf"), -1
        for k, slot in running.items():
            p = process[k]
            x = beside.get(p)
            if x is None:
                others = together[p] - 1 + (p in polled)
                x = beside[p] = others**crowding if others else 0.0
            rate = slot[3] = share / (1 + slot[2] * x) if x else share
            work = slot[1]
            end = now + (work if work > 0.0 else 0.0) / rate
            if work > slot[4]:
                slot[0].start = now + (work - slot[4]) / rate
            if first_k < 0 or end < first or (end == first and k < first_k):
                first, first_k = end, k
        self.next_end[machine] = self.version
        return first, (first_k, self.version)
