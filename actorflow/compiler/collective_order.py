"""order collectives: one fixed global order consistent with every dependency.

Every rank runs its collectives in this order, which is what keeps them deadlock-free.
"""

from __future__ import annotations

import attrs

from ..plan import Plan
from .topology import data_edges, topological_order


def order_collectives(plan: Plan) -> Plan:
    position = {u: k for k, u in enumerate(topological_order(data_edges(plan)))}
    ordered = sorted(plan.collectives, key=lambda c: position[c.actors[0]])
    return attrs.evolve(plan, collectives=tuple(ordered))
