"""Parameter-server training: the parameters sharded over the servers by bytes, sync
training equal to data-parallel training step for step (float64, 1e-9) for 1 and 2
servers and 2 and 3 workers, in one process and over ranks; async training's loss
falling with its staleness within its bound; compile says which rank is what and what
each server holds and moves."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from actorflow.config import load_config, parse_config
from actorflow.errors import ConfigError
from actorflow.training import checkpoint, compile_config, train
from actorflow.training.parameter_server import assign, rank_devices
from test_cli import run_cli

MODEL = """\
model: {kind: mlp, sizes: [6, 16, 8, 3], dtype: float64}
data: {kind: synthetic_classification, samples: 96, seed: 1}
train: {steps: 5, batch_size: 24, optimizer: {kind: sgd, lr: 0.1, momentum: 0.9}}
"""


def _config(workers: int, servers: int | None = None, *more: str):
    devices = ", ".join(f"cpu:{k}" for k in range(workers))
    ps = f", parameter_server: {{servers: {servers}}}" if servers else ""
    text = MODEL + f"parallel: {{stages: [[{devices}]], data_parallel: {workers}, micro_batches: 2{ps}}}\n"
    return parse_config(text, list(more))


def test_parameters_go_to_the_server_holding_the_fewest_bytes_largest_first():
    sizes = {"w0": 400, "b0": 40, "w1": 300, "b1": 30, "w2": 100}
    assert assign(sizes, 2) == {"w0": 0, "w1": 1, "w2": 1, "b0": 0, "b1": 1}
    assert assign(sizes, 1) == dict.fromkeys(sizes, 0)


@pytest.mark.parametrize("workers", [2, 3])
def test_sync_training_equals_data_parallel_training_step_for_step(workers):
    reference = train(_config(workers))
    for servers in (1, 2):
        served = train(_config(workers, servers))
        np.testing.assert_allclose(served.losses, reference.losses, rtol=0, atol=1e-9)
        assert served.parameters.keys() == reference.parameters.keys()
        for name, value in reference.parameters.items():
            np.testing.assert_allclose(served.parameters[name], value, rtol=0, atol=1e-9)


def test_the_servers_hold_every_parameter_and_its_state_and_push_once_a_step():
    plan = compile_config(_config(2, 2), ranks=4)
    servers = {"cpu:2", "cpu:3"}
    assert {plan.registers[p.register].device for p in plan.parameters} == servers
    assert {plan.rank_of(d) for d in servers} == {2, 3}
    updates = [a for a in plan.actors if a.kind == "update"]
    assert updates and {a.device for a in updates} == servers
    pushes = [a for a in plan.actors if a.kind == "send" and a.device in ("cpu:0", "cpu:1")]
    gradients = [p for p in pushes if plan.registers[p.inputs[0].register].name.endswith(".accumulate")]
    assert gradients and all(a.every == plan.micro_batches for a in gradients)


def test_compile_says_which_rank_is_what_and_each_server_s_bytes_and_traffic(capsys, tmp_path):
    path = tmp_path / "ps.yaml"
    path.write_text(
        MODEL + "parallel: {stages: [[cpu:0, cpu:1]], data_parallel: 2, parameter_server: {servers: 2}}\n"
    )
    code, out, err = run_cli(capsys, "compile", str(path), "--ranks", "4")
    assert code == 0, err
    lines = out.splitlines()
    start = lines.index("parameter servers (sync): 2 servers, 2 workers (the data-parallel replicas)")
    roles = lines[start + 1 :]
    assert roles[:2] == ["  rank 0: worker on cpu:0", "  rank 1: worker on cpu:1"]
    assert roles[2].startswith("  rank 2: server 0 on cpu:2: ") and roles[3].startswith(
        "  rank 3: server 1 on cpu:3: "
    )
    assert all("MiB of parameters and optimizer state; a step, " in r and "pushed" in r for r in roles[2:])


@pytest.mark.parametrize("staleness", [0, 2])
def test_async_training_s_loss_falls_on_the_default_task_and_its_staleness_stays_within_k(staleness):
    config = load_config(
        "configs/parameter_server.yaml",
        [
            "train.steps=24",
            "parallel.parameter_server.mode=async",
            f"parallel.parameter_server.staleness={staleness}",
        ],
    )
    result = train(config)
    assert np.mean(result.losses[-4:]) < 0.95 * np.mean(result.losses[:4])
    assert result.staleness is not None
    mean, most = result.staleness
    assert 0 <= mean <= most <= staleness
    if staleness == 0:  # every worker's update of step j is in before any pull of step j + 1
        assert most == 0


def test_an_async_run_resumes_from_its_checkpoint_with_its_staleness_counts(tmp_path):
    """Not bit for bit (the order gradients arrive in varies), but from the checkpoint's
    step, with the servers' parameters, optimizer state and update clocks."""
    steps = ["parallel.parameter_server.mode=async", "parallel.parameter_server.staleness=1"]
    keep = f"output.checkpoint={{path: {tmp_path / 'ck'}, every: 8}}"
    first = train(load_config("configs/parameter_server.yaml", [*steps, "train.steps=8", keep]))
    (saved,) = (tmp_path / "ck").iterdir()
    with np.load(next(saved.glob("*.npz"))) as shard:
        assert any(name.endswith(".clock") for name in shard.files)
    rest = train(
        load_config("configs/parameter_server.yaml", [*steps, "train.steps=16"]), resume=str(tmp_path / "ck")
    )
    assert (rest.first_step, rest.steps) == (8, 8)
    assert np.mean(rest.losses) < np.mean(first.losses)
    assert rest.staleness is not None and 0 <= rest.staleness[0] <= rest.staleness[1] <= 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.parameter_server.servers=0"], "parallel.parameter_server.servers: must be >= 1"),
        (["parallel.parameter_server.staleness=2"], "parallel.parameter_server.staleness: only async"),
        (["train.optimizer.shard=true"], "train.optimizer.shard: the parameter servers hold"),
        (["parallel.parameter_server.servers=7"], "parallel.parameter_server.servers: 7 servers but"),
    ],
)
def test_bad_parameter_server_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        _config(2, 1, *overrides)


