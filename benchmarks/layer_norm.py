"""The fused layer norm (one forward op, one backward op for x, gamma and beta) against
the same layer norm composed of elementwise and reduction ops, whose backward pass
autodiff builds op by op. Per variant: ops in the graph (forward and backward), and the
median over --repeats of the milliseconds per iteration of forward and gradients on one
device, x of shape (--rows, --width) float32, --iterations iterations pipelined in a
warm session; then the ratio composed / fused. Both results are checked to agree.

Run: python benchmarks/layer_norm.py [--rows 4096] [--width 768] [--iterations 10] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import actorflow as af  # noqa: E402
from actorflow.text import columns  # noqa: E402

EPS = 1e-5


def composed(x: af.Tensor, gamma: af.Tensor, beta: af.Tensor) -> af.Tensor:
    """(x - mean) * exp(-log(var + eps) / 2) * gamma + beta, from the ops autodiff knows."""
    ops = af.ops
    centered = ops.sub(x, ops.mean(x, axis=-1, keepdims=True))
    var = ops.mean(ops.mul(centered, centered), axis=-1, keepdims=True)
    eps = ops.full(var.shape, EPS, var.dtype, var.device)
    rstd = ops.exp(ops.scale(ops.log(ops.add(var, eps)), -0.5))
    return ops.add(ops.mul(ops.mul(centered, rstd), gamma), beta)


def plan(variant: str, rows: int, width: int) -> tuple[af.Plan, int]:
    with af.Graph() as g:
        x = af.placeholder("x", (rows, width), "float32")
        dy = af.placeholder("dy", (rows, width), "float32")
        gamma = af.placeholder("gamma", (width,), "float32")
        beta = af.placeholder("beta", (width,), "float32")
        build = af.ops.layer_norm if variant == "fused" else composed
        y = build(x, gamma, beta)
        af.output("y", y)
        for name, d in zip(("dx", "dgamma", "dbeta"), af.gradients(y, [x, gamma, beta], dy)):
            af.output(name, d)
    return af.compile(g), len(g.nodes)


def per_iteration(plans: dict[str, af.Plan], feeds: list[dict], repeats: int) -> tuple[dict, dict]:
    """Median seconds per iteration of each plan, the plans timed in turn within each
    repeat (so a noisy neighbour slows both), and each plan's first results."""
    times: dict[str, list[float]] = {name: [] for name in plans}
    with contextlib.ExitStack() as stack:
        sessions = {name: stack.enter_context(af.Session(p)) for name, p in plans.items()}
        outs = {name: session.run(feeds[:1])[0] for name, session in sessions.items()}
        for _ in range(repeats):
            for name, session in sessions.items():
                start = time.perf_counter()
                session.run(feeds)
                times[name].append((time.perf_counter() - start) / len(feeds))
    return {name: statistics.median(t) for name, t in times.items()}, outs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    feed = {
        "x": rng.standard_normal((args.rows, args.width)).astype(np.float32),
        "dy": rng.standard_normal((args.rows, args.width)).astype(np.float32),
        "gamma": rng.uniform(0.5, 1.5, args.width).astype(np.float32),
        "beta": rng.standard_normal(args.width).astype(np.float32),
    }
    feeds = [feed] * args.iterations
    built = {variant: plan(variant, args.rows, args.width) for variant in ("fused", "composed")}
    ms, results = per_iteration({v: p for v, (p, _) in built.items()}, feeds, args.repeats)
    rows = [(v, str(nodes), f"{ms[v] * 1e3:.2f}") for v, (_, nodes) in built.items()]
    for name in ("y", "dx", "dgamma", "dbeta"):
        np.testing.assert_allclose(results["fused"][name], results["composed"][name], rtol=2e-3, atol=2e-3)
    print(f"layer norm of ({args.rows}, {args.width}) float32, forward and gradients, one device")
    print("\n".join(columns([("variant", "ops", "ms/iteration"), *rows])))
    print(f"composed / fused: {ms['composed'] / ms['fused']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
