"""The project's habits, checked with the suite so the README's one test command (and CI)
runs them: ruff's lint and format, and mypy on the package (configured in pyproject)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy"]],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_tool_is_clean(command):
    done = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, done.stdout + done.stderr
