"""The ``actorflow`` command."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .errors import ConfigError
from .trace.cli import add_commands as add_trace_commands


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

    run = sub.add_parser(
        "run",
        help="train the model a YAML config describes, pipelined over its stages",
        description="Train the run CONFIG describes (see configs/): a progress bar with the loss, "
        "then a table of samples/s, measured pipeline bubble per stage beside the theory "
        "(p-1)/(m+p-1), peak activations held per stage and planned memory per device.",
    )
    _config_arguments(run)
    run.add_argument("--steps", type=_positive, help="override train.steps")
    run.add_argument("--trace", metavar="PATH", help="write a Chrome trace there (overrides output.trace)")
    run.add_argument("--metrics", metavar="PATH", help="write the results as JSON there (overrides output.metrics)")
    run.add_argument("--quiet", action="store_true", help="no progress bar or per-step loss")

    comp = sub.add_parser(
        "compile",
        help="print the plan of a YAML config's run without running it",
        description="Compile the run CONFIG describes and print an overview of its plan (streams, "
        "actors per kind, planned memory), or all of it with --dump, or its actor graph with --dot "
        "(render with: dot -Tsvg).",
    )
    _config_arguments(comp)
    view = comp.add_mutually_exclusive_group()
    view.add_argument(
        "--dump", action="store_true",
        help="every actor with its stream, priority, inputs and outputs (quota, consumers); "
        "events; collective order; planned memory per device",
    )
    view.add_argument("--dot", action="store_true", help="the actor graph as Graphviz text, streams as clusters")
    add_trace_commands(sub)
    return p


def _config_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="the run's YAML config, e.g. configs/default.yaml")
    p.add_argument(
        "--set", dest="overrides", metavar="PATH=VALUE", action="append", default=[],
        help="override a config value, e.g. --set parallel.micro_batches=8 (repeatable)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo

        return demo(args.iterations, args.batch, args.width, args.quota, args.trace)
    if args.command in ("run", "compile"):
        from .config import load_config

        overrides = list(args.overrides)
        if getattr(args, "steps", None) is not None:
            overrides.append(f"train.steps={args.steps}")
        try:
            config = load_config(args.config, overrides)
        except ConfigError as err:
            print(f"actorflow {args.command}: error: {err}", file=sys.stderr)
            return 2
        return _run(config, args) if args.command == "run" else _compile(config, args)
    if args.command == "trace":
        from .trace.cli import run as trace

        return trace(args)
    parser().print_help()
    return 2


def _compile(config, args) -> int:
    from .training import compile_config
    from .views import dot, overview

    plan = compile_config(config)
    print(plan.summary() if args.dump else dot(plan) if args.dot else overview(plan))
    return 0


def _run(config, args) -> int:
    from tqdm import tqdm

    from .training import train
    from .training.report import metrics, table

    trace = args.trace or config.output.trace
    metrics_path = args.metrics or config.output.metrics
    bar = tqdm(total=config.train.steps, unit="step", disable=args.quiet, file=sys.stderr)

    def on_step(step: int, loss: float) -> None:
        bar.update()
        bar.set_postfix(loss=f"{loss:.4f}")
        if not args.quiet and (step + 1) % config.train.log_every == 0:
            bar.write(f"step {step + 1}/{config.train.steps} loss {loss:.4f}", file=sys.stderr)

    try:
        result = train(config, on_step, trace)
    finally:
        bar.close()
    print(table(config, result))
    if trace:
        print(f"trace written to {trace}")
    if metrics_path:
        with open(metrics_path, "w") as f:
            json.dump(metrics(config, result), f, indent=2)
        print(f"metrics written to {metrics_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
