"""priorities: when several actors of one stream can act, the driver launches the lowest
number first.

Compute first (PaddlePaddle #47471): an actor that waits on a collective's result is put
after every actor that doesn't, so its event wait can't hold up compute that could run
meanwhile. Ties go by topological order. ``enabled=False`` keeps topological order alone.
"""

from __future__ import annotations

import attrs

from ..plan import Plan
from .topology import data_edges, topological_order, unit_of


def assign_priorities(plan: Plan, enabled: bool = True) -> Plan:
    unit = unit_of(plan)
    position = {u: k for k, u in enumerate(topological_order(data_edges(plan)))}
    collective_streams = {s.id for s in plan.streams if s.kind == "collective"}
    stream_of = {a.id: a.stream for a in plan.actors}

    def waits_on_collective(actor) -> bool:
        producers = (plan.registers[i.register].producer for i in actor.inputs)
        return any(p >= 0 and stream_of[p] in collective_streams for p in producers)

    def key(actor):
        late = enabled and actor.stream not in collective_streams and waits_on_collective(actor)
        return (late, position[unit[actor.id]], actor.id)

    rank = {a.id: k for k, a in enumerate(sorted(plan.actors, key=key))}
    actors = tuple(attrs.evolve(a, priority=rank[a.id]) for a in plan.actors)
    return attrs.evolve(plan, actors=actors)
