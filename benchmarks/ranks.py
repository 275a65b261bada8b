"""What running over ranks (one process per rank, MPI between them) costs, against the
same work in one process and against bare MPI, on this machine's loopback:

(a) all_reduce: a plan that is only a 2-rank all_reduce of N MiB float32 (cpu:0 on rank
    0, cpu:1 on rank 1), fed every iteration, against bare mpi4py blocking ``Allreduce``
    (which busy-polls: MPI's best case) on the same sizes in the same two processes. The
    time of one collective is taken the same way for both: per iteration, last end minus
    last start over the two ranks' spans (from the later rank's arrival until both hold
    the result), so neither side is charged for the ranks arriving apart; the median
    over iterations. Bandwidth is algorithm bytes (N) over that time. A second actorflow
    column feeds nothing (the all_reduce reads parameters): what the feed's copy beside
    the collective costs it.
(b) one hop: a chain of cheap ops alternating cpu:0 and cpu:1 (``to_device`` then
    ``relu`` on a float32[1]), on 2 ranks (each hop a send/recv pair over MPI) against
    the same chain in one process (each hop a copy actor). Per hop: the slope between a
    short and a long chain, so feeding, fetching and the host's round trip cancel out;
    as latency (one iteration per ``Session.run``) and as throughput (many iterations
    pipelined in one ``run``: what a hop costs the host).
(c) data parallel: benchmarks/overlap.py's training step (its builder, default widths and
    batch, its schedule (4): compute-first, gradients fused in 1 MiB buckets), no
    emulated link, on 2 ranks, against 2 devices in one process and 1 device. Beside
    each, the CPU time its busiest compute stream's thread took a step (its kernels and
    its waits' bookkeeping): no runtime can make a step shorter than that, so 1 device's
    step over it bounds the speed-up on these cores, whatever the communication costs.
(d) pipeline: benchmarks/pipeline.py's 2-stage MLP (its config and ``measure``) on 2
    ranks: bubble per stage, from both ranks' spans on one timeline, against the theory
    (p-1)/(m+p-1) and against the same run in one process.

Each part runs in its own ``actorflow launch -n 2`` of this script (``--worker PART``,
with this run's options); rank 0 prints its numbers as one JSON line, which this process
reads. The one-process runs of (b) and (c) take turns with the 2-rank runs on rank 0 of
the same launch, while rank 1 sleeps in a polled barrier; (d)'s run here, after its
launch. Figures are medians over the repeats; ratios are taken per repeat, then the
median.

Run: python benchmarks/ranks.py [--quick] [--repeats 5] [--parts a b c d]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import actorflow as af
import overlap  # the other benchmarks' builders: benchmarks/ is on sys.path when this script runs
import pipeline
from actorflow.runtime.mpi_world import gather, mpi
from actorflow.text import columns
from actorflow.world import RANK_CPUS, cpus_of, shares_listed, this_rank

REPO = Path(__file__).resolve().parent.parent
RESULT = "RESULT "
TWO_RANKS = [["cpu:0"], ["cpu:1"]]
OVERLAP_SIZES = [128] + [512] * 8
"""overlap.py's default widths (an argparse default there, so not importable)."""
OVERLAP_SCHEDULE = dict(priority=True, fusion=True, bucket_cap=1 << 20)
"""overlap.py's schedule (4) with its bucket cap."""
PIPELINE = dict(width=512, layers=4, batch=4096)
"""pipeline.py's defaults."""


# -- (a) all_reduce ------------------------------------------------------------------


def all_reduce_plan(n: int, fed: bool) -> af.Plan:
    """One all_reduce of float32[n] over cpu:0 (rank 0) and cpu:1 (rank 1), its inputs
    fed (or parameters); each rank fetches one element of its result, so the outputs,
    which every rank receives, stay tiny."""
    with af.Graph() as g:
        if fed:
            parts = [af.placeholder(f"x{k}", (n,), "float32", f"cpu:{k}") for k in range(2)]
        else:
            parts = [af.parameter(f"x{k}", np.ones(n, np.float32), f"cpu:{k}") for k in range(2)]
        for k, r in enumerate(af.ops.all_reduce(parts, op="sum")):
            af.output(f"y{k}", af.ops.slice(r, [0], [1]))
    return af.compile(g, ranks=TWO_RANKS)


