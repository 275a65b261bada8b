"""The ``actorflow`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="actorflow",
        description="An actor-model dataflow runtime: compile a graph into a Plan of actors and run it.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="compile and run a small two-device graph, checked against numpy",
        description="Build a graph on cpu:0 and cpu:1 (matmuls, a copy, an all-reduce, a user "
        "kernel), print its plan, run it pipelined and print results and timing.",
    )
    demo.add_argument("--iterations", type=_positive, default=50, help="iterations to run (default 50)")
    demo.add_argument("--batch", type=_positive, default=64, help="rows of x (default 64)")
    demo.add_argument("--width", type=_positive, default=256, help="features (default 256)")
    demo.add_argument("--quota", type=_positive, default=2, help="buffers per register (default 2)")
    demo.add_argument("--trace", metavar="PATH", help="write a Chrome trace (ui.perfetto.dev) there")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo

        return demo(args.iterations, args.batch, args.width, args.quota, args.trace)
    parser().print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
