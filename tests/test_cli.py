"""The ``actorflow`` command: the demo, help, and argument errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from actorflow import cli


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """cli.main(argv) -> (exit code, stdout, stderr), turning SystemExit into its code."""
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_demo_prints_the_plan_and_the_error(capsys):
    code, out, err = run_cli(capsys, "demo", "--iterations", "3")
    assert code == 0, out + err
    # the plan summary
    assert out.startswith("Plan: ")
    for part in (
        "stream cpu:0/compute",
        "stream cpu:1/copy",
        "stream rank0/collective",
        "quota 2",
        "events (producer -> consumer",
        "collective order",
        "planned memory",
        "cpu:0:",
        "cpu:1:",
        "w0 (parameter)",
    ):
        assert part in out, part
    # the run and its check against numpy
    assert "ran 3 iterations (batch 64, width 256, quota 2)" in out
    m = re.search(r"max \|actorflow - numpy\| = (\S+)", out)
    assert m, out
    assert float(m.group(1)) < 1e-4
    held = re.search(r"most buffers held by one register: (\d+) \(quota 2\)", out)
    assert held and 1 <= int(held.group(1)) <= 2


def test_demo_options_change_the_plan(capsys):
    code, out, _ = run_cli(
        capsys, "demo", "--iterations", "2", "--batch", "8", "--width", "16", "--quota", "1"
    )
    assert code == 0
    assert "quota 1" in out
    assert "quota 2" not in out
    assert "ran 2 iterations (batch 8, width 16, quota 1)" in out
    assert "float32[8, 16]" in out


def test_demo_writes_a_trace(capsys, tmp_path):
    path = tmp_path / "demo.trace.json"
    code, out, _ = run_cli(
        capsys, "demo", "--iterations", "2", "--batch", "8", "--width", "16", "--trace", str(path)
    )
    assert code == 0
    assert f"trace written to {path}" in out
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e["ph"] == "X" for e in events)


def test_top_level_help(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    assert out.startswith("usage: actorflow")
    assert "demo" in out
    assert "compile and run a small two-device graph" in out


def test_demo_help(capsys):
    code, out, _ = run_cli(capsys, "demo", "--help")
    assert code == 0
    assert out.startswith("usage: actorflow demo")
    for option in ("--iterations", "--batch", "--width", "--quota", "--trace"):
        assert option in out


def test_no_command_prints_help_and_exits_2(capsys):
    code, out, _ = run_cli(capsys)
    assert code == 2
    assert "usage: actorflow" in out


@pytest.mark.parametrize("option", ["--iterations", "--batch", "--width", "--quota"])
def test_zero_is_a_usage_error(capsys, option):
    code, out, err = run_cli(capsys, "demo", option, "0")
    assert code == 2
    assert out == ""
    assert "usage: actorflow demo" in err
    assert f"argument {option}: must be an integer >= 1, got '0'" in err


def test_unknown_option_is_a_usage_error(capsys):
    code, _, err = run_cli(capsys, "demo", "--nope")
    assert code == 2
    assert "unrecognized arguments: --nope" in err


def test_unknown_command_is_a_usage_error(capsys):
    code, _, err = run_cli(capsys, "train")
    assert code == 2
    assert "invalid choice: 'train'" in err


def test_not_a_number_is_a_usage_error(capsys):
    code, out, err = run_cli(capsys, "demo", "--iterations", "abc")
    assert code == 2
    assert out == ""
    assert "argument --iterations" in err
    assert "'abc'" in err


def test_not_a_number_error_does_not_name_a_private_helper(capsys):
    _, _, err = run_cli(capsys, "demo", "--iterations", "abc")
    assert "_positive" not in err


# -- as a process --------------------------------------------------------------------------------


def run_module(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "actorflow", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_python_m_actorflow_demo():
    proc = run_module("demo", "--iterations", "3", "--batch", "8", "--width", "16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Plan: ")
    assert "max |actorflow - numpy|" in proc.stdout


def test_python_m_actorflow_runs_the_demo_when_given_only_options():
    proc = run_module("--iterations", "2", "--batch", "8", "--width", "16")
    assert proc.returncode == 0, proc.stderr
    assert "ran 2 iterations (batch 8, width 16, quota 2)" in proc.stdout


def test_python_m_actorflow_bad_argument_exits_2():
    proc = run_module("demo", "--iterations", "0")
    assert proc.returncode == 2
    assert "must be an integer >= 1, got '0'" in proc.stderr
    assert proc.stdout == ""


def test_python_m_actorflow_help():
    proc = run_module("--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: actorflow")


def test_version_is_the_package_version(capsys):
    import actorflow

    assert re.fullmatch(r"\d+\.\d+\.\d+", actorflow.__version__)
    code, out, _ = run_cli(capsys, "--version")
    assert (code, out) == (0, f"actorflow {actorflow.__version__}\n")
    proc = run_module("--version")
    assert (proc.returncode, proc.stdout) == (0, out)
