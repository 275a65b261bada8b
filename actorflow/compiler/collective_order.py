"""order collectives: one fixed global order consistent with every dependency.

Every rank runs its collectives in this order, which is what keeps them deadlock-free.
"""

from __future__ import annotations

import attrs

from ..plan import Plan
from .topology import positions


def order_collectives(plan: Plan) -> Plan:
    position = positions(plan)
    ordered = sorted(plan.collectives, key=lambda c: position[c.actors[0]])
    return attrs.evolve(plan, collectives=tuple(ordered))
