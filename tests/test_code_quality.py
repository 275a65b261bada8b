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


def package_imports() -> dict[str, set[str]]:
    """Per module of ``actorflow`` (a package by its ``__init__``), the modules of the
    package it imports, anywhere in the module: TYPE_CHECKING blocks and function bodies
    included. ``from .x import y`` counts as importing ``x.y`` where that is a module."""
    import ast

    package = ROOT / "actorflow"
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                found.update(
                    f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names
                )
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        found &= modules.keys() - {name}
    return graph


def test_the_package_has_no_import_circle():
    from actorflow.dag import find_cycle

    edges = {m: sorted(deps) for m, deps in package_imports().items()}
    assert find_cycle(edges) is None, find_cycle(edges)


def test_the_runtime_never_imports_the_compiler_or_the_ops():
    runtime = {m: deps for m, deps in package_imports().items() if m.startswith("actorflow.runtime")}
    assert runtime
    assert not [
        d for deps in runtime.values() for d in deps if d.startswith(("actorflow.compiler", "actorflow.ops"))
    ]


def test_every_mutant_still_applies():
    """Each mutant of ``tests/mutants/run.py`` finds the line it changes, once, in its file:
    a change to that line would otherwise leave the mutant runner failing only when run
    (about 32 minutes), not in the suite."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutants_run", ROOT / "tests" / "mutants" / "run.py")
    assert spec is not None and spec.loader is not None
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    missing = [m.name for m in run.MUTANTS if (ROOT / m.path).read_text().count(m.old) != 1]
    assert not missing, f"mutants whose line is not in their file exactly once: {missing}"
