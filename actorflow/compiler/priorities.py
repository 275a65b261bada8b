"""priorities: when several actors of one stream can act, the driver launches the lowest
number first, so it decides their order in the stream's queue.

Deeper first: an actor later in the topological order goes ahead of an earlier one, so
earlier iterations drain before later ones start (the way pipelines run backward before
forward): the work another device waits for enters the queue first, and fewer buffers
are held. Compute first (PaddlePaddle #47471), unless ``compute_first=False``: an actor
that waits on a collective's result goes after every actor that doesn't, so its wait
can't hold up compute that could run meanwhile.
"""

from __future__ import annotations

import attrs

from ..plan import Plan
from .topology import positions, unit_of


def assign_priorities(plan: Plan, compute_first: bool = True) -> Plan:
    unit = unit_of(plan)
    position = positions(plan)
    collective_streams = {s.id for s in plan.streams if s.kind == "collective"}
    stream_of = {a.id: a.stream for a in plan.actors}

    def waits_on_collective(actor) -> bool:
        producers = (plan.registers[i.register].producer for i in actor.inputs)
        return any(p >= 0 and stream_of[p] in collective_streams for p in producers)

    def key(actor):
        late = compute_first and actor.stream not in collective_streams and waits_on_collective(actor)
        return (late, -position[unit[actor.id]], actor.id)

    rank = {a.id: k for k, a in enumerate(sorted(plan.actors, key=key))}
    actors = tuple(attrs.evolve(a, priority=rank[a.id]) for a in plan.actors)
    return attrs.evolve(plan, actors=actors)
