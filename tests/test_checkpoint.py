"""Checkpoints: a run of 2N steps and a run of N steps resumed for N more give the same
losses and parameters bit for bit (one process, pipelines, the sharded optimizer, ranks);
a kill while a checkpoint is written leaves the previous one loadable; a checkpoint that
is corrupt, partial or of another model, layout or data is one line and exit 2."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from actorflow.config import parse_config
from actorflow.training import checkpoint, compile_config, train
from test_cli import run_cli
from test_cli_run import TINY_YAML

REPO = Path(__file__).parent.parent
ONE_PROCESS = {
    "pipeline, sgd with momentum": ["train.optimizer.momentum=0.9"],
    "sharded adam over 2 replicas": [
        "parallel.stages=[[cpu:0,cpu:1]]",
        "parallel.data_parallel=2",
        "train.optimizer={kind: adam, lr: 0.01, shard: true, shard_threshold_kb: 0}",
    ],
    "2 parameter servers of 2 workers": [
        "parallel.stages=[[cpu:0,cpu:1]]",
        "parallel.data_parallel=2",
        "parallel.parameter_server={servers: 2}",
        "train.optimizer.momentum=0.9",
    ],
}


def _config(tmp_path, overrides=(), every=None):
    keep = [f"output.checkpoint={{path: {tmp_path / 'ck'}, every: {every}}}"] if every else []
    return parse_config(TINY_YAML, [*overrides, *keep])


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("overrides", ONE_PROCESS.values(), ids=ONE_PROCESS.keys())
def test_a_resumed_run_repeats_the_uninterrupted_one_bit_for_bit(tmp_path, overrides):
    whole = train(_config(tmp_path, [*overrides, "train.steps=8"]))
    first = train(_config(tmp_path, [*overrides, "train.steps=4"], every=3))
    assert first.losses == whole.losses[:4]
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000004"]  # at its end, alone
    rest = train(_config(tmp_path, [*overrides, "train.steps=8"]), resume=str(tmp_path / "ck"))
    assert rest.first_step == 4 and rest.steps == 4
    assert rest.losses == whole.losses[4:]
    assert _same(rest.parameters, whole.parameters)


def test_the_manifest_holds_each_shard_s_checksum_arrays_step_and_data(tmp_path):
    config = _config(tmp_path, ["train.steps=2", "train.optimizer.momentum=0.5"], every=2)
    train(config)
    folder = tmp_path / "ck" / "step-00000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["step"], manifest["world"], manifest["data_position"]) == (2, 1, 16)
    assert manifest["data"] == config.to_dict()["data"]
    shard = manifest["shards"]["rank0.npz"]
    names = {p.name for p in compile_config(config).parameters}
    assert set(shard["arrays"]) == names and any(n.endswith(".momentum") for n in names)
    with np.load(folder / "rank0.npz") as npz:
        assert set(npz.files) == names


def test_metrics_of_a_resumed_run_give_its_first_step_and_its_own_losses(capsys, tmp_path, tiny_file):
    keep = ["--set", f"output.checkpoint={{path: {tmp_path / 'ck'}, every: 2}}"]
    assert run_cli(capsys, "run", str(tiny_file), "--steps", "2", "--quiet", *keep)[0] == 0
    code, out, err = run_cli(
        capsys,
        "run",
        str(tiny_file),
        "--steps",
        "5",
        "--quiet",
        "--resume",
        str(tmp_path / "ck"),
        "--metrics",
        str(tmp_path / "m.json"),
    )
    assert code == 0, err
    assert out.startswith("3 steps (3-5 of 5) of 8 samples")
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (metrics["first_step"], metrics["steps_run"], len(metrics["losses"])) == (2, 3, 3)


@pytest.fixture
def tiny_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_YAML)
    return path


def _corrupt(folder: Path) -> None:
    data = bytearray((folder / "rank0.npz").read_bytes())
    data[len(data) // 2] ^= 1
    (folder / "rank0.npz").write_bytes(bytes(data))


BAD = {
    "corrupt shard": (_corrupt, [], "rank0.npz is corrupt"),
    "partial": (lambda f: (f / "rank0.npz").unlink(), [], "cannot read rank0.npz"),
    "corrupt manifest": (lambda f: (f / "manifest.json").write_text("{"), [], "is not JSON"),
    "another model": (None, ["--set", "model.sizes=[6,5,3]"], "another model or layout"),
    "another layout": (None, ["--set", "parallel.stages=[cpu:0]"], "another model or layout"),
    "another dtype": (None, ["--set", "model.dtype=float32"], "another model or layout"),
    "other data": (None, ["--set", "data.seed=7"], "other data"),
    "another batch size": (None, ["--set", "train.batch_size=4"], "reads from sample 16"),
    "nothing left": (None, ["--steps", "2"], "nothing left to run"),
}


@pytest.mark.parametrize(("damage", "argv", "message"), BAD.values(), ids=BAD.keys())
def test_a_bad_checkpoint_is_one_line_and_exit_2(capsys, tmp_path, tiny_file, damage, argv, message):
    keep = ["--set", f"output.checkpoint={{path: {tmp_path / 'ck'}, every: 2}}"]
    assert run_cli(capsys, "run", str(tiny_file), "--steps", "2", "--quiet", *keep)[0] == 0
    if damage is not None:
        damage(tmp_path / "ck" / "step-00000002")
    code, out, err = run_cli(
        capsys, "run", str(tiny_file), "--steps", "4", "--resume", str(tmp_path / "ck"), *argv
    )
    assert code == 2 and out == ""
    assert err.startswith(f"actorflow run: error: checkpoint {tmp_path / 'ck' / 'step-00000002'}: ")
    assert message in err and err.count("\n") == 1


def test_a_checkpoint_path_that_is_a_file_is_refused_before_the_first_step(capsys, tmp_path, tiny_file):
    (tmp_path / "ck").write_text("")
    keep = f"output.checkpoint={{path: {tmp_path / 'ck'}, every: 2}}"
    code, _, err = run_cli(capsys, "run", str(tiny_file), "--set", keep)
    assert (code, err) == (
        2,
        f"actorflow run: error: output.checkpoint.path: {tmp_path / 'ck'} is a file; give a folder's path\n",
    )


WRITER = """
import os, sys, time
import numpy as np
from actorflow.config import parse_config
from actorflow.training import checkpoint
from test_cli_run import TINY_YAML
path, stage = sys.argv[1], sys.argv[2]
config = parse_config(TINY_YAML)
checkpoint.save(path, 1, {"w": np.zeros(1 << 20)}, {}, config, 0, 0, None)

