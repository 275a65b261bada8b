"""Keeping Python's cyclic garbage collector out of the way: ``cyclic_gc_paused()`` holds
it off while code builds a large structure of objects that reference counting frees on
its own; ``heap_frozen()`` keeps it from scanning the heap that existed when a runtime
opened, while the runtime runs.

CPython runs the collector after every 700 net allocations of container objects, and
every so often over the whole heap. Building something as large as a 100k-actor plan
(compile's passes, ``Plan.from_bytes``) or the wiring of a runtime for one allocates
millions of objects, so with a large plan alive most of that time went to collections
that found nothing: compile time grew as the square of the actors (100k actors: 25 s
with the collector, 7 s without); opening a runtime took three times as long, a
plan's round trip through bytes 1.6 times, and a run's report (its trace exported,
read back and measured) 1.5 times. ``actorflow simulate --layout 16,8,8`` (1024
devices: 512k simulated acts, then their spans and report) took 50.9 s with the
collector on, 29.9 s with it off; the replay's schedule of a 181k-act simulation 6.1-6.7
s, 4.8-5.3 s.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_runtimes = 0  # open runtimes inside heap_frozen


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic collector inside; afterwards it is on again if it was on before
    (usable as a decorator). Across threads, whoever found it on turns it back on, so it
    never stays off for good."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def heap_frozen() -> Iterator[None]:
    """While any runtime is inside, every object alive when one entered is frozen out of
    the cyclic collector (``gc.freeze``); when the last leaves, every frozen object is
    collectable again (``gc.unfreeze``), the program's own frozen objects too: the
    collector can't tell whose they were (Python 3.12 freezes a few hundred at start-up).

    Why: every so often CPython collects over the whole heap, holding the GIL. With
    PyTorch, CuPy and a compiled plan in the process that took 170-330 ms on an H200
    machine's host, in which no stream's host thread launched anything and the GPU went
    idle. The objects a run makes are few and short-lived, so its collections over them
    alone cost little. Garbage cycles among the frozen objects wait until the last
    runtime leaves.
    """
    global _runtimes
    with _lock:
        _runtimes += 1
        gc.freeze()
    try:
        yield
    finally:
        with _lock:
            _runtimes -= 1
            if _runtimes == 0:
                gc.unfreeze()
