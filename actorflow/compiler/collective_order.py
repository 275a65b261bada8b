"""order collectives: one fixed global order consistent with every dependency, each
collective as early as its inputs are ready (so a gradient's all-reduce follows the
backward op that made it, not the whole backward pass).

Every rank runs its collectives in this order, which is what keeps them deadlock-free.
"""

from __future__ import annotations

import attrs

from ..plan import Plan
from .topology import ready_order


def order_collectives(plan: Plan) -> Plan:
    ready = ready_order(plan)
    ordered = sorted(plan.collectives, key=lambda c: ready[c.actors[0]])
    return attrs.evolve(plan, collectives=tuple(ordered))
