"""``actorflow run`` and ``actorflow compile``: config mistakes are one line and exit 2, a
tiny run prints its table and writes metrics and a trace, compile runs nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from actorflow.config import load_config
from actorflow.trace import summarize
from actorflow.training import compile_config, report
from actorflow.training.machine import SIZES
from test_cli import run_cli
from test_config import BASELINE_YAML, MALFORMED

TINY_YAML = """\
model: {kind: mlp, sizes: [6, 8, 3], dtype: float64}
data: {kind: synthetic_classification, samples: 32, seed: 1}
train: {steps: 50, batch_size: 8, optimizer: {kind: sgd, lr: 0.1}, log_every: 1}
parallel: {stages: [cpu:0, cpu:1], micro_batches: 2, schedule: 1f1b}
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML)
    return path


@pytest.fixture
def no_running(monkeypatch):
    """Make any attempt to run a plan fail loudly."""
    from actorflow.runtime.runtime import Runtime

    def refuse(*args, **kwargs):
        raise AssertionError("nothing may run here")

    monkeypatch.setattr(Runtime, "__init__", refuse)


# -- config mistakes ------------------------------------------------------------------


def malformed_argv(tmp_path, spec) -> tuple[str, list[str], str]:
    """(config file, --set arguments, what ``<string>`` reads as) for one MALFORMED spec."""
    path = tmp_path / "case.yaml"
    if isinstance(spec, str):
        path.write_text(spec)
        return str(path), [], str(path)
    path.write_text(BASELINE_YAML)
    return str(path), [arg for override in spec for arg in ("--set", override)], str(path)


@pytest.mark.usefixtures("no_running")
@pytest.mark.parametrize("command", ["run", "compile"])
@pytest.mark.parametrize(
    ("spec", "message"), [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED]
)
def test_malformed_configs_exit_2_with_one_line(capsys, tmp_path, command, spec, message):
    config, sets, source = malformed_argv(tmp_path, spec)
    code, out, err = run_cli(capsys, command, config, *sets)
    assert code == 2, err
    assert out == ""
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    expected = message.replace("<string>", source, 1) if message.startswith("<string>") else message
    assert err == f"actorflow {command}: error: {expected}\n"


@pytest.mark.usefixtures("no_running")
@pytest.mark.parametrize("command", ["run", "compile"])
def test_a_missing_config_file_exits_2(capsys, tmp_path, command):
    missing = tmp_path / "nowhere.yaml"
    code, out, err = run_cli(capsys, command, str(missing))
    assert code == 2
    assert out == "" and "Traceback" not in err
    assert err.count("\n") == 1
    assert str(missing) in err and "cannot read" in err


# -- run ------------------------------------------------------------------------------


def test_run_prints_the_table_and_writes_metrics_and_trace(capsys, tmp_path, tiny):
    metrics, trace = tmp_path / "m.json", tmp_path / "t.json"
    code, out, err = run_cli(
        capsys, "run", str(tiny), "--steps", "3", "--quiet", "--metrics", str(metrics), "--trace", str(trace)
    )
    assert code == 0, err
    assert "Traceback" not in err
    assert "samples/s" in out and "3 steps of 8 samples" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    assert "bubble" in lines[header] and "peak activations" in lines[header]
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [r[:2] for r in rows] == [["0", "cpu:0"], ["1", "cpu:1"]]
    for r in rows:
        bubble = float(r[3])
        assert 0.0 <= bubble <= 1.0
        assert float(r[4]) == pytest.approx(1 / 3, abs=1e-3)  # (p-1)/(m+p-1) with p = m = 2

    data = json.loads(metrics.read_text())
    assert data["steps"] == 3
    assert len(data["losses"]) == 3 and all(isinstance(x, float) for x in data["losses"])
    assert data["config"]["train"]["steps"] == 3
    assert [s["devices"] for s in data["stages"]] == [["cpu:0"], ["cpu:1"]]
    for s, stage in enumerate(data["stages"]):
        assert 1 <= stage["peak_activations"] <= 2 - s  # 1F1B: p - s
        assert 0.0 <= stage["bubble"] <= 1.0
    assert data["samples_per_second"] > 0
    assert f"metrics written to {metrics}" in out

    chrome = json.loads(trace.read_text())
    assert chrome["traceEvents"]
    assert f"trace written to {trace}" in out
    timed = chrome["otherData"]["machine"]["matmul"]  # for calibrating: this machine's products
    assert [row[:3] for row in timed] == [[s, s, s] for s in SIZES] and all(row[3] > 0 for row in timed)
    # the report's share of the critical path between kernels is the trace's
    share = summarize(chrome).critical_path.shares["gap"]
    assert data["critical_path_handoff_share"] == pytest.approx(share)
    assert f"critical path: {share:.0%} between kernels" in out
    path = summarize(chrome).critical_path
    assert data["critical_path_communication_share"] == pytest.approx(path.communication_share)
    assert f"{path.communication_share:.0%} in communication" in out


