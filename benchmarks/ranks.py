"""What running over ranks (one process per rank, MPI between them) costs, against the
same work in one process, on this machine's loopback:

(a) all_reduce: a plan that is only a 2-rank all_reduce of N MiB float32 (cpu:0 on rank
    0, cpu:1 on rank 1), fed every iteration, against bare mpi4py ``Allreduce`` on the
    same sizes in the same two processes. Time per iteration of the collective, taken
    the same way for both: per iteration, last end minus last start over the two ranks'
    spans (the moment the later rank arrived until both have the result), so neither
    side is charged for the ranks arriving apart. Bandwidth is algorithm bytes (N) over
    that time. A second actorflow row feeds nothing (the all_reduce reads parameters) to
    show what the per-iteration feed copy takes from the collective beside it.
(b) one hop: a chain of cheap ops alternating cpu:0 and cpu:1 (``to_device`` then
    ``relu`` on a float32[1]), on 2 ranks (each hop is a send/recv pair over MPI)
    against the same plan in one process (each hop a copy actor). Per hop, the slope
    between a short and a long chain, so feeding, fetching and the host's round trip
    cancel out: latency (one iteration per ``Session.run``) and throughput (many
    iterations pipelined in one ``run``: what a hop costs the host).
(c) data parallel: benchmarks/overlap.py's MLP training step (its builder, its default
    widths and batch, schedule (4): compute-first and fused gradients), no emulated
    link, on 2 ranks against 2 devices in one process and the whole batch on 1 device.
(d) pipeline: benchmarks/pipeline.py's 2-stage MLP (its config and ``measure``) on 2
    ranks, bubble per stage (from both ranks' spans on one timeline) against the theory
    (p-1)/(m+p-1) and against the same run in one process.

Each part runs in its own ``actorflow launch -n 2`` (this script with ``--worker PART``);
rank 0 prints its numbers as one JSON line, which this process reads. The one-process
baselines of (b) and (c) run on rank 0 of the same launch, interleaved with the ranks'
runs, while rank 1 sleeps in a polled barrier; (d)'s in this process. Figures are
medians over --repeats; ratios are taken per repeat, then the median.

Run: python benchmarks/ranks.py [--quick] [--repeats 5] [--parts a b c d]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import actorflow as af
import overlap  # the other benchmarks' builders: benchmarks/ is on sys.path when this script runs
import pipeline
from actorflow.text import columns

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULT = "RESULT "
TWO_RANKS = [["cpu:0"], ["cpu:1"]]
DATA_PARALLEL = dict(priority=True, fusion=True, bucket_cap=1 << 20)
"""overlap.py's schedule (4); its bucket cap (1 MiB) too."""
OVERLAP_SIZES = [128] + [512] * 8
"""overlap.py's default widths (an argparse default there, so not importable)."""


# -- (a) all_reduce ------------------------------------------------------------------


def all_reduce_plan(n: int, fed: bool) -> af.Plan:
    """One all_reduce of float32[n] over cpu:0 (rank 0) and cpu:1 (rank 1); each rank
    fetches one element of its result, so outputs crossing ranks stay tiny."""
    with af.Graph() as g:
        if fed:
            parts = [af.placeholder(f"x{k}", (n,), "float32", f"cpu:{k}") for k in range(2)]
        else:
            parts = [af.parameter(f"x{k}", np.ones(n, np.float32), f"cpu:{k}") for k in range(2)]
        for k, r in enumerate(af.ops.all_reduce(parts, op="sum")):
            af.output(f"y{k}", af.ops.slice(r, [0], [1]))
    return af.compile(g, ranks=TWO_RANKS)


def collective_times(spans) -> dict[int, tuple[float, float]]:
    """(start, end) of this rank's collective kernel per iteration."""
    return {s.args["iteration"]: (s.start, s.end) for s in spans if s.category == "collective"}


def meet(per_rank: list[dict[int, tuple[float, float]]]) -> float:
    """Median over iterations of last end minus last start over ranks (one host, one clock)."""
    common = set.intersection(*(set(times) for times in per_rank))
    return statistics.median(
        max(times[i][1] for times in per_rank) - max(times[i][0] for times in per_rank) for i in common
    )


