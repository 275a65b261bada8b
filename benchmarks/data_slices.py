"""Each rank's peak resident memory when the mlp trains on memory-mapped .npy files
(``data.kind: npy``) over 2 ranks, against the slice of the data set it is fed and
against a run of the same model on synthetic data.

Writes x.npy (rows, --features) float32 of --gib GiB and labels.npy (rows,) int64 into a
temporary folder, then trains the mlp [features, 64, 10] for one epoch (rows / --batch
steps), data-parallel over cpu:0 and cpu:1, three times:

  npy, 2 ranks        ``actorflow launch -n 2``, one device a rank: each rank is fed
                      half of each batch's rows;
  synthetic, 2 ranks  the same run on synthetic_classification data of one batch: the
                      run's own memory (Python, actorflow, the plan, its registers);
  npy, 1 process      both devices in one process, which reads the whole set.

Each process prints its peak RSS (VmHWM of /proc/self/status, which getrusage's
ru_maxrss also reports) once its run ends, and the data files' pages resident in it at
the last step (the Rss of their mappings in /proc/self/smaps). A rank's slice: the bytes
of the x rows it is fed over the epoch, and the whole labels file, which every rank reads
once to check the labels' range. The check: a rank's npy peak is at most its slice plus
its synthetic peak.

Run: python benchmarks/data_slices.py [--gib 1] [--features 256] [--batch 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from actorflow.config import parse_config
from actorflow.text import columns
from actorflow.training import train
from actorflow.world import this_rank
from soak import rss_mb  # benchmarks/ is on sys.path when this script runs

REPO = Path(__file__).resolve().parent.parent
RESULT = "RESULT "
CLASSES = 10


def rows_of(args) -> int:
    return int(args.gib * 2**30) // (args.features * 4)


def write_data(args, folder: Path) -> None:
    """x (rows, features) float32 and labels (rows,) int64, a chunk of rows at a time."""
    rows, rng, chunk = rows_of(args), np.random.default_rng(0), 2**16
    x = np.lib.format.open_memmap(folder / "x.npy", "w+", np.float32, (rows, args.features))
    for start in range(0, rows, chunk):
        x[start : start + chunk] = rng.standard_normal((min(chunk, rows - start), args.features), np.float32)
    x.flush()
    del x
    np.save(folder / "labels.npy", rng.integers(0, CLASSES, rows))


def config(args, kind: str, folder: Path):
    rows = rows_of(args)
    data = (
        {"kind": "npy", "samples": rows, "x": str(folder / "x.npy"), "labels": str(folder / "labels.npy")}
        if kind == "npy"
        else {"kind": "synthetic_classification", "samples": args.batch}
    )
    return parse_config(
        {
            "model": {"sizes": [args.features, 64, CLASSES], "dtype": "float32"},
            "data": data,
            "train": {"steps": rows // args.batch, "batch_size": args.batch, "optimizer": {"lr": 0.01}},
            "parallel": {"stages": [["cpu:0", "cpu:1"]], "data_parallel": 2},
        }
    )


def mapped_mib(suffix: str) -> float:
    """MiB of this process's mappings of files named ``*suffix`` resident now (smaps' Rss)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0]:  # a mapping's header: address range, ..., path
                inside = line.rstrip().endswith(suffix)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total / 1024


def worker(args) -> None:
    """Train, then print this process's peak RSS, and what of the data files it held
    resident at the last step, as a RESULT line."""
    run_config = config(args, args.worker, Path(args.folder))
    held: dict[str, float] = {}

    def on_step(step: int, loss: float) -> None:
        if step + 1 == run_config.train.steps:
            held.update(data_mib=mapped_mib("x.npy") + mapped_mib("labels.npy"), loss=loss)

    start = time.perf_counter()
    train(run_config, on_step)
    result = {"rank": this_rank(), "peak_mib": rss_mb()[1], "seconds": time.perf_counter() - start, **held}
    print(RESULT + json.dumps(result), flush=True)


def run(args, kind: str, folder: Path, ranks: int) -> list[dict]:
    """The RESULT of each process of a run of ``kind`` on ``ranks`` ranks (1: no launcher)."""
    command = [sys.executable, __file__, *sys.argv[1:], "--worker", kind, "--folder", str(folder)]
    if ranks > 1:
        command = [sys.executable, "-m", "actorflow.cli", "launch", "-n", str(ranks), "--", *command]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    found = [json.loads(line.split(RESULT, 1)[1]) for line in done.stdout.splitlines() if RESULT in line]
    if done.returncode != 0 or len(found) != ranks:
        raise SystemExit(f"{kind} on {ranks} ranks failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return sorted(found, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="the size of x.npy in GiB")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = rows_of(args)
    steps = rows // args.batch
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        write_data(args, folder)
        x_mib = (folder / "x.npy").stat().st_size / 2**20
        labels_mib = (folder / "labels.npy").stat().st_size / 2**20
        npy = run(args, "npy", folder, 2)
        synthetic = run(args, "synthetic", folder, 2)
        whole = run(args, "npy", folder, 1)
    fed = steps * args.batch // 2 * args.features * 4 / 2**20  # x rows a rank is fed
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(
        f"data: x {x_mib:.0f} MiB ({rows} x {args.features} float32), labels {labels_mib:.0f} MiB; "
        f"mlp [{args.features}, 64, {CLASSES}], {steps} steps of {args.batch} (one epoch), data parallel 2"
    )
    slice_mib = fed + labels_mib
    table = [["run", "rank", "slice", "data resident", "peak RSS", "synthetic peak", "<= slice + synthetic"]]
    for r, (mine, own) in enumerate(zip(npy, synthetic)):
        table.append(
            [
                "npy, 2 ranks",
                str(r),
                f"{slice_mib:.0f}",
                f"{mine['data_mib']:.0f}",
                f"{mine['peak_mib']:.0f}",
                f"{own['peak_mib']:.0f}",
                "yes" if mine["peak_mib"] <= slice_mib + own["peak_mib"] else "NO",
            ]
        )
    one = whole[0]
    table.append(
        [
            "npy, 1 process",
            "-",
            f"{x_mib + labels_mib:.0f}",
            f"{one['data_mib']:.0f}",
            f"{one['peak_mib']:.0f}",
            "",
            "",
        ]
    )
    print("MiB:")
    print("\n".join(columns(table)))
    print(
        f"seconds: npy 2 ranks {max(r['seconds'] for r in npy):.1f}, synthetic 2 ranks "
        f"{max(r['seconds'] for r in synthetic):.1f}, npy 1 process {whole[0]['seconds']:.1f}; "
        f"last loss npy {npy[0]['loss']:.4f} (2 ranks) {whole[0]['loss']:.4f} (1 process)"
    )


if __name__ == "__main__":
    main()
