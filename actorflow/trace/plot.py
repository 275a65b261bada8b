"""A Gantt chart of a trace: one row per stream, spans colored by phase (forward, backward,
update, communication), the steps on a row of their own with a line at each step's end,
metrics on top.

matplotlib is optional (``pip install 'actorflow[plot]'``); it is imported when a plot is
drawn, and drawn through the Agg canvas directly, so pyplot's global backend is untouched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .metrics import TraceSummary, summarize_parsed
from .parse import COPY_CATEGORIES, Trace, parse
from .recorder import STEP, WAIT

INSTALL = "pip install 'actorflow[plot]'"
PHASES = ("forward", "backward", "weight", "update", "communication")
COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "weight": "#DA8BC3",
    "update": "#8172B3",
    "communication": "#55A868",
    "compute": "#64B5CD",  # a kernel of a trace that names no phase
    WAIT: "#C8C8C8",
    "other": "#937860",
}
STEP_SHADES = ("#D9D9D9", "#A6A6A6")  # alternate steps on the steps' row
STEP_LINE = "#7F7F7F"
MARKED_STEPS = 200  # more steps than this get their row, but no lines across the streams
LABELED_STEPS = 40
_COMMUNICATION = COPY_CATEGORIES | {"collective", "send", "recv"}


def color_group(category: str, phase: str | None = None) -> str:
    """The span's phase where the trace names one (``args["phase"]``), else from its
    category: compute, communication (copies, feeds, fetches, collectives, sends and
    receives), update (updates and variables), wait, or other."""
    if category == WAIT:
        return WAIT
    if phase in PHASES:
        return phase
    if category == "compute":
        return "compute"
    if category in _COMMUNICATION:
        return "communication"
    return "update" if category in ("update", "variable") else "other"


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
        if s.category != STEP:
            group = color_group(s.category, s.args.get("phase"))
            bars.setdefault((s.track, group), []).append((s.start / 1e6, (s.end - s.start) / 1e6))
    for (row, group), ranges in bars.items():
        ax.broken_barh(ranges, (row - 0.4, 0.8), facecolors=COLORS[group], linewidth=0)
    _mark_steps(ax, trace)
    ax.set_yticks(range(rows), [_label(t.process, t.thread) for t in trace.tracks])
    ax.set_xlabel("time (ms)")
    if trace.spans:
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_xlim(0, max(s.end for s in trace.spans) / 1e6)
    present = sorted({group for _, group in bars}, key=list(COLORS).index)
    handles = [Patch(color=COLORS[g], label=g) for g in present]
    if any(s.category == STEP for s in trace.spans):
        handles.append(Patch(color=STEP_SHADES[1], label="step"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.set_title(_title(summary), fontsize="medium")
    fig.savefig(path, dpi=dpi)


def _mark_steps(ax: Any, trace: Trace) -> None:
    """The step spans in alternating shades on their row (labelled while few), and a line
    across every row at each step's end (while not too many)."""
    steps = [s for s in trace.spans if s.category == STEP]
    for k, s in enumerate(steps):
        ax.broken_barh(
            [(s.start / 1e6, (s.end - s.start) / 1e6)],
            (s.track - 0.4, 0.8),
            facecolors=STEP_SHADES[k % 2],
            linewidth=0,
        )
        if len(steps) <= LABELED_STEPS:
            ax.text((s.start + s.end) / 2e6, s.track, s.name, ha="center", va="center", fontsize="x-small")
        if len(steps) <= MARKED_STEPS:
            ax.axvline(s.end / 1e6, color=STEP_LINE, linewidth=0.6, linestyle="--")


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
