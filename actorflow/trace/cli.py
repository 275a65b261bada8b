"""``actorflow trace summary TRACE [--json]`` and ``actorflow trace plot TRACE -o PNG``.

The main command registers these with ``add_commands(subparsers)`` and, when its
``args.command == "trace"``, returns ``run(args)``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .metrics import summarize
from .parse import load


def add_commands(subparsers: Any) -> None:
    """Add the ``trace`` command (with ``summary`` and ``plot``) to an argparse subparsers object."""
    trace = subparsers.add_parser(
        "trace",
        help="summarize or plot a Chrome trace written by a run",
        description="Read a Chrome trace (from `actorflow demo --trace` or af.run(..., trace=PATH)) "
        "and print its metrics or draw its timeline.",
    )
    sub = trace.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)
    summary = sub.add_parser(
        "summary",
        help="print busy fractions, overlap, bubble and critical path",
        description="Print per-stream busy time, collective/compute overlap, the bubble per pipeline "
        "stage and the critical path with its share per op kind.",
    )
    summary.add_argument("--json", action="store_true", help="print the metrics as JSON")
    plot = sub.add_parser(
        "plot",
        help="draw the timeline as a PNG (needs matplotlib)",
        description="Draw a Gantt chart, one row per stream, colored by op kind, metrics in the title.",
    )
    plot.add_argument("-o", "--output", required=True, metavar="PNG", help="where to write the PNG")
    for p, handler in ((summary, summary_command), (plot, plot_command)):
        p.add_argument("trace", metavar="TRACE", help="a Chrome trace JSON file")
        p.add_argument(
            "--stages",
            metavar="DEVICES",
            type=lambda text: [d.strip() for d in text.split(",") if d.strip()],
            help="pipeline stages' devices in order, e.g. cpu:0,cpu:1 (default: the spans' stage args)",
        )
        p.set_defaults(trace_handler=handler)


def run(args: argparse.Namespace) -> int:
    return args.trace_handler(args)


def summary_command(args: argparse.Namespace) -> int:
    data = _read(args.trace)
    if data is None:
        return 1
    summary = summarize(data, args.stages)
    print(summary.to_json() if args.json else summary.format())
    return 0


def plot_command(args: argparse.Namespace) -> int:
    from .plot import plot_timeline

    data = _read(args.trace)
    if data is None:
        return 1
    try:
        plot_timeline(data, args.output, stages=args.stages)
    except ImportError as e:
        print(f"actorflow trace plot: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"actorflow trace plot: can't write {args.output}: {e}", file=sys.stderr)
        return 1
    print(f"timeline written to {args.output}")
    return 0


def _read(path: str) -> dict[str, Any] | list[dict[str, Any]] | None:
    try:
        return load(path)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        print(f"actorflow trace: can't read {path}: {e}", file=sys.stderr)
        return None
