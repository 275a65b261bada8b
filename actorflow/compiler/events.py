"""insert events: an event only where a consumer's stream differs from its producer's,
and only where no other input already implies it.

Every data edge guarantees "producer finished before consumer starts" (same stream: stream
order; otherwise: an event). So if producer P reaches another input Y of consumer C, C's
wait on Y already covers P, and P's event is redundant: events live on the transitive
reduction of the actor DAG (the idea of Paddle's ShrinkEventInfo). A collective's
participants run as one kernel, so their inputs are pruned together.
"""

from __future__ import annotations

import attrs

from ..plan import Plan
from .topology import data_edges, descendants, unit_of


def insert_events(plan: Plan) -> Plan:
    unit = unit_of(plan)
    reach = descendants(data_edges(plan))
    stream = {a.id: a.stream for a in plan.actors}
    producer_units: dict[int, set[int]] = {}
    for actor in plan.actors:
        producer_units.setdefault(unit[actor.id], set()).update(
            unit[plan.registers[i.register].producer]
            for i in actor.inputs
            if not plan.registers[i.register].is_parameter
        )
    actors = []
    for actor in plan.actors:
        others = producer_units[unit[actor.id]]
        inputs = []
        for i in actor.inputs:
            p = plan.registers[i.register].producer
            needed = (
                p >= 0
                and stream[p] != actor.stream
                and not any(reach[unit[p]] >> y & 1 for y in others if y != unit[p])
            )
            inputs.append(attrs.evolve(i, event=needed))
        actors.append(attrs.evolve(actor, inputs=tuple(inputs)))
    return attrs.evolve(plan, actors=tuple(actors))
