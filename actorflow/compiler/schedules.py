"""pipeline schedules as quotas: no schedule is written down. A stage may run the forward
pass of a micro-batch only while it has a free buffer in each register its backward pass
will read (its activations, the stage's input, the parameters handed to the
micro-batch), so the quota of those registers is the number of micro-batches in flight
on the stage. GPipe keeps all m; 1F1B keeps p - s on stage s of p (counted from 0), so
the last stage alternates one forward, one backward. Backward before forward when both
are ready comes from the priorities (deeper first).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import CompileError
from ..plan import Plan

SCHEDULES = ("gpipe", "1f1b")


def schedule_quotas(plan: Plan, stages: Sequence[Sequence[str]], schedule: str) -> dict[str, int]:
    """Register name -> quota for every register a stage keeps for its backward pass."""
    if schedule not in SCHEDULES:
        raise CompileError(f"schedule: one of {', '.join(SCHEDULES)}, got {schedule!r}")
    stage_of = {device: s for s, devices in enumerate(stages) for device in devices}
    m, p = plan.micro_batches, len(stages)
    quotas = {}
    for reg in kept_for_backward(plan):
        if reg.device not in stage_of:
            raise CompileError(f"stages: {reg.name!r} lives on {reg.device}, which no stage lists")
        quotas[reg.name] = m if schedule == "gpipe" else p - stage_of[reg.device]
    return quotas


def kept_for_backward(plan: Plan) -> list:
    """Registers made by the forward pass (or fed, or repeated) and read by the backward pass."""
    return [
        reg
        for reg in plan.registers
        if not reg.is_parameter
        and not reg.control
        and not plan.actors[reg.producer].backward
        and plan.actors[reg.producer].kind != "variable"
        and any(plan.actors[c.actor].backward for c in reg.consumers)
    ]