Times = dict[int, tuple[float, float]]
"""(start, end) per iteration, perf_counter seconds (one clock for all ranks of a host)."""


def meet(per_rank: list[Times]) -> float:
    """Median over iterations of the last end minus the last start over the ranks."""
    common = set.intersection(*(set(times) for times in per_rank))
    return statistics.median(
        max(times[i][1] for times in per_rank) - max(times[i][0] for times in per_rank) for i in common
    )


def actorflow_all_reduce(plan: af.Plan, feeds: dict, iterations: int) -> float | None:
    """Seconds per collective (on rank 0; None elsewhere), from the kernel spans of
    ``iterations`` pipelined iterations of a warm session."""
    with af.Session(plan, trace=True) as s:
        s.run([feeds] * 2)
        s.recorder.clear()
        s.run([feeds] * iterations)
        mine = {
            sp.args["iteration"]: (sp.start, sp.end) for sp in s.recorder.spans if sp.category == "collective"
        }
    everyone = gather(mine)
    return None if everyone is None else meet(everyone)


def bare_all_reduce(buffer: np.ndarray, iterations: int, in_place: bool) -> float | None:
    """Seconds per blocking mpi4py Allreduce of ``buffer`` (on rank 0; None elsewhere),
    each after a barrier, timed as ``actorflow_all_reduce`` is."""
    MPI = mpi()
    comm = MPI.COMM_WORLD
    out = np.empty_like(buffer)
    times = {}
    for i in range(iterations + 1):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE if in_place else buffer, out)
        times[i] = (start, time.perf_counter())
    del times[0]  # the first touch of ``out``
    everyone = gather(times)
    return None if everyone is None else meet(everyone)


def part_a(args) -> dict:
    rows = []
    for mib in args.mib:
        n = mib * 2**20 // 4
        feeds = {f"x{k}": np.ones(n, np.float32) for k in range(2)}
        fed, unfed = all_reduce_plan(n, True), all_reduce_plan(n, False)
        iterations = max(6, args.iterations * 4 // max(mib, 4))
        runs: dict[str, list] = {"fed": [], "unfed": [], "bare": [], "bare_out": []}
        for _ in range(args.repeats):
            runs["fed"].append(actorflow_all_reduce(fed, feeds, iterations))
            runs["unfed"].append(actorflow_all_reduce(unfed, {}, iterations))
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
    """(seconds per iteration run alone, seconds per iteration pipelined), warm session."""
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


def per_hop(plans: dict[int, af.Plan], iterations: int) -> list[float]:
    """[latency, throughput cost] per hop: the slope from the shortest to the longest chain."""
    short, long = min(plans), max(plans)
    a, b = chain_times(plans[short], iterations), chain_times(plans[long], iterations)
    return [(y - x) / (long - short) for x, y in zip(a, b)]


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
    ranks = overlap.data_parallel(sizes, batch, no_link, ranks=2, **OVERLAP_SCHEDULE)
    local = overlap.data_parallel(sizes, batch, no_link, ranks=1, **OVERLAP_SCHEDULE)
    single = one_device(sizes, batch)
    runs: dict[str, list] = {
        key: [] for key in ("ranks", "local", "one", "ranks cpu", "local cpu", "one cpu")
    }
    for _ in range(args.repeats):
        wall, cpu = step_and_cpu(ranks, feeds, args.steps)
        cpus = gather(cpu)
        beside = {
            "local": on_rank0(lambda: step_and_cpu(local, feeds, args.steps)),
            "one": on_rank0(lambda: step_and_cpu(single, feeds, args.steps)),
        }
        if cpus is None:  # not rank 0
            continue
        for key, (seconds, busiest) in [("ranks", (wall, max(cpus))), *beside.items()]:
            runs[key].append(seconds)
            runs[f"{key} cpu"].append(busiest)
    return {"sizes": sizes, "batch": batch, **runs}


def step_and_cpu(plan: af.Plan, feeds: dict, steps: int) -> tuple[float, float]:
    """(seconds a step, CPU seconds a step of this process's busiest compute stream
    thread) over a run of ``steps`` steps, after a run of two to warm up; untraced."""
    with af.Session(plan) as s:
        s.run([feeds] * 2)
        clocks = [
            time.pthread_getcpuclockid(t.ident)
            for t in threading.enumerate()
            if t.name.endswith("/compute") and t.ident is not None
        ]
        before = [time.clock_gettime(c) for c in clocks]
        start = time.perf_counter()
        s.run([feeds] * steps)
        wall = time.perf_counter() - start
        cpu = max(time.clock_gettime(c) - b for c, b in zip(clocks, before))
    return wall / steps, cpu / steps


# -- (d) pipeline --------------------------------------------------------------------


def part_d(args) -> dict:
    """Per schedule and m: samples/s, bubble per stage and theory, medians over the
    repeats (pipeline.py's ``measure``: ``train`` on every rank; rank 0's result holds
    every stage's bubble, from the spans of both ranks)."""
    options = argparse.Namespace(**PIPELINE, steps=args.pipeline_steps, repeats=args.pipeline_repeats)
    out = {}
    for schedule in args.schedules:
        for m in args.micro_batches:
            samples, bubbles, _, _, theory, _ = pipeline.measure(options, ["cpu:0", "cpu:1"], m, schedule)
            out[f"{schedule} {m}"] = {"samples": samples, "bubbles": bubbles, "theory": theory}
    return out


# -- running the parts ---------------------------------------------------------------


def on_rank0(measure):
    """``measure()`` on rank 0 alone (a one-process plan) while the other rank sleeps in
    ``gather``'s barrier, polled with back-off, leaving the cores to rank 0; the result
    on rank 0, None elsewhere. Rank 0 is bound to its share of the CPUs (``actorflow
    launch``): the threads of the one-process run may use all the launcher's."""
    result = None
    if this_rank() == 0:
        own = os.sched_getaffinity(0)
        everything = set().union(*map(cpus_of, shares_listed(os.environ.get(RANK_CPUS, ""))))
        os.sched_setaffinity(0, everything or own)  # the run's threads inherit the calling thread's
        try:
            result = measure()
        finally:
            os.sched_setaffinity(0, own)
    gather(None)
    return result


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}


