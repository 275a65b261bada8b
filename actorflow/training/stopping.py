"""Why a run ends before its last step: a Ctrl-C, or a loss that stopped being finite.

Either way the run ends between two steps, so what it reports (losses, bubbles,
parameters, metrics) is whole. Over ranks every rank must end after the same step, or
the others would wait for a step it never runs: a loss is the same on every rank (the
run's outputs reach each one), and a Ctrl-C, which may reach the ranks in different
steps, is shared by an allreduce that each step starts and the next completes, so
sharing it costs no wait and the ranks stop one step after the first of them heard it.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import attrs

from ..runtime.mpi_world import Vote


@attrs.frozen
class Stop:
    """``kind``: "interrupted" (exit status 130) or "nonfinite" (1); ``text``: one line."""

    kind: str
    text: str

    @property
    def exit_status(self) -> int:
        return 130 if self.kind == "interrupted" else 1


def nonfinite(losses: list[float], steps: int, first: int = 0) -> Stop | None:
    """A Stop if the latest loss is NaN or infinite, naming its step and the last finite
    loss; ``losses`` are those of the steps after ``first``."""
    if math.isfinite(losses[-1]):
        return None
    finite = [(first + k, loss) for k, loss in enumerate(losses) if math.isfinite(loss)]
    last = (
        f"the last finite loss was {finite[-1][1]:.6g} at step {finite[-1][0] + 1}"
        if finite
        else "no loss was finite"
    )
    return Stop(
        "nonfinite",
        f"the loss is {losses[-1]} at step {first + len(losses)} of {steps} ({last}); stopped there "
        "(train.stop_on_nonfinite: false trains on)",
    )


class Interrupts:
    """``with Interrupts(world) as i: ... if i.stop_now(): break``: a first Ctrl-C
    asks the run to stop after the steps in flight, a second raises KeyboardInterrupt at
    once. Only the main thread can catch signals: elsewhere nothing is installed."""

    def __init__(self, world: int, check: Callable[[], None] = lambda: None) -> None:
        self.heard = False
        self._old: Any = None
        self._vote = Vote() if world > 1 else None  # over ranks: asked each step, answered the next
        self._check = check  # may raise to give up waiting for the other ranks (``mpi_world.gather``)

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._hear)
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.finish()
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)

    def _hear(self, signum: int, frame: FrameType | None) -> None:
        if self.heard:
            raise KeyboardInterrupt
        self.heard = True

    def stop_now(self) -> bool:
        """Whether the run stops after the steps every rank has just run."""
        if self._vote is None:
            return self.heard
        if self._vote.answer(self._check):
            return True
        self._vote.ask(self.heard)
        return False

    def finish(self) -> None:
        """Answer the last ask (every rank completes the last one it started)."""
        if self._vote is not None:
            self._vote.answer(self._check)

    def regrouped(self) -> None:
        """The ranks lost one (``mpi_world.regroup``): the ask in flight is left out."""
        if self._vote is not None:
            self._vote.forget()
