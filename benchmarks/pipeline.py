"""Pipeline parallelism from quotas: a 2-stage MLP trained with m micro-batches per step,
m in {1, 2, 4, 8}, under the GPipe and the 1F1B schedule, against the same model on one
device (the whole batch at once).

Per variant it prints: throughput (samples/s) and its ratio to one device; the measured
bubble per stage (the part of each step its compute stream sat idle, from the trace)
beside the theory (p-1)/(m+p-1); the most micro-batches whose activations a stage held
at once, beside the schedule's bound (m for GPipe, p - s for 1F1B). Each figure is the
median over --repeats runs of --steps steps.

Run: python benchmarks/pipeline.py [--steps 4] [--repeats 3] [--width 512] [--batch 4096]
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


def config(args, stages, micro_batches, schedule):
    """The first layer is 1.5x wider: it computes no input gradient, so this evens the stages."""
    sizes = [args.width * 3 // 2] + [args.width] * args.layers
    return parse_config(
        {
            "model": {"sizes": sizes, "activation": "relu", "dtype": "float32"},
            "data": {"samples": args.batch * 4, "seed": 0},
            "train": {
                "steps": args.steps,
                "batch_size": args.batch,
                "optimizer": {"kind": "sgd", "lr": 0.01},
            },
            "parallel": {"stages": stages, "micro_batches": micro_batches, "schedule": schedule},
        }
    )


def measure(args, stages, micro_batches, schedule):
    """Medians over the repeats: (samples/s, bubble per stage, peak activations per stage,
    their bound per stage, theory)."""
    runs = [train(config(args, stages, micro_batches, schedule)) for _ in range(args.repeats)]
    p = len(stages)
    return (
        statistics.median(r.samples_per_second for r in runs),
        [statistics.median(r.bubbles[s] for r in runs) for s in range(p)],
        [max(r.peak_activations[s] for r in runs) for s in range(p)],
        runs[0].activation_quotas,
        runs[0].theory,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=512, help="layer width (default 512)")
    p.add_argument("--layers", type=int, default=4, help="dense layers, split 2 and 2 (default 4)")
    p.add_argument("--batch", type=int, default=4096, help="global batch per step (default 4096)")
    p.add_argument("--steps", type=int, default=4, help="steps per run (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant; medians are printed")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args()

    two = ["cpu:0", "cpu:1"]
    sizes = config(args, two, 1, "1f1b").model.sizes
    flops = 2 * 3 * args.width * args.width * args.batch * args.layers // 2
    print(
        f"actorflow pipeline benchmark: python {platform.python_version()}, numpy {np.__version__}, "
        f"{os.cpu_count()} cores; MLP {list(sizes)} float32, batch {args.batch}, "
        f"2 stages of {args.layers // 2} layers; {args.steps} steps x {args.repeats} runs (medians)"
    )
    print(
        f"per stage and step: {flops / 1e9:.2f} GFLOP forward + backward, "
        f"{flops / 1e9 / max(args.micro_batches):.3f} GFLOP per micro-batch at m = {max(args.micro_batches)}"
    )
    baseline, *_ = measure(args, ["cpu:0"], 1, "1f1b")
    print(f"one device: {baseline:,.0f} samples/s\n")
    header = (
        "schedule",
        "m",
        "samples/s",
        "vs 1 device",
        "bubble s0",
        "bubble s1",
        "theory",
        "peak act s0",
        "peak act s1",
        "bound s0/s1",
    )
    rows = []
    for schedule in ("gpipe", "1f1b"):
        for m in args.micro_batches:
            throughput, bubbles, peaks, bound, theory = measure(args, two, m, schedule)
            rows.append(
                (
                    schedule,
                    str(m),
                    f"{throughput:,.0f}",
                    f"{throughput / baseline:.2f}x",
                    f"{bubbles[0]:.3f}",
                    f"{bubbles[1]:.3f}",
                    f"{theory:.3f}",
                    str(peaks[0]),
                    str(peaks[1]),
                    f"{bound[0]}/{bound[1]}",
                )
            )
    print("\n".join(columns([header, *rows])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
