"""What a runtime needs of a device: streams that run work in order, like CUDA streams.

Two seams, one per way of ordering acts:

- ``Programs`` (the replayed order, ``replay``): each stream gets a program once, a
  block of instructions, each a kernel with the events it waits on: (stream, count),
  "that stream finished that many instructions", CUDA's ``stream.wait_event(event)``
  on an event the other stream recorded after that instruction. The host hands over a
  run (``run(steps)``) and hears only its end, failures and, for fetches and traced
  spans, the acts that asked to be heard. ``replay.Replay`` implements it with one CPU
  thread per stream (a rank's communication stream on its transport's thread); on a
  GPU the same threads launch each instruction on its CUDA stream after waiting on the
  events it needs (``cuda.Gpus.replayed``), and the virtual clock (``virtual``) runs
  the same programs' acts for ``actorflow simulate``.
- ``Stream`` (the drivers, ``driver``): takes launched kernels and runs them one after
  another, after the events it was told to ``wait`` on; it reports each kernel's end
  through the ``on_done(ctx, result, start, end, ok)`` it was made with, counts the
  kernels launched and finished, and knows the one running, for the stall report.
  ``CpuStream`` (a stream thread of this process: the thread that runs the stream's
  driver runs its kernels, so launching is calling and the end is reported before
  ``launch`` returns), the rank's communication stream (``transport.CommExecutor``:
  sends and receives, which end later, in any order, on the transport's thread) and
  ``cuda.CudaStream`` (the kernel queued on a CUDA stream, its end reported at once
  with the ``event`` that marks it on the GPU, for other streams to wait on) implement
  it.

``Fence`` holds streams while one kernel of another runs: with overlap off, a
collective's compute streams stop while it runs, as if they were one stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import attrs

from ..plan import Plan

OnDone = Callable[[Any, Any, float, float, bool], None]
"""``on_done(ctx, result or exception, start, end, ok)``: a launched kernel ended."""

POLL = 0.1


@attrs.frozen
class WaitChain:
    """``text``: the wait-for chain of a stalled run, for people; ``remote``: (rank, actor
    id) where the chain's last actor waits on another rank (a send or receive in flight,
    a collective over ranks), so the chain goes on there; None otherwise."""

    text: str
    remote: tuple[int, int] | None = None

    @classmethod
    def across(cls, plan: Plan, text: str, actor: int, what: str) -> WaitChain:
        """The chain ``text``, which goes on at the rank of ``actor``, what its last act
        waits on there (``what``)."""
        rank = plan.rank_of(plan.actors[actor].device)
        return cls(f"{text}, which waits on rank {rank}: {what}", (rank, actor))


class Programs(Protocol):
    """Every stream of one rank, each running its program (see the module's docstring)."""

    peaks: dict[tuple[int, int], int]
    """(actor id, output) -> the most buffers it held at once."""

    def start(self) -> None:
        """Start the streams; they wait for runs."""

    def busy(self) -> int:
        """How many streams have work in a run: each says when it finished it."""

    def run(self, steps: int) -> None:
        """Run every stream's program for ``steps`` steps."""

    def close(self) -> None:
        """Stop every stream after the kernel in progress; none waits on for good."""

    def release(self) -> None:
        """Let go of whatever names the buffers, once every stream's thread ended."""

    @property
    def progress(self) -> int:
        """Instructions finished so far, over every stream (the stall watchdog's)."""

    def report(self) -> list[str]:
        """What each stream does, for a StallError."""

    def chain(self, start: int | None = None) -> WaitChain:
        """The wait-for chain, from the first waiting stream's next act, or from the
        next act of actor ``start`` (another rank's chain reached it)."""

    def threads(self) -> list[threading.Thread]:
        """The threads it started, for closing to join."""


class Stream(Protocol):
    name: str
    submitted: int
    done: int
    running: Any
    """The ``ctx`` of the kernel running now, or None."""
    event: Any
    """What another stream waits on for the last launched kernel's work (a CUDA event),
    or None where its end, when reported, means the work is done."""

    def launch(self, kernel: Callable, ins: list, outs: list, ctx: Any) -> None:
        """Run ``kernel(ins, outs)`` after the kernels launched before it."""

    def wait(self, event: Any) -> None:
        """Kernels launched from now on start after ``event`` (another stream's)."""

    def finish(self) -> None:
        """Return once the work launched so far is done (the end of a run)."""

    def close(self) -> None:
        """Launch nothing more; the kernel in progress ends on its own."""


class CpuStream:
    def __init__(self, name: str, on_done: OnDone, timed: bool = True) -> None:
        self.name = name
        self._on_done = on_done
        self._clock = time.perf_counter if timed else float  # float() is 0.0, called in C
        self.submitted = 0
        self.done = 0
        self.running: Any = None
        self.event: Any = None

    def launch(self, kernel: Callable, ins: list, outs: list, ctx: Any) -> None:
        """Run the kernel now, on this (the stream's) thread, and report its end."""
        self.submitted += 1
        self.running = ctx
        start = self._clock()
        try:
            result, ok = kernel(ins, outs), True
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the host
            result, ok = exc, False
        end = self._clock()
        self.running = None
        self.done = self.submitted
        self._on_done(ctx, result, start, end, ok)

    def wait(self, event: Any) -> None:
        """A host kernel that reads what a GPU wrote waits for it here, on the host."""
        event.synchronize()

    def finish(self) -> None:
        """Nothing queued: every kernel ended when it was launched."""

    def close(self) -> None:
        """Nothing to stop: the kernel in progress ends on its own, and none follows."""


class Fence:
    """One collective's hold on ``streams`` other streams: each parks when it reaches the
    fence, the collective runs once all have parked, and its end releases them, with the
    event that marks that end on a GPU (``event``: what a held GPU stream then waits on;
    None on the host, where the end is the release)."""

    def __init__(self, streams: int) -> None:
        self._parked = threading.Semaphore(0)
        self._streams = streams
        self._released = threading.Event()
        self.event: Any = None

    def park(self, closed: Callable[[], bool]) -> Any:
        """On a held stream's thread: stop here until the collective ended (or ``closed``);
        returns its ``event``."""
        self._parked.release()
        while not self._released.wait(POLL):
            if closed():
                return None
        return self.event

    def hold(self, closed: Callable[[], bool]) -> None:
        """On the collective's thread: wait until every held stream parked (or ``closed``)."""
        for _ in range(self._streams):
            while not self._parked.acquire(timeout=POLL):
                if closed():
                    return

    def release(self, event: Any = None) -> None:
        self.event = event
        self._released.set()
