"""actorflow against plain PyTorch eager on the CPU: the default training run, both ways.

configs/default.yaml (a 4-layer MLP over 2 pipeline stages, 1F1B, SGD with momentum)
trained by actorflow and by the same model in PyTorch eager, from the same initial
parameters (the compiled plan's) and the same batches (``training.data.step_feeds``):

(a) the losses: the largest |actorflow - torch| over every step and every pair of runs
    (goal: at most 1e-5 at every step), and the largest in each tenth of the steps;
    beside it, the same for one run each with model.dtype=float64, which tells a
    difference in what the two compute from float32 rounding that training amplifies;
(b) samples/s of ``actorflow run configs/default.yaml``, against PyTorch eager with
    torch.set_num_threads(1) and (2), and the ratios actorflow / torch; beside it the
    samples/s its own kernels would give in a pipeline with no time between them (each
    stage's measured kernel seconds a step, m identical micro-batches: the flow shop's
    makespan), the bound no host path can pass;
(c) the same with parallel.micro_batches=8 (PyTorch's step is the same full batch
    either way, so its figures measure the same computation again);
(d) per m, beside them: the same run over a rank per stage (``actorflow launch -n 2 --
    actorflow run ...``: its stages in processes of their own, MPI between them), against
    torch and against the bare pipeline over processes; its losses count in (a);
(e) per m, beside them: the same model's stages as plain numpy loops (``numpy_stages``):
    on one thread; a thread, or a process, per stage, each on its own (no hand-off: the
    bound of any pipeline on that placement before its bubble); and a bare 1F1B pipeline
    of them over threads, or processes (rings of buffers and semaphores, no runtime; over
    processes also waiting by spinning on shared counts):
    what numpy's kernels reach on each placement with no runtime at all, and actorflow
    against the bare pipeline over threads (its own placement).

actorflow's side is the CLI itself, run as a subprocess (``python -m actorflow run
configs/default.yaml --metrics FILE --set train.steps=N --set parallel.micro_batches=M``):
its samples/s is the figure the CLI prints, read unrounded from its ``--metrics`` JSON
with every step's loss: timed by ``training.train`` over the steps alone (not start-up
or compile), with the tracing its report needs, in a process that never loads torch.
PyTorch's side is timed the same way, over its steps alone: each step takes its batch
from ``step_feeds``, runs forward, backward and ``optimizer.step()``, and reads the
loss. Each figure is the median of --repeats runs, the actorflow and torch runs of a
repeat one after the other; ratios are taken per repeat, then their median.

Each repeat runs actorflow in one process, then over ranks, then the numpy loops, then torch.

Run: python benchmarks/vs_torch.py [--repeats 3] [--steps 100] [--micro-batches 4 8] [--quick]
(torch is a benchmark extra: pip install 'actorflow[bench]')
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
import time
from pathlib import Path

import numpy as np

import numpy_stages  # benchmarks/ is on sys.path when this script runs
from actorflow.config import Config, load_config
from actorflow.text import columns, count
from actorflow.trace.metrics import makespan
from actorflow.training import compile_config
from actorflow.training.data import Data, dataset, step_feeds

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
GOAL = 1e-5  # the largest loss difference allowed at any step


def actorflow_run(overrides: list[str], ranks: int = 1) -> tuple[float, list[float], float]:
    """(samples/s, loss per step, kernel-bound samples/s) of ``actorflow run`` on the
    default config with these ``--set`` overrides, as its ``--metrics`` JSON gives them;
    ``ranks`` > 1: under ``actorflow launch -n ranks`` (a process per stage).
    Kernel-bound: the samples/s of the same kernels in a pipeline with no time between
    them, m identical micro-batches flowing through stages of the measured kernel times
    (``trace.metrics.balanced_bubbles``'s makespan): what no host path can beat."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.json")
        command = [sys.executable, "-m", "actorflow", "run", str(CONFIG), "--metrics", metrics]
        if ranks > 1:
            command = [sys.executable, "-m", "actorflow", "launch", "-n", str(ranks), "--", *command]
        for override in overrides:
            command += ["--set", override]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
        with open(metrics) as f:
            result = json.load(f)
    m = result["config"]["parallel"]["micro_batches"]
    step = makespan([stage["kernel_seconds_per_step"] for stage in result["stages"]], m)
    return result["samples_per_second"], result["losses"], result["config"]["train"]["batch_size"] / step


def initial_parameters(config: Config) -> dict[str, np.ndarray]:
    """The model parameters as the compiled plan starts them (not the optimizer's state)."""
    return {p.name: p.value for p in compile_config(config).parameters if not p.state}


def torch_run(
    config: Config, data: Data, initial: dict[str, np.ndarray], threads: int
) -> tuple[float, list[float]]:
    """(samples/s, loss per step) of the config's MLP trained in PyTorch eager on
    ``threads`` threads: each step the whole batch, mean cross-entropy, torch's SGD (whose
    momentum is actorflow's: v = m v + g; p -= lr v)."""
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, config.model.dtype)
    activation = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh}[config.model.activation]
    layers: list[torch.nn.Module] = []
    for k, (a, b) in enumerate(zip(config.model.sizes, config.model.sizes[1:])):
        linear = torch.nn.Linear(a, b, dtype=dtype)
        with torch.no_grad():  # actorflow computes h @ w + b with w (in, out); torch's weight is (out, in)
            linear.weight.copy_(torch.from_numpy(initial[f"w{k}"].T))
            linear.bias.copy_(torch.from_numpy(initial[f"b{k}"]))
        layers.append(linear)
        if k < config.layers - 1:
            layers.append(activation())
    model = torch.nn.Sequential(*layers)
    spec = config.train.optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
    losses = []
    start = time.perf_counter()
    for step in range(config.train.steps):
        feeds = step_feeds(config, data, step)
        x = torch.from_numpy(np.concatenate([f["x"] for f in feeds]))
        labels = torch.from_numpy(np.concatenate([f["labels"] for f in feeds]))
        loss = torch.nn.functional.cross_entropy(model(x), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    return config.train.steps * config.train.batch_size / seconds, losses


def loss_differences(ours: list[list[float]], theirs: list[list[float]]) -> np.ndarray:
    """Per step, the largest |actorflow - torch| loss over every pair of their runs."""
    return np.abs(np.array(ours)[:, None, :] - np.array(theirs)[None, :, :]).max(axis=(0, 1))


def compare(
    overrides: list[str], repeats: int
) -> tuple[list[float], list[float], list[float], dict[str, list[float]], dict[int, list[float]], np.ndarray]:
    """Samples/s of each repeat's actorflow run (in one process, and over a rank per
    stage) and its kernel-bound samples/s; per placement, of the plain numpy stages; per
    thread count, of its torch runs; and ``loss_differences`` over the actorflow runs
    (both) and the torch runs."""
    config = load_config(CONFIG, overrides)
    data, initial = dataset(config), initial_parameters(config)
    ours: list[float] = []
    over_ranks: list[float] = []
    bounds: list[float] = []
    plain: dict[str, list[float]] = {placement: [] for placement in numpy_stages.PLACEMENTS}
    theirs: dict[int, list[float]] = {1: [], 2: []}
    our_losses, their_losses = [], []
    stages = (config.model.sizes, config.stage_layers, config.train.batch_size, config.parallel.micro_batches)
    for _ in range(repeats):
        rate, losses, kernel_bound = actorflow_run(overrides)
        ours.append(rate)
        bounds.append(kernel_bound)
        our_losses.append(losses)
        rate, losses, _ = actorflow_run(overrides, ranks=len(config.parallel.stages))
        over_ranks.append(rate)
        our_losses.append(losses)
        for placement, rates in plain.items():
            rates.append(numpy_stages.rate(placement, *stages, config.train.steps))
        for threads, rates in theirs.items():
            rate, losses = torch_run(config, data, initial, threads)
            rates.append(rate)
            their_losses.append(losses)
    return ours, over_ranks, bounds, plain, theirs, loss_differences(our_losses, their_losses)


def float64_differences(overrides: list[str]) -> np.ndarray:
    """``loss_differences`` of one run each with model.dtype=float64: the two trainings'
    arithmetic compared with float32's rounding out of the way."""
    config = load_config(CONFIG, [*overrides, "model.dtype=float64"])
    _, ours, _ = actorflow_run([*overrides, "model.dtype=float64"])
    _, theirs = torch_run(config, dataset(config), initial_parameters(config), 1)
    return loss_differences([ours], [theirs])


def by_tenth(diffs: np.ndarray) -> str:
    """The largest difference in each tenth of the steps, as "1-10 3e-07, 11-20 ..."."""
    bounds = np.linspace(0, len(diffs), min(10, len(diffs)) + 1).astype(int)
    return ", ".join(f"{a + 1}-{b} {diffs[a:b].max():.0e}" for a, b in zip(bounds, bounds[1:]))


def loss_row(measure: str, diffs: np.ndarray) -> tuple[str, str, str, str]:
    worst, over = int(np.argmax(diffs)), int((diffs > GOAL).sum())
    return (
        measure,
        f"{diffs[worst]:.1e} at step {worst + 1}",
        f"goal {GOAL:.0e} at each of {len(diffs)} steps",
        "holds" if not over else f"exceeded at {over} steps",
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="runs per figure; medians are printed (default 3)")
    p.add_argument("--steps", type=int, help="training steps per run (default: the config's, 100)")
    p.add_argument(
        "--micro-batches",
        type=int,
        nargs="+",
        default=[4, 8],
        help="actorflow's micro-batches a step, one comparison each (default 4 8)",
    )
    p.add_argument("--quick", action="store_true", help="a fast smoke run: 1 repeat of 20 steps, m = 4")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.steps, args.micro_batches = 1, 20, [4]
    try:
        import torch
    except ImportError:
        print("vs_torch.py needs PyTorch: pip install 'actorflow[bench]' (torch==2.13.0)")
        return 0
    steps = load_config(CONFIG).train.steps if args.steps is None else args.steps

    print(
        f"actorflow vs PyTorch eager: python {platform.python_version()}, numpy {np.__version__}, "
        f"torch {torch.__version__}, {os.cpu_count()} cores, {CONFIG.name}, {steps} steps, "
        f"medians of {count(args.repeats, 'run')}"
    )
    rows = [("measure", "actorflow", "baseline", "ratio")]
    tenths = []
    for m in args.micro_batches:
        overrides = [f"train.steps={steps}", f"parallel.micro_batches={m}"]
        ours, over_ranks, bounds, plain, theirs, diffs = compare(overrides, args.repeats)
        rows.append(loss_row(f"m = {m}: largest |loss difference|, actorflow - torch", diffs))
        torches = {
            threads: (f"torch eager on {count(threads, 'thread')}", theirs[threads]) for threads in (2, 1)
        }
        comparisons = [
            ("actorflow run", ours, torches[2]),
            ("its kernels with no time between them", bounds, torches[2]),
            *((what, plain[placement], torches[2]) for placement, what in numpy_stages.PLACEMENTS.items()),
            ("actorflow run", ours, torches[1]),
            ("its kernels with no time between them", bounds, torches[1]),
            ("actorflow run", ours, (numpy_stages.PLACEMENTS["threads 1f1b"], plain["threads 1f1b"])),
            ("actorflow run over a rank per stage", over_ranks, torches[2]),
            (
                "actorflow run over a rank per stage",
                over_ranks,
                (numpy_stages.PLACEMENTS["processes 1f1b"], plain["processes 1f1b"]),
            ),
        ]
        for what, rates, (baseline, base_rates) in comparisons:
            ratios = [a / b for a, b in zip(rates, base_rates)]
            rows.append(
                (
                    f"m = {m}: samples/s, {what} against {baseline}",
                    f"{statistics.median(rates):,.0f}",
                    f"{statistics.median(base_rates):,.0f}",
                    f"{statistics.median(ratios):.2f}x (runs: {', '.join(f'{r:.2f}' for r in ratios)})",
                )
            )
        rows.append(
            loss_row(f"m = {m}: the same losses in float64, one run each", float64_differences(overrides))
        )
        tenths.append(f"m = {m}, largest |loss difference| in each tenth of the steps: {by_tenth(diffs)}")
    print("\n".join(columns(rows)))
    print("\n".join(tenths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
