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

Two callers: ``replay.schedule`` times every act one tick (``Timing`` None) to decide each
stream's order ahead of a run; ``actorflow simulate`` times them by a cost model to
predict a run.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Sequence

import attrs

from .launching import LaunchQueue
from .protocol import Act
from .wiring import Unit, Wiring, acts_in


@attrs.frozen
class Timing:
    """How long things take on the virtual clock, in seconds: ``costs[u]`` an act of unit
    u; ``launch`` what a stream spends per act around its kernel; ``hop`` a message from
    one stream's thread to another's; ``between`` the host's time from a run's end to
    the next one's start."""

    costs: Sequence[float]
    launch: float = 0.0
    hop: float = 0.0
    between: float = 0.0


class Entry:
    """One act of the simulation: its unit's act per member, its stream (index), its step
    and which of the unit's ``per_step`` acts a step it is (``offset``), its start and
    end on the clock, its place in its stream's block (``replay``), and the acts it
    waited on."""

    __slots__ = ("unit", "acts", "stream", "per_step", "step", "offset", "start", "end", "place", "deps")

    def __init__(self, unit: Unit, acts: list[Act], stream: int, per_step: int, start: float) -> None:
        self.unit = unit
        self.acts = acts
        self.stream = stream
        self.per_step = per_step
        self.step, self.offset = divmod(acts[0].number, per_step)
        self.start = start
        self.end = start
        self.place = -1
        self.deps: list[Entry] = []

    def key(self) -> tuple:
        """What must repeat from one period to the next."""
        return (self.unit.id, self.offset, *((tuple(a.inputs), tuple(a.outputs)) for a in self.acts))


def simulate(
    wiring: Wiring,
    micro_batches: int,
    steps: int,
    runs: int = 1,
    timing: Timing | None = None,
    orders: Sequence[list[Unit]] | None = None,
) -> list[list[Entry]] | None:
    """``runs`` runs of ``steps`` steps each, one after another (a run starts when the
    last ended), of ``wiring``'s actors on the virtual clock; the acts each stream ran, in
    order (None if some actor never got to act). ``timing`` None: one tick an act, no
    hop. ``orders``: per stream, the units it launches in a run, in order (a replayed
    run's), instead of choosing as a driver does."""
    index = {s.stream.id: k for k, s in enumerate(wiring.streams)}
    queues = [
        LaunchQueue(s.units, s.order if orders is None else orders[k]) for k, s in enumerate(wiring.streams)
    ]
    costs = timing.costs if timing is not None else [1.0] * len(wiring.units)
    launch_s = timing.launch if timing is not None else 0.0
    hop = timing.hop if timing is not None else 0.0
    per_step = {u.id: acts_in(u.actor, micro_batches) for u in wiring.units}
    ready_from: dict[tuple[int, int, int], Entry] = {}
    freed_by: dict[tuple[int, int, int], list[Entry]] = defaultdict(list)
    ran: list[list[Entry]] = [[] for _ in queues]
    busy = [False] * len(queues)
    events: list[tuple[float, int, int, object]] = []  # (time, kind, order, what): ends before news
    sequence = 0

    def launch(k: int, now: float) -> None:
        unit = queues[k].pop()
        if unit is None:
            return
        acts = [m.state.take() for m in unit.members]
        queues[k].requeue(unit)
        entry = Entry(unit, acts, k, per_step[unit.id], now + launch_s)  # its kernel's start
        for member, act in zip(unit.members, acts):
            actor = member.actor.id
            for slot, buffer in enumerate(act.inputs):
                if buffer is not None:
                    entry.deps.append(ready_from[(actor, slot, buffer)])
            for out in act.takes:
                entry.deps.extend(freed_by.pop((actor, out, act.outputs[out]), ()))
        ran[k].append(entry)
        busy[k] = True
        entry.end = entry.start + costs[unit.id]
        heapq.heappush(events, (entry.end, 0, k, entry))

    def tell(unit: Unit, now: float, k: int, news: tuple) -> None:
        """Deliver ``news`` to ``unit``'s stream: at once on stream k, a hop later elsewhere."""
        nonlocal sequence
        target = index[unit.stream]
        if target == k or not hop:
            hear(news)
        else:
            heapq.heappush(events, (now + hop, 1, sequence, news))
            sequence += 1

    def hear(news: tuple) -> None:
        member, out, buffer, slot = news
        if slot < 0:
            if member.state.on_free(out, buffer):
                queues[index[member.unit.stream]].dirty(member.unit)
        else:
            member.state.on_ready(slot, buffer)
            queues[index[member.unit.stream]].dirty(member.unit)

    def end(entry: Entry, now: float) -> None:
        k = entry.stream
        for member, act in zip(entry.unit.members, entry.acts):
            for slot in act.releases:
                spec = member.fed[slot]
                producer = spec.producer
                assert producer is not None, "a fed input has a producer"
                buffer = act.inputs[slot]
                assert buffer is not None, "an act releases what it read"
                freed_by[(producer.actor.id, spec.out, buffer)].append(entry)
                tell(producer.unit, now, k, (producer, spec.out, buffer, -1))
            for out in act.publishes:
                buffer = act.outputs[out]
                for consumer, slot in member.outputs[out].by_call[act.call]:
                    ready_from[(consumer.actor.id, slot, buffer)] = entry
                    tell(consumer.unit, now, k, (consumer, out, buffer, slot))
            member.state.complete()
        busy[k] = False

    now = 0.0
    for run in range(runs):
        if run and timing is not None:
            now += timing.between
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
                    end(what, now)  # type: ignore[arg-type]
                else:
                    hear(what)  # type: ignore[arg-type]
            for k in range(len(queues)):
                if not busy[k]:
                    launch(k, now)
        if any(m.state.acts_left for m in wiring.members.values()):
            return None  # it stalls: the drivers will say where, when it does
    return ran
