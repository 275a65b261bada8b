"""What each actor waits on, as log lines at each act attempt (``ACTORFLOW_DEBUG``).

``ACTORFLOW_DEBUG`` holds comma-separated flags (``debug_flags``), read once when a
Runtime is built. The runtime's flag:

- ``actors``: at each act attempt (each time a stream's driver considers launching a
  unit), log one line through the ``logging`` logger ``actorflow.actors`` at DEBUG level:
  the unit, its stream, its act number (counted since the Runtime was built) and either
  "acts" or what it waits on. So that the lines show when only the variable is set, such
  a Runtime sets that logger's level to DEBUG unless the user set one, and attaches a
  stderr ``StreamHandler`` to it if no handler would see its records (neither its own nor
  an ancestor's, such as the one ``logging.basicConfig`` installs on the root logger).

``lacking`` is the one description of what an actor lacks, shared by the log and by the
StallError's list of waiting actors (see ``stall`` for the wait-for chain).
"""

from __future__ import annotations

import logging

from ..plan import Plan
from .wiring import Member, Unit


def lacking(plan: Plan, member: Member) -> list[str]:
    """What keeps ``member`` from its next act: one phrase per input with nothing ready and
    per output with no credit (empty if it lacks nothing)."""
    missing_in, missing_out = member.state.lacking()
    reasons = []
    for k in missing_in:
        spec = member.fed[k]
        assert spec.producer is not None, "a fed input has a producer"
        reg = plan.registers[spec.producer.actor.outputs[spec.out]]
        reasons.append(f"input {reg.name!r} from {spec.producer.actor.name!r} not ready")
    for k in missing_out:
        reg = plan.registers[member.actor.outputs[k]]
        holders = ", ".join(repr(c.actor.name) for c, _ in member.outputs[k].consumers)
        reasons.append(f"no credit on output {reg.name!r} (all {reg.quota} held by {holders})")
    return reasons


class ActorLog:
    """The ``actors`` flag's log of act attempts; the drivers call it only when it is on."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.logger = logging.getLogger("actorflow.actors")
        if self.logger.level == logging.NOTSET:
            self.logger.setLevel(logging.DEBUG)
        if not self.logger.hasHandlers():
            self.logger.addHandler(logging.StreamHandler())

    def attempt(self, stream: str, unit: Unit, acts: bool) -> None:
        """``unit`` acts now (``acts``), or can't: say what it waits on."""
        state = unit.members[0].state
        if acts:
            what = "acts"
        elif state.acts_left <= 0:
            what = "has no acts left in this run"
        else:
            named = len(unit.members) > 1  # a collective: say which participant lacks what
            what = "waits: " + "; ".join(
                f"{m.actor.name}: {reason}" if named else reason
                for m in unit.members
                for reason in lacking(self.plan, m)
            )
        self.logger.debug(
            "actor %s on %s, act %d: %s", unit.name, self._where(stream, unit), state.number, what
        )

    def turn(self, stream: str, unit: Unit, first: Unit) -> None:
        """``unit`` waits for its place in the collective order, where ``first`` comes first."""
        self.logger.debug(
            "actor %s on %s, act %d: waits for its turn: %r is next in collective order",
            unit.name,
            self._where(stream, unit),
            unit.members[0].state.number,
            first.name,
        )

    def _where(self, thread: str, unit: Unit) -> str:
        """The actor's stream in the plan, and the thread that runs it if another's (a
        small move runs on its partner's stream, see ``Runtime._host_moves``)."""
        stream = self.plan.streams[unit.members[0].actor.stream].name
        return stream if stream == thread else f"{stream} (run by {thread})"