def actorflow_all_reduce(plan: af.Plan, feeds: dict, iterations: int) -> float | None:
    """Seconds per collective (rank 0; None elsewhere), from the trace of ``iterations``
    pipelined iterations of a warm session."""
    with af.Session(plan, trace=True) as s:
        s.run([feeds] * 2)
        s.recorder.spans.clear()
        s.run([feeds] * iterations)
        mine = collective_times(s.recorder.spans)
    everyone = gather(mine)
    return None if everyone is None else meet(everyone)


def bare_all_reduce(buffer: np.ndarray, iterations: int, in_place: bool) -> float | None:
    """Seconds per blocking mpi4py Allreduce of ``buffer`` (rank 0; None elsewhere), each
    after a barrier. Blocking calls busy-poll: the best case for bare MPI."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = np.empty_like(buffer)
    times = {}
    for i in range(iterations + 1):
        comm.Barrier()
        start = time.perf_counter()
        if in_place:
            comm.Allreduce(MPI.IN_PLACE, out)
        else:
            comm.Allreduce(buffer, out)
        times[i] = (start, time.perf_counter())
    del times[0]  # warm-up: first touch of ``out``
    everyone = gather(times)
    return None if everyone is None else meet(everyone)


def part_a(args) -> dict:
    rows = []
    for mib in args.mib:
        n = mib * 2**20 // 4
        feeds = {f"x{k}": np.ones(n, np.float32) for k in range(2)}
        plans = {"fed": all_reduce_plan(n, True), "unfed": all_reduce_plan(n, False)}
        runs: dict[str, list] = {"fed": [], "unfed": [], "bare": [], "bare_out": []}
        iterations = max(4, min(args.iterations, args.iterations * 4 // mib))
        for _ in range(args.repeats):
            runs["fed"].append(actorflow_all_reduce(plans["fed"], feeds, iterations))
            runs["unfed"].append(actorflow_all_reduce(plans["unfed"], {}, iterations))
            runs["bare"].append(bare_all_reduce(feeds["x0"], iterations, in_place=True))
            runs["bare_out"].append(bare_all_reduce(feeds["x0"], iterations, in_place=False))
        rows.append({"mib": mib, "iterations": iterations, **runs})
    return {"rows": rows}


# -- (b) one hop ---------------------------------------------------------------------


def hop_chain(hops: int, ranks: int) -> af.Plan:
    """x on cpu:0, then ``hops`` times: to the other device, relu."""
    with af.Graph() as g:
        h = af.placeholder("x", (1,), "float32", "cpu:0")
        for k in range(hops):
            h = af.ops.relu(af.ops.to_device(h, f"cpu:{(k + 1) % 2}"))
        af.output("y", h)
    return af.compile(g, ranks=TWO_RANKS if ranks == 2 else 1)


def chain_times(plan: af.Plan, iterations: int) -> tuple[float, float]:
    """(seconds per iteration run alone, seconds per iteration pipelined) in a warm session."""
    feeds = {"x": np.ones(1, np.float32)}
    with af.Session(plan) as s:
        s.run([feeds] * 2)
        start = time.perf_counter()
        for _ in range(iterations):
            s.run(feeds)
        alone = (time.perf_counter() - start) / iterations
        start = time.perf_counter()
        s.run([feeds] * iterations)
        pipelined = (time.perf_counter() - start) / iterations
    return alone, pipelined


def per_hop(plans: dict[int, af.Plan], iterations: int) -> tuple[float, float]:
    """(latency, throughput cost) per hop: the slope between the shortest and longest chain."""
    short, long = min(plans), max(plans)
    a, b = chain_times(plans[short], iterations), chain_times(plans[long], iterations)
    return tuple((y - x) / (long - short) for x, y in zip(a, b))


def part_b(args) -> dict:
    ranks = {h: hop_chain(h, 2) for h in args.hops}
    local = {h: hop_chain(h, 1) for h in args.hops}
    runs: dict[str, list] = {"ranks": [], "local": []}
    for _ in range(args.repeats):
        runs["ranks"].append(per_hop(ranks, args.hop_iterations))
        runs["local"].append(on_rank0(lambda: per_hop(local, args.hop_iterations)))
    return runs


# -- (c) data parallel ---------------------------------------------------------------


def one_device(sizes: list[int], batch: int) -> af.Plan:
    """overlap.py's model and loss on cpu:0 with the whole batch."""
    with af.Graph() as g:
        x = af.placeholder("x", (batch, sizes[0]), "float32", "cpu:0")
        y = af.placeholder("y", (batch, sizes[-1]), "float32", "cpu:0")
        params = [af.parameter(f"w{k}", w, "cpu:0") for k, w in enumerate(overlap.weights(sizes))]
        loss = overlap.mlp_loss(x, y, params)
        af.minimize(loss, af.optim.SGD(lr=0.01))
        af.output("loss", loss)
    return af.compile(g, ranks=1)


