"""How much the runtime costs, and whether it pays off.

(a) host overhead per act: a chain of no-op ``call`` actors on one device, many
    iterations, against a plain Python loop calling the same functions (goal, #25: at
    most 6x the plain loop's per-call cost at quota 2), replayed (the default order) and
    decided as the run goes (``order="dynamic"``, the drivers); compiled unfused, one
    actor per call, and beside it the same chain fused as ``compile`` makes it (actors
    of at most 8 calls, ``compiler.chains.MAX_MEMBERS``: here 8 and 2);
(d) host overhead per hop: one no-op actor on each of cpu:0, cpu:1 and cpu:2, one after
    the other; a hop is a hand-off from one device to the next (two per iteration),
    replayed and dynamic, against the bare pipeline: the same hand-offs between plain
    threads with no runtime at all (goal, #25: at most 1.5x at quota 2); the plan's
    copies run on their producers' threads (``wiring._host_moves``), so it has the bare
    pipeline's three threads and one hand-off a hop. A thread ping-pong round trip
    (``queue.SimpleQueue``, two wake-ups) is printed beside, as the machine's price of a
    wake-up that day;
(b) throughput of a chain of 384x384 float32 matmuls split over cpu:0 and cpu:1,
    against the same chain on cpu:0 alone;
(c) registers in flight: the most buffers any register held at once, against its quota;
(e) a run's own cost, for a program that runs one iteration at a time: a ``Session.run``
    of one iteration of a one-actor plan (a no-op ``call``), run after run, against a
    thread ping-pong round trip (the least a hand-over to another thread and back costs:
    the run wakes the stream's thread, which wakes the caller);
(f) a training step's host cost: configs/default.yaml's model at widths 4 (a batch of
    16), whose kernels cost next to nothing, so what is left is calling them and handing
    off between streams; on one device and on its 2 stages in one process, run as
    ``train`` runs it (steps_per_run steps a ``Session.run``), against the same model's
    plain numpy loop at those widths on one thread (``numpy_stages``).

Every figure is the median of several runs, each measured beside its baseline in the
same process. Run: python benchmarks/overhead.py [--repeats 5] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import sys
import threading
import time

import numpy as np

import actorflow as af
import numpy_stages  # benchmarks/ is on sys.path when this script runs
from actorflow.config import load_config
from actorflow.text import columns
from actorflow.training import compile_config
from actorflow.training.data import dataset, step_feeds

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.sizes=[4, 4, 4, 4, 2]", "train.batch_size=16"]
"""(f)'s overrides of configs/default.yaml."""


def noop(a: np.ndarray) -> np.ndarray:
    return a


def noop_chain(actors: int, quota: int, fuse: bool = False) -> af.Plan:
    """``actors`` no-op calls in a chain on cpu:0; unfused (the default here), each is an
    actor of its own, which is what (a) measures."""
    with af.Graph() as g:
        h = af.placeholder("x", (1,), "float32", "cpu:0")
        for _ in range(actors):
            h = af.ops.call(noop, h, shape=(1,), dtype="float32")
        af.output("y", h)
    return af.compile(g, quota=quota, fuse_kernels=fuse)


def device_chain(devices: int, quota: int) -> af.Plan:
    """One no-op actor per device, each handing its result to the next device."""
    with af.Graph() as g:
        h = af.placeholder("x", (1,), "float32", "cpu:0")
        for d in range(devices):
            h = af.ops.to_device(h, f"cpu:{d}") if d else h
            h = af.ops.call(noop, h, shape=(1,), dtype="float32")
        af.output("y", h)
    return af.compile(g, quota=quota, fuse_kernels=False)


def ping_pong(rounds: int) -> float:
    """µs per round trip of a message to another thread and back."""
    there: queue.SimpleQueue = queue.SimpleQueue()
    back: queue.SimpleQueue = queue.SimpleQueue()

    def echo() -> None:
        while (item := there.get()) is not None:
            back.put(item)

    thread = threading.Thread(target=echo)
    thread.start()
    start = time.perf_counter()
    for k in range(rounds):
        there.put(k)
        back.get()
    elapsed = time.perf_counter() - start
    there.put(None)
    thread.join()
    return elapsed / rounds * 1e6


