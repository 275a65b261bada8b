"""Sharding strategies for the transformer: data parallel, Megatron by hand, and what the
compiler's SBP search finds from few annotations, on 2 and 4 devices.

The model is configs/transformer.yaml's (one stage, float32; --layers blocks). Per
strategy and device count it prints: the predicted communication a step (the plan's
collectives, as a ring moves them: ``Plan.communication_per_step``), the measured one
(each collective act in the run's trace, counted, times the bytes it moves), the
median step time over --repeats runs of --steps steps and its ratio to data parallel
in the same invocation, and how long the compile (with the search) took. Strategies:

- data parallel: the batch split (S(0)), every parameter replicated;
- Megatron: query, key, value and first MLP weights by column, the attention output and
  second MLP weights by row, the rest replicated (the batch too);
- search, wq only: only each block's query weight annotated (by column); the compiler
  chooses every other placeholder's and parameter's SBP;
- search, nothing: no annotation at all.

Run: python benchmarks/sharding.py [--layers 2] [--steps 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import Counter

import numpy as np

import actorflow as af
from actorflow.config import load_config
from actorflow.text import columns
from actorflow.training import transformer
from actorflow.training.data import dataset, step_feeds


def strategies(args, n: int):
    """(name, config, annotated) for each strategy on n devices."""
    devices = [f"cpu:{k}" for k in range(n)]
    sets = [f"model.layers={args.layers}", "parallel.micro_batches=1", f"train.steps={args.steps}"]
    tp = load_config(
        "configs/transformer.yaml", [*sets, f"parallel.stages=[{devices}]", f"parallel.tensor_parallel={n}"]
    )
    dp = load_config(
        "configs/transformer.yaml",
        [*sets, f"parallel.stages=[{devices}]", "parallel.tensor_parallel=1", f"parallel.data_parallel={n}"],
    )
    wq = {f"h{k}.wq" for k in range(args.layers)}
    return [
        ("data parallel", dp, None),
        ("Megatron", tp, None),
        ("search, wq only", tp, wq),
        ("search, nothing", tp, set()),
    ]


def measure(args, config, annotated):
    """(plan, compile seconds, measured bytes a step, median step seconds)."""
    start = time.perf_counter()
    plan = af.compile(transformer.build_graph(config, annotated))
    compiled = time.perf_counter() - start
    data = dataset(config)
    moved = {c.name: c.nbytes for c in plan.collectives}
    steps, acts = [], Counter()
    for _ in range(args.repeats):
        with af.Session(plan, trace=True) as session:
            session.run(step_feeds(config, data, 0))  # warm-up
            start = time.perf_counter()
            for step in range(args.steps):
                session.run(step_feeds(config, data, step))
            steps.append((time.perf_counter() - start) / args.steps)
            acts = Counter(s.args["actor"] for s in session.recorder.kernels() if s.args["actor"] in moved)
            iterations = len({s.args["iteration"] for s in session.recorder.kernels()})
    measured = sum(moved[name] * count for name, count in acts.items()) / iterations
    return plan, compiled, measured, statistics.median(steps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--steps", type=int, default=10, help="steps per run (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="runs per strategy; step times are medians")
    p.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    model = load_config("configs/transformer.yaml").model
    print(
        f"actorflow sharding benchmark: python {platform.python_version()}, numpy {np.__version__}, "
        f"{os.cpu_count()} cores; transformer d_model {model.d_model}, {model.heads} heads, "
        f"{args.layers} blocks, seq_len {model.seq_len}, batch 32; {args.steps} steps x {args.repeats} runs"
    )
    header = (
        "devices",
        "strategy",
        "predicted B/step",
        "measured B/step",
        "step ms",
        "vs data parallel",
        "compile s",
    )
    rows = []
    for n in args.devices:
        base = None
        for name, config, annotated in strategies(args, n):
            plan, compiled, measured, step = measure(args, config, annotated)
            base = base or step
            rows.append(
                (
                    str(n),
                    name,
                    f"{plan.communication_per_step():,}",
                    f"{measured:,.0f}",
                    f"{step * 1e3:.1f}",
                    f"{step / base:.2f}",
                    f"{compiled:.2f}",
                )
            )
    print("\n".join(columns([header, *rows])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