def worker(args) -> int:
    result = PARTS[args.worker](args)
    if this_rank() == 0:
        print(RESULT + json.dumps(result), flush=True)
    return 0


def launch(part: str, timeout: float) -> dict:
    """Run this script with ``--worker part`` (and this run's options) on 2 ranks; rank
    0's JSON. Past ``timeout`` the launcher gets SIGTERM (it stops mpiexec and the ranks,
    killing their tree if they linger), then SIGKILL."""
    command = [
        sys.executable,
        "-m",
        "actorflow.cli",
        "launch",
        "-n",
        "2",
        "--",
        sys.executable,
        str(Path(__file__).resolve()),
        *sys.argv[1:],
        "--worker",
        part,
    ]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise SystemExit(f"part ({part}) did not finish within {timeout:.0f} s:\n{out}") from expired
    found = [line.split(RESULT, 1)[1] for line in out.splitlines() if line.startswith(f"[0] {RESULT}")]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"part ({part}) failed (exit status {proc.returncode}):\n{out}")
    return json.loads(found[0])


# -- the tables ----------------------------------------------------------------------


def median(values) -> float:
    return statistics.median(values)


def ratio(top: list[float], bottom: list[float]) -> float:
    """The median of the per-repeat ratios top / bottom."""
    return median([a / b for a, b in zip(top, bottom)])


def table_a(result: dict) -> list[str]:
    header = (
        "MiB",
        "iterations",
        "actorflow fed",
        "GB/s",
        "unfed",
        "GB/s",
        "bare in place",
        "GB/s",
        "bare out of place",
        "GB/s",
        "fed / bare",
        "unfed / bare",
    )
    rows = []
    for r in result["rows"]:
        cells = [str(r["mib"]), str(r["iterations"])]
        for key in ("fed", "unfed", "bare", "bare_out"):
            cells += [f"{median(r[key]) * 1e3:.2f} ms", f"{r['mib'] * 2**20 / median(r[key]) / 1e9:.2f}"]
        # the bandwidth ratio: bare time over actorflow time
        cells += [f"{ratio(r['bare'], r['fed']):.2f}x", f"{ratio(r['bare'], r['unfed']):.2f}x"]
        rows.append(tuple(cells))
    return columns([header, *rows])


