"""``cyclic_gc_paused()``: Python's cyclic garbage collector held off while code builds a
large structure of objects that reference counting frees on its own.

CPython runs the collector after every 700 net allocations of container objects, and
every so often over the whole heap. Building something as large as a 100k-actor plan
(compile's passes, ``Plan.from_bytes``) or the wiring of a runtime for one allocates
millions of objects, so with a large plan alive most of that time went to collections
that found nothing: compile time grew as the square of the actors (100k actors: 25 s
with the collector, 7 s without); opening a runtime took three times as long, a
plan's round trip through bytes 1.6 times, and a run's report (its trace exported,
read back and measured) 1.5 times.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


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
