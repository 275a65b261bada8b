"""insert events: how each input is kept in order with its producer (see ``plan.Input``).

Same stream: stream order, nothing to add. Across streams, an early launch with an event
hides the host's round trip, but a stream thread waiting on an event holds up everything
queued behind it. When a stream is fed by one other stream only, its queue follows that
stream's order and the wait costs nothing: those inputs get events. A stream fed by
several (the host counts as one where the stream carries feeds: a copy stream with
feeds, fetches and device-to-device copies) gets its inputs only at the producer's
completion. A collective stream is the exception: its inputs get events whatever feeds
it (no round trip through the host before each collective). Over ranks it runs its
collectives in one fixed order, so nothing queued behind a waiting collective could have
run first; within a process it launches a collective only once every input of it was
launched, so a wait on an event there holds up nothing that could have gone first. An
actor that reads one register twice waits once.

Across ranks nothing waits on an event that only another rank can complete. The
communication stream starts sends and receives without waiting and finishes them in
any order, so what it reads (even from itself) and what reads it are synced at
completion. In a plan over several ranks so are the collective streams' results: a
collective launched on one rank finishes only once every other rank has joined it,
which may take work queued on this rank behind a wait for that collective (in one
process a launched collective has every input it needs). Neither kind counts as a
stream that feeds another, since neither makes one wait.

Every input guarantees "producer finished before consumer starts", so if producer P
reaches another input Y of consumer C, C's wait on Y already covers P, and P's event is
redundant: events live on the transitive reduction of the actor DAG (the idea of
Paddle's ShrinkEventInfo). A collective's participants on one rank run as one kernel, so
their inputs are pruned together; those on other ranks wait on their own inputs, so
nothing they read implies anything here. A reused communication subgraph acts once per call: its
inputs and what reads it always wait on their own event, and no path through it
implies anything (it may pass through a later call).
"""

from __future__ import annotations

from ..plan import Plan
from ..records import evolve
from .topology import data_edges, reaches_any, unit_of, unit_positions

SEARCH_BUDGET = 4096
"""Nodes one implied-event search may visit; past it the event stays (an event already
implied costs a wait that is over at once, never a wrong order), so the pass stays linear."""


def insert_events(plan: Plan) -> Plan:
    unit = unit_of(plan)
    edges = data_edges(plan, across_ranks=False)  # a wait implies others on its own rank only
    position = unit_positions(plan, across_ranks=False)
    reused = {unit[a.id] for a in plan.actors if a.calls > 1}
    if reused:  # a path through a reused subgraph may pass through a later call: it implies nothing
        edges = {u: vs - reused for u, vs in edges.items()}
    stream = {a.id: a.stream for a in plan.actors}
    ordered = {s.id for s in plan.streams if s.kind == "collective"}
    comm = {s.id for s in plan.streams if s.kind == "comm"}
    at_completion = comm | (ordered if plan.world > 1 else set())
    rank = {a.id: plan.streams[a.stream].rank for a in plan.actors}
    producer_units: dict[tuple[int, int], set[int]] = {}
    host = -1
    sources: dict[int, set[int]] = {s.id: set() for s in plan.streams}
    for actor in plan.actors:
        producers = [plan.registers[i.register].producer for i in actor.inputs]
        producers = [p for p in producers if p >= 0]
        producer_units.setdefault((unit[actor.id], rank[actor.id]), set()).update(unit[p] for p in producers)
        sources[actor.stream].update(
            stream[p] for p in producers if stream[p] != actor.stream and stream[p] not in at_completion
        )
        if actor.kind == "feed":
            sources[actor.stream].add(host)
    latest = {u: sorted((position[p] for p in ps), reverse=True)[:2] for u, ps in producer_units.items()}

    def implied(consumer: tuple[int, int], producer: int) -> bool:
        """Another producer of ``consumer`` (a unit's actors on one rank) is reachable from
        ``producer`` (transitive reduction)."""
        top = latest[consumer]
        if len(top) < 2:
            return False
        bound = top[1] if position[producer] == top[0] else top[0]
        if bound < position[producer]:
            return False
        return bool(reaches_any(edges, position, producer, producer_units[consumer], bound, SEARCH_BUDGET))

    def sync(actor, producer: int, seen: bool) -> str:
        if producer < 0:
            return "stream"
        if actor.stream in comm:
            return "completion"
        if stream[producer] == actor.stream:
            return "stream"
        if stream[producer] in at_completion:
            return "completion"
        if len(sources[actor.stream]) > 1 and actor.stream not in ordered:
            return "completion"
        if actor.calls > 1 or plan.actors[producer].calls > 1:
            return "event"  # each call waits for its own input, each reader for its own call
        if seen or implied((unit[actor.id], rank[actor.id]), unit[producer]):
            return "implied"
        return "event"

    actors = []
    for actor in plan.actors:
        inputs, seen = [], set()
        for i in actor.inputs:
            mode = sync(actor, plan.registers[i.register].producer, i.register in seen)
            inputs.append(i if i.sync == mode else evolve(i, sync=mode))
            seen.add(i.register)
        changed = any(new is not old for new, old in zip(inputs, actor.inputs))
        actors.append(evolve(actor, inputs=tuple(inputs)) if changed else actor)
    return evolve(plan, actors=tuple(actors))
