"""actorflow on a CUDA GPU (CuPy), in one run: issue #26's benchmark.

Every figure is the median of --repeats runs, each measured beside its baseline in the
same process; the GPU's name and the parameters are printed with the tables.

(a) Host cost per act and the GPU's idle share on a chain of small kernels: a graph of
    --chain element-wise ops (tanh of --size float32) on cuda:0, compiled unfused (one
    actor, so one kernel launch, per op), fed and fetched each step, run for --steps
    steps; and the same chain spread over cuda:0 and cuda:1 (logical devices sharing the
    GPU), moving to the other device every --block ops, so compute streams, copies and
    events are crossed. Host cost per act: the wall time of the run / (actors x steps).
    The baseline: the same tanh kernels launched back to back by plain CuPy on one
    stream, measured twice: its host time per launch (wall time of steps x chain
    launches / launches), and the GPU's busy time per kernel, from CUDA events around
    the kernels queued behind a gate kernel (a spin on the GPU's clock that holds the
    stream until the host has queued them all, so the GPU never waits on the host and
    the events time the kernels alone). Idle share = 1 - busy / wall, where busy is the
    chain's kernels' busy time (steps x chain x busy per kernel: the feed, copy and fetch
    kernels are not counted as busy).

(b) Compute/communication overlap: benchmarks/overlap.py's data-parallel MLP (its
    builders and timing, imported, on cuda:0 and cuda:1: two logical devices of one GPU)
    in its four schedules, with compute alone C, communication alone M, and per schedule
    T, max(C, M), C + M and the efficiency (C + M - T) / min(C, M) (goal: schedule (4)
    at least 0.9). What communication is here, in two tables:
      - "emulated link on the GPU": between logical devices of one GPU, a collective is
        device copies and a reduction kernel on the collective stream, taking tens of
        microseconds where compute takes milliseconds. To measure overlap as a
        multi-GPU run would need it, each collective also takes a link's time (overlap.py's
        sizing: M about --comm-share of C), spent ON THE GPU, on the collective stream:
        a one-thread spin kernel on the GPU's clock (one SM of the GPU's), queued in
        front of the collective's copies and reduction. It starts when the gradient is
        ready on the GPU, holds up what follows it on that stream, and leaves the other
        SMs to compute, as a transfer over NVLink or a network does. That is the
        runtime's own emulation on a GPU stream (``cuda.Gpus.link``); on the host it is a
        sleep (runtime/wiring.py ``_lasting``), which on a GPU would start when the host
        launched the collective, before the gradient exists.
      - "no link": the GPU's own copies and reductions on the collective stream and
        nothing else; M is then a small share of C, so the efficiency is as noisy as
        C's variation over M, and on one GPU the collective's kernels take the same SMs
        and memory bandwidth as compute.

(c) The transformer (configs/transformer.yaml) scaled up (--d-model, --layers, --heads,
    --seq-len, --vocab, --batch) on one GPU (parallel.stages [[cuda:0]], tensor_parallel
    1, 1 micro-batch), trained by actorflow (``training.train``, the CLI's own path:
    the config compiled, every step a ``Session.run`` with its trace spans, Adam) against
    the same model in PyTorch eager on the same GPU, written here op for op (actorflow's
    training/transformer.py: pre-norm blocks, tanh GELU, causal softmax, no biases on
    q/k/v or the head), from the same initial parameters, on the same batches
    (``training.data.step_feeds``), with torch.optim.Adam (actorflow's Adam is torch's
    formula), each step's loss read (``.item()``) as actorflow's run reads it; torch's
    run first in each repeat. Printed: the largest |loss difference| at any step over
    every pair of runs (goal: float tolerance, at most 1e-4 on a loss of about
    log(vocab)), and samples/s actorflow / torch over the steps after --warm-steps,
    timed on both sides from the end of the last warm-up step to the end of the last
    step (actorflow's from ``train``'s per-step callback; the first steps compile CuPy's
    kernels and warm cuBLAS) (goal: at least 1.0). ``train`` gives the runtime
    --steps-per-run steps at a time (``train.steps_per_run``, the config's default
    unless given): the host queues a step while the GPU runs the one before, and the
    losses of a run's steps come together at its end, so the warm-up is rounded up to
    whole runs; torch reads each loss at its step's end.

(d) benchmarks/gpu_habits.py's measurements (each kernel habit against its plain
    version), called as they are.

(e) Where (c)'s step spends its GPU time, both sides (not run unless asked: --only e):
    torch.profiler's CUDA activity (CUPTI, which sees CuPy's kernels as well as torch's)
    of two runs of each side, of --profile-steps and of 2 steps, every kernel's time
    summed by name; their difference over the steps between is a step's, without what a
    run does once (uploading the parameters, allocating the registers, reading the
    parameters back). Printed: each side's GPU time a step and kernels a step, and the
    --profile-rows kernels that take the most.

Needs CuPy and a GPU (pip install 'actorflow[cuda]'), and torch for (c) and (e); without a
GPU it says so and exits. --quick shrinks every part for a smoke run.

Run: python benchmarks/gpu.py [--repeats 3] [--quick] [--only a b c d e]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

import actorflow as af
from actorflow.config import TrainConfig
from actorflow.runtime.cuda import import_cupy, unavailable
from actorflow.text import columns, count

ROOT = Path(__file__).resolve().parents[1]
TRANSFORMER = ROOT / "configs" / "transformer.yaml"
LOSS_GOAL = 1e-4
"""The largest |actorflow - torch| loss difference allowed at any step of (c)."""
DEVICES = ["cuda:0", "cuda:1"]
"""The logical devices of (a), (b) and (c): two of one GPU (cuda:N runs on GPU N % count)."""
TORCH_DEVICE = "cuda:0"
"""(c)'s PyTorch device: the GPU DEVICES[0] runs on."""
OVERLAP_GOAL = 0.9
"""Schedule (4)'s overlap efficiency in (b), with the emulated link."""
CHUNK = 512
"""Kernels queued behind one gate in (a)'s busy-time measurement (well under the
launch queue's depth, about 1024, past which a launch would wait for the GPU)."""

