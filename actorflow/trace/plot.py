"""A Gantt chart of a trace: one row per stream, spans colored by op kind, metrics on top.

matplotlib is optional (``pip install 'actorflow[plot]'``); it is imported when a plot is
drawn, and drawn through the Agg canvas directly, so pyplot's global backend is untouched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .metrics import TraceSummary, summarize_parsed
from .parse import COPY_CATEGORIES, parse
from .recorder import WAIT

INSTALL = "pip install 'actorflow[plot]'"
COLORS = {
    "compute": "#4C72B0",
    "copy": "#DD8452",
    "collective": "#55A868",
    WAIT: "#C8C8C8",
    "other": "#8172B3",
}


def color_group(category: str) -> str:
    """compute, copy (feeds and fetches too), collective, wait, or other (update, variable,
    repeat, accumulate and anything else)."""
    if category in ("compute", "collective", WAIT):
        return category
    return "copy" if category in COPY_CATEGORIES else "other"


def plot_timeline(
    trace_json: dict[str, Any] | list[dict[str, Any]],
    path: str | os.PathLike,
    *,
    stages: Sequence[str] | None = None,
    width: int = 1600,
    height: int | None = None,
) -> None:
    """Write a PNG of ``width`` x ``height`` pixels (height None: 200 + 40 per stream)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(f"plotting a trace needs matplotlib: {INSTALL}") from e

    trace = parse(trace_json)
    summary = summarize_parsed(trace, stages)
    rows = len(trace.tracks)
    height = 200 + 40 * rows if height is None else height
    dpi = 100
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for s in trace.spans:
        bars.setdefault((s.track, color_group(s.category)), []).append((s.start / 1e6, (s.end - s.start) / 1e6))
    for (row, group), ranges in bars.items():
        ax.broken_barh(ranges, (row - 0.4, 0.8), facecolors=COLORS[group], linewidth=0)
    ax.set_yticks(range(rows), [_label(t.process, t.thread) for t in trace.tracks])
    ax.set_xlabel("time (ms)")
    if trace.spans:
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_xlim(0, max(s.end for s in trace.spans) / 1e6)
    present = sorted({group for _, group in bars}, key=list(COLORS).index)
    if present:
        handles = [Patch(color=COLORS[g], label=g) for g in present]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.set_title(_title(summary), fontsize="medium")
    fig.savefig(path, dpi=dpi)


def _label(process: str, thread: str) -> str:
    return thread if thread.startswith(process) else f"{process} {thread}"


def _title(summary: TraceSummary) -> str:
    compute = [s.busy_fraction for s in summary.streams if s.kind == "compute"]
    parts = [f"wall {summary.wall_s * 1e3:.2f} ms"]
    if compute:
        parts.append(f"compute busy {sum(compute) / len(compute):.0%} (mean)")
    if summary.overlap is not None:
        parts.append(f"overlap {summary.overlap:.0%}")
    if summary.bubble is not None:
        parts.append(f"bubble {summary.bubble:.0%} (mean)")
    path = summary.critical_path
    shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(path.shares.items(), key=lambda kv: -kv[1])[:4])
    critical = f"critical path {path.length_s * 1e3:.2f} ms" + (f" ({shares})" if shares else "")
    return " | ".join(parts) + "\n" + critical