def bare_pipeline(devices: int, iterations: int, quota: int) -> float:
    """µs per hop of the same chain's hand-offs with nothing else: one thread per device,
    each with a ``SimpleQueue`` inbox, passing a "ready" on and a "free" back per hop,
    ``quota`` credits per edge, batching what its inbox holds, no kernels, no actors.
    The floor of any runtime that gives each device its own thread, on this machine."""
    inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(devices)]
    last = devices - 1

    def stage(k: int) -> None:
        credits, ready, left, inbox = quota, iterations if k == 0 else 0, iterations, inboxes[k]
        while left:
            news = [] if ready and (credits or k == last) else [inbox.get()]
            while not inbox.empty():
                news.append(inbox.get_nowait())
            for item in news:
                if item:
                    ready += 1
                else:
                    credits += 1
            while ready and (credits or k == last):
                ready, left = ready - 1, left - 1
                if k:
                    inboxes[k - 1].put(False)  # the register read is free again
                if k < last:
                    credits -= 1
                    inboxes[k + 1].put(True)  # the next device's input is ready

    threads = [threading.Thread(target=stage, args=(k,)) for k in range(devices)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - start) / (iterations * last) * 1e6


def matmul_chain(length: int, size: int, devices: int, quota: int, fetch: str = "all") -> af.Plan:
    """``fetch``: the host gets the whole last matrix each iteration ("all") or its first row."""
    rng = np.random.default_rng(0)
    with af.Graph() as g:
        h = af.placeholder("x", (size, size), "float32", "cpu:0")
        for k in range(length):
            device = f"cpu:{k * devices // length}"
            w = (rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
            h = af.ops.matmul(af.ops.to_device(h, device), af.parameter(f"w{k}", w, device))
        af.output("y", h if fetch == "all" else af.ops.slice(h, [0], [1]))
    return af.compile(g, quota=quota)


def timed_run(plan: af.Plan, feeds: list[dict], order: str = "replay") -> tuple[float, dict]:
    """Seconds for one pipelined run of ``feeds`` in a warm session, and its register stats."""
    with af.Session(plan, order=order) as session:
        session.run(feeds[:2])
        start = time.perf_counter()
        session.run(feeds)
        elapsed = time.perf_counter() - start
        return elapsed, session.register_stats()


def host_overhead(actors: int, iterations: int, repeats: int, quota: int) -> tuple[float, float, float]:
    """(µs per act replayed, µs per act dynamic, µs per call in a plain loop), medians."""
    plan = noop_chain(actors, quota)
    feeds = [{"x": np.ones(1, np.float32)}] * iterations
    acts = len(plan.actors) * iterations
    x, out = np.ones(1, np.float32), np.empty(1, np.float32)
    ours, dynamic, plain = [], [], []
    for _ in range(repeats):
        ours.append(timed_run(plan, feeds)[0] / acts * 1e6)
        dynamic.append(timed_run(plan, feeds, "dynamic")[0] / acts * 1e6)
        start = time.perf_counter()
        for _ in range(iterations):
            h = x
            for _ in range(actors):
                h = np.asarray(noop(h))
                np.copyto(out, h)
        plain.append((time.perf_counter() - start) / (iterations * actors) * 1e6)
    return statistics.median(ours), statistics.median(dynamic), statistics.median(plain)


def hop_overhead(
    devices: int, iterations: int, repeats: int, quota: int
) -> tuple[float, float, float, float]:
    """(µs per hop replayed, dynamic, µs per ping-pong round trip, µs per hop of the bare
    pipeline), medians, measured in turns."""
    plan = device_chain(devices, quota)
    feeds = [{"x": np.ones(1, np.float32)}] * iterations
    hops = (devices - 1) * iterations
    ours, dynamic, trips, bare = [], [], [], []
    for _ in range(repeats):
        ours.append(timed_run(plan, feeds)[0] / hops * 1e6)
        dynamic.append(timed_run(plan, feeds, "dynamic")[0] / hops * 1e6)
        trips.append(ping_pong(iterations))
        bare.append(bare_pipeline(devices, iterations, quota))
    return tuple(statistics.median(v) for v in (ours, dynamic, trips, bare))  # type: ignore[return-value]


def fused_overhead(actors: int, iterations: int, repeats: int, quota: int) -> tuple[float, float]:
    """(µs per no-op call with the chain fused as compile fuses it, µs per act unfused), medians."""
    plans = [noop_chain(actors, quota, fuse=True), noop_chain(actors, quota)]
    feeds = [{"x": np.ones(1, np.float32)}] * iterations
    runs: list[list[float]] = [[], []]
    for _ in range(repeats):
        for times, plan in zip(runs, plans):
            times.append(timed_run(plan, feeds)[0] / (iterations * actors) * 1e6)
    return statistics.median(runs[0]), statistics.median(runs[1])


def two_devices(
    length: int, size: int, iterations: int, quota: int, repeats: int, fetch: str = "all"
) -> tuple[float, float, list[float]]:
    """(iterations/s on 1 device, on 2 devices, per-repeat ratios), medians."""
    plans = {d: matmul_chain(length, size, d, quota, fetch) for d in (1, 2)}
    x = np.random.default_rng(1).standard_normal((size, size)).astype(np.float32)
    feeds = [{"x": x}] * iterations
    rates: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(repeats):
        for d in (1, 2):
            rates[d].append(iterations / timed_run(plans[d], feeds)[0])
    ratios = [b / a for a, b in zip(rates[1], rates[2])]
    return statistics.median(rates[1]), statistics.median(rates[2]), ratios


def run_cost(runs: int, repeats: int) -> tuple[float, float]:
    """(µs per one-iteration ``Session.run`` of a one-actor plan, µs per thread ping-pong
    round trip), medians, measured in turns."""
    feed = {"x": np.ones(1, np.float32)}
    ours, trips = [], []
    with af.Session(noop_chain(1, 2)) as session:
        seconds_a_run(session, feed, 50)
        for _ in range(repeats):
            ours.append(seconds_a_run(session, feed, runs) * 1e6)
            trips.append(ping_pong(runs))
    return statistics.median(ours), statistics.median(trips)


def seconds_a_run(session: af.Session, feeds: dict | list[dict], runs: int) -> float:
    """Seconds per ``session.run(feeds)``, over ``runs`` runs one after another."""
    start = time.perf_counter()
    for _ in range(runs):
        session.run(feeds)
    return (time.perf_counter() - start) / runs


def step_cost(stages: str, runs: int, repeats: int) -> tuple[float, float]:
    """(µs a step of actorflow, µs a step of the plain numpy loop), medians, for (f): the
    default model at widths 4 on ``stages`` (a ``parallel.stages`` value)."""
    config = load_config(os.path.join(REPO, "configs", "default.yaml"), [*TINY, f"parallel.stages={stages}"])
    per_run = config.train.steps_per_run
    data = dataset(config)
    feeds = [f for step in range(per_run) for f in step_feeds(config, data, step)]
    shape = (config.model.sizes, [config.layers], config.train.batch_size, config.parallel.micro_batches)
    ours, plain = [], []
    with af.Session(compile_config(config)) as session:
        seconds_a_run(session, feeds, 5)
        for _ in range(repeats):
            ours.append(seconds_a_run(session, feeds, runs) / per_run * 1e6)
            samples = numpy_stages.rate("thread", *shape, runs * per_run)
            plain.append(config.train.batch_size / samples * 1e6)
    return statistics.median(ours), statistics.median(plain)


def in_flight(length: int, size: int, iterations: int, quota: int) -> int:
    plan = matmul_chain(length, size, 2, quota)
    x = np.zeros((size, size), np.float32)
    _, stats = timed_run(plan, [{"x": x}] * iterations)
    return max(s["max_held"] for s in stats.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs per figure; medians are printed (default 5)")
    p.add_argument("--actors", type=int, default=10, help="no-op actors in the chain of (a) (default 10)")
    p.add_argument("--devices", type=int, default=3, help="devices in the chain of (d) (default 3)")
    p.add_argument("--iterations", type=int, default=2000, help="iterations of (a) (default 2000)")
    p.add_argument(
        "--quotas",
        type=int,
        nargs="+",
        default=[2, 8],
        help="quotas of (a): 2 is the default; 8 leaves slack for the credits' round trip (default 2 8)",
    )
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[16, 32],
        help="matmuls in the chains of (b) (default 16 32)",
    )
    p.add_argument("--size", type=int, default=384, help="matrix size of (b) (default 384)")
    p.add_argument("--steps", type=int, default=100, help="iterations of (b) and (c) (default 100)")
    p.add_argument("--quick", action="store_true", help="a fast smoke run: few repeats and iterations")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.iterations, args.steps = 1, 200, 10

    print(
        f"actorflow overhead benchmark: python {platform.python_version()}, numpy {np.__version__}, "
        f"{os.cpu_count()} cores, medians of {args.repeats} runs"
    )
    overhead = {q: host_overhead(args.actors, args.iterations, args.repeats, q) for q in args.quotas}
    hops = {q: hop_overhead(args.devices, args.iterations, args.repeats, q) for q in args.quotas}
    fused = fused_overhead(args.actors, args.iterations, args.repeats, args.quotas[0])
    cases = [(n, "all") for n in args.lengths] + [(args.lengths[-1], "row")]
    chains = {case: two_devices(case[0], args.size, args.steps, 2, args.repeats, case[1]) for case in cases}
    held = {q: in_flight(args.lengths[0], args.size, max(args.steps // 4, 8), q) for q in (1, 2, 3)}
    us_run, us_trip = run_cost(args.iterations, args.repeats)
    placements = {"1 device": "[cpu:0]", "2 stages in one process": "[cpu:0, cpu:1]"}
    steps = {
        name: step_cost(stages, max(1, args.iterations // 40), args.repeats)
        for name, stages in placements.items()
    }

    rows = []
    for q, (us_act, us_dynamic, us_plain) in overhead.items():
        for order, us in (("replayed", us_act), ("dynamic", us_dynamic)):
            rows.append(
                (
                    f"(a) host overhead, {args.actors} no-op call actors x {args.iterations} iterations, "
                    f"quota {q}, {order}",
                    f"{us:.1f} us/act",
                    f"{us_plain:.2f} us/call (plain loop)",
                    f"{us / us_plain:.1f}x (+{us - us_plain:.1f} us/act)",
                )
            )
    rows.append(
        (
            f"(a) the same chain fused (compile's default: chains of at most 8), quota {args.quotas[0]}",
            f"{fused[0]:.1f} us/call",
            f"{fused[1]:.1f} us/call (unfused)",
            f"{fused[0] / fused[1]:.2f}x",
        )
    )
    for q, (us_hop, us_dynamic, us_trip, us_bare) in hops.items():
        for order, us in (("replayed", us_hop), ("dynamic", us_dynamic)):
            rows.append(
                (
                    f"(d) host overhead, {args.devices}-device chain of no-op actors x {args.iterations} "
                    f"iterations, quota {q}, {order}",
                    f"{us:.1f} us/hop",
                    f"{us_bare:.1f} us/hop (bare pipeline)",
                    f"{us / us_bare:.2f}x",
                )
            )
        rows.append(
            (
                f"(d) a thread ping-pong round trip, beside quota {q}'s runs",
                f"{us_trip:.1f} us/round trip",
                f"{us_bare:.1f} us/hop (bare pipeline)",
                f"{us_trip / us_bare:.2f}x",
            )
        )
    rows += [
        (
            f"(b) {n} matmuls {args.size}x{args.size} f32, {args.steps} iterations, quota 2, "
            f"fetch {'the result' if fetch == 'all' else 'its first row'}",
            f"{two:.1f} it/s on 2 devices",
            f"{one:.1f} it/s on 1 device",
            f"{two / one:.2f}x (runs: {', '.join(f'{r:.2f}' for r in ratios)})",
        )
        for (n, fetch), (one, two, ratios) in chains.items()
    ]
    rows += [
        (
            f"(c) most buffers held by one register, quota {q}",
            f"{h} held",
            f"quota {q}",
            "equal" if h == q else "differs",
        )
        for q, h in held.items()
    ]
    rows.append(
        (
            f"(e) a Session.run of one iteration of a one-actor plan, {args.iterations} runs",
            f"{us_run:.1f} us/run",
            f"{us_trip:.1f} us/round trip (thread ping-pong)",
            f"{us_run / us_trip:.1f}x",
        )
    )
    rows += [
        (
            f"(f) a training step's host cost: default.yaml's model at widths 4, {name}",
            f"{ours:.0f} us/step",
            f"{plain:.0f} us/step (plain numpy loop)",
            f"{ours / plain:.2f}x",
        )
        for name, (ours, plain) in steps.items()
    ]
    print("\n".join(columns([("measure", "actorflow", "baseline", "ratio"), *rows])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
