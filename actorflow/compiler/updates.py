"""order updates: an update writes its parameter in place, so within an iteration it must
come after every other read of that parameter.

A reader that already reaches the update through data (the forward ops, whose results
feed the gradient) needs nothing more; every other reader (say the backward matmul that
reads W to compute dX) gets a control register into the update. Across iterations the
variable's quota of 1 does the rest: its buffer is free for iteration i + 1 only once
the update of iteration i let go of it.

A parameter with no variable, which several updates write (async parameter servers:
see ``expand``), is left alone: its reads (each worker's snapshot) and its updates run
on its device's one compute stream, in the order their inputs arrive, and the credits of
the snapshots' versions bound how far a worker's reads run ahead of the updates.
"""

from __future__ import annotations

from ..plan import Consumer, Input, Plan, Register
from ..records import evolve
from .topology import data_edges, reachable, unit_of


def order_updates(plan: Plan) -> Plan:
    unit = unit_of(plan)
    updates = [a for a in plan.actors if a.kind == "update" and not plan.as_arriving(a)]
    readers = [
        (c.actor, update.id)
        for update in updates
        for c in plan.registers[update.inputs[0].register].consumers
        if c.actor != update.id
    ]
    ordered = reachable(data_edges(plan), {(unit[r], unit[u]) for r, u in readers})
    actors = list(plan.actors)
    registers = list(plan.registers)
    for reader_id, update_id in readers:
        if (unit[reader_id], unit[update_id]) in ordered:
            continue
        reader, update = actors[reader_id], actors[update_id]
        reg = Register(
            id=len(registers),
            name=f"{reader.name}->{update.name}",
            producer=reader.id,
            device=reader.device,
            shape=(0,),
            dtype="bool",
            consumers=(Consumer(update.id, len(update.inputs)),),
            control=True,
        )
        registers.append(reg)
        actors[reader.id] = evolve(reader, outputs=(*reader.outputs, reg.id))
        actors[update.id] = evolve(update, inputs=(*update.inputs, Input(reg.id)))
    return evolve(plan, actors=tuple(actors), registers=tuple(registers))
