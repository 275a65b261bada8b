"""predict communication: the bytes each collective would move over the links, as a
ring implementation moves them (``Collective.nbytes``).

emulate links: in one process a collective is a memory copy, far faster than a real
interconnect. With a link bandwidth and latency given, each collective is told how long
a ring collective would take on that link, so schedules can be compared as if the
communication were real. Reported as "emulated" wherever it shows."""

from __future__ import annotations

from ..ops.collective import ring_seconds, ring_total_bytes
from ..plan import Plan
from ..records import evolve


def predict_communication(plan: Plan) -> Plan:
    collectives = []
    for coll in plan.collectives:
        first = plan.actors[coll.actors[0]]
        call = sum(plan.registers[i.register].nbytes for i in first.inputs) // first.calls
        nbytes = round(ring_total_bytes(coll.op, call, len(coll.actors)))
        collectives.append(evolve(coll, nbytes=nbytes))
    return evolve(plan, collectives=tuple(collectives))


def emulate_links(plan: Plan, bandwidth: float, latency: float) -> Plan:
    collectives = []
    for coll in plan.collectives:
        first = plan.actors[coll.actors[0]]
        nbytes = sum(plan.registers[i.register].nbytes for i in first.inputs)
        seconds = ring_seconds(coll.op, nbytes, len(coll.actors), bandwidth, latency)
        collectives.append(evolve(coll, seconds=seconds))
    return evolve(plan, collectives=tuple(collectives), link=(float(bandwidth), float(latency)))
