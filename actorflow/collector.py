"""Keeping Python's cyclic garbage collector out of the way: ``cyclic_gc_paused()`` holds
it off while code builds a large structure of objects that reference counting frees on
its own; ``full_collections_paused()`` keeps it from scanning the whole heap while a
runtime runs.

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
_runtimes = 0  # open runtimes inside full_collections_paused
_thresholds = gc.get_threshold()  # the collector's, before the first of them entered
_NEVER = 2**31 - 1
"""A threshold no count of collections reaches."""


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
def full_collections_paused() -> Iterator[None]:
    """While any runtime is inside, the cyclic collector makes no collection over the
    whole heap (its oldest generation's threshold is set out of reach); its collections
    of young objects go on. When the last runtime leaves, the thresholds are what they
    were when the first entered.

    Why: every so often CPython collects over the whole heap, holding the GIL. With
    PyTorch, CuPy and a compiled plan in the process that took 170-330 ms on an H200
    machine's host, in which no stream's host thread launched anything and the GPU went
    idle. The objects a run makes are few and short-lived, so its collections over them
    alone cost little. A program that keeps a runtime open for long (a ``Session``) and
    makes cyclic garbage of its own that outlives its young collections can call
    ``gc.collect()`` where a pause does no harm: nothing else collects it meanwhile.

    Until 2026-11-28 a runtime froze the heap instead (``gc.freeze``, and ``gc.unfreeze``
    when the last left). Each opening froze the garbage of the runs before it, and its
    thaw put it in the oldest generation uncounted: CPython collects that generation
    when enough objects came into it from the younger ones since the last time, and
    thawed ones don't count. ``af.run`` of one 399-actor plan, 60 times in a row, left
    3.4M objects of garbage (605 MB) for a final collection of 4.5 s; each worker of the
    test suite ended with 3-5 s of it. (Python 3.14's incremental collector takes the
    whole heap in small parts instead, and ignores that threshold.)
    """
    global _runtimes, _thresholds
    with _lock:
        if _runtimes == 0:
            _thresholds = gc.get_threshold()
            gc.set_threshold(_thresholds[0], _thresholds[1], _NEVER)
        _runtimes += 1
    try:
        yield
    finally:
        with _lock:
            _runtimes -= 1
            if _runtimes == 0:
                gc.set_threshold(*_thresholds)