class Stuck:
    def __init__(self, f): self.f = f
    def write(self, data):
        self.f.write(data[: len(data) // 2]); self.f.flush()
        print("stuck", flush=True); time.sleep(600)

real = checkpoint.replaced
def replaced(path, mode="w"):
    manager = real(path, mode)
    f = manager.__enter__()
    return Hold(manager, Stuck(f) if stage == "shard" and path.endswith(".npz") else f)

class Hold:
    def __init__(self, m, f): self.m, self.f = m, f
    def __enter__(self): return self.f
    def __exit__(self, *exc): return self.m.__exit__(*exc)

def rename(a, b):
    print("stuck", flush=True); time.sleep(600)

checkpoint.replaced = replaced
if stage == "rename":
    checkpoint.os.rename = rename
checkpoint.save(path, 2, {"w": np.ones(1 << 20)}, {}, config, 0, 0, None)
"""


@pytest.mark.parametrize("stage", ["shard", "rename"])
def test_a_kill_while_a_checkpoint_is_written_leaves_the_previous_one_loadable(tmp_path, stage):
    from ranks import environment

    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "ck"), stage],
        cwd=REPO,
        env=environment(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline() == "stuck\n"
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=30)
    assert checkpoint.latest(str(tmp_path / "ck")).endswith("step-00000001")
    folder = Path(checkpoint.latest(str(tmp_path / "ck")))
    with np.load(folder / "rank0.npz") as npz:
        assert np.array_equal(npz["w"], np.zeros(1 << 20))
    assert (tmp_path / "ck" / ".step-00000002.partial").is_dir()
    checkpoint.save(str(tmp_path / "ck"), 3, {"w": np.ones(1)}, {}, parse_config(TINY_YAML), 0, 0, None)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000003"]


RANKS = {
    "2 pipeline stages on 2 ranks": [],
    "sharded optimizer over 2 ranks": [
        "parallel.stages=[[cpu:0,cpu:1]]",
        "parallel.data_parallel=2",
        "train.optimizer={kind: sgd, lr: 0.1, momentum: 0.9, shard: true, shard_threshold_kb: 0}",
    ],
}


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(150)
@pytest.mark.parametrize("overrides", RANKS.values(), ids=RANKS.keys())
def test_a_resumed_run_over_ranks_repeats_the_uninterrupted_one_bit_for_bit(tmp_path, tiny_file, overrides):
    from ranks import launch

    sets = [a for o in overrides for a in ("--set", o)]

    def run(steps: int, name: str, *more: str) -> tuple[list[float], dict]:
        code, out = launch(
            2,
            sys.executable,
            "-m",
            "actorflow.cli",
            "run",
            str(tiny_file),
            "--quiet",
            "--steps",
            str(steps),
            "--metrics",
            str(tmp_path / f"{name}.json"),
            "--parameters",
            str(tmp_path / f"{name}.npz"),
            *sets,
            *more,
            timeout=60,
        )
        assert code == 0, out
        with np.load(tmp_path / f"{name}.npz") as npz:
            return json.loads((tmp_path / f"{name}.json").read_text())["losses"], dict(npz)

    keep = ("--set", f"output.checkpoint={{path: {tmp_path / 'ck'}, every: 3}}")
    whole, whole_parameters = run(6, "whole")
    first, _ = run(3, "first", *keep)
    assert {p.name for p in (tmp_path / "ck" / "step-00000003").iterdir()} == {
        "manifest.json",
        "rank0.npz",
        "rank1.npz",
    }
    rest, parameters = run(6, "rest", "--resume", str(tmp_path / "ck"))
    assert first + rest == whole
    assert _same(parameters, whole_parameters)
