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


def runtime_imports() -> dict[str, set[str]]:
    """Per module of ``actorflow/runtime``, the modules of the package it imports (by name,
    anywhere in the module, TYPE_CHECKING blocks and function bodies included)."""
    import ast

    folder = ROOT / "actorflow" / "runtime"
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        found = graph.setdefault(path.stem, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 2
                and (node.module or "").startswith(("compiler", "ops"))
            ):
                found.add("../" + (node.module or ""))
    return graph


def test_the_runtime_has_no_import_circle_and_never_imports_the_compiler_or_the_ops():
    from actorflow.dag import find_cycle

    graph = runtime_imports()
    assert not [m for deps in graph.values() for m in deps if m.startswith("../")]
    edges = {m: sorted(d for d in deps if d in graph) for m, deps in graph.items()}
    assert find_cycle(edges) is None, find_cycle(edges)
