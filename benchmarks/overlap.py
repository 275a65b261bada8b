"""Does communication hide behind computation? A data-parallel MLP training step on 2
devices, gradients all-reduced over an *emulated* link sized so that communication takes
about half of the compute time, in four schedules:

  (1) collectives share the compute streams (no overlap possible),
  (2) a separate collective stream, no priorities, no fusion,
  (3) plus compute-first dispatch,
  (4) plus fusion of the gradient all-reduces.

In the same run it measures compute alone C (each device trains its half of the batch,
no collectives) and communication alone M (the same all-reduces, nothing else), and
prints per variant: step time T, the bound max(C, M), serial C + M, and the overlap
efficiency (C + M - T) / min(C, M). Each variant writes a Chrome trace.

The default batch makes kernels of milliseconds (a 1024 x 512 x 512 matmul per device),
as on an accelerator: each step also pays a fixed host cost (the runtime's Python, about
30 us a kernel, and its threads competing for the cores), which a smaller batch makes a
larger part of the step; try --batch 256 to see it.

Run: python benchmarks/overlap.py [--batch 2048] [--repeats 3] [--steps 10] [--bucket-cap BYTES] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

import actorflow as af
from actorflow.text import columns

DEVICES = ["cpu:0", "cpu:1"]

VARIANTS = [
    ("(1) collectives on the compute streams", dict(overlap=False, priority=False, fusion=False)),
    ("(2) collective stream, no priorities", dict(priority=False, fusion=False)),
    ("(3) + compute-first dispatch", dict(priority=True, fusion=False)),
    ("(4) + fusion", dict(priority=True, fusion=True)),
]
"""The four schedules: compile options of each (the fused one takes --bucket-cap too)."""


def with_cap(options: dict, bucket_cap: int) -> dict:
    return dict(options, bucket_cap=bucket_cap) if options["fusion"] else options


def figures(t: float, c: float, m: float) -> tuple[str, ...]:
    """A schedule's T, max(C, M), C + M (ms), T / max(C, M) and overlap efficiency
    (C + M - T) / min(C, M)."""
    efficiency = (c + m - t) / min(c, m)
    return (
        f"{t * 1e3:.2f}",
        f"{max(c, m) * 1e3:.2f}",
        f"{(c + m) * 1e3:.2f}",
        f"{t / max(c, m):.2f}",
        f"{efficiency:.2f}",
    )


def weights(sizes: list[int], seed: int = 0) -> list[np.ndarray]:
    """A weight matrix and a bias per layer, alternating."""
    rng = np.random.default_rng(seed)
    out = []
    for a, b in zip(sizes, sizes[1:]):
        out += [(rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), np.zeros(b, np.float32)]
    return out


def mlp_loss(x, y, params):
    h = x
    layers = len(params) // 2
    for k in range(layers):
        h = af.ops.bias_add(af.ops.matmul(h, params[2 * k]), params[2 * k + 1])
        if k < layers - 1:
            h = af.ops.tanh(h)
    return af.ops.mse_loss(h, y)


def data_parallel(sizes, batch, link, **options) -> af.Plan:
    with af.Graph() as g:
        x = af.placeholder("x", (batch, sizes[0]), "float32", DEVICES, af.S(0))
        y = af.placeholder("y", (batch, sizes[-1]), "float32", DEVICES, af.S(0))
        params = [af.parameter(f"w{k}", w, DEVICES, af.B) for k, w in enumerate(weights(sizes))]
        loss = mlp_loss(x, y, params)
        af.minimize(loss, af.optim.SGD(lr=0.01))
        af.output("loss", loss)
    return af.compile(g, link_bandwidth=link[0], link_latency=link[1], **options)


def compute_alone(sizes, batch) -> af.Plan:
    """Each device trains on its half of the batch with its own weights: the same kernels, no collectives."""
    with af.Graph() as g:
        for d in DEVICES:
            x = af.placeholder(f"x[{d}]", (batch // 2, sizes[0]), "float32", d)
            y = af.placeholder(f"y[{d}]", (batch // 2, sizes[-1]), "float32", d)
            params = [af.parameter(f"w{k}[{d}]", w, d) for k, w in enumerate(weights(sizes))]
            loss = mlp_loss(x, y, params)
            af.minimize(loss, af.optim.SGD(lr=0.01))
            af.output(f"loss[{d}]", loss)
    return af.compile(g)


def communication_alone(sizes, link) -> af.Plan:
    """The gradient all-reduces alone, one per weight, on the emulated link."""
    with af.Graph() as g:
        for k, w in enumerate(weights(sizes)):
            parts = [af.parameter(f"g{k}[{d}]", np.zeros_like(w), d) for d in DEVICES]
            for d, r in zip(DEVICES, af.ops.all_reduce(parts)):
                af.output(f"r{k}[{d}]", af.ops.slice(r, [0] * r.ndim, [1] * r.ndim))
    return af.compile(g, link_bandwidth=link[0], link_latency=link[1], fusion=False)


def step_time(plan: af.Plan, feeds: dict, steps: int, repeats: int) -> float:
    """Median seconds per step over ``repeats`` runs of ``steps`` pipelined steps, untraced
    (recording costs host time, and the baselines are timed untraced too)."""
    times = []
    with af.Session(plan) as s:
        s.run([feeds] * 2)
        for _ in range(repeats):
            start = time.perf_counter()
            s.run([feeds] * steps)
            times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def write_trace(plan: af.Plan, feeds: dict, steps: int, path: str) -> None:
    """A separate traced run of ``steps`` steps, after two warm-up steps."""
    with af.Session(plan, trace=True) as s:
        s.run([feeds] * 2)
        s.recorder.clear()
        s.run([feeds] * steps)
        s.recorder.write(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[128] + [512] * 8,
        help="layer widths (default 128, then 8 layers of 512)",
    )
    p.add_argument(
        "--batch", type=int, default=2048, help="global batch, split over 2 devices (default 2048)"
    )
    p.add_argument("--steps", type=int, default=10, help="steps per timed run (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; medians are printed")
    p.add_argument(
        "--comm-share", type=float, default=0.5, help="emulated communication time as a share of compute"
    )
    p.add_argument(
        "--latency", type=float, default=100e-6, help="emulated link latency per collective, seconds"
    )
    p.add_argument(
        "--bucket-cap",
        type=int,
        default=1 << 20,
        help="fusion bucket cap, bytes (default 1 MiB: DDP's 25 MiB would put this 7 MiB model in one bucket)",
    )
    p.add_argument("--out", default="benchmarks/out", help="folder for the traces")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)

    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.batch, args.sizes[0])).astype(np.float32)
    y = rng.standard_normal((args.batch, args.sizes[-1])).astype(np.float32)
    half = args.batch // 2
    local_feeds = {}
    for k, d in enumerate(DEVICES):
        local_feeds[f"x[{d}]"] = x[k * half : (k + 1) * half]
        local_feeds[f"y[{d}]"] = y[k * half : (k + 1) * half]

    c = step_time(compute_alone(args.sizes, args.batch), local_feeds, args.steps, args.repeats)
    grad_bytes = sum(w.nbytes for w in weights(args.sizes))
    # ring all-reduce over 2 devices moves 2(n-1)/n = 1 x the bytes: pick the bandwidth so M ~ share x C
    seconds = max(args.comm_share * c - 2 * len(args.sizes[1:]) * args.latency, 1e-4)
    link = (grad_bytes / seconds, args.latency)
    m = step_time(communication_alone(args.sizes, link), {}, args.steps, args.repeats)

    print(
        f"actorflow overlap benchmark: python {platform.python_version()}, numpy {np.__version__}, "
        f"{os.cpu_count()} cores; MLP {args.sizes}, batch {args.batch} split over {len(DEVICES)} devices, "
        f"{args.steps} steps x {args.repeats} runs (medians)"
    )
    print(
        f"link emulated: {link[0] / 1e9:.3f} GB/s, {link[1] * 1e6:.0f} us latency; "
        f"gradients {grad_bytes / 2**20:.1f} MiB per step"
    )
    print(f"compute alone C = {c * 1e3:.2f} ms, communication alone M = {m * 1e3:.2f} ms (emulated)")
    header = ("variant", "T ms", "max(C,M) ms", "C+M ms", "T/max(C,M)", "overlap efficiency", "trace")
    rows = []
    for k, (label, options) in enumerate(VARIANTS, 1):
        trace = os.path.join(args.out, f"overlap_variant{k}.trace.json")
        plan = data_parallel(args.sizes, args.batch, link, **with_cap(options, args.bucket_cap))
        t = step_time(plan, {"x": x, "y": y}, args.steps, args.repeats)
        write_trace(plan, {"x": x, "y": y}, args.steps, trace)
        rows.append((label, *figures(t, c, m), trace))
    print("\n".join(columns([header, *rows])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
