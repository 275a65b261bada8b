"""Parameter-server training against data-parallel all-reduce training of the same model,
and as workers and servers are added: one table of samples/s.

The model is configs/parameter_server.yaml's (the default MLP, float32, one stage, 4
micro-batches); each row is ``actorflow run`` under ``actorflow launch`` with --steps
steps, its samples/s read from --metrics (the run's own measure: the steps' wall time,
after the first step, which pays for the ranks' start, is not left out). Rows: data
parallel on W ranks (the W workers all-reduce their gradients), and sync parameter
and async parameter servers (staleness 1: a worker at most one step ahead) with W
workers and S servers on W + S ranks, for W = 2, 3 and S = 1, 2. Each row runs --repeats
times, alternating with the others, and the table gives the median and its ratio to
data parallel with the same workers, taken per repeat.

Run: python benchmarks/parameter_server.py [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from actorflow.text import columns

REPO = Path(__file__).resolve().parent.parent
CONFIG = str(REPO / "configs/parameter_server.yaml")


def rows() -> list[tuple[str, int, int, list[str]]]:
    """(name, workers, ranks, --set overrides) of each row."""
    out = []
    for workers in (2, 3):
        devices = ",".join(f"cpu:{k}" for k in range(workers))
        layout = [
            f"parallel.stages=[[{devices}]]",
            f"parallel.data_parallel={workers}",
            "train.batch_size=240",
        ]
        out.append(
            (
                f"data parallel, {workers} workers",
                workers,
                workers,
                [*layout, "parallel.parameter_server=null"],
            )
        )
        for mode in ("sync", "async"):
            for servers in (1, 2):
                name = f"{mode}, {workers} workers + {servers} server{'s' * (servers > 1)}"
                ps = f"parallel.parameter_server={{servers: {servers}, mode: {mode}, staleness: {int(mode == 'async')}}}"
                out.append((name, workers, workers + servers, [*layout, ps]))
    return out


def run(ranks: int, overrides: list[str], steps: int, timeout: float) -> float:
    """samples/s of one launch."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = os.path.join(folder, "m.json")
        sets = [a for o in overrides for a in ("--set", o)]
        command = [
            *(sys.executable, "-m", "actorflow.cli", "launch", "-n", str(ranks), "--"),
            *(sys.executable, "-m", "actorflow.cli", "run", CONFIG, "--quiet", "--steps", str(steps)),
            *sets,
            *("--metrics", metrics),
        ]
        env = dict(os.environ, PYTHONPATH=str(REPO))
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}")
        with open(metrics) as f:
            return json.load(f)["samples_per_second"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args()
    table = rows()
    measured: dict[str, list[float]] = {name: [] for name, *_ in table}
    for _ in range(args.repeats):
        for name, _, ranks, overrides in table:
            measured[name].append(run(ranks, overrides, args.steps, args.timeout))
    print(
        f"parameter servers vs data parallel: {platform.node()}, {os.cpu_count()} cores, "
        f"{args.steps} steps of 240 samples, median of {args.repeats}"
    )
    lines = [("layout", "ranks", "samples/s", "vs data parallel, same workers")]
    for name, workers, ranks, _ in table:
        baseline = measured[f"data parallel, {workers} workers"]
        ratios = [a / b for a, b in zip(measured[name], baseline)]
        lines.append(
            (
                name,
                str(ranks),
                f"{statistics.median(measured[name]):,.0f}",
                f"{statistics.median(ratios):.2f}x",
            )
        )
    print("\n".join(columns(lines)))


if __name__ == "__main__":
    main()