def table_b(result: dict) -> list[str]:
    header = ("per hop", "2 ranks µs", "1 process µs", "2 ranks / 1 process")
    rows = []
    for k, what in enumerate(("latency (one iteration per run)", "throughput (pipelined)")):
        ours, theirs = [r[k] for r in result["ranks"]], [r[k] for r in result["local"]]
        rows.append(
            (what, f"{median(ours) * 1e6:.1f}", f"{median(theirs) * 1e6:.1f}", f"{ratio(ours, theirs):.2f}x")
        )
    return columns([header, *rows])


def table_c(result: dict) -> list[str]:
    one = result["one"]
    rows = [
        (
            label,
            f"{median(result[key]) * 1e3:.2f}",
            f"{ratio(one, result[key]):.2f}x",
            f"{median(result[f'{key} cpu']) * 1e3:.2f}",
            f"{ratio(one, result[f'{key} cpu']):.2f}x",
        )
        for label, key in (
            ("2 ranks (cpu:0 | cpu:1)", "ranks"),
            ("2 devices in 1 process", "local"),
            ("1 device", "one"),
        )
    ]
    header = ("placement", "ms/step", "speed-up over 1 device", "busiest compute thread CPU ms/step", "bound")
    return columns([header, *rows])


def table_d(ranks: dict, local: dict) -> list[str]:
    header = (
        "schedule",
        "m",
        "theory",
        "2 ranks s0",
        "s1",
        "worst |bubble - theory|",
        "1 process s0",
        "s1",
        "samples/s 2 ranks / 1 process",
    )
    rows = []
    for key, r in ranks.items():
        schedule, m = key.split()
        mine = local[key]
        rows.append(
            (
                schedule,
                m,
                f"{r['theory']:.3f}",
                f"{r['bubbles'][0]:.3f}",
                f"{r['bubbles'][1]:.3f}",
                f"{max(abs(b - r['theory']) for b in r['bubbles']):.3f}",
                f"{mine['bubbles'][0]:.3f}",
                f"{mine['bubbles'][1]:.3f}",
                f"{r['samples']:,.0f} / {mine['samples']:,.0f}",
            )
        )
    return columns([header, *rows])


def goals(results: dict) -> list[str]:
    lines = []
    if "a" in results:
        worst = min(ratio(r["bare"], r["fed"]) for r in results["a"]["rows"])
        lines.append(
            f"(a) all_reduce bandwidth >= 0.9x bare MPI at every size: {_met(worst >= 0.9)} (worst {worst:.2f}x)"
        )
    if "c" in results:
        c = results["c"]
        speed = ratio(c["one"], c["ranks"])
        bound = ratio(c["one"], c["ranks cpu"])
        lines.append(
            f"(c) 2 ranks >= 1.85x of 1 device: {_met(speed >= 1.85)} ({speed:.2f}x; "
            f"their compute threads' CPU time alone bounds it at {bound:.2f}x)"
        )
    if "d" in results:
        worst = max(abs(b - r["theory"]) for r in results["d"].values() for b in r["bubbles"])
        lines.append(f"(d) every bubble within 0.05 of theory: {_met(worst <= 0.05)} (worst {worst:.3f})")
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(args, results: dict, local_pipeline: dict | None) -> None:
    if "a" in results:
        print(
            "\n(a) 2-rank all_reduce (sum) of float32: time of one collective, from both ranks' spans; "
            "GB/s = MiB x 2^20 / time; ratio = bare in-place time / actorflow time"
        )
        print("\n".join(table_a(results["a"])))
    if "b" in results:
        print(
            f"\n(b) one hop of a chain of to_device + relu on float32[1], alternating cpu:0 / cpu:1: "
            f"the slope from {args.hops[0]} to {args.hops[1]} hops, {args.hop_iterations} iterations"
        )
        print("\n".join(table_b(results["b"])))
    if "c" in results:
        c = results["c"]
        print(
            f"\n(c) overlap.py's data-parallel MLP {c['sizes']}, batch {c['batch']}, schedule (4), "
            f"no emulated link; {args.steps} steps per run"
        )
        print("\n".join(table_c(c)))
    if "d" in results:
        print(
            f"\n(d) pipeline.py's MLP (width {PIPELINE['width']}, {PIPELINE['layers']} layers, batch "
            f"{PIPELINE['batch']}) on 2 stages, {args.pipeline_steps} steps per run, medians of "
            f"{args.pipeline_repeats} runs; bubble per stage from both ranks' spans, theory (p-1)/(m+p-1)"
        )
        print("\n".join(table_d(results["d"], local_pipeline)))


