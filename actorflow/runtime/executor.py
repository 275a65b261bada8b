"""How a stream runs the kernels its driver launches, like a CUDA stream.

``StreamExecutor``: kernels run in order on the stream's own thread, the thread that runs
its driver's message loop (``driver``), so launching a kernel is calling it. It counts
the kernels launched and finished, and knows the one running, for the stall report.

``Fence`` holds streams while one kernel of another runs: with overlap off, a
collective's compute streams stop while it runs, as if they were one stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

Completion = tuple[Any, Any, float, float, bool]
"""(context, result or exception, start, end, ok): what a launch reports when it ends."""

POLL = 0.1


class StreamExecutor:
    def __init__(self, name: str, on_done: Callable[[Completion], None], timed: bool = True) -> None:
        self.name = name
        self._on_done = on_done
        self._clock = time.perf_counter if timed else float  # float() is 0.0, called in C
        self.submitted = 0
        self.done = 0
        self.running: Any = None

    def launch(self, kernel: Callable, ins: list, outs: list, ctx: Any) -> None:
        """Run the kernel now, on this (the stream's) thread, and report its completion."""
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
        self._on_done((ctx, result, start, end, ok))

    def close(self) -> None:
        """Nothing to stop: the kernel in progress ends on its own, and none follows."""


class Fence:
    """One collective's hold on ``streams`` other streams: each parks when it reaches the
    fence, the collective runs once all have parked, and its end releases them."""

    def __init__(self, streams: int) -> None:
        self._parked = threading.Semaphore(0)
        self._streams = streams
        self._released = threading.Event()

    def park(self, closed: Callable[[], bool]) -> None:
        """On a held stream's thread: stop here until the collective ended (or ``closed``)."""
        self._parked.release()
        while not self._released.wait(POLL):
            if closed():
                return

    def hold(self, closed: Callable[[], bool]) -> None:
        """On the collective's thread: wait until every held stream parked (or ``closed``)."""
        for _ in range(self._streams):
            while not self._parked.acquire(timeout=POLL):
                if closed():
                    return

    def release(self) -> None:
        self._released.set()
