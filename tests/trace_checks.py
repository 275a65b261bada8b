"""Checks on a run's trace that the property tests and the micro-batch tests share."""

from __future__ import annotations

import actorflow as af


def unit_of(plan: af.Plan) -> dict[int, str]:
    """Actor id -> the name its spans carry: the collective's name for participants."""
    unit = {a.id: a.name for a in plan.actors}
    for coll in plan.collectives:
        for a in coll.actors:
            unit[a] = coll.name
    return unit


def index_acts(spans) -> dict[tuple[str, int], object]:
    """(unit name, act) -> span: with micro-batches a unit acts several times an iteration."""
    index = {}
    for span in spans:
        key = (span.args["actor"], span.args["act"])
        assert key not in index, f"two spans for {key}"
        index[key] = span
    return index


def check_quotas_in_trace(plan: af.Plan, spans) -> int:
    """No write over a buffer still being read: for every data edge, the producer's write of
    its (n + quota)-th publication of the register starts only after the consumer's last
    read of its n-th publication ended. A publication spans ``period`` producer acts (an
    accumulate's) and serves ``hold`` consumer acts (a parameter's readers'). Returns the pairs checked."""
    index = index_acts(spans)
    checked = 0
    for reg, p, c, consumer, _ in data_edges(plan):
        producer = plan.actors[reg.producer]
        period = max(1, max(plan.actors[x.actor].every for x in reg.consumers) // producer.every)
        hold = max(1, producer.every // consumer.every)
        n = 0
        while (p, (n + reg.quota) * period) in index:
            write, read = index[(p, (n + reg.quota) * period)], index[(c, n * hold + hold - 1)]
            assert write.start >= read.end, (
                f"{p} wrote {reg.name!r} (quota {reg.quota}) for act {(n + reg.quota) * period} "
                f"while {c} still read it at act {n * hold + hold - 1}"
            )
            n += 1
            checked += 1
    return checked


def data_edges(plan: af.Plan):
    """(register, producer unit, consumer unit, consumer actor, input) for every input
    read from a produced register (parameters excluded), whatever its sync."""
    unit = unit_of(plan)
    for actor in plan.actors:
        for inp in actor.inputs:
            reg = plan.registers[inp.register]
            if not reg.is_parameter:
                yield reg, unit[reg.producer], unit[actor.id], actor, inp
