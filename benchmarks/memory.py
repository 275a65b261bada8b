"""Memory against time: optimizer sharding and recompute on a data-parallel run and a
2-stage pipeline (2 replicas a stage), each against the plain run of the same layout.

Per layout, variant and device it prints the planned memory (every buffer of every
register, parameters and optimizer state included), the held memory (each register's
most buffers at once, summed: what the run measured) and the step time, each beside
its ratio to the plain run of the layout, measured in the same invocation. Variants:
plain, shard (``train.optimizer.shard``, every parameter), recompute
(``parallel.recompute: true``, every stage) and both. Adam, so the optimizer state is
twice the parameters. Step times are medians over --repeats runs of --steps steps;
planned memory does not vary between runs, held memory is the largest of the runs.

GPipe by default: every register is allocated once for the whole run (planned memory
is what the quotas allocate), so recompute saves what kept registers held for several
micro-batches at once, less the buffers its copies write; under 1F1B a stage keeps p - s
micro-batches, the last stage one, and the copies' buffers cost about what they free.

Run: python benchmarks/memory.py [--width 256] [--batch 4096] [--schedule gpipe] [--steps 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import numpy as np

from actorflow.config import parse_config
from actorflow.text import columns
from actorflow.training import train

LAYOUTS = {
    "data-parallel": {"stages": [["cpu:0", "cpu:1"]], "data_parallel": 2},
    "2-stage pipeline": {"stages": [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]], "data_parallel": 2},
}
VARIANTS = {"plain": (False, False), "shard": (True, False), "recompute": (False, True), "both": (True, True)}


def config(args, layout: str, shard: bool, recompute: bool):
    return parse_config(
        {
            "model": {"sizes": [args.width] * (args.layers + 1), "activation": "gelu", "dtype": "float32"},
            "data": {"samples": args.batch * 4, "seed": 0},
            "train": {
                "steps": args.steps,
                "batch_size": args.batch,
                "optimizer": {"kind": "adam", "lr": 1e-3, "shard": shard, "shard_threshold_kb": 0},
            },
            "parallel": {
                **LAYOUTS[layout],
                "micro_batches": args.micro_batches,
                "schedule": args.schedule,
                "recompute": recompute,
            },
        }
    )


def measure(args, layout: str, variant: str):
    """(planned bytes per device, held bytes per device, median step seconds)."""
    runs = [train(config(args, layout, *VARIANTS[variant])) for _ in range(args.repeats)]
    held = {d: max(r.held_memory[d] for r in runs) for d in runs[0].memory}
    return runs[0].memory, held, statistics.median(r.seconds / args.steps for r in runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=256, help="layer width (default 256)")
    p.add_argument("--layers", type=int, default=4, help="dense layers (default 4)")
    p.add_argument("--batch", type=int, default=4096, help="global batch per step (default 4096)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (default 4)")
    p.add_argument("--schedule", default="gpipe", help="pipeline schedule (default gpipe)")
    p.add_argument("--steps", type=int, default=6, help="steps per run (default 6)")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant; step times are medians")
    args = p.parse_args()
    print(
        f"actorflow memory benchmark: python {platform.python_version()}, numpy {np.__version__}, "
        f"{os.cpu_count()} cores; MLP {[args.width] * (args.layers + 1)} float32 gelu, Adam, "
        f"batch {args.batch}, {args.micro_batches} micro-batches, {args.schedule}; {args.steps} steps x "
        f"{args.repeats} runs"
    )
    header = (
        "layout",
        "variant",
        "device",
        "planned MiB",
        "vs plain",
        "held MiB",
        "vs plain",
        "step ms",
        "vs plain",
    )
    rows = []
    for layout in LAYOUTS:
        base_planned, base_held, base_step = measure(args, layout, "plain")
        for variant in VARIANTS:
            planned, held, step = (
                (base_planned, base_held, base_step) if variant == "plain" else measure(args, layout, variant)
            )
            for device in sorted(planned):
                rows.append(
                    (
                        layout,
                        variant,
                        device,
                        f"{planned[device] / 2**20:.2f}",
                        f"{planned[device] / base_planned[device]:.2f}",
                        f"{held[device] / 2**20:.2f}",
                        f"{held[device] / base_held[device]:.2f}",
                        f"{step * 1e3:.1f}",
                        f"{step / base_step:.2f}",
                    )
                )
    print("\n".join(columns([header, *rows])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