# -- the GPU -------------------------------------------------------------------------


def gpu_name(cp: Any) -> str:
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


class Spinner:
    """The runtime's spin kernel (``cuda.SPIN``) as a callable: ``spin(seconds)`` queues
    the spin on the current stream; ``calls`` counts the spins queued."""

    def __init__(self, cp: Any) -> None:
        from actorflow.runtime.cuda import SPIN

        self.kernel = cp.RawKernel(SPIN, "actorflow_spin")
        self.calls = 0

    def __call__(self, seconds: float) -> None:
        self.kernel((1,), (1,), (np.int64(max(0, round(seconds * 1e9))),))
        self.calls += 1


def make_spinner(cp: Any) -> tuple[Spinner | None, str]:
    """The spinner, compiled and run once (10 us), or None and why not."""
    try:
        spin = Spinner(cp)
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            spin(1e-5)
        stream.synchronize()
        spin.calls = 0
        return spin, ""
    except Exception as err:  # noqa: BLE001 - reported in the tables instead
        return None, f"the gate kernel failed: {err!r}"


def runs(values: list[float], fmt: str = "{:.2f}") -> str:
    return ", ".join(fmt.format(v) for v in values)


# -- (a) host cost per act and idle share --------------------------------------------


def chain_plan(n: int, size: int, devices: list[str], block: int, quota: int) -> af.Plan:
    """``n`` tanh ops on ``size`` float32, fed ``x`` and fetched ``y``; op k on
    ``devices[(k // block) % len(devices)]``; unfused: one actor per op."""
    with af.Graph() as g:
        here = devices[0]
        h = af.placeholder("x", (size,), "float32", here)
        for k in range(n):
            device = devices[(k // block) % len(devices)]
            if device != here:
                h, here = af.ops.to_device(h, device), device
            h = af.ops.tanh(h)
        af.output("y", h)
    return af.compile(g, quota=quota, fuse_kernels=False)


def chain_walls(plan: af.Plan, x: np.ndarray, steps: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` runs of ``steps`` steps, in one warm session."""
    feeds = [{"x": x}] * steps
    walls = []
    with af.Session(plan) as session:
        session.run(feeds[:2])  # CuPy compiles its kernels at their first launch
        for _ in range(repeats):
            start = time.perf_counter()
            session.run(feeds)
            walls.append(time.perf_counter() - start)
    return walls


def bare_launch(cp: Any, x: np.ndarray, launches: int) -> float:
    """Seconds of host time per launch of ``launches`` tanh kernels by plain CuPy on one
    stream, back to back (the wall time until the stream is done, / launches)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.asarray(x)
        b = cp.empty_like(a)
        cp.tanh(a, out=b)
        stream.synchronize()
        start = time.perf_counter()
        for _ in range(launches):
            cp.tanh(a, out=b)
            a, b = b, a
        stream.synchronize()
        return (time.perf_counter() - start) / launches


def busy_per_kernel(cp: Any, spin: Spinner, x: np.ndarray, launches: int, host_per_launch: float) -> float:
    """Seconds of GPU time per tanh kernel: ``launches`` of them, ``CHUNK`` at a time
    queued behind a gate (a spin) long enough for the host to queue the chunk, timed by
    CUDA events recorded after the gate and after the chunk. A chunk whose gate was over
    before its last launch was queued (the GPU may have waited on the host) is
    discarded, and the gate doubled."""
    stream = cp.cuda.Stream(non_blocking=True)
    gate = max(5e-3, 4 * host_per_launch * CHUNK)
    done, ms = 0, 0.0
    with stream:
        a = cp.asarray(x)
        b = cp.empty_like(a)
        cp.tanh(a, out=b)
        while done < launches:
            k = min(CHUNK, launches - done)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            spin(gate)
            start.record(stream)
            for _ in range(k):
                cp.tanh(a, out=b)
                a, b = b, a
            end.record(stream)
            if start.done:
                stream.synchronize()
                gate *= 2
                if gate > 2.0:
                    raise RuntimeError("the gate could not hold the GPU while the host queued a chunk")
                continue
            end.synchronize()
            ms += cp.cuda.get_elapsed_time(start, end)
            done += k
    return ms / 1e3 / done


def section_a(args: argparse.Namespace, cp: Any, spin: Spinner | None, why_no_spin: str) -> None:
    n, size, steps = args.chain, args.size, args.steps
    x = np.random.default_rng(0).uniform(-1, 1, size).astype(np.float32)
    variants = [
        (DEVICES[0], DEVICES[:1]),
        (f"{DEVICES[0]}/{DEVICES[1]}, crossing every {args.block} ops", DEVICES[:2]),
    ]
    launches = steps * n
    measured = []
    for label, devices in variants:
        plan = chain_plan(n, size, devices, args.block, args.quota)
        walls = chain_walls(plan, x, steps, args.repeats)
        measured.append((label, len(plan.actors), walls))
    bare = [bare_launch(cp, x, launches) for _ in range(args.repeats)]
    busy = []
    if spin is not None:
        busy = [
            busy_per_kernel(cp, spin, x, min(launches, 8 * CHUNK), statistics.median(bare))
            for _ in range(args.repeats)
        ]
    print(
        f"(a) {n} tanh ops on {size} float32, unfused, quota {args.quota}, {steps} steps a run, "
        f"{count(args.repeats, 'run')}; baseline: the same {launches} tanh launches by plain CuPy on one stream"
    )
    rows = [("measure", "actorflow", "baseline", "ratio")]
    host = statistics.median(bare)
    gpu = statistics.median(busy) if busy else float("nan")
    for label, actors, walls in measured:
        per_act = [w / (actors * steps) for w in walls]
        rows.append(
            (
                f"(a) host cost per act, {label} ({actors} actors)",
                f"{statistics.median(per_act) * 1e6:.2f} us/act",
                f"{host * 1e6:.2f} us/launch (bare CuPy loop)",
                f"{statistics.median(per_act) / host:.2f}x (runs: {runs([p / host for p in per_act])})",
            )
        )
        if busy:
            idle = [1 - launches * gpu / w for w in walls]
            rows.append(
                (
                    f"(a) GPU idle share, {label}",
                    f"{statistics.median(idle):.3f} (wall {statistics.median(walls) * 1e3:.1f} ms)",
                    f"{1 - gpu / host:.3f} (bare CuPy loop)",
                    f"busy {gpu * 1e6:.2f} us/kernel x {launches}",
                )
            )
        else:
            rows.append((f"(a) GPU idle share, {label}", "n/a", why_no_spin, ""))
    rows.append(
        (
            "(a) GPU busy time per tanh kernel (CUDA events, queued behind a gate)",
            f"{gpu * 1e6:.2f} us" if busy else "n/a",
            "",
            f"runs: {runs([b * 1e6 for b in busy])} us" if busy else why_no_spin,
        )
    )
    print("\n".join(columns(rows)))


# -- (b) overlap ---------------------------------------------------------------------


def section_b(args: argparse.Namespace) -> None:
    import overlap  # benchmarks/overlap.py, beside this file

    devices = DEVICES[:2]
    sizes, batch, steps = args.overlap_sizes, args.overlap_batch, args.overlap_steps
    saved_devices = overlap.DEVICES
    overlap.DEVICES = devices  # its builders place on overlap.DEVICES
    try:
        rng = np.random.default_rng(1)
        x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
        y = rng.standard_normal((batch, sizes[-1])).astype(np.float32)
        half = batch // 2
        local = {}
        for k, d in enumerate(devices):
            local[f"x[{d}]"] = x[k * half : (k + 1) * half]
            local[f"y[{d}]"] = y[k * half : (k + 1) * half]
        c = overlap.step_time(overlap.compute_alone(sizes, batch), local, steps, args.repeats)
        grad_bytes = sum(w.nbytes for w in overlap.weights(sizes))
        print(
            f"(b) overlap.py's data-parallel MLP {sizes}, batch {batch} split over {' and '.join(devices)} "
            f"(one GPU), {steps} steps x {count(args.repeats, 'run')} (medians); gradients "
            f"{grad_bytes / 2**20:.1f} MiB a step; compute alone C = {c * 1e3:.2f} ms"
        )
        seconds = max(args.comm_share * c - 2 * len(sizes[1:]) * args.latency, 1e-4)
        links = [
            (
                "emulated link: the runtime spends its time in a spin on the collective stream",
                (grad_bytes / seconds, args.latency),
            ),
            ("no link: the collective stream's own copies and reductions", (None, 0.0)),
        ]
        for name, link in links:
            table = overlap_table(overlap, sizes, batch, link, steps, args, x, y, c)
            if link[0] is not None:
                print(f"(b) {name}: {link[0] / 1e9:.3f} GB/s, {link[1] * 1e6:.0f} us latency")
            else:
                print(f"(b) {name}")
            print("\n".join(columns(table)))
    finally:
        overlap.DEVICES = saved_devices


def overlap_table(
    overlap: Any,
    sizes: list[int],
    batch: int,
    link: tuple[float | None, float],
    steps: int,
    args: argparse.Namespace,
    x: np.ndarray,
    y: np.ndarray,
    c: float,
) -> list[tuple[str, ...]]:
    m = overlap.step_time(overlap.communication_alone(sizes, link), {}, steps, args.repeats)
    rows: list[tuple[str, ...]] = [
        ("schedule", "T ms", "max(C,M) ms", "C+M ms", "T/max(C,M)", "overlap efficiency"),
        ("communication alone M", f"{m * 1e3:.2f}", "", "", "", ""),
    ]
    for k, (label, options) in enumerate(overlap.VARIANTS, 1):
        plan = overlap.data_parallel(sizes, batch, link, **overlap.with_cap(options, args.bucket_cap))
        t = overlap.step_time(plan, {"x": x, "y": y}, steps, args.repeats)
        if args.out and link[0] is not None:
            overlap.write_trace(plan, {"x": x, "y": y}, 3, os.path.join(args.out, f"overlap{k}.trace.json"))
        row = overlap.figures(t, c, m)
        if label.startswith("(4)") and link[0] is not None:
            efficiency = (c + m - t) / min(c, m)
            row = (
                *row[:-1],
                f"{row[-1]} (goal {OVERLAP_GOAL}: {'holds' if efficiency >= OVERLAP_GOAL else 'missed'})",
            )
        rows.append((label, *row))
    return rows


# -- (c) the transformer against PyTorch ---------------------------------------------


def transformer_config(args: argparse.Namespace, device: str, steps: int) -> Any:
    from actorflow.config import load_config

    return load_config(
        TRANSFORMER,
        [
            f"model.d_model={args.d_model}",
            f"model.layers={args.layers}",
            f"model.heads={args.heads}",
            f"model.seq_len={args.seq_len}",
            f"model.vocab={args.vocab}",
            f"train.batch_size={args.batch}",
            f"train.steps={steps}",
            "parallel.micro_batches=1",
            "parallel.tensor_parallel=1",
            f"parallel.stages=[[{device}]]",
            f"train.steps_per_run={args.steps_per_run}",
        ],
    )


def warm_steps(args: argparse.Namespace) -> int:
    """(c)'s untimed steps: --warm-steps, rounded up to whole runs of --steps-per-run (the
    steps of one ``Session.run`` end together, so actorflow's clock starts at a run's end);
    torch warms up as many."""
    return -(-args.warm_steps // args.steps_per_run) * args.steps_per_run


def actorflow_transformer(
    config: Any, warm: int, trace: str | None = None
) -> tuple[float, list[float], float]:
    """(samples/s over the steps after ``warm``, loss per step, the GPU's kernel seconds a
    step over the steps the report traced) of ``training.train``."""
    from actorflow.training import train

    stamps: list[float] = []
    result = train(config, on_step=lambda step, loss: stamps.append(time.perf_counter()), trace=trace)
    timed = len(stamps) - warm
    rate = timed * config.train.batch_size / (stamps[-1] - stamps[warm - 1])
    return rate, list(result.losses), sum(result.kernel_seconds)


def torch_transformer(
    config: Any, data: dict, initial: dict[str, np.ndarray], device: str, warm: int
) -> tuple[float, list[float]]:
    """(samples/s over the steps after ``warm``, loss per step) of actorflow's transformer
    (training/transformer.py's ``_forward`` with one stage, op for op) in PyTorch eager
    on ``device``, trained with torch.optim.Adam on ``step_feeds``'s batches."""
    import torch
    import torch.nn.functional as F

    from actorflow.training.data import step_feeds

    model = config.model
    d, heads, seq = model.d_model, model.heads, model.seq_len
    dh = d // heads
    params = {name: torch.tensor(value, device=device, requires_grad=True) for name, value in initial.items()}
    spec = config.train.optimizer
    optimizer = torch.optim.Adam(
        list(params.values()), lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps
    )
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)

    def forward(ids: Any, labels: Any) -> Any:
        rows = ids.shape[0]
        h = (params["embedding"][ids] + params["position"]).reshape(rows * seq, d)
        for k in range(model.layers):

            def p(name: str, k: int = k) -> Any:
                return params[f"h{k}.{name}"]

            a = F.layer_norm(h, (d,), p("ln1.gamma"), p("ln1.beta"), 1e-5)
            q, kk, v = ((a @ p(w)).reshape(rows, seq, heads, dh).transpose(1, 2) for w in ("wq", "wk", "wv"))
            scores = (q @ kk.transpose(2, 3)) * (1 / math.sqrt(dh))
            attended = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
            merged = attended.transpose(1, 2).reshape(rows * seq, d)
            h = h + (merged @ p("wo") + p("bo"))
            m = F.layer_norm(h, (d,), p("ln2.gamma"), p("ln2.beta"), 1e-5)
            u = F.gelu(m @ p("w1") + p("b1"), approximate="tanh")
            h = h + (u @ p("w2") + p("b2"))
        h = F.layer_norm(h, (d,), params["ln.gamma"], params["ln.beta"], 1e-5)
        return F.cross_entropy(h @ params["head"], labels.reshape(rows * seq))

    losses, stamps = [], []
    for step in range(config.train.steps):
        (feeds,) = step_feeds(config, data, step)
        ids = torch.from_numpy(feeds["x"]).to(device)
        labels = torch.from_numpy(feeds["labels"]).to(device)
        loss = forward(ids, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        stamps.append(time.perf_counter())
    timed = len(stamps) - warm
    return timed * config.train.batch_size / (stamps[-1] - stamps[warm - 1]), losses


@dataclasses.dataclass
class Comparison:
    """(c)'s runs so far: samples/s and losses per run of each side."""

    ours: list[float] = dataclasses.field(default_factory=list)
    theirs: list[float] = dataclasses.field(default_factory=list)
    our_losses: list[list[float]] = dataclasses.field(default_factory=list)
    their_losses: list[list[float]] = dataclasses.field(default_factory=list)
    busy: list[float] = dataclasses.field(default_factory=list)

    def differences(self) -> np.ndarray:
        """Per step, the largest |actorflow - torch| loss over every pair of their runs
        (over the steps every run has, should one have stopped early)."""
        steps = min(len(losses) for losses in self.our_losses + self.their_losses)
        ours = np.array([losses[:steps] for losses in self.our_losses])
        theirs = np.array([losses[:steps] for losses in self.their_losses])
        return np.abs(ours[:, None, :] - theirs[None, :, :]).max(axis=(0, 1))


def compare_transformer(
    args: argparse.Namespace,
    device: str,
    torch_device: str,
    found: Comparison,
    free: Callable[[], None] = lambda: None,
) -> Any:
    """Fill ``found`` with --repeats runs of each side, torch's first in each repeat (so
    its figure stands should actorflow's run fail); ``free`` runs after each (to hand
    cached GPU memory back between the two). Returns the config."""
    from actorflow.training import initial_parameters
    from actorflow.training.data import dataset

    warm = warm_steps(args)
    config = transformer_config(args, device, warm + args.train_steps)
    data, initial = dataset(config), initial_parameters(config)
    for k in range(args.repeats):
        rate, losses = torch_transformer(config, data, initial, torch_device, warm)
        found.theirs.append(rate)
        found.their_losses.append(losses)
        free()
        trace = os.path.join(args.out, "transformer.trace.json") if args.out and k == 0 else None
        rate, losses, busy = actorflow_transformer(config, warm, trace)
        found.busy.append(busy)
        found.ours.append(rate)
        found.our_losses.append(losses)
        free()
    return config


def torch_on_gpu(part: str) -> Any:
    """The torch module where it is installed and sees a CUDA GPU, else None, having said
    why ``part`` is skipped."""
    try:
        import torch
    except ImportError:
        print(f"{part} skipped: PyTorch is not installed (pip install 'actorflow[bench]')")
        return None
    if not torch.cuda.is_available():
        print(f"{part} skipped: torch {torch.__version__} sees no CUDA GPU")
        return None
    return torch


def section_c(args: argparse.Namespace, cp: Any) -> None:
    torch = torch_on_gpu("(c)")
    if torch is None:
        return

    def free() -> None:
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()

    warm = warm_steps(args)
    steps = warm + args.train_steps
    print(
        f"(c) transformer: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, seq_len "
        f"{args.seq_len}, vocab {args.vocab}, batch {args.batch}, {steps} steps a run "
        f"({warm} warm-up), {count(args.repeats, 'run')}; actorflow on parallel.stages "
        f"[[{DEVICES[0]}]], {count(args.steps_per_run, 'step')} a Session.run, against torch "
        f"{torch.__version__} eager on {torch.cuda.get_device_name(TORCH_DEVICE)} "
        f"(torch float32 matmul precision {torch.get_float32_matmul_precision()!r}, "
        f"CUPY_TF32={os.environ.get('CUPY_TF32', 'unset')})",
        flush=True,
    )
    found = Comparison()
    try:
        compare_transformer(args, DEVICES[0], TORCH_DEVICE, found, free)
    finally:  # what was measured, even if a run failed
        rows = [("measure", "actorflow", "baseline", "ratio")]
        if found.our_losses and found.their_losses:
            diffs = found.differences()
            worst, over = int(np.argmax(diffs)), int((diffs > LOSS_GOAL).sum())
            rows.append(
                (
                    "(c) largest |loss difference|, actorflow - torch",
                    f"{diffs[worst]:.1e} at step {worst + 1}",
                    f"goal {LOSS_GOAL:.0e} at each of {len(diffs)} steps",
                    "holds" if not over else f"exceeded at {over} steps",
                )
            )
        ratios = [a / b for a, b in zip(found.ours, found.theirs)]
        rows.append(
            (
                f"(c) samples/s over steps {warm + 1}-{steps}, actorflow against torch eager",
                f"{statistics.median(found.ours):,.1f}" if found.ours else "n/a (failed)",
                f"{statistics.median(found.theirs):,.1f}" if found.theirs else "n/a (failed)",
                f"{statistics.median(ratios):.2f}x (runs: {runs(ratios)}; goal 1.0)" if ratios else "",
            )
        )
        if found.busy and found.ours:
            step = args.batch / statistics.median(found.ours)
            rows.append(
                (
                    "(c) actorflow: GPU kernel time a step (traced steps, GPU-timed) / step time",
                    f"{statistics.median(found.busy) * 1e3:.1f} / {step * 1e3:.1f} ms",
                    "",
                    f"GPU busy {statistics.median(found.busy) / step:.0%}",
                )
            )
        print("\n".join(columns(rows)))
        if found.our_losses and found.their_losses:
            print(f"(c) |loss difference| per step: {', '.join(f'{v:.1e}' for v in found.differences())}")


# -- (e) where (c)'s step spends its GPU time -------------------------------------------


def kernel_seconds(run: Callable[[], Any]) -> dict[str, tuple[float, int]]:
    """Per kernel name, the GPU seconds and launches of everything ``run`` queues (CUPTI:
    CuPy's kernels, cuBLAS' and torch's alike), as (seconds, count) pairs summed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as found:
        run()
        torch.cuda.synchronize()
    times: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for event in found.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.time_range.elapsed_us() / 1e6
            counts[event.name] += 1
    return {name: (times[name], counts[name]) for name in times}


def per_step(run: Callable[[int], Any], steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per kernel name, seconds and launches a step: runs of ``steps`` and of 2 steps
    (after one to warm up), their difference over the steps between."""
    run(2)
    short, long = kernel_seconds(lambda: run(2)), kernel_seconds(lambda: run(steps))
    seconds = {k: (long[k][0] - short.get(k, (0.0, 0))[0]) / (steps - 2) for k in long}
    launches = {k: (long[k][1] - short.get(k, (0.0, 0))[1]) / (steps - 2) for k in long}
    return seconds, launches


def section_e(args: argparse.Namespace) -> None:
    if torch_on_gpu("(e)") is None:
        return
    from actorflow.training import initial_parameters, train
    from actorflow.training.data import dataset

    steps = max(3, args.profile_steps)
    config = transformer_config(args, DEVICES[0], steps)
    data, initial = dataset(config), initial_parameters(config)

    def ours(n: int) -> None:
        train(transformer_config(args, DEVICES[0], n))

    def theirs(n: int) -> None:
        torch_transformer(transformer_config(args, DEVICES[0], n), data, initial, TORCH_DEVICE, 1)

    print(
        f"(e) (c)'s model: GPU time a step by kernel (CUPTI), runs of {steps} and of 2 steps, "
        f"the difference over {steps - 2} steps",
        flush=True,
    )
    for side, run in (("torch eager", theirs), ("actorflow", ours)):
        seconds, launches = per_step(run, steps)
        total, count = sum(seconds.values()), sum(launches.values())
        rows = [
            ("ms a step", "launches", f"kernel ({side}: {total * 1e3:.2f} ms, {count:.0f} launches a step)")
        ]
        for name in sorted(seconds, key=lambda k: -seconds[k])[: args.profile_rows]:
            rows.append((f"{seconds[name] * 1e3:.3f}", f"{launches[name]:.1f}", name[:110]))
        print("\n".join(columns(rows)), flush=True)


# -- (d) the kernel habits -----------------------------------------------------------


def section_d(args: argparse.Namespace) -> None:
    try:
        import gpu_habits  # benchmarks/gpu_habits.py, beside this file
    except ImportError as err:
        print(f"(d) skipped: benchmarks/gpu_habits.py cannot be imported ({err})")
        return
    if hasattr(gpu_habits, "main"):
        argv = ["--quick"] if args.quick else []
        try:
            code = gpu_habits.main(argv)
        except SystemExit as exit:
            if not argv or exit.code != 2:
                raise
            print("(d) gpu_habits.py takes no --quick: run in full")
            code = gpu_habits.main([])
        if code:
            raise RuntimeError(f"gpu_habits.main returned {code}")
    elif hasattr(gpu_habits, "rows"):
        print("\n".join(columns([tuple(str(cell) for cell in row) for row in gpu_habits.rows()])))
    else:
        print("(d) skipped: benchmarks/gpu_habits.py has neither main(argv) nor rows()")


# -- main ----------------------------------------------------------------------------


QUICK = {
    "repeats": 1,
    "steps": 100,
    "overlap_sizes": [256] + [1024] * 4,
    "overlap_batch": 2048,
    "overlap_steps": 5,
    "d_model": 256,
    "layers": 2,
    "heads": 4,
    "seq_len": 128,
    "train_steps": 4,
}
"""--quick's values, for the options the command line leaves at their defaults."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs per figure; medians are printed (default 3)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 repeat, every part shrunk")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="write Chrome traces there: (b)'s four schedules over the emulated link, (c)'s first actorflow run",
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=list("abcde"),
        default=list("abcd"),
        help="the parts to run (default a b c d: the issue's; e profiles (c))",
    )
    a = p.add_argument_group("(a) host cost per act")
    a.add_argument("--chain", type=int, default=64, help="element-wise ops in the chain (default 64)")
    a.add_argument("--size", type=int, default=1 << 16, help="float32 elements an op (default 65536)")
    a.add_argument("--steps", type=int, default=500, help="steps a run (default 500)")
    a.add_argument("--block", type=int, default=16, help="ops on one device before a move (default 16)")
    a.add_argument("--quota", type=int, default=2, help="register quota (default 2)")
    b = p.add_argument_group("(b) overlap")
    b.add_argument(
        "--overlap-sizes",
        type=int,
        nargs="+",
        default=[1024] + [2048] * 8,
        help="layer widths (default 1024, then 8 layers of 2048: matmuls of a third of a ms on an H100)",
    )
    b.add_argument("--overlap-batch", type=int, default=8192, help="global batch, split over 2 devices")
    b.add_argument("--overlap-steps", type=int, default=10, help="steps a timed run (default 10)")
    b.add_argument("--comm-share", type=float, default=0.5, help="the link's time as a share of C")
    b.add_argument("--latency", type=float, default=100e-6, help="the link's latency a collective, s")
    b.add_argument("--bucket-cap", type=int, default=1 << 20, help="fusion bucket cap of (4), bytes")
    c = p.add_argument_group("(c) transformer")
    c.add_argument("--d-model", type=int, default=1024)
    c.add_argument("--layers", type=int, default=8)
    c.add_argument("--heads", type=int, default=16)
    c.add_argument("--seq-len", type=int, default=512)
    c.add_argument("--vocab", type=int, default=64)
    c.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    c.add_argument("--train-steps", type=int, default=8, help="timed steps a run (default 8)")
    c.add_argument(
        "--warm-steps", type=int, default=2, help="untimed steps first, rounded up to whole runs (default 2)"
    )
    c.add_argument(
        "--steps-per-run",
        type=int,
        default=attrs.fields(TrainConfig).steps_per_run.default,
        help="actorflow's train.steps_per_run (default: the config's, %(default)s)",
    )
    e = p.add_argument_group("(e) (c)'s profile")
    e.add_argument("--profile-steps", type=int, default=6, help="steps of the longer run (default 6)")
    e.add_argument("--profile-rows", type=int, default=25, help="kernels listed a side (default 25)")
    args = p.parse_args(argv)
    if args.quick:  # what the command line left at its default
        for name, value in QUICK.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    counts = (
        "repeats",
        "chain",
        "size",
        "steps",
        "block",
        "overlap_steps",
        "train_steps",
        "warm_steps",
        "steps_per_run",
    )
    if min(getattr(args, name) for name in counts) < 1:
        p.error(f"{', '.join('--' + name.replace('_', '-') for name in counts)}: each at least 1")
    return args


def section(name: str, run: Callable[[], None]) -> bool:
    """Run one part; a failure prints its traceback and the next part still runs."""
    print(f"\n== {name}", flush=True)
    start = time.perf_counter()
    try:
        run()
        ok = True
    except Exception:  # noqa: BLE001 - one part's failure must not cost the others
        print(f"FAILED: {name}")
        traceback.print_exc(file=sys.stdout)
        ok = False
    print(f"({name}: {time.perf_counter() - start:.1f} s)", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    why = unavailable()
    if why is not None:
        print(f"gpu.py needs CuPy and a CUDA GPU: {why}")
        return 1
    cp = import_cupy()
    start = time.perf_counter()
    print(
        f"actorflow GPU benchmark: {gpu_name(cp)} ({cp.cuda.runtime.getDeviceCount()} GPU(s) visible), "
        f"python {platform.python_version()}, numpy {np.__version__}, cupy {cp.__version__}, CUDA runtime "
        f"{cp.cuda.runtime.runtimeGetVersion()}, driver {cp.cuda.runtime.driverGetVersion()}, "
        f"{os.cpu_count()} cores; medians of {count(args.repeats, 'run')}{', --quick' if args.quick else ''}",
        flush=True,
    )
    spin, why_no_spin = make_spinner(cp)
    if spin is None:
        print(f"no gate kernel: {why_no_spin}")
    parts = {
        "a": ("(a) host cost per act, GPU idle share", lambda: section_a(args, cp, spin, why_no_spin)),
        "b": ("(b) compute/communication overlap", lambda: section_b(args)),
        "c": ("(c) the transformer against PyTorch eager", lambda: section_c(args, cp)),
        "d": ("(d) kernel habits (gpu_habits.py)", lambda: section_d(args)),
        "e": ("(e) the transformer's GPU time a step by kernel", lambda: section_e(args)),
    }
    failed = [name for key, (name, run) in parts.items() if key in args.only and not section(name, run)]
    print(f"\ngpu.py took {time.perf_counter() - start:.0f} s", end="")
    print(f"; FAILED: {'; '.join(failed)}" if failed else "")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