def test_run_metrics_path_from_the_config(capsys, tmp_path, tiny):
    metrics = tmp_path / "from-config.json"
    code, _, err = run_cli(
        capsys, "run", str(tiny), "--steps", "2", "--quiet", "--set", f"output.metrics={metrics}"
    )
    assert code == 0, err
    assert len(json.loads(metrics.read_text())["losses"]) == 2


def test_run_without_quiet_reports_progress_on_stderr(capsys, tiny):
    code, out, err = run_cli(capsys, "run", str(tiny), "--steps", "2")
    assert code == 0
    assert "step 2/2 loss" in err
    assert "step 2/2" not in out  # stdout holds only the table


def test_no_progress_bar_frames_when_stderr_is_not_a_terminal(tiny):
    proc = subprocess.run(
        [sys.executable, "-m", "actorflow", "run", str(tiny), "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 4 and all(
        re.fullmatch(rf"step {k}/4 loss \d+\.\d{{4}}", line) for k, line in enumerate(lines, 1)
    ), lines


def test_quiet_prints_no_per_step_loss(capsys, tiny):
    """--quiet: no progress bar and no per-step loss lines (log_every is 1 here)."""
    code, out, err = run_cli(capsys, "run", str(tiny), "--steps", "3", "--quiet")
    assert code == 0
    assert err == "", err
    assert "samples/s" in out


def test_a_run_on_cuda_devices_without_cupy_or_a_gpu_exits_2_naming_the_extra(capsys, tiny):
    from actorflow.runtime.cuda import unavailable

    if unavailable() is None:
        pytest.skip("CUDA is usable here")
    code, out, err = run_cli(
        capsys, "run", str(tiny), "--steps", "2", "--quiet", "--set", "parallel.stages=[cuda:0, cuda:1]"
    )
    assert code == 2
    assert (
        err.startswith("actorflow run: error: cuda: devices need CuPy and a GPU") and "actorflow[cuda]" in err
    )
    assert "Traceback" not in err


# -- compile --------------------------------------------------------------------------


@pytest.mark.usefixtures("no_running")
def test_compile_prints_the_plan_and_runs_nothing(capsys, tiny):
    code, out, err = run_cli(capsys, "compile", str(tiny), "--set", "parallel.schedule=gpipe", "--dump")
    assert code == 0, err
    assert out.startswith("Plan: ")
    plan = compile_config(load_config(tiny, ["parallel.schedule=gpipe"]))
    assert out == plan.summary() + "\n"
    assert "accumulate" in out  # the micro-batch actors are in the plan
    assert "samples/s" not in out
    code, short, _ = run_cli(capsys, "compile", str(tiny), "--set", "parallel.schedule=gpipe")
    assert code == 0 and short.startswith(out.splitlines()[0])
    for stream in plan.streams:
        assert stream.name in short
    for device in plan.memory:
        assert device in short.splitlines()[-1]


@pytest.mark.usefixtures("no_running")
def test_compile_dot_is_graphviz_with_a_cluster_per_stream_and_an_edge_per_register_use(capsys, tiny):
    code, out, err = run_cli(capsys, "compile", str(tiny), "--dot")
    assert code == 0, err
    plan = compile_config(load_config(tiny))
    assert out.startswith("digraph plan {") and out.rstrip().endswith("}")
    assert out.count("{") == out.count("}")
    assert out.count("subgraph cluster_") == len(plan.streams)
    declared = set(re.findall(r"^\s+(a\d+) \[label=", out, re.M))
    assert declared == {f"a{a.id}" for a in plan.actors}
    edges = re.findall(r"^\s+(a\d+) -> (a\d+) ", out, re.M)
    uses = [(r.producer, c.actor) for r in plan.registers if not r.is_parameter for c in r.consumers]
    assert sorted(edges) == sorted((f"a{p}", f"a{c}") for p, c in uses)
    assert len(re.findall('style="dashed"', out)) == sum(
        len(r.consumers) for r in plan.registers if r.control
    )


@pytest.mark.usefixtures("no_running")
def test_compile_honours_set_overrides(capsys, tiny):
    unfused = ("--set", "runtime.fuse_kernels=false")
    _, one, _ = run_cli(capsys, "compile", str(tiny), "--set", "parallel.micro_batches=1", *unfused)
    _, two, _ = run_cli(capsys, "compile", str(tiny), *unfused)
    _, fused, _ = run_cli(capsys, "compile", str(tiny))
    assert "accumulate" not in one and "accumulate" in two
    assert "fused" in fused and "fused" not in two


@pytest.mark.usefixtures("no_running")
def test_switching_the_optimizer_kind_drops_momentum_and_says_so(capsys, tmp_path):
    path = tmp_path / "momentum.yaml"
    path.write_text(TINY_YAML.replace("lr: 0.1}", "lr: 0.1, momentum: 0.9}"))
    code, _, err = run_cli(capsys, "compile", str(path), "--set", "train.optimizer.kind=adam")
    assert code == 0, err
    assert err == (
        "actorflow compile: --set train.optimizer.kind=adam: dropped train.optimizer.momentum, "
        "which adam does not take\n"
    )
    code, _, err = run_cli(capsys, "compile", str(path), "--set", "train.optimizer.beta1=0.5")
    assert code == 2 and "--set train.optimizer.beta1=null" in err
    code, _, err = run_cli(capsys, "compile", str(path), "--set", "train.optimizer.momentum=null")
    assert code == 0 and err == ""


@pytest.mark.usefixtures("no_running")
def test_compile_shows_the_streams_of_each_rank_against_the_limit(capsys, tiny):
    plan = compile_config(load_config(tiny, ["runtime.max_streams=9"]))
    code, out, err = run_cli(capsys, "compile", str(tiny), "--set", "runtime.max_streams=9")
    assert code == 0, err
    kinds = sorted({s.kind for s in plan.streams})
    counts = ", ".join(f"{sum(s.kind == k for s in plan.streams)} {k}" for k in kinds)
    assert out.splitlines()[1] == f"streams of rank 0: {len(plan.streams)} of max_streams 9 ({counts})"
    code, out, err = run_cli(
        capsys, "compile", str(tiny), "--set", f"runtime.max_streams={len(plan.streams) - 1}"
    )
    assert code != 0 and f"needs {len(plan.streams)} streams" in out + err


# -- arguments ------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "compile"])
def test_help_mentions_set(capsys, command):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    assert "--set" in out and "CONFIG" in out


@pytest.mark.usefixtures("no_running")
@pytest.mark.parametrize("steps", ["0", "-3", "many"])
def test_bad_steps_is_a_usage_error(capsys, tiny, steps):
    code, out, err = run_cli(capsys, "run", str(tiny), "--steps", steps)
    assert code == 2
    assert "--steps" in err and "usage:" in err
    assert out == ""


def test_a_trace_past_its_limit_keeps_the_last_steps_and_says_so(capsys, tmp_path, tiny, monkeypatch):
    from actorflow.training import runner

    monkeypatch.setattr(runner, "TRACE_LIMIT", 300)
    trace = tmp_path / "t.json"
    code, out, err = run_cli(capsys, "run", str(tiny), "--steps", "20", "--quiet", "--trace", str(trace))
    assert code == 0, err
    kept_from = json.loads(trace.read_text())["otherData"]["kept_from"]
    assert 0 < kept_from < 20
    assert (
        f"trace written to {trace} (the spans of {kept_from} iterations before {kept_from} were dropped"
        in out
    )
    assert f"bubble measured over steps {kept_from}-19 ({20 - kept_from} of the 20)" in out


@pytest.mark.parametrize(
    ("per_second", "shown"), [(35132.4, "35,132"), (100.0, "100"), (42.25, "42.2"), (0.027298, "0.0273")]
)
def test_samples_a_second_show_three_digits_at_least(per_second, shown):
    """A predicted step of a large model is a fraction of a sample a second, not 0."""
    assert report.rate(per_second) == shown
