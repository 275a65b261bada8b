"""Pipeline parallelism from quotas: a 2-stage MLP trained with m micro-batches per step,
m in {1, 2, 4, 8}, under the GPipe and the 1F1B schedule, and ZB-H1 (zb1) at m = 4 and
8, against the same model on one device (the whole batch at once).

Per variant it prints: throughput (samples/s) and its ratio to one device; the measured
bubble per stage (the part of each step its compute stream sat idle, from the trace)
beside the theory with equal forward (F), input-gradient (B) and weight-gradient (W)
times, (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(3m+p-1) for ZB-H1; the most
micro-batches whose activations a stage held at once (for ZB-H1, its W's inputs
included), beside the schedule's bound (m for GPipe, p - s for 1F1B, p for ZB-H1).

A second table sets ZB-H1 beside 1F1B at each m: F, B and W are measured from each
run's trace (kernel time per micro-batch on a stage's compute stream: F the forward
actors, B the backward ones autodiff did not mark ``weight_grad``, W those it did, the
accumulation of their results included; the mean over stages), and the theory is the
paper's bubble time (arXiv 2401.10241, section 2) over the step's time: 1F1B
(p-1)(F+B+W) / (m(F+B+W) + (p-1)(F+B+W)), ZB-H1 (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W))
(0 where W > F+B); beside them the measured mean bubbles over stages and the ratio
ZB-H1 / 1F1B of both. Each figure is the median over --repeats runs of --steps steps.

Run: python benchmarks/pipeline.py [--steps 4] [--repeats 3] [--width 512] [--batch 4096]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import numpy as np

from actorflow.compiler.schedules import ZERO_BUBBLE
from actorflow.config import parse_config
from actorflow.text import columns
from actorflow.trace.metrics import PASSES, pipeline_theory
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


def measure(args, stages, micro_batches, schedule, passes=False):
    """Medians over the repeats: (samples/s, bubble per stage, peak activations per stage,
    their bound per stage, theory (p-1)/(m+p-1), and with ``passes`` F, B and W ms per
    micro-batch from each run's trace (``RunResult.passes``), else None)."""
    runs = [train(config(args, stages, micro_batches, schedule)) for _ in range(args.repeats)]
    p = len(stages)
    return (
        statistics.median(r.samples_per_second for r in runs),
        [statistics.median(r.bubbles[s] for r in runs) for s in range(p)],
        [max(r.peak_activations[s] for r in runs) for s in range(p)],
        runs[0].activation_quotas,
        (p - 1) / (micro_batches + p - 1),
        [statistics.median(r.passes[k] * 1e3 for r in runs) for k in PASSES] if passes else None,
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
    rows, measured = [], {}
    variants = [(s, m) for s in ("gpipe", "1f1b") for m in args.micro_batches]
    variants += [("zb1", m) for m in args.micro_batches if m in (4, 8)]
    for schedule, m in variants:
        compared = schedule in ("1f1b", "zb1") and m in (4, 8)
        throughput, bubbles, peaks, bound, _, passes = measure(args, two, m, schedule, compared)
        measured[schedule, m] = (bubbles, passes)
        rows.append(
            (
                schedule,
                str(m),
                f"{throughput:,.0f}",
                f"{throughput / baseline:.2f}x",
                f"{bubbles[0]:.3f}",
                f"{bubbles[1]:.3f}",
                f"{pipeline_theory(2, m, zero_bubble=schedule in ZERO_BUBBLE):.3f}",
                str(peaks[0]),
                str(peaks[1]),
                f"{bound[0]}/{bound[1]}",
            )
        )
    print("\n".join(columns([header, *rows])))
    zero_bubble = [m for m in args.micro_batches if ("zb1", m) in measured]
    if zero_bubble:
        print("\nZB-H1 against 1F1B (F, B, W: ms per micro-batch from the traces; bubbles: mean over stages)")
        print("\n".join(columns(zb_rows(measured, zero_bubble))))
    return 0


def zb_rows(measured, micro_batches):
    """Per m, 1F1B's and ZB-H1's F, B, W, theory and measured bubble, and ZB-H1 / 1F1B."""
    head = ("m", "schedule", "F ms", "B ms", "W ms", "theory", "bubble", "zb1/1f1b theory", "zb1/1f1b bubble")
    rows = [head]
    for m in micro_batches:
        got = {}
        for schedule in ("1f1b", "zb1"):
            bubbles, (f, b, w) = measured[schedule, m]
            got[schedule] = (
                pipeline_theory(2, m, f, b, w, zero_bubble=schedule in ZERO_BUBBLE),
                statistics.mean(bubbles),
            )
            rows.append(
                (
                    str(m),
                    schedule,
                    f"{f:.2f}",
                    f"{b:.2f}",
                    f"{w:.2f}",
                    f"{got[schedule][0]:.3f}",
                    f"{got[schedule][1]:.3f}",
                    "",
                    "",
                )
            )
        ratios = [got["zb1"][k] / got["1f1b"][k] if got["1f1b"][k] else float("nan") for k in range(2)]
        rows[-1] = (*rows[-1][:7], f"{ratios[0]:.2f}", f"{ratios[1]:.2f}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
