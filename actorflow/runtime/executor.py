"""A stream: one dedicated OS thread running launched kernels in order, like a CUDA stream.

Events are timeline points: "kernel number ``seq`` of stream S has finished". A kernel
waits for its events on its own thread, never on the host; a completion says how long
(start, end and the streams waited on, or None if they had all finished).

Completions go back to trio in batches through ``run_sync_soon``. Each hand-over costs a
GIL switch or two (tens of µs here), so a batch is posted when the thread is about to
block; once it holds an *urgent* completion (one that returns credits to another stream,
tells another stream "ready", or carries a result for the host) and its first kernel
started ``URGENT_AFTER`` seconds ago, or before a kernel that took longer than that
last time, so urgent news never waits behind a long kernel while tiny ones share a
wake-up; and otherwise ``FLUSH_AFTER`` seconds after its first kernel started.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import trio

_STOP = None
URGENT_AFTER = 50e-6
FLUSH_AFTER = 0.01


class StreamExecutor:
    def __init__(self, name: str, token: trio.lowlevel.TrioToken, deliver: Callable[[list], None]) -> None:
        self.name = name
        self._token = token
        self._deliver = deliver
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._closed = False
        self._waiters = 0
        self.submitted = 0
        self.done = 0
        self.running: Any = None
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, kernel: Callable, ins: list, outs: list, waits: list, ctx: Any, urgent: bool) -> int:
        """Queue a kernel; returns its sequence number, the event others may wait on.
        A kernel with ``ctx`` None reports no completion (a fence)."""
        self.submitted += 1
        self._queue.put((self.submitted, kernel, ins, outs, waits, ctx, urgent))
        return self.submitted

    def wait_until(self, seq: int) -> bool:
        """Block this (other) stream's thread until kernel ``seq`` finished; False if closed."""
        with self._cond:
            self._waiters += 1
            try:
                while self.done < seq and not self._closed:
                    self._cond.wait()
            finally:
                self._waiters -= 1
            return self.done >= seq

    def close(self) -> None:
        """Stop after the kernel in progress; wakes every thread waiting on this stream."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._queue.put(_STOP)

    def _post(self, batch: list) -> None:
        post(self._token, self._deliver, batch)

    def _loop(self) -> None:
        batch: list = []
        oldest = 0.0
        pressing = False
        took: dict[int, float] = {}
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                if batch:
                    self._post(batch)
                    batch = []
                item = self._queue.get()
            if item is _STOP or self._closed:
                break
            seq, kernel, ins, outs, waits, ctx, urgent = item
            waited = None
            for stream, point in waits:
                if stream.done < point:
                    if batch:
                        self._post(batch)
                        batch = []
                    began = time.perf_counter() if waited is None else waited[0]
                    if not stream.wait_until(point):
                        return
                    names = stream.name if waited is None else f"{waited[2]}, {stream.name}"
                    waited = (began, time.perf_counter(), names)
            if pressing and batch and took.get(id(kernel), 0.0) > URGENT_AFTER:
                self._post(batch)
                batch = []
            self.running = ctx
            start = time.perf_counter()
            try:
                result = kernel(ins, outs)
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the host
                batch.append((ctx, exc, start, time.perf_counter(), False, waited))
                self._post(batch)
                return
            end = time.perf_counter()
            took[id(kernel)] = end - start
            self.running = None
            self.done = seq
            if self._waiters:
                with self._cond:
                    self._cond.notify_all()
            if ctx is None:
                continue
            if not batch:
                oldest = start
                pressing = False
            batch.append((ctx, result, start, end, True, waited))
            pressing = pressing or urgent
            age = end - oldest
            if (pressing and age > URGENT_AFTER) or age > FLUSH_AFTER:
                self._post(batch)
                batch = []
        if batch:
            self._post(batch)


def post(token: trio.lowlevel.TrioToken, fn: Callable[..., Any], *args: Any) -> None:
    """Call ``fn(*args)`` on the trio thread, from any thread, unless the run has ended
    (``run_sync_soon`` then raises ``RunFinishedError``: at shutdown, nobody is left to tell)."""
    try:
        token.run_sync_soon(fn, *args)
    except trio.RunFinishedError:
        pass
