"""The Plan: everything the compiler decided, as frozen data the runtime executes.

Split by job: the records (``plan_data``), the plan check (``plan_check``), the round trip
through bytes (``plan_bytes``) and the summary (``plan_summary``), each importing only
those before it; ``Plan`` is the data with the last two as methods, and this module the
one place users and passes import the records from.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from . import plan_bytes, plan_summary
from .plan_data import (
    DEFAULT_RESOURCES,
    Actor,
    Collective,
    Consumer,
    Feed,
    Input,
    Kernel,
    LogicalTensor,
    Output,
    Parameter,
    PlanData,
    Register,
    Resources,
    Stream,
)


@attrs.frozen
class Plan(PlanData):
    def to_bytes(self, key: bytes | None = None) -> bytes:
        """The plan sealed as bytes, with an HMAC under ``key`` if given (see ``plan_bytes``)."""
        return plan_bytes.to_bytes(self, key)

    @classmethod
    def from_bytes(
        cls, data: bytes, *, allow: Sequence[str] = (), trusted: bool = False, key: bytes | None = None
    ) -> Plan:
        """A Plan read back and checked, safely by default (see ``plan_bytes.from_bytes``):
        functions import only from actorflow, numpy's ufuncs and the modules in ``allow``;
        functions carried by value load only when ``trusted``; ``key`` checks the HMAC of a
        plan sealed with it."""
        return plan_bytes.from_bytes(data, cls, allow=allow, trusted=trusted, key=key)

    def summary(self) -> str:
        """The Plan for people: streams, actors, quotas, events, collective order, memory."""
        return plan_summary.summary(self)


__all__ = [
    "DEFAULT_RESOURCES",
    "Actor",
    "Collective",
    "Consumer",
    "Feed",
    "Input",
    "Kernel",
    "LogicalTensor",
    "Output",
    "Parameter",
    "Plan",
    "Register",
    "Resources",
    "Stream",
]
