"""``actorflow trace summary TRACE [--json]``, ``actorflow trace plot TRACE -o PNG`` and
``actorflow trace merge RANK_TRACE... -o OUT.json``.

The main command registers these with ``add_commands(subparsers)`` and, when its
``args.command == "trace"``, returns ``run(args)``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .merge import merge
from .metrics import summarize
from .parse import load
from .recorder import write_chrome


def add_commands(subparsers: Any) -> None:
    """Add the ``trace`` command (with ``summary``, ``plot`` and ``merge``) to an argparse
    subparsers object."""
    trace = subparsers.add_parser(
        "trace",
        help="summarize, plot or merge Chrome traces written by a run",
        description="Read a Chrome trace (from `actorflow demo --trace` or af.run(..., trace=PATH)) "
        "and print its metrics or draw its timeline, or merge the traces of a run's ranks.",
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
    merging = sub.add_parser(
        "merge",
        help="merge the ranks' traces of one run into one",
        description="Merge the traces the ranks of one run wrote (t.rank0.json, t.rank1.json, ...) "
        "into one Perfetto trace, a process per rank, with flow arrows across ranks.",
    )
    merging.add_argument("traces", nargs="+", metavar="RANK_TRACE", help="a rank's Chrome trace JSON file")
    merging.add_argument(
        "-o", "--output", required=True, metavar="OUT.json", help="where to write the merged trace"
    )
    merging.set_defaults(trace_handler=merge_command)


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


def merge_command(args: argparse.Namespace) -> int:
    traces = []
    for path in args.traces:
        try:
            traces.append(load(path))
        except (OSError, ValueError) as e:
            return _merge_error(f"can't read {path}: {e}")
    try:
        merged = merge(traces, names=args.traces)
    except ValueError as e:
        return _merge_error(str(e))
    try:
        write_chrome(merged, args.output)
    except OSError as e:
        return _merge_error(f"can't write {args.output}: {e}")
    print(f"merged trace written to {args.output}")
    return 0


def _merge_error(message: str) -> int:
    print(f"actorflow trace merge: error: {message}", file=sys.stderr)
    return 2


def _read(path: str) -> dict[str, Any] | list[dict[str, Any]] | None:
    try:
        return load(path)
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        print(f"actorflow trace: can't read {path}: {e}", file=sys.stderr)
        return None
