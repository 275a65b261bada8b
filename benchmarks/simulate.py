"""The simulator's accuracy: configs measured by ``actorflow run`` and predicted by
``actorflow simulate`` in the same invocation, the cost model calibrated on one run of a
config not in the table (per model: the MLP's on GPipe at 2 micro-batches, its crowding
on 2x2 under GPipe at 2 micro-batches; the transformer's on 4 micro-batches).

Per config: the measured step time (from the run's trace: per ``Session.run`` of
``train.steps_per_run`` steps, its first step's start to the next run's, by its steps, so
that the host's time between runs counts as in the prediction; the median over the runs,
which leaves out those other load on the machine stretched, then over --repeats runs)
beside the predicted one and the error; the
measured bubble per stage (median over runs) beside the predicted one. Then the median
and worst errors and the worst bubble difference, against the goals (5%, 10%, 0.05).

The configs' runs are taken in turns (every config once, then again), so that a slow
minute of the machine (others' load moves this one's speed by 10-20% between minutes)
falls on every config alike, and each turn ends with a run of the calibration's own
config (and of the crowding's). The cost model is calibrated on one of those runs, the
one whose step is their median (``--calibration typical``, the default), so that the
calibration run is of the machine the table ran on, not of the minute before it
(``--calibration first``: one run before the table, which a calibration's drift then
shows: on 2026-11-28 the MLP's calibration run was 20% faster than the same config
beside the table). The line after the table gives the calibration run's step beside
its config's runs in the turns.

Runs over ranks are measured as a user runs them (``actorflow launch -n R -- actorflow
run ...``; rank 0's steps) and predicted with ``--ranks R``. Before the table, the
machine's CPU pressure (``/proc/pressure/cpu``, others' load) while it was measured.

Run: python benchmarks/simulate.py [--steps 30] [--repeats 3] [--calibration typical|first]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from actorflow.config import load_config
from actorflow.simulate import calibrate, fit_crowding, predict
from actorflow.text import columns
from actorflow.trace.parse import parse
from actorflow.training import train
from actorflow.training.parameter_server import run_starts

MLP = [
    ("default (1f1b, m4)", "default", [], 1),
    ("gpipe m4", "gpipe", [], 1),
    ("zb1 m4", "zb1", [], 1),
    ("1f1b m2", "1f1b", ["parallel.micro_batches=2"], 1),
    ("1f1b m8", "1f1b", ["parallel.micro_batches=8"], 1),
    ("gpipe m8", "gpipe", ["parallel.micro_batches=8"], 1),
    ("zb1 m8", "zb1", ["parallel.micro_batches=8"], 1),
    ("1 device", "default", ["parallel.stages=[cpu:0]", "parallel.micro_batches=1"], 1),
    ("recompute", "default", ["parallel.recompute=true"], 1),
    ("2x2 data parallel", "2x2", [], 1),
    ("2x2 sharded optimizer", "2x2", ["train.optimizer.shard=true"], 1),
    ("default, 2 ranks", "default", [], 2),
    ("2x2, 2 ranks", "2x2", [], 2),
    ("2x2, 4 ranks", "2x2", [], 4),
]
TRANSFORMER = [
    ("transformer (tp 2, m2)", "transformer", [], 1),
    ("transformer zb1", "transformer", ["parallel.schedule=zb1"], 1),
    ("transformer, 2 ranks", "transformer", [], 2),
]
CALIBRATION = {
    "mlp": ("gpipe", ["parallel.micro_batches=2"]),
    "transformer": ("transformer", ["parallel.micro_batches=4"]),
}
CROWDING = {"mlp": ("2x2", ["parallel.schedule=gpipe", "parallel.micro_batches=2"])}
"""Per model, a run of more than two devices in one process, not in the table, that the
crowding is fitted on (``fit_crowding``; the transformer's calibration run has four)."""


def measured(name: str, sets: list[str], steps: int, folder: str, ranks: int = 1) -> tuple:
    """One run's (step seconds, bubble per stage, trace): the step is the median over the
    run's ``Session.run`` periods (see the module's docstring)."""
    config = load_config(f"configs/{name}.yaml", [*sets, f"train.steps={steps}"])
    runs = run_starts(config)  # a run's period: to the next one's start, by its steps
    path = os.path.join(folder, f"{name}.json")
    if ranks == 1:
        bubbles = train(config, trace=path).bubbles
    else:
        bubbles = launched(name, sets, steps, ranks, path)
    with open(path) as f:
        chrome = json.load(f)
    parsed = parse(chrome)
    starts = sorted(
        s.start
        for s in parsed.spans
        if s.category == "step" and (ranks == 1 or parsed.tracks[s.track].process == "rank 0")
    )
    period = statistics.median((starts[b] - starts[a]) / (b - a) for a, b in zip(runs, runs[1:])) / 1e9
    return period, bubbles, chrome


def launched(name: str, sets: list[str], steps: int, ranks: int, trace: str) -> list[float]:
    """A run over ``ranks`` started as a user does; its bubble per stage (its merged trace
    goes to ``trace``)."""
    metrics = trace + ".metrics.json"
    cli = [sys.executable, "-m", "actorflow.cli"]
    sets_ = [a for s in [*sets, f"train.steps={steps}"] for a in ("--set", s)]
    command = [*cli, "launch", "-n", str(ranks), "--", *cli, "run", f"configs/{name}.yaml", *sets_]
    subprocess.run(
        [*command, "--trace", trace, "--metrics", metrics, "--quiet"], check=True, capture_output=True
    )
    with open(metrics) as f:
        return [s["bubble"] for s in json.load(f)["stages"]]


def typical(runs: list[tuple]) -> tuple:
    """Of ``measured`` runs, the one whose step time is the median (the lower middle of an
    even number)."""
    return sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2]


