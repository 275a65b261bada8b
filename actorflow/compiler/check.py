"""check: refuse a Plan that is incomplete or could deadlock.

The wait-for graph has the data edges (producer before consumer, within an iteration)
and the collective order (each collective stream runs its collectives one after another
in that order). A cycle there hangs every run, so it is a compile error naming the cycle.
Quotas only add edges from iteration i to iteration i + quota, which cannot close a cycle
while every quota is at least 1; stream order is decided at launch, in dependency order.
"""

from __future__ import annotations

from ..errors import CompileError, DeadlockError
from ..plan import Plan
from .topology import call_edges, find_cycle, unit_of


def check(plan: Plan) -> Plan:
    names = {a.id: a.name for a in plan.actors}
    names.update({coll.actors[0]: coll.name for coll in plan.collectives})
    for a in plan.actors:
        if not 0 <= a.stream < len(plan.streams):
            raise CompileError(f"actor {a.name!r} has no stream")
    for r in plan.registers:
        if r.quota < 1:
            raise CompileError(f"register {r.name!r} has quota {r.quota}; it must be >= 1")
    for coll in plan.collectives:
        streams = {plan.actors[a].stream for a in coll.actors}
        if len(streams) != len({plan.streams[s].rank for s in streams}):
            raise CompileError(f"the participants of {coll.name!r} on one rank are on different streams")
    rates = {plan.actors[c.actors[0]].every: c.name for c in plan.collectives}
    if len(rates) > 1:
        raise CompileError(
            "the collective stream runs its collectives in one fixed order, so they must all act "
            f"once per step or all once per micro-batch; {sorted(rates.values())} don't"
        )

    unit = unit_of(plan)
    edges = {u: {(v, "data") for v in vs} for u, vs in call_edges(plan).items()}
    names.update({u: f"{names[u[0]]} call {u[1]}" for u in edges if isinstance(u, tuple)})
    for earlier, later in stream_order_pairs(plan):
        edges[unit[earlier.actors[0]]].add((unit[later.actors[0]], "collective order"))
    cycle = find_cycle({u: [v for v, _ in vs] for u, vs in edges.items()})
    if cycle is not None:
        steps = [names[cycle[0]]]
        for u, v in zip(cycle, cycle[1:]):
            why = "/".join(sorted(kind for w, kind in edges[u] if w == v))
            steps.append(f"-({why})-> {names[v]}")
        raise DeadlockError("the plan can deadlock: wait-for cycle " + " ".join(steps))
    return plan


def stream_order_pairs(plan: Plan) -> list[tuple]:
    """Consecutive collectives of each collective stream, in the collective order: what
    the streams wait on (each runs its part of the order, one after another)."""
    last: dict[int, object] = {}
    pairs = []
    for coll in plan.collectives:
        stream = plan.actors[coll.actors[0]].stream
        if stream in last:
            pairs.append((last[stream], coll))
        last[stream] = coll
    return pairs
