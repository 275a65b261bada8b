"""recompute: activation checkpointing for the actors ``af.recompute`` marked.

A marked forward actor is cloned when a backward actor reads one of its outputs, or
a clone does (the clone of the marked op it feeds): the clone is a backward actor with
the same op, kernel, attributes and device, reading the original's inputs (the clones'
outputs where a marked producer was cloned too), and the backward readers read its
outputs instead. The original keeps only its forward readers, so its buffers are free
once the forward pass is done with them; the inputs it was fed become what the
backward pass keeps (``schedules.kept_for_backward``). A marked collective is cloned
whole: a clone per participant, forming one new collective.

A clone free to run once its inputs are ready would run right after the forward pass
and hold its outputs as long as the original did, saving nothing. So each waits (a
control register) on a backward actor that feeds a backward reader of its outputs,
directly or through other clones: the gradient arriving there. Of those it takes the
latest in the plan's topological order that comes before the first backward actor
needing the clone. Then every clone can sit in that order just before the first actor
needing it, and every edge, the control ones included, goes forward: no cycle.
"""

from __future__ import annotations

import math

from ..plan import Actor, Collective, Input, Plan, Register
from ..records import evolve
from .registers import wish_quotas
from .topology import data_edges, positions, unit_of, with_consumers


def recompute(plan: Plan) -> Plan:
    marked: dict[int, list[int]] = {}
    unit = unit_of(plan)
    for a in plan.actors:
        if a.recompute and not a.backward:
            marked.setdefault(unit[a.id], []).append(a.id)
    if not marked:
        return plan
    position = positions(data_edges(plan))
    needed = _needed(plan, marked, unit, position)
    if not needed:
        return plan
    gates = _gates(plan, needed, unit, position)
    actors, registers, collectives = list(plan.actors), list(plan.registers), list(plan.collectives)
    twin: dict[int, int] = {}
    clone_of: dict[int, int] = {}
    for u in sorted(needed, key=position.__getitem__):
        members = needed[u]
        group = -1
        if plan.actors[members[0]].kind == "collective":
            group = len(collectives)
            original = plan.collectives[plan.actors[members[0]].group]
            ids = tuple(len(actors) + k for k in range(len(members)))
            collectives.append(Collective(group, f"{original.name}.recompute", original.op, ids))
        for member in members:
            clone = _clone(plan.actors[member], len(actors), group, registers, twin)
            actors.append(clone)
            clone_of[member] = clone.id
    for a in plan.actors:
        if a.backward:
            actors[a.id] = evolve(a, inputs=tuple(_read(i, twin) for i in a.inputs))
    for u, gate in gates.items():
        if gate not in _producer_gates(plan, needed[u], unit, gates):
            _wait(actors, registers, gate, _nearest(actors, [clone_of[a] for a in needed[u]], gate))
    return evolve(
        plan,
        actors=tuple(actors),
        registers=with_consumers(actors, registers),
        collectives=tuple(collectives),
    )


def recompute_quotas(plan: Plan) -> Plan:
    """Wishes one buffer for each output of a marked actor and of a clone (where the
    schedule or the user gives none): the forward pass no longer keeps the one, the
    backward pass reads the other soon after it is made. Buffers are planned per
    register, so this is what makes the plan's memory smaller, not only the buffers held."""
    return wish_quotas(
        plan,
        {
            plan.registers[o].name: 1
            for a in plan.actors
            if a.recompute
            for o in a.outputs
            if not plan.registers[o].control
        },
    )


def _needed(
    plan: Plan, marked: dict[int, list[int]], unit: dict[int, int], position: dict[int, int]
) -> dict[int, list[int]]:
    """The marked units to clone, with their actors: those some backward actor reads, and
    those a clone will read; found from the last in topological order back."""
    needed: dict[int, list[int]] = {}
    for u in sorted(marked, key=position.__getitem__, reverse=True):
        readers = (plan.actors[c.actor] for r in _outputs(plan, marked[u]) for c in r.consumers)
        if any(b.backward or unit[b.id] in needed for b in readers):
            needed[u] = marked[u]
    return needed


def _gates(
    plan: Plan, needed: dict[int, list[int]], unit: dict[int, int], position: dict[int, int]
) -> dict[int, int]:
    """Cloned unit -> the backward actor its clone waits on (see the module's docstring);
    a unit whose backward readers are fed by no such actor waits on none."""
    first: dict[int, float] = {}
    gates: dict[int, int] = {}
    for u in sorted(needed, key=position.__getitem__, reverse=True):
        first[u] = math.inf
        candidates = []
        for reg in _outputs(plan, needed[u]):
            for c in reg.consumers:
                b = plan.actors[c.actor]
                if unit[b.id] in needed:
                    first[u] = min(first[u], first[unit[b.id]])
                    if unit[b.id] in gates:
                        candidates.append(gates[unit[b.id]])
                elif b.backward:
                    first[u] = min(first[u], position[unit[b.id]])
                    candidates.extend(_gradient_producers(plan, b))
        before = [g for g in candidates if position[unit[g]] < first[u]]
        if before:
            gates[u] = max(before, key=lambda g: position[unit[g]])
    return gates


def _producer_gates(plan: Plan, members: list[int], unit: dict[int, int], gates: dict[int, int]) -> set[int]:
    """The gates of the clones these members' clones read: waiting on one of them again adds nothing."""
    producers = (plan.registers[i.register].producer for a in members for i in plan.actors[a].inputs)
    return {gates[unit[p]] for p in producers if p >= 0 and unit[p] in gates}


def _gradient_producers(plan: Plan, actor: Actor) -> list[int]:
    """The backward actors whose outputs ``actor`` reads."""
    producers = (plan.registers[i.register].producer for i in actor.inputs)
    return [p for p in producers if p >= 0 and plan.actors[p].backward]


def _outputs(plan: Plan, members: list[int]) -> list[Register]:
    return [plan.registers[o] for a in members for o in plan.actors[a].outputs]


def _clone(actor: Actor, clone_id: int, group: int, registers: list[Register], twin: dict[int, int]) -> Actor:
    """The backward copy of ``actor``, with new output registers (``twin``: original -> copy's)."""
    outputs = []
    for o in actor.outputs:
        reg = registers[o]
        copy = Register(len(registers), f"{reg.name}.recompute", clone_id, reg.device, reg.shape, reg.dtype)
        registers.append(copy)
        twin[o] = copy.id
        outputs.append(copy.id)
    return evolve(
        actor,
        id=clone_id,
        name=f"{actor.name}.recompute",
        inputs=tuple(_read(i, twin) for i in actor.inputs),
        outputs=tuple(outputs),
        group=group,
        backward=True,
    )


def _read(i: Input, twin: dict[int, int]) -> Input:
    return evolve(i, register=twin[i.register]) if i.register in twin else i


def _nearest(actors: list[Actor], clones: list[int], gate: int) -> int:
    """The clone on the gate's device, if one is (a collective's participants), else the first."""
    return next((c for c in clones if actors[c].device == actors[gate].device), clones[0])


def _wait(actors: list[Actor], registers: list[Register], producer: int, consumer: int) -> None:
    """A control register: ``consumer`` acts only after ``producer`` (consumers are filled in later)."""
    before, after = actors[producer], actors[consumer]
    reg = Register(
        len(registers), f"{before.name}->{after.name}", before.id, before.device, (0,), "bool", control=True
    )
    registers.append(reg)
    actors[producer] = evolve(before, outputs=(*before.outputs, reg.id))
    actors[consumer] = evolve(after, inputs=(*after.inputs, Input(reg.id)))