def test_too_few_ranks_for_the_servers_and_a_worker_is_one_line():
    with pytest.raises(
        ConfigError, match="^parallel.parameter_server.servers: 2 server ranks and 2 worker devices"
    ):
        rank_devices(_config(2, 2), 2)


def _metrics_over_4_ranks(tmp_path: Path, text: str) -> dict:
    """The --metrics of ``actorflow run`` of the config ``text`` on 4 ranks."""
    from ranks import launch

    path, metrics = tmp_path / "ps.yaml", tmp_path / "m.json"
    path.write_text(text)
    run = ["-m", "actorflow.cli", "run", str(path), "--quiet", "--metrics", str(metrics)]
    code, out = launch(4, sys.executable, *run, timeout=90)
    assert code == 0, out
    return json.loads(metrics.read_text())


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(120)
def test_sync_training_over_ranks_equals_data_parallel_training(tmp_path):
    metrics = _metrics_over_4_ranks(
        tmp_path,
        MODEL
        + "parallel: {stages: [[cpu:0, cpu:1]], data_parallel: 2, micro_batches: 2, parameter_server: {servers: 2}}\n",
    )
    reference = train(_config(2))
    np.testing.assert_allclose(metrics["losses"], reference.losses, rtol=0, atol=1e-9)


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(120)
def test_async_training_over_ranks_counts_staleness_within_k(tmp_path):
    metrics = _metrics_over_4_ranks(
        tmp_path,
        MODEL.replace("steps: 5", "steps: 20")
        + "parallel: {stages: [[cpu:0, cpu:1]], data_parallel: 2, micro_batches: 2, "
        "parameter_server: {servers: 2, mode: async, staleness: 1}}\n",
    )
    assert 0 <= metrics["staleness"]["mean"] <= metrics["staleness"]["max"] <= 1


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(150)
def test_a_server_killed_stops_every_rank_within_10_s_naming_it_and_resume_finishes(tmp_path):
    import ranks

    path = tmp_path / "ps.yaml"
    path.write_text(
        MODEL + "parallel: {stages: [[cpu:0, cpu:1]], data_parallel: 2, parameter_server: {servers: 1}}\n"
    )
    ck = tmp_path / "ck"
    run = [sys.executable, "-m", "actorflow.cli", "run", str(path), "--quiet"]
    keep = ["--set", f"output.checkpoint={{path: {ck}, every: 5}}"]
    proc = ranks.start(3, *run, "--steps", "1000000", *keep)
    try:
        pids = ranks.wait_for_checkpoint(proc, ck, 3)
        killed = time.monotonic()
        os.kill(pids[2], signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        ended = time.monotonic()
    finally:
        ranks.kill(proc)
    assert proc.returncode != 0
    assert ended - killed < 10, out
    assert "rank 2 was lost" in out or "rank 2 was killed by SIGKILL" in out, out
    assert ranks.wait_gone(pids, within=2) == []
    step = json.loads((Path(checkpoint.latest(str(ck))) / "manifest.json").read_text())["step"]
    code, out = ranks.launch(
        3,
        *run,
        "--steps",
        str(step + 3),
        "--resume",
        str(ck),
        "--metrics",
        str(tmp_path / "m.json"),
        timeout=60,
    )
    assert code == 0, out
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (metrics["first_step"], metrics["steps_run"]) == (step, 3)
