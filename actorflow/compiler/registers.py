"""plan registers: a quota per register, and the planned memory per device: every buffer
is allocated once, so the peak is the total.

A register's quota is the user's (``compile``'s ``quotas``), else what a pass wished for
it (``Plan.quota_wishes``: a schedule's, a fused chain's, ...), else the default; then
raised to its floor (``Plan.quota_floors``). A parameter or variable has exactly one
buffer."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import CompileError
from ..plan import Plan
from ..records import evolve
from ..text import size_text


def wish_quotas(plan: Plan, wishes: Mapping[str, int]) -> Plan:
    """``plan`` with a pass's quota ``wishes`` recorded, where no earlier pass wished one."""
    return evolve(plan, quota_wishes=dict(wishes) | plan.quota_wishes) if wishes else plan


def plan_registers(
    plan: Plan, quota: int, quotas: Mapping[str, int] | None = None, max_memory: int | None = None
) -> Plan:
    """``quota`` (the default) and ``quotas`` (per register name) as ``compile`` checked them."""
    quotas = dict(quotas or {})
    names = {r.name for r in plan.registers if not r.is_parameter}
    unknown = sorted(set(quotas) - names)
    if unknown:
        raise CompileError(f"quotas name tensors the plan does not hold: {unknown} (known: {sorted(names)})")
    wished = plan.quota_wishes | quotas
    single = {a.outputs[0] for a in plan.actors if a.kind == "variable"}
    registers = tuple(
        evolve(
            r,
            quota=1
            if r.is_parameter or r.id in single
            else max(wished.get(r.name, quota), plan.quota_floors.get(r.name, 1)),
        )
        for r in plan.registers
    )
    memory: dict[str, int] = {}
    for r in registers:
        memory[r.device] = memory.get(r.device, 0) + r.nbytes * r.quota
    for device, nbytes in sorted(memory.items()):
        if max_memory is not None and nbytes > max_memory:
            raise CompileError(_over_memory(registers, device, nbytes, max_memory))
    return evolve(plan, registers=registers, memory=memory, quota_wishes={}, quota_floors={})


def _over_memory(registers, device: str, nbytes: int, max_memory: int) -> str:
    mine = sorted((r for r in registers if r.device == device), key=lambda r: -r.nbytes * r.quota)
    largest = ", ".join(
        f"{r.name} {r.dtype}{list(r.shape)} x quota {r.quota} = {size_text(r.nbytes * r.quota)}"
        for r in mine[:3]
    )
    return (
        f"{device} plans {size_text(nbytes)} ({nbytes} bytes) of registers x quota and parameters, more than "
        f"max_memory {size_text(max_memory)}; the largest: {largest}. Lower the quotas, or give max_memory"
    )
