"""Which unit a stream launches next: among the units that can act, the lowest priority
number first (ties by unit id); a collective stream only the unit next in its order
(``wiring.step_order``), step after step. Sans-IO, so the stream threads' drivers and
the replay's simulation (``replay``) make the same choice."""

from __future__ import annotations

import heapq
from collections.abc import Callable

from .wiring import Unit

OnAttempt = Callable[[Unit, Unit | None], None]
"""``on_attempt(unit, first)``: ``unit`` was considered; ``first`` is the unit its
collective order wants instead, or None (then the unit acts if it can)."""


def can_act(unit: Unit) -> bool:
    """Whether every member of ``unit`` can act (see ``protocol.ActorProtocol.can_act``)."""
    for m in unit.members:
        if not m.state.can_act():
            return False
    return True


class LaunchQueue:
    """The units of one stream that may be able to act: ``dirty`` puts one in when news
    for it came, ``pop`` takes out the next to launch."""

    def __init__(self, units: list[Unit], order: list[Unit] | None) -> None:
        self._heap: list[tuple[int, int, Unit]] = []
        self._entries = {unit.id: (unit.priority, unit.id, unit) for unit in units}
        self.order = order or []
        self.ordered = order is not None
        self.cursor = 0

    def __bool__(self) -> bool:
        return bool(self._heap)

    def dirty(self, unit: Unit) -> None:
        if not unit.queued:
            unit.queued = True
            heapq.heappush(self._heap, self._entries[unit.id])

    def pop(self, on_attempt: OnAttempt | None = None) -> Unit | None:
        """The next unit to launch now, or None if none in the queue can act. A unit that
        can act again after this act stays queued (a collective stream's next in order
        is queued instead)."""
        heap = self._heap
        while heap:
            unit = heapq.heappop(heap)[2]
            unit.queued = False
            if self.ordered and unit is not self.order[self.cursor]:
                if on_attempt is not None:
                    on_attempt(unit, self.order[self.cursor])
                continue
            if on_attempt is not None:
                on_attempt(unit, None)
            if not can_act(unit):
                continue
            if self.ordered:
                self.cursor = (self.cursor + 1) % len(self.order)
                self.dirty(self.order[self.cursor])
            return unit
        return None

    def requeue(self, unit: Unit) -> None:
        """After ``unit``'s act was taken: queue it again if it can still act (a collective
        stream's order queued its next already)."""
        if not self.ordered and can_act(unit):
            self.dirty(unit)
