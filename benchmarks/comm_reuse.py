"""Communication subgraph reuse, off and on, for a model with thousands of collectives:
a deep data-parallel MLP on 4 devices (one gradient all-reduce per layer, fusion off so
each stays its own collective, all with one key), collective streams carrying
--per-stream collectives each. Per variant: collective streams and all streams, the
stream threads the runtime runs (counted while a Session is open), actors, collectives,
planned register bytes, compile seconds and step time (median of --steps steps after a
warm-up step). Then the shipped transformer (configs/transformer.yaml: per stage, the
per-layer all-reduces of tensor parallelism, each reading what the layers before it
computed from the last: chained calls), reuse off and on, with --transformer-per-stream
collectives a stream: collective streams, actors, compile seconds and step time (the
mean of --transformer-steps trained steps), and whether the losses are the same. Then
the compile-time table of ``compile_time.py`` (1k, 10k and 100k actors, time per actor).

Run: python benchmarks/comm_reuse.py [--layers 1000] [--per-stream 64] [--steps 3]
     [--transformer-per-stream 1] [--transformer-steps 30] [--actors 1000 10000 100000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import actorflow as af  # noqa: E402
from actorflow.config import load_config  # noqa: E402
from actorflow.text import columns  # noqa: E402
from actorflow.training import compile_config, train  # noqa: E402
from compile_time import DEVICES, compile_table, deep_mlp, time_compile  # noqa: E402


def feeds(width: int = 8, batch: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "x": rng.standard_normal((batch, width)).astype(np.float32),
        "y": rng.standard_normal((batch, width)).astype(np.float32),
    }


def measure(graph: af.Graph, steps: int, **options) -> tuple[tuple[str, ...], list[float]]:
    plan, seconds = time_compile(graph, 1, fusion=False, **options)
    collective = [s for s in plan.streams if s.kind == "collective"]
    before = threading.active_count()
    batch = feeds()
    times, losses = [], []
    with af.Session(plan) as s:
        threads = threading.active_count() - before
        losses.append(float(s.run(batch)["loss"]))  # warm-up
        for _ in range(steps):
            start = time.perf_counter()
            losses.append(float(s.run(batch)["loss"]))
            times.append(time.perf_counter() - start)
    registers = sum(r.nbytes * r.quota for r in plan.registers)
    row = (
        str(len(collective)),
        str(len(plan.streams)),
        str(threads),
        str(len(plan.actors)),
        str(len(plan.collectives)),
        str(plan.labels),
        f"{registers / 2**20:.2f}",
        f"{seconds:.2f}",
        f"{statistics.median(times) * 1e3:.0f}",
    )
    return row, losses


def transformer(per_stream: int, steps: int) -> None:
    """The shipped transformer trained with reuse off and on, side by side."""
    config = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs/transformer.yaml"
    )
    rows = [("reuse", "collective streams", "streams", "actors", "collectives", "compile s", "step ms")]
    losses = {}
    for name, reuse in (("off", []), ("on (-1)", ["runtime.comm_reuse=-1"])):
        run = load_config(
            config, [f"train.steps={steps}", f"runtime.max_ops_per_stream={per_stream}", *reuse]
        )
        start = time.perf_counter()
        plan = compile_config(run)
        seconds = time.perf_counter() - start
        result = train(run)
        losses[name] = result.losses
        rows.append(
            (
                name,
                str(sum(s.kind == "collective" for s in plan.streams)),
                str(len(plan.streams)),
                str(len(plan.actors)),
                str(len(plan.collectives)),
                f"{seconds:.2f}",
                f"{result.seconds / steps * 1e3:.1f}",
            )
        )
    print(
        f"\nthe shipped transformer (configs/transformer.yaml), max_ops_per_stream {per_stream}, {steps} steps"
    )
    print("\n".join(columns(rows)))
    print(
        f"losses of the {steps} steps identical with and without reuse: {losses['off'] == losses['on (-1)']}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=1000)
    p.add_argument("--per-stream", type=int, default=64, help="max_ops_per_stream")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--transformer-per-stream", type=int, default=1, help="the transformer's max_ops_per_stream"
    )
    p.add_argument("--transformer-steps", type=int, default=30)
    p.add_argument(
        "--actors", type=int, nargs="*", default=[1000, 10000, 100000], help="compile-time table sizes"
    )
    args = p.parse_args()
    graph = deep_mlp(args.layers)
    header = (
        "reuse",
        "collective streams",
        "streams",
        "threads",
        "actors",
        "collectives",
        "labels",
        "register MiB",
        "compile s",
        "step ms",
    )
    rows, losses = [header], {}
    for name, reuse in (("off", None), ("on (-1)", -1)):
        row, losses[name] = measure(graph, args.steps, max_ops_per_stream=args.per_stream, comm_reuse=reuse)
        rows.append((name, *row))
    print(
        f"deep data-parallel MLP, {args.layers} layers on {len(DEVICES)} devices, fusion off, "
        f"max_ops_per_stream {args.per_stream}; step time median of {args.steps}"
    )
    print("\n".join(columns(rows)))
    same = losses["off"] == losses["on (-1)"]
    print(f"losses of the {args.steps + 1} steps identical with and without reuse: {same}")
    transformer(args.transformer_per_stream, args.transformer_steps)
    if args.actors:
        print(
            f"\ncompile time, deep data-parallel MLP on {len(DEVICES)} devices (fusion on), one compile each"
        )
        print("\n".join(columns(compile_table(args.actors, 1))))


if __name__ == "__main__":
    main()
