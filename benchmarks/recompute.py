"""Recompute against keeping activations: configs/default.yaml's MLP (2 stages, 4
micro-batches) under GPipe and 1F1B, plain and with ``parallel.recompute: true``.

Per variant it prints: the bytes kept for backward per stage (each kept register at the
most buffers it held, ``RunResult.kept_bytes``), the planned memory of all devices, the
throughput, and each as a ratio of the plain run measured in the same invocation. The
throughput is the median over --repeats runs of --steps steps.

Run: python benchmarks/recompute.py [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from actorflow.config import load_config
from actorflow.text import columns
from actorflow.training import train

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


def measure(schedule: str, recompute: bool, args: argparse.Namespace) -> tuple[list[int], int, float]:
    overrides = [f"parallel.schedule={schedule}", f"parallel.recompute={str(recompute).lower()}"]
    config = load_config(CONFIG, [*overrides, f"train.steps={args.steps}"])
    runs = [train(config) for _ in range(args.repeats)]
    speed = statistics.median(r.samples_per_second for r in runs)
    return runs[0].kept_bytes, sum(runs[0].memory.values()), speed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = [
        [
            "schedule",
            "recompute",
            "kept bytes per stage",
            "x plain",
            "planned bytes",
            "x plain",
            "samples/s",
            "x plain",
        ]
    ]
    for schedule in ("gpipe", "1f1b"):
        base_kept, base_memory, base_speed = measure(schedule, False, args)
        for recompute in (False, True):
            kept, memory, speed = (
                measure(schedule, True, args) if recompute else (base_kept, base_memory, base_speed)
            )
            rows.append(
                [
                    schedule,
                    str(recompute).lower(),
                    " ".join(str(k) for k in kept),
                    f"{sum(kept) / sum(base_kept):.2f}",
                    str(memory),
                    f"{memory / base_memory:.2f}",
                    f"{speed:.0f}",
                    f"{speed / base_speed:.2f}",
                ]
            )
    print("\n".join(columns(rows)))


if __name__ == "__main__":
    main()
