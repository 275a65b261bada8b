"""micro-batches: with m > 1, a step feeds m micro-batches. Feeds, the forward and the
backward pass act once per micro-batch; variables and updates act once per step, and so
do the collectives, copies and adds whose consumers all act once per step (a gradient's
all-reduce runs on the accumulated gradient, once; a gradient pushed to a parameter
server is accumulated before it moves, and the workers' gradients are summed there once:
sums commute with the accumulation), and whatever reads only once-per-step values.

Where a once-per-step register feeds once-per-micro-batch consumers (a parameter read by
the forward and backward passes), each consumer reads it in place and holds it for its m
acts of the step: no copy per micro-batch, no buffer per micro-batch in flight (OneFlow
passes pointers within a machine), and an update waits for the last of them (``updates``).
Where a once-per-micro-batch register feeds once-per-step consumers, an ``accumulate``
actor sums it over the step's micro-batches, divided by m, and publishes it once. Rates
are recorded as ``Actor.every``; the runtime derives the holds and periods from them.
"""

from __future__ import annotations

from ..ops.micro_batch import accumulate
from ..plan import Actor, Consumer, Input, Plan, Register
from ..records import evolve
from .topology import unit_of

SUMS = ("copy", "add")
"""Ops that commute with the accumulation of their inputs over a step's micro-batches."""


def split_micro_batches(plan: Plan, micro_batches: int) -> Plan:
    if micro_batches == 1:
        return plan
    per_step = _per_step(plan)
    actors = [evolve(a, every=micro_batches) if a.id in per_step else a for a in plan.actors]
    registers = list(plan.registers)
    for reg in plan.registers:
        if reg.is_parameter:
            continue
        if reg.producer in per_step:
            continue  # read in place, held for the step's m acts
        crossing = [c for c in reg.consumers if c.actor in per_step]
        if not crossing:
            continue
        bridge = Actor(
            id=len(actors),
            name=f"{reg.name}.accumulate",
            kind="compute",
            op="accumulate",
            kernel=accumulate,
            attrs={"micro_batches": micro_batches},
            device=reg.device,
            inputs=(Input(reg.id),),
            outputs=(len(registers),),
            where=actors[reg.producer].where,
            backward=True,
            weight_grad=actors[reg.producer].weight_grad,
        )
        actors.append(bridge)
        registers.append(
            Register(
                len(registers), bridge.name, bridge.id, reg.device, reg.shape, reg.dtype, tuple(crossing)
            )
        )
        for c in crossing:
            inputs = list(actors[c.actor].inputs)
            inputs[c.slot] = evolve(inputs[c.slot], register=bridge.outputs[0])
            actors[c.actor] = evolve(actors[c.actor], inputs=tuple(inputs))
        kept = tuple(c for c in reg.consumers if c not in crossing) + (Consumer(bridge.id, 0),)
        registers[reg.id] = evolve(reg, consumers=kept)
    return evolve(plan, actors=tuple(actors), registers=tuple(registers), micro_batches=micro_batches)


def _per_step(plan: Plan) -> set[int]:
    """Actors that act once per step: variables and updates; collectives, copies and
    adds all of whose consumers do; actors all of whose inputs are parameters or come
    from ones that do (what reads only parameters reads the same all the step long)."""
    unit = unit_of(plan)
    members: dict[int, list[int]] = {}
    for a in plan.actors:
        members.setdefault(unit[a.id], []).append(a.id)
    per_step = {a.id for a in plan.actors if a.kind in ("variable", "update")}
    changed = True
    while changed:
        changed = False
        for ids in members.values():
            if ids[0] in per_step:
                continue
            actors = [plan.actors[i] for i in ids]
            producers = [plan.registers[i.register].producer for a in actors for i in a.inputs]
            consumers = [c.actor for a in actors for o in a.outputs for c in plan.registers[o].consumers]
            downstream = (
                (actors[0].kind == "collective" or actors[0].op in SUMS)
                and consumers
                and all(c in per_step for c in consumers)
            )
            upstream = producers and all(p < 0 or p in per_step for p in producers)
            if downstream or upstream:
                per_step.update(ids)
                changed = True
    return per_step
