"""What ``actorflow run`` writes and how it ends: outputs checked before the first step,
files replaced whole, strict metrics, the trained parameters, a stop at a non-finite
loss, and Ctrl-C ending a run after the step in flight, in one process and over ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from actorflow.config import parse_config
from actorflow.files import write_json
from actorflow.training import train
from test_cli import run_cli
from test_cli_run import TINY_YAML

REPO = Path(__file__).parent.parent


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML)
    return path


def _strict(path) -> dict:
    def refuse(constant):
        raise AssertionError(f"{constant} in strict JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


# -- outputs checked before any step --------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--metrics", "{tmp}/nowhere/m.json"], "--metrics: folder {tmp}/nowhere does not exist"),
        (
            ["--metrics", "{tmp}/a.json", "--trace", "{tmp}/a.json"],
            "--metrics: {tmp}/a.json is also --trace's path",
        ),
        (["--parameters", "{config}"], "--parameters: {config} is the run's config; it would be overwritten"),
        (["--trace", "{tmp}"], "--trace: {tmp} is a folder; give a file's path"),
        (
            ["--set", "output.metrics={tmp}/nowhere/m.json"],
            "output.metrics: folder {tmp}/nowhere does not exist",
        ),
    ],
    ids=["missing-folder", "one-path-twice", "the-config", "a-folder", "from-the-config"],
)
def test_bad_output_paths_exit_2_before_the_first_step(capsys, tmp_path, tiny, argv, message):
    fill = {"tmp": str(tmp_path), "config": str(tiny)}
    code, out, err = run_cli(capsys, "run", str(tiny), *(a.format(**fill) for a in argv))
    assert code == 2
    assert out == ""
    assert err.startswith(f"actorflow run: error: {message.format(**fill)}")
    assert err.count("\n") == 1
    assert tiny.read_text() == TINY_YAML


def test_a_kill_while_metrics_are_written_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "m.json"
    write_json({"run": "previous"}, path)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from actorflow.files import write_json; "
            "write_json({'losses': list(range(5_000_000))}, sys.argv[1])",  # a second of writing
            str(path),
        ],
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(p.name.endswith(".part") and p.stat().st_size for p in tmp_path.iterdir()):
            assert writer.poll() is None, "the writer ended before it was killed"
            assert time.monotonic() < deadline
            time.sleep(0.002)  # leave the cores to the writer
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.wait(timeout=30)
    assert _strict(path) == {"run": "previous"}


def test_metrics_are_strict_json_and_the_run_says_how_many_numbers_became_null(capsys, tmp_path, tiny):
    metrics = tmp_path / "m.json"
    code, out, _ = run_cli(
        capsys,
        "run",
        str(tiny),
        "--quiet",
        "--steps",
        "12",
        "--set",
        "train.optimizer.lr=1e30",
        "--set",
        "train.stop_on_nonfinite=false",
        "--metrics",
        str(metrics),
    )
    assert code == 0
    losses = _strict(metrics)["losses"]
    nulls = losses.count(None)
    assert len(losses) == 12 and nulls > 0
    assert f"metrics written to {metrics} ({nulls} NaN or infinite number" in out


@pytest.mark.timeout(60)
def test_a_nonfinite_loss_stops_the_run_at_its_step_with_exit_1(capsys, tmp_path, tiny):
    on = tmp_path / "on.json"
    off = tmp_path / "off.json"
    args = ["run", str(tiny), "--quiet", "--steps", "40", "--set", "train.optimizer.lr=1e30"]
    assert run_cli(capsys, *args, "--set", "train.stop_on_nonfinite=false", "--metrics", str(off))[0] == 0
    every = _strict(off)["losses"]
    first = every.index(None)
    code, _, err = run_cli(capsys, *args, "--metrics", str(on))
    assert code == 1
    stopped = _strict(on)
    assert stopped["steps_run"] == first + 1
    assert stopped["losses"][:first] == every[:first]
    last = f"{every[first - 1]:.6g}"
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            f"actorflow run: the loss is nan at step {first + 1} of 40 (the last finite loss was {last} at step {first})"
        )
    )


def test_the_trained_parameters_are_written_as_npz(capsys, tmp_path, tiny):
    path = tmp_path / "p.npz"
    code, out, _ = run_cli(capsys, "run", str(tiny), "--quiet", "--steps", "5", "--parameters", str(path))
    assert code == 0 and f"parameters written to {path}" in out
    expected = train(parse_config(TINY_YAML, ["train.steps=5"])).parameters
    with np.load(path) as saved:
        assert sorted(saved.files) == sorted(expected)
        for name, value in expected.items():
            np.testing.assert_array_equal(saved[name], value)


# -- Ctrl-C --------------------------------------------------------------------------------


def _interrupt(argv: list[str], after: str, timeout: float = 90, env: dict | None = None) -> tuple[int, str]:
    """Start ``argv``, send SIGINT once ``after`` appears in its output, return (status, output)."""
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    seen = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if after in line:
                proc.send_signal(signal.SIGINT)
                break
        seen.append(proc.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail("the run did not end after Ctrl-C:\n" + "".join(seen))
    return proc.returncode, "".join(seen)


def _endless_run(tiny, metrics) -> list[str]:
    return [
        sys.executable,
        "-m",
        "actorflow.cli",
        "run",
        str(tiny),
        "--steps",
        "1000000",
        "--metrics",
        str(metrics),
    ]


@pytest.mark.timeout(120)
def test_ctrl_c_ends_a_run_after_the_step_in_flight_with_its_metrics(tmp_path, tiny):
    metrics = tmp_path / "m.json"
    code, out = _interrupt(_endless_run(tiny, metrics), "step 3/")
    assert code == 130, out
    (line,) = [x for x in out.splitlines() if x.startswith("actorflow run: interrupted")]
    ran = _strict(metrics)["steps_run"]
    assert line == f"actorflow run: interrupted at step {ran} of 1000000"
    assert "Traceback" not in out


@pytest.mark.timeout(150)
def test_ctrl_c_under_launch_stops_every_rank_after_one_step_and_says_so_once(tmp_path, tiny):
    from ranks import environment, launcher

    metrics = tmp_path / "m.json"
    code, out = _interrupt(
        launcher(2, *_endless_run(tiny, metrics)), "step 3/", timeout=120, env=environment()
    )
    assert code == 130, out
    lines = [x for x in out.splitlines() if "interrupted at step" in x]
    ran = _strict(metrics)["steps_run"]
    assert lines == [f"[0] actorflow run: interrupted at step {ran} of 1000000"], out
    assert "Traceback" not in out and "Ctrl-C" not in out
