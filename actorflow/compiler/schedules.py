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

ZB-H1 ("zb1", alias "zbh1"; Qi et al., zero-bubble pipelines, arXiv 2401.10241) splits
each backward pass into B, the input gradients the previous stage waits for, and W, the
weight gradients nobody waits for (``Actor.weight_grad``, marked by autodiff). W goes
behind every forward and B of its stream (``priorities``), so it runs when neither can:
in the time 1F1B's stage would wait for the next gradient, and at the step's tail. What
only B reads keeps 1F1B's p - s; what a W reads (a layer's input, the gradient it
multiplies) is held until that W, for as many micro-batches as ZB-H1 keeps in flight on
every stage: p for what the forward pass kept, and s + 1 (s deferred W, one being
written) for what B makes, so no stage holds more than stage 0 holds under 1F1B. The
step cannot end with a W undone: the updates read their gradients' sums.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import CompileError
from ..plan import Plan
from .registers import wish_quotas

SCHEDULES = ("gpipe", "1f1b", "zb1", "zbh1")
ZERO_BUBBLE = ("zb1", "zbh1")


def schedule_quotas(plan: Plan, stages: Sequence[Sequence[str]], schedule: str, default: int) -> Plan:
    """The plan with the quota a ``schedule`` wishes for every register a stage keeps for
    its backward pass, under GPipe for every register crossing stages, and under ZB-H1
    for every register a W reads (``default``: everyone else's quota)."""
    stage_of = {device: s for s, devices in enumerate(stages) for device in devices}
    m, p = plan.micro_batches, len(stages)

    def stage(reg) -> int:
        if reg.device not in stage_of:
            raise CompileError(f"stages: {reg.name!r} lives on {reg.device}, which no stage lists")
        return stage_of[reg.device]

    quotas: dict[str, int] = {}
    if schedule == "gpipe":
        quotas.update((reg.name, max(m, default)) for reg in crossing_stages(plan))
    kept = kept_for_backward(plan)
    for reg in kept:
        quotas[reg.name] = m if schedule == "gpipe" else p - stage(reg)
    if schedule in ZERO_BUBBLE:
        forward = {reg.name for reg in kept}
        for reg in read_by_weight_grads(plan):
            quotas[reg.name] = p if reg.name in forward else max(default, min(p, stage(reg) + 1))
    return wish_quotas(plan, quotas)


def kept_for_backward(plan: Plan) -> list:
    """Registers made by the forward pass (or fed) and read by the backward pass."""
    return _held_across(plan, lambda a: a.backward or a.kind == "variable", lambda a: a.backward)


def read_by_weight_grads(plan: Plan) -> list:
    """Registers a W actor (``Actor.weight_grad``) reads that a forward or B actor makes:
    what deferring the W holds."""
    return _held_across(plan, lambda a: a.weight_grad, lambda a: a.weight_grad)


def _held_across(plan: Plan, excluded_producer, reader) -> list:
    """Data registers whose producer is not ``excluded_producer`` and of which some
    consumer is a ``reader``."""
    return [
        reg
        for reg in plan.registers
        if not reg.is_parameter
        and not reg.control
        and not excluded_producer(plan.actors[reg.producer])
        and any(reader(plan.actors[c.actor]) for c in reg.consumers)
    ]


def crossing_stages(plan: Plan) -> list:
    """Registers a micro-batch moves between devices in: each copy's inputs and outputs
    (a send's input and a receive's output, across ranks)."""
    moves = [a for a in plan.actors if a.kind in ("copy", "send", "recv")]
    ids = {i.register for a in moves for i in a.inputs} | {o for a in moves for o in a.outputs}
    return [plan.registers[r] for r in sorted(ids) if not plan.registers[r].is_parameter]