def part_c(args) -> dict:
    sizes, batch = OVERLAP_SIZES, args.batch
    rng = np.random.default_rng(1)
    feeds = {
        "x": rng.standard_normal((batch, sizes[0])).astype(np.float32),
        "y": rng.standard_normal((batch, sizes[-1])).astype(np.float32),
    }
    no_link = (None, 0.0)
    ranks = overlap.data_parallel(sizes, batch, no_link, ranks=2, **DATA_PARALLEL)
    local = overlap.data_parallel(sizes, batch, no_link, ranks=1, **DATA_PARALLEL)
    single = one_device(sizes, batch)
    runs: dict[str, list] = {"ranks": [], "local": [], "one": []}
    for _ in range(args.repeats):
        runs["ranks"].append(overlap.step_time(ranks, feeds, args.steps, 1))
        runs["local"].append(on_rank0(lambda: overlap.step_time(local, feeds, args.steps, 1)))
        runs["one"].append(on_rank0(lambda: overlap.step_time(single, feeds, args.steps, 1)))
    return {"sizes": sizes, "batch": batch, **runs}


# -- (d) pipeline --------------------------------------------------------------------


def pipeline_args(args) -> argparse.Namespace:
    """pipeline.py's defaults, with this run's steps and repeats."""
    return argparse.Namespace(width=512, layers=4, batch=4096, steps=args.pipeline_steps, repeats=args.repeats)


def measure_pipeline(args) -> dict:
    """Per schedule and m: (samples/s, bubble per stage, theory), medians over the repeats."""
    out = {}
    for schedule in args.schedules:
        for m in args.micro_batches:
            throughput, bubbles, _, _, theory = pipeline.measure(pipeline_args(args), ["cpu:0", "cpu:1"], m, schedule)
            out[f"{schedule} {m}"] = {"samples": throughput, "bubbles": bubbles, "theory": theory}
    return out


# -- running the parts ---------------------------------------------------------------


def gather(obj):
    """Every rank's ``obj`` on rank 0 (None elsewhere), meeting at a barrier polled with
    back-off (a rank waiting here leaves the cores to the other)."""
    from actorflow.runtime.transport import gather as transport_gather

    return transport_gather(obj)


def on_rank0(measure):
    """``measure()`` on rank 0 alone (in one process: its plan has ranks=1) while the
    other ranks sleep in ``gather``; its result on rank 0, None elsewhere."""
    from actorflow.world import this_rank

    result = measure() if this_rank() == 0 else None
    gather(None)
    return result


WORKERS = {"a": part_a, "b": part_b, "c": part_c}


def worker(args) -> int:
    from actorflow.world import this_rank

    result = WORKERS[args.worker](args) if args.worker != "d" else measure_pipeline(args)
    if this_rank() == 0:
        print(RESULT + json.dumps(result), flush=True)
    return 0


def launch(part: str, argv: list[str], timeout: float) -> dict:
    """Run ``--worker part`` on 2 ranks; rank 0's JSON. On a time-out the launcher gets
    SIGTERM (it stops mpiexec and the ranks), then SIGKILL if it lingers."""
    command = [sys.executable, "-m", "actorflow.cli", "launch", "-n", "2", "--",
               sys.executable, str(Path(__file__).resolve()), "--worker", part, *argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise SystemExit(f"part ({part}) did not finish within {timeout:.0f} s:\n{out}")
    lines = out.splitlines()
    found = [json.loads(line.split(RESULT, 1)[1]) for line in lines if line.startswith(f"[0] {RESULT}")]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"part ({part}) failed (exit status {proc.returncode}):\n{out}")
    return found[0]


