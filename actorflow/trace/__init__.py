"""Recording what ran where and when, exporting it (Chrome/Perfetto JSON), measuring it
(busy, overlap, bubble, critical path) and plotting it. Sits below the runtime: it knows
plain names and numbers, never Plans."""

from .metrics import CriticalPath, StageBubble, StreamStat, TraceSummary, summarize
from .parse import load
from .plot import plot_timeline
from .recorder import STEP, TRACE_LIMIT, WAIT, Recorder, Span, parse_iterations

__all__ = [
    "STEP",
    "TRACE_LIMIT",
    "WAIT",
    "CriticalPath",
    "Recorder",
    "Span",
    "StageBubble",
    "StreamStat",
    "TraceSummary",
    "load",
    "parse_iterations",
    "plot_timeline",
    "summarize",
]
