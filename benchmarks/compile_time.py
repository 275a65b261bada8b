"""Compile time against size: a deep data-parallel MLP on 4 devices (batch S(0), weights
B, SGD, the default gradient fusion) compiled at about 1k, 10k and 100k actors. Prints
actors, collectives, the graph's build time, compile time (median of --repeats) and
compile time per actor, which should stay flat: every pass is linear in actors and
edges (reachability questions cost a big-int OR per edge, as wide as the questions).

Python's own cost per object grows with the data it walks (caches, allocator arenas):
the same 10k-actor compile is 10-20% slower per actor while a 100k-actor plan is alive.
So two more columns tell the passes' growth from the machine's: each size compiled again
beside the largest size's plan (one heap size), and a baseline measured on each plan,
one sweep that is linear by construction (copy every actor, build the data edges, order
them topologically), with compile time as a multiple of it. A pass that grew faster than
linear would make that multiple grow.

The sizes count one actor per op, so these compile with ``fuse_kernels=False``; the
last two columns give the default compile, whose chain fusion makes fewer, larger
actors (see ``compiler.chains``): its actors and seconds.

Run: python benchmarks/compile_time.py [--actors 1000 10000 100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

import actorflow as af
from actorflow.collector import cyclic_gc_paused
from actorflow.dag import topological_order
from actorflow.plan_check import data_edges
from actorflow.records import evolve
from actorflow.text import columns

DEVICES = [f"cpu:{k}" for k in range(4)]
ACTORS_PER_LAYER = 28  # per layer of the 4-device MLP with fusion on: fit by layers()


def deep_mlp(layers: int, width: int = 8, batch: int = 8, devices: list[str] = DEVICES) -> af.Graph:
    """``layers`` of tanh(h @ w), data-parallel over ``devices``: one gradient all-reduce
    per layer, all with the same key (op, shape, dtype, group, reduce op)."""
    rng = np.random.default_rng(0)
    with af.Graph() as g:
        x = af.placeholder("x", (batch, width), "float32", devices, af.S(0))
        y = af.placeholder("y", (batch, width), "float32", devices, af.S(0))
        h = x
        for k in range(layers):
            w = af.parameter(
                f"w{k}",
                (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
                devices,
                af.B,
            )
            h = af.ops.tanh(af.ops.matmul(h, w))
        loss = af.ops.mse_loss(h, y)
        af.minimize(loss, af.optim.SGD(lr=0.01))
        af.output("loss", loss)
    return g


UNFUSED = {"fuse_kernels": False}  # one actor per op, as the sizes are counted


def layers_for(actors: int) -> int:
    return max(1, round(actors / ACTORS_PER_LAYER))


def compile_once(graph: af.Graph, **options) -> tuple[af.Plan, float]:
    """The plan and its compile seconds. ``compile`` pauses the cyclic collector; the
    collections it puts off would otherwise land in whichever compile comes next,
    scanning whatever heap is alive then, so each compile starts after a collection."""
    gc.collect()
    start = time.perf_counter()
    plan = af.compile(graph, **options)
    return plan, time.perf_counter() - start


def time_compile(graph: af.Graph, repeats: int, **options) -> tuple[af.Plan, float]:
    """The plan and the median compile seconds of ``repeats`` compiles."""
    times = []
    for _ in range(repeats):
        plan, seconds = compile_once(graph, **options)
        times.append(seconds)
    return plan, statistics.median(times)


@cyclic_gc_paused()  # as compile pauses it
def linear_sweep(plan: af.Plan) -> float:
    """Seconds of one sweep over ``plan`` that is linear by construction: a copy of every
    actor, the data edges, their topological order."""
    start = time.perf_counter()
    tuple(evolve(a, priority=k) for k, a in enumerate(plan.actors))
    topological_order(data_edges(plan))
    return time.perf_counter() - start


def compile_and_sweep(graph: af.Graph, repeats: int) -> tuple[af.Plan, float, float]:
    """The plan, compile seconds and compile time over a linear sweep's (each a median of
    ``repeats``), each sweep right after its compile, so the ratio is of one moment."""
    times, ratios = [], []
    for _ in range(repeats):
        plan, seconds = compile_once(graph, **UNFUSED)
        times.append(seconds)
        ratios.append(seconds / linear_sweep(plan))
    return plan, statistics.median(times), statistics.median(ratios)


def compile_table(sizes: list[int], repeats: int) -> list[tuple[str, ...]]:
    header = (
        "target actors",
        "layers",
        "actors",
        "collectives",
        "build s",
        "compile s",
        "us per actor",
        "x linear sweep",
    )
    rows, graphs = [], []
    for target in sizes:
        layers = layers_for(target)
        start = time.perf_counter()
        graph = deep_mlp(layers)
        build = time.perf_counter() - start
        plan, seconds, ratio = compile_and_sweep(graph, repeats)
        fused, fused_seconds = time_compile(graph, repeats)
        graphs.append(graph)
        rows.append(
            [
                str(target),
                str(layers),
                str(len(plan.actors)),
                str(len(plan.collectives)),
                f"{build:.2f}",
                f"{seconds:.2f}",
                f"{seconds / len(plan.actors) * 1e6:.1f}",
                f"{ratio:.1f}",
                str(len(fused.actors)),
                f"{fused_seconds:.2f}",
            ]
        )
    largest = plan  # alive while every size compiles again beside it
    for row, graph in zip(rows, graphs):
        _, seconds = time_compile(graph, repeats, **UNFUSED)
        row.insert(8, f"{seconds / int(row[2]) * 1e6:.1f}")
    beside = f"us per actor beside the {len(largest.actors) // 1000}k plan"
    return [(*header, beside, "fused actors", "fused compile s"), *map(tuple, rows)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--actors", type=int, nargs="+", default=[1000, 10000, 100000])
    p.add_argument("--repeats", type=int, default=3, help="compiles per size; the median is printed")
    args = p.parse_args()
    print(f"compile time, deep data-parallel MLP on {len(DEVICES)} devices, median of {args.repeats}")
    print("\n".join(columns(compile_table(args.actors, args.repeats))))


if __name__ == "__main__":
    main()