def worker_argv(args) -> list[str]:
    """The options a worker needs, as this run got them."""
    return [
        "--repeats", str(args.repeats), "--iterations", str(args.iterations), "--mib", *map(str, args.mib),
        "--hops", *map(str, args.hops), "--hop-iterations", str(args.hop_iterations),
        "--batch", str(args.batch), "--steps", str(args.steps), "--pipeline-steps", str(args.pipeline_steps),
        "--micro-batches", *map(str, args.micro_batches), "--schedules", *args.schedules,
    ]


# -- the tables ----------------------------------------------------------------------


def median(values) -> float:
    return statistics.median(values)


def ratios(top, bottom) -> float:
    """Median of the per-repeat ratios."""
    return median([a / b for a, b in zip(top, bottom)])


def table_a(result: dict) -> list[str]:
    header = ("MiB", "iters", "actorflow fed", "GB/s", "unfed", "GB/s", "bare in place", "GB/s",
              "bare out of place", "GB/s", "fed / bare", "unfed / bare")
    rows = []
    for r in result["rows"]:
        nbytes = r["mib"] * 2**20
        cells = [str(r["mib"]), str(r["iterations"])]
        for key in ("fed", "unfed", "bare", "bare_out"):
            cells += [f"{median(r[key]) * 1e3:.2f} ms", f"{nbytes / median(r[key]) / 1e9:.2f}"]
        # bandwidth ratio = time ratio inverted: bare time / actorflow time, per repeat
        cells += [f"{ratios(r['bare'], r['fed']):.2f}x", f"{ratios(r['bare'], r['unfed']):.2f}x"]
        rows.append(tuple(cells))
    return columns([header, *rows])


def table_b(result: dict, args) -> list[str]:
    header = ("hop", "2 ranks µs/hop", "1 process µs/hop", "ranks / process")
    rows = []
    for k, what in enumerate(("latency (one iteration per run)", "throughput (pipelined)")):
        ours = [r[k] for r in result["ranks"]]
        theirs = [r[k] for r in result["local"]]
        rows.append((what, f"{median(ours) * 1e6:.1f}", f"{median(theirs) * 1e6:.1f}", f"{ratios(ours, theirs):.2f}x"))
    return columns([header, *rows])


def table_c(result: dict) -> list[str]:
    one = result["one"]
    header = ("placement", "ms/step", "speed-up over 1 device")
    rows = [
        ("2 ranks (cpu:0 | cpu:1)", f"{median(result['ranks']) * 1e3:.2f}", f"{ratios(one, result['ranks']):.2f}x"),
        ("2 devices, 1 process", f"{median(result['local']) * 1e3:.2f}", f"{ratios(one, result['local']):.2f}x"),
        ("1 device", f"{median(one) * 1e3:.2f}", "1.00x"),
    ]
    return columns([header, *rows])


def table_d(ranks: dict, local: dict) -> list[str]:
    header = ("schedule", "m", "theory", "2 ranks s0", "s1", "max |diff|", "1 process s0", "s1",
              "samples/s ranks / 1 process")
    rows = []
    for key, r in ranks.items():
        schedule, m = key.split()
        mine = local[key]
        worst = max(abs(b - r["theory"]) for b in r["bubbles"])
        rows.append((
            schedule, m, f"{r['theory']:.3f}", f"{r['bubbles'][0]:.3f}", f"{r['bubbles'][1]:.3f}", f"{worst:.3f}",
            f"{mine['bubbles'][0]:.3f}", f"{mine['bubbles'][1]:.3f}", f"{r['samples']:,.0f} / {mine['samples']:,.0f}",
        ))
    return columns([header, *rows])


