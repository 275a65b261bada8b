"""check: refuse a Plan that is incomplete or could deadlock (``plan_check.validate``, which
``Plan.from_bytes`` also runs on every plan it reads)."""

from __future__ import annotations

from ..plan import Plan
from ..plan_check import validate


def check(plan: Plan) -> Plan:
    validate(plan)
    return plan
