"""pipeline schedules as quotas: no schedule is written down. A stage may run the forward
pass of a micro-batch only while it has a free buffer in each register its backward pass
will read (its activations, the stage's input, the parameters handed to the
micro-batch), so the quota of those registers is the number of micro-batches in flight
on the stage. GPipe keeps all m; 1F1B keeps p - s on stage s of p (counted from 0), so
the last stage alternates one forward, one backward. Backward before forward when both
are ready comes from the priorities (deeper first).

Under GPipe the registers a micro-batch crosses from one stage to another in (what a
copy reads and what it writes: activations forward, gradients back) get at least m
buffers too, unless kept for backward (those keep exactly m). A stage runs its m
forward passes before it reads the gradients sent back, so those pile up; and a send
that waits for a buffer is queued behind the work its stream was handed meanwhile, so
the next stage would wait on it far longer than on the buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import CompileError
from ..plan import Plan

SCHEDULES = ("gpipe", "1f1b")


def schedule_quotas(
    plan: Plan, stages: Sequence[Sequence[str]], schedule: str, default: int
) -> dict[str, int]:
    """Register name -> quota for every register a stage keeps for its backward pass, and
    under GPipe for every register crossing stages (``default``: everyone else's quota)."""
    if schedule not in SCHEDULES:
        raise CompileError(f"schedule: one of {', '.join(SCHEDULES)}, got {schedule!r}")
    stage_of = {device: s for s, devices in enumerate(stages) for device in devices}
    m, p = plan.micro_batches, len(stages)
    quotas: dict[str, int] = {}
    if schedule == "gpipe":
        quotas.update((reg.name, max(m, default)) for reg in crossing_stages(plan))
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


def crossing_stages(plan: Plan) -> list:
    """Registers a micro-batch moves between devices in: each copy's inputs and outputs
    (a send's input and a receive's output, across ranks)."""
    moves = [a for a in plan.actors if a.kind in ("copy", "send", "recv")]
    ids = {i.register for a in moves for i in a.inputs} | {o for a in moves for o in a.outputs}
    return [plan.registers[r] for r in sorted(ids) if not plan.registers[r].is_parameter]