def goals(a: dict | None, c: dict | None, d: dict | None) -> list[str]:
    lines = []
    if a is not None:
        worst = min(ratios(r["bare"], r["fed"]) for r in a["rows"])
        lines.append(f"(a) all_reduce bandwidth >= 0.9x bare MPI at every size: {'met' if worst >= 0.9 else 'NOT met'} (worst {worst:.2f}x)")
    if c is not None:
        speed = ratios(c["one"], c["ranks"])
        lines.append(f"(c) 2 ranks >= 1.85x of 1 device: {'met' if speed >= 1.85 else 'NOT met'} ({speed:.2f}x)")
    if d is not None:
        worst = max(abs(b - r["theory"]) for r in d.values() for b in r["bubbles"])
        lines.append(f"(d) bubble within 0.05 of theory: {'met' if worst <= 0.05 else 'NOT met'} (worst {worst:.3f})")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["a", "b", "c", "d"], choices=["a", "b", "c", "d"])
    p.add_argument("--repeats", type=int, default=5, help="repeats per figure; medians are printed (default 5)")
    p.add_argument("--mib", type=int, nargs="+", default=[1, 16, 64], help="(a) all_reduce sizes, MiB")
    p.add_argument("--iterations", type=int, default=40, help="(a) iterations per repeat at <= 4 MiB (fewer above)")
    p.add_argument("--hops", type=int, nargs=2, default=[4, 20], help="(b) the short and the long chain")
    p.add_argument("--hop-iterations", type=int, default=200, help="(b) iterations per chain and repeat")
    p.add_argument("--batch", type=int, default=2048, help="(c) global batch (overlap.py's default 2048)")
    p.add_argument("--steps", type=int, default=10, help="(c) steps per timed run")
    p.add_argument("--pipeline-steps", type=int, default=4, help="(d) steps per run (pipeline.py's default 4)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8], help="(d) values of m")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"], choices=["1f1b", "gpipe"], help="(d)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launched part before it is stopped")
    p.add_argument("--quick", action="store_true", help="a smoke run: few repeats, small sizes")
    p.add_argument("--worker", choices=["a", "b", "c", "d"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.repeats, args.mib, args.iterations, args.hop_iterations = 1, [1, 16], 10, 30
        args.steps, args.pipeline_steps, args.micro_batches, args.schedules = 3, 2, [2, 4], ["1f1b"]
    if args.worker:
        return worker(args)

    from mpi4py import MPI

    started = time.perf_counter()
    print(
        f"actorflow ranks benchmark: python {platform.python_version()}, numpy {np.__version__}, "
        f"{MPI.Get_library_version().splitlines()[0].strip()}, {os.cpu_count()} cores; 2 ranks on loopback "
        f"(actorflow launch -n 2), medians of {args.repeats} repeats"
    )
    results = {part: launch(part, worker_argv(args), args.timeout) for part in args.parts}
    if "a" in results:
        print(f"\n(a) 2-rank all_reduce (sum) of float32, time per collective from both ranks' spans; "
              f"GB/s = MiB x 2^20 / time; ratio = bare time / actorflow time, per repeat")
        print("\n".join(table_a(results["a"])))
    if "b" in results:
        print(f"\n(b) one hop of a chain to_device + relu on float32[1], alternating cpu:0 / cpu:1: slope "
              f"between {args.hops[0]} and {args.hops[1]} hops, {args.hop_iterations} iterations")
        print("\n".join(table_b(results["b"], args)))
    if "c" in results:
        c = results["c"]
        print(f"\n(c) overlap.py's data-parallel MLP {c['sizes']}, batch {c['batch']}, no emulated link, "
              f"schedule (4) (bucket cap 1 MiB); {args.steps} steps per run")
        print("\n".join(table_c(c)))
    if "d" in results:
        local = measure_pipeline(args)
        print(f"\n(d) pipeline.py's MLP (width 512, 4 layers, batch 4096) on 2 stages, {args.pipeline_steps} "
              f"steps per run; bubble per stage from both ranks' spans, theory (p-1)/(m+p-1)")
        print("\n".join(table_d(results["d"], local)))
    print()
    print("\n".join(goals(results.get("a"), results.get("c"), results.get("d"))))
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
