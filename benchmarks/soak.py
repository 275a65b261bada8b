"""Long runs in bounded memory: resident memory (RSS) over time, at checkpoints.

(a) ``Session.run`` soak: a small two-device plan (matmul and relu on cpu:0, a copy to
    cpu:1, relu there) run for --iterations iterations, --chunk feeds per ``run`` call,
    untraced, then --traced-iterations traced (``trace=True``: the recorder holds at most
    ``TRACE_LIMIT`` spans, the latest whole iterations; the limit is reached after about
    33,000 iterations of this plan, so past that RSS must stay flat).
(b) ``actorflow run configs/default.yaml`` for --steps steps, in a subprocess (the run's
    report times ``REPORT_STEPS`` steps after its first run, and holds at most
    ``REPORT_SPANS`` spans), its RSS read from /proc/PID/status whenever it logs a step.

Memory is flat when the RSS at the last checkpoint is about the RSS at the first one
past warm-up; each table ends with that ratio. RSS comes from /proc (Linux only).

Run: python benchmarks/soak.py [--iterations 1000000] [--traced-iterations 300000]
     [--chunk 1000] [--steps 20000] [--checkpoints 10] [--only session|run]
     [--quick]   (--quick: 20,000 iterations each, 1,000 steps; about a minute)
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time

import numpy as np

import actorflow as af
from actorflow.text import columns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_LINE = re.compile(r"step (\d+)/(\d+)")


def rss_mb(pid: int | str = "self") -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB: resident memory now and its peak."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def small_plan() -> af.Plan:
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 8), dtype="float32", device="cpu:0")
        w = af.parameter("w", np.full((8, 8), 0.1, np.float32), device="cpu:0")
        h = af.ops.relu(af.ops.matmul(x, w))
        af.output("y", af.ops.relu(af.ops.to_device(h, "cpu:1")))
    return af.compile(g, quota=2)


def soak_session(iterations: int, chunk: int, checkpoints: int, trace: bool) -> list[tuple[str, ...]]:
    plan = small_plan()
    x = np.ones((4, 8), np.float32)
    feeds = [{"x": x}] * chunk
    every = max(1, iterations // checkpoints)
    rows = [("iterations", "seconds", "µs/iteration", "RSS MiB", "peak MiB", "spans held")]
    start = last = time.perf_counter()
    done = last_done = 0
    with af.Session(plan, trace=trace) as s:
        while done < iterations:
            n = min(chunk, iterations - done)
            out = s.run(feeds[:n])
            done += n
            if done // every > (done - n) // every or done == iterations:
                now = time.perf_counter()
                rss, peak = rss_mb()
                per = (now - last) / (done - last_done) * 1e6
                spans = len(s.recorder.spans) if trace else 0
                rows.append(
                    (
                        f"{done:,}",
                        f"{now - start:.1f}",
                        f"{per:.0f}",
                        f"{rss:.1f}",
                        f"{peak:.1f}",
                        f"{spans:,}",
                    )
                )
                last, last_done = now, done
        expected = np.maximum(np.maximum(x @ np.full((8, 8), 0.1, np.float32), 0), 0)
        np.testing.assert_allclose(out[-1]["y"], expected, rtol=1e-6)
    return rows


def soak_run(steps: int, checkpoints: int) -> list[tuple[str, ...]]:
    """``actorflow run`` in a subprocess, logging every step; its RSS at each checkpoint."""
    every = max(1, steps // checkpoints)
    command = [
        sys.executable,
        "-m",
        "actorflow",
        "run",
        os.path.join(ROOT, "configs", "default.yaml"),
        "--steps",
        str(steps),
        "--set",
        "train.log_every=1",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    rows = [("steps", "seconds", "ms/step", "RSS MiB", "peak MiB")]
    start = last = time.perf_counter()
    last_step = 0
    child = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for line in child.stderr:
        m = STEP_LINE.search(line)
        if m is None:
            continue
        step = int(m[1])
        if step % every == 0 or step == steps:
            try:
                rss, peak = rss_mb(child.pid)
            except (FileNotFoundError, KeyError):  # it ended between the line and the read
                break
            now = time.perf_counter()
            per = (now - last) / max(1, step - last_step) * 1e3
            rows.append((f"{step:,}", f"{now - start:.1f}", f"{per:.1f}", f"{rss:.1f}", f"{peak:.1f}"))
            last, last_step = now, step
    report = child.stdout.read()
    if child.wait() != 0:
        raise SystemExit(f"actorflow run failed ({child.returncode}):\n{report}")
    bubble_note = [line.strip() for line in report.splitlines() if "bubble measured" in line]
    rows.append(("(report)", "", "", bubble_note[0] if bubble_note else "bubble over every step", ""))
    return rows


def flatness(rows: list[tuple[str, ...]], column: int = 3) -> str:
    """RSS at the last checkpoint over RSS at the second (the first is still warming up)."""
    values = [float(r[column]) for r in rows[1:] if r[column].replace(".", "", 1).isdigit()]
    if len(values) < 3:
        return "too few checkpoints to judge"
    return f"RSS last / second checkpoint: {values[-1] / values[1]:.3f} ({values[-1] - values[1]:+.1f} MiB)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=1_000_000)
    parser.add_argument("--traced-iterations", type=int, default=300_000, help="for the traced soak")
    parser.add_argument("--chunk", type=int, default=1000, help="feeds per Session.run call")
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--only", choices=("session", "run"))
    parser.add_argument("--quick", action="store_true", help="20,000 iterations and 1,000 steps")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.traced_iterations, args.steps = 20_000, 20_000, 1_000
    print(
        f"python {platform.python_version()}, {os.cpu_count()} cores; checkpoints every 1/{args.checkpoints}"
    )
    if args.only in (None, "session"):
        for trace, iterations in ((False, args.iterations), (True, args.traced_iterations)):
            what = "traced (at most TRACE_LIMIT spans held)" if trace else "untraced"
            print(
                f"\n(a) Session.run, {iterations:,} iterations of a small plan, {args.chunk} a call, {what}"
            )
            rows = soak_session(iterations, args.chunk, args.checkpoints, trace)
            print("\n".join(columns(rows)))
            print(flatness(rows))
    if args.only in (None, "run"):
        print(f"\n(b) actorflow run configs/default.yaml --steps {args.steps:,} (a subprocess)")
        rows = soak_run(args.steps, args.checkpoints)
        print("\n".join(columns(rows)))
        print(flatness(rows[:-1]))


if __name__ == "__main__":
    main()
