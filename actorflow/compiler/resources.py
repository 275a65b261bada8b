"""The device resource model: how many streams a rank may run, how many collectives a
collective stream may carry, how many labels the calls of reused communication subgraphs
may take, and how many bytes a device may plan. Defaults are generous for CPU runs;
``max_memory`` defaults to the memory this machine has available when it compiles; the
Plan then records 0 for it, so that compiling a graph twice gives equal Plans (and
ranks agree on the digest) however the free memory moved in between."""

from __future__ import annotations

import os

from ..plan import Resources


def memory_limit(limits: Resources) -> int:
    """Bytes a device may plan: ``max_memory``, or what this machine has available."""
    return limits.max_memory or available_memory()


def available_memory() -> int:
    """Bytes this machine can still give (MemAvailable on Linux, else free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