def pressure() -> str:
    """The machine's CPU pressure: the share of time some task waited for a core."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="steps per measured run (default 30)")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per config; medians")
    p.add_argument(
        "--calibration",
        choices=["typical", "first"],
        default="typical",
        help="calibrate on the run of the calibration's config, among those of the turns, whose step "
        "is the median (typical, the default), or on one run of it before the table (first)",
    )
    args = p.parse_args()
    print(f"actorflow simulate accuracy: {os.cpu_count()} cores; {args.steps} steps x {args.repeats} runs")
    start = pressure()
    rows = [("config", "measured ms", "predicted ms", "error", "bubble measured", "bubble predicted")]
    errors, gaps = [], []
    drifts = []
    with tempfile.TemporaryDirectory() as folder:
        for kind, table in (("mlp", MLP), ("transformer", TRANSFORMER)):
            name, sets = CALIBRATION[kind]
            first = args.calibration == "first"
            again = [measured(name, sets, args.steps, folder)] if first else []
            crowded = [measured(*CROWDING[kind], args.steps, folder)] if first and kind in CROWDING else []
            runs: dict[str, list[tuple]] = {label: [] for label, *_ in table}
            for _ in range(args.repeats):  # in turns: a slow minute of the machine falls on every config
                for label, config_name, config_sets, ranks in table:
                    runs[label].append(measured(config_name, config_sets, args.steps, folder, ranks)[:2])
                again.append(measured(name, sets, args.steps, folder))
                if kind in CROWDING and not first:
                    crowded.append(measured(*CROWDING[kind], args.steps, folder))
            chosen = again[0] if first else typical(again)
            model = calibrate(chosen[2], f"{name} {' '.join(sets)}")
            print(f"{kind}: calibrated on {name} {' '.join(sets)}", end="")
            if kind in CROWDING:
                crowd_name, crowd_sets = CROWDING[kind]
                crowd = crowded[0] if first else typical(crowded)
                model = fit_crowding(model, crowd[2], f"{crowd_name} {' '.join(crowd_sets)}")
                print(
                    f"; crowding {model.crowding:.2f} fitted on {crowd_name} {' '.join(crowd_sets)}", end=""
                )
            print(f" (contention {model.contention:.2f})")
            drifts.append((kind, chosen[0], [period for period, *_ in (again[1:] if first else again)]))
            for label, config_name, config_sets, ranks in table:
                step = statistics.median(period for period, _ in runs[label])
                bubbles = [
                    statistics.median(b[s] for _, b in runs[label]) for s in range(len(runs[label][0][1]))
                ]
                config = load_config(
                    f"configs/{config_name}.yaml", [*config_sets, f"train.steps={args.steps}"]
                )
                prediction = predict(config, model, ranks=ranks)
                error = prediction.step_seconds / step - 1
                errors.append(abs(error))
                gaps += [abs(a - b) for a, b in zip(bubbles, prediction.result.bubbles)]
                rows.append(
                    (
                        label,
                        f"{step * 1e3:.3f}",
                        f"{prediction.step_seconds * 1e3:.3f}",
                        f"{error:+.1%}",
                        " ".join(f"{b:.3f}" for b in bubbles),
                        " ".join(f"{b:.3f}" for b in prediction.result.bubbles),
                    )
                )
    print(f"CPU pressure at the end ({pressure()}), at the start ({start})")
    print("\n".join(columns(rows)))
    print(
        f"step time error: median {statistics.median(errors):.1%} (goal 5%), worst {max(errors):.1%} "
        f"(goal 10%); bubble: worst difference {max(gaps):.3f} (goal 0.05)"
    )
    for kind, calibrated, again in drifts:
        print(
            f"{kind}: the calibration run stepped {calibrated * 1e3:.3f} ms, its config beside the table "
            f"{' '.join(f'{a * 1e3:.3f}' for a in again)} ms (median {statistics.median(again) / calibrated - 1:+.1%}): "
            "the machine's drift since calibrating, which every prediction of the table carries"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