def mpi_library() -> str:
    """The MPI the ranks load, without starting it here: the mpich wheel's version, else
    the library MPI4PY_LIBMPI names (an MPICH installed some other way)."""
    try:
        return f"mpich {importlib.metadata.version('mpich')}"
    except importlib.metadata.PackageNotFoundError:
        return f"MPI {os.environ.get('MPI4PY_LIBMPI', 'the one mpi4py was built for')}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    p.add_argument(
        "--repeats", type=int, default=5, help="repeats of (a), (b), (c); medians are printed (default 5)"
    )
    p.add_argument(
        "--mib",
        type=int,
        nargs="+",
        default=[1, 16, 64],
        help="(a) all_reduce sizes in MiB (default 1 16 64)",
    )
    p.add_argument(
        "--iterations",
        type=int,
        default=40,
        help="(a) iterations per repeat up to 4 MiB, fewer above (default 40)",
    )
    p.add_argument(
        "--hops", type=int, nargs=2, default=[4, 20], help="(b) the short and the long chain (default 4 20)"
    )
    p.add_argument(
        "--hop-iterations", type=int, default=200, help="(b) iterations per chain and repeat (default 200)"
    )
    p.add_argument("--batch", type=int, default=2048, help="(c) global batch (default 2048, overlap.py's)")
    p.add_argument("--steps", type=int, default=10, help="(c) steps per timed run (default 10)")
    p.add_argument(
        "--pipeline-steps", type=int, default=4, help="(d) steps per run (default 4, pipeline.py's)"
    )
    p.add_argument(
        "--pipeline-repeats", type=int, default=3, help="(d) runs per variant (default 3, pipeline.py's)"
    )
    p.add_argument(
        "--micro-batches", type=int, nargs="+", default=[2, 4, 8], help="(d) values of m (default 2 4 8)"
    )
    p.add_argument(
        "--schedules",
        nargs="+",
        default=["1f1b", "gpipe"],
        choices=["1f1b", "gpipe"],
        help="(d) (default both)",
    )
    p.add_argument("--timeout", type=float, default=300, help="seconds a part may run before it is stopped")
    p.add_argument("--quick", action="store_true", help="a smoke run: one repeat, fewer sizes and steps")
    p.add_argument("--worker", choices=list(PARTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.repeats, args.pipeline_repeats, args.mib, args.iterations, args.hop_iterations = (
            1,
            1,
            [1, 16],
            12,
            30,
        )
        args.steps, args.pipeline_steps, args.micro_batches, args.schedules = 3, 2, [2, 4], ["1f1b"]
    if args.worker:
        return worker(args)

    started = time.perf_counter()
    print(
        f"actorflow ranks benchmark: python {platform.python_version()}, numpy {np.__version__}, "
        f"mpi4py {importlib.metadata.version('mpi4py')}, {mpi_library()}, "
        f"{os.cpu_count()} cores; 2 ranks on loopback (actorflow launch -n 2); medians of {args.repeats} repeats"
    )
    results, seconds = {}, {}
    for part in args.parts:
        begun = time.perf_counter()
        results[part] = launch(part, args.timeout)
        seconds[part] = time.perf_counter() - begun
    local_pipeline = None
    if "d" in results:  # the same runs in this process (train compiles for the launcher's ranks)
        begun = time.perf_counter()
        local_pipeline = part_d(args)
        seconds["d"] += time.perf_counter() - begun
    report(args, results, local_pipeline)
    print()
    print("\n".join(goals(results)))
    print(
        f"({', '.join(f'({k}) {v:.0f} s' for k, v in seconds.items())}; {time.perf_counter() - started:.0f} s in all)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
