"""order collectives: one fixed global order consistent with every dependency, each
collective as early as its inputs are ready (so a gradient's all-reduce follows the
backward op that made it, not the whole backward pass), and of two whose producers could
start at once, first the one the compute streams launch first (``topology.ready_order``).

Every rank runs its collectives over ranks in this order, which is what keeps them
deadlock-free (a collective stream within one process launches what can act, by
priority: ``runtime.wiring``). With micro-batches, collectives may act at two rates (see
``Actor.every``): those that act once per step and read only per-step values (an
all-gather of a sharded parameter) come first, then those acting once per micro-batch,
then the per-step ones reading accumulated values (a gradient's all-reduce); a
collective stream runs the middle part once per micro-batch (``runtime.wiring.step_order``).
"""

from __future__ import annotations

from ..plan import Plan
from ..records import evolve
from .topology import data_edges, descendants, ready_order, unit_of


def order_collectives(plan: Plan) -> Plan:
    ready = ready_order(plan)
    unit = unit_of(plan)
    per_micro_batch = {unit[a.id] for a in plan.actors if a.every < plan.micro_batches}
    after = descendants(data_edges(plan), per_micro_batch)

    def phase(unit_id: int) -> int:
        if unit_id in per_micro_batch:
            return 1
        return 2 if unit_id in after else 0

    ordered = sorted(plan.collectives, key=lambda c: (phase(unit[c.actors[0]]), ready[c.actors[0]]))
    return evolve(plan, collectives=tuple(ordered))
