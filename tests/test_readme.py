"""The README's examples run as written: each Python block as a script of its own, the
YAML block as a config (the default one), and its `actorflow` command lines in order, in
a scratch directory with the repository's configs: each through the command's own entry
(``actorflow.cli.main``, what ``python -m actorflow`` and the ``actorflow`` script call),
one after another in one fresh interpreter (a process each took 30 s for the 17 lines,
most of it starting Python and importing; one process, 12 s)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from actorflow.config import load_config

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)
(YAML_BLOCK,) = re.findall(r"```yaml\n(.*?)```", README, re.S)

# Lines of indented blocks that run one `actorflow` command. Left out: those that need
# several ranks (`launch`, and `trace merge` of the traces such a run writes), which
# test_launch, test_ranks and test_trace_merge run, and the quick start's install lines,
# which CI runs.
COMMANDS = [
    line.split("  #")[0].strip()
    for line in re.findall(r"^    (actorflow .*)$", README, re.M)
    if not line.startswith(("actorflow launch", "actorflow trace merge"))
]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[f"python-{i}" for i in range(len(PYTHON_BLOCKS))])
def test_python_block_runs_as_a_script(tmp_path, block):
    script = tmp_path / "example.py"
    script.write_text(block)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_yaml_block_is_the_default_config(tmp_path):
    shown = tmp_path / "shown.yaml"
    shown.write_text(YAML_BLOCK)
    assert load_config(shown) == load_config(ROOT / "configs" / "default.yaml")


# Runs each command line given as JSON, in order, through the command's entry; stops at
# the first that fails, naming it.
COMMAND_RUNNER = """
import json, sys
from actorflow.cli import main
for argv in json.loads(sys.argv[1]):
    print('$ actorflow', *argv, file=sys.stderr, flush=True)
    if (code := main(argv)) != 0:
        sys.exit(f'exit status {code}')
"""


@pytest.mark.long
def test_command_lines_run_in_order(tmp_path):
    assert any(c.startswith("actorflow run") for c in COMMANDS)
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    argvs = [shlex.split(command)[1:] for command in COMMANDS]
    done = subprocess.run(
        [sys.executable, "-c", COMMAND_RUNNER, json.dumps(argvs)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("$ actorflow") == len(COMMANDS)
