"""The actor DAG as the passes see it: a collective's participants form one unit, since they
run as one kernel."""

from __future__ import annotations

from ..dag import Edges, topological_order
from ..plan import Plan
from ..plan_check import data_edges, unit_of


def positions(plan: Plan) -> dict[int, int]:
    """Unit -> its place in the deterministic topological order of the unit DAG."""
    return {u: k for k, u in enumerate(topological_order(data_edges(plan)))}


def ready_order(plan: Plan) -> dict[int, tuple[int, int]]:
    """Unit -> (latest topological position among its producers, its own position).

    Sorting by it puts a unit as early as its inputs allow: a gradient's all-reduce
    comes right after the backward op that made the gradient (gradient-ready order),
    and it is consistent with every dependency, since a unit's producers all come
    before it.
    """
    position = positions(plan)
    unit = unit_of(plan)
    latest = dict.fromkeys(position, -1)
    for reg in plan.registers:
        if reg.is_parameter:
            continue
        for c in reg.consumers:
            consumer, producer = unit[c.actor], unit[reg.producer]
            if consumer != producer:
                latest[consumer] = max(latest[consumer], position[producer])
    return {u: (latest[u], position[u]) for u in position}


def descendants(edges: Edges) -> dict[int, int]:
    """Unit -> bitset (a Python int) of the units reachable from it by a path of length >= 1."""
    reach: dict[int, int] = {}
    for u in reversed(topological_order(edges)):
        bits = 0
        for v in edges[u]:
            bits |= (1 << v) | reach[v]
        reach[u] = bits
    return reach
