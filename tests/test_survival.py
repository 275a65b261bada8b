"""Parameter-server training going on without a lost worker (``training.survival``):
which ranks may be lost, the config without them, and workers SIGKILLed mid-run over
ranks, one after another: the run finishes, names each worker and the step, and its
losses equal one process training the workers there were between the losses (float64,
1e-9); async loses the lead and goes on; a Ctrl-C through the guards; how a process
that survived a loss exits."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from actorflow.config import parse_config
from actorflow.errors import CheckpointError
from actorflow.runtime import Session
from actorflow.training import checkpoint, compile_config, train
from actorflow.training.data import dataset, position, step_feeds
from actorflow.training.parameter_server import replicas_on, without
from actorflow.training.runner import local_feeds
from actorflow.training.survival import losable

MODEL = """\
model: {kind: mlp, sizes: [6, 16, 8, 3], dtype: float64}
data: {kind: synthetic_classification, samples: 1000, seed: 1}
train: {steps: 5, batch_size: 24, optimizer: {kind: sgd, lr: 0.1, momentum: 0.9}}
"""


def _config(workers: int, servers: int, *more: str, stages: int = 1):
    devices = iter(f"cpu:{k}" for k in range(workers * stages))
    listed = ", ".join("[" + ", ".join(next(devices) for _ in range(workers)) + "]" for _ in range(stages))
    text = MODEL + (
        f"parallel: {{stages: [{listed}], data_parallel: {workers}, micro_batches: 2, "
        f"parameter_server: {{servers: {servers}}}}}\n"
    )
    return parse_config(text, list(more))


def test_without_a_worker_each_left_keeps_its_devices_and_its_share_of_a_batch():
    config = _config(3, 1, stages=2)
    assert replicas_on(config, ["cpu:4"]) == [1]
    left = without(config, [1])
    assert left.parallel.stages == (("cpu:0", "cpu:2"), ("cpu:3", "cpu:5"))
    assert left.parallel.data_parallel == 2
    assert left.train.batch_size == 16
    assert left.replica_batch_size == config.replica_batch_size


def test_the_ranks_holding_workers_only_may_be_lost_while_a_worker_is_left():
    assert losable(_config(2, 2), compile_config(_config(2, 2), ranks=4)) == {0, 1}
    assert losable(_config(4, 1), compile_config(_config(4, 1), ranks=3)) == {0, 1}
    assert losable(_config(2, 1), compile_config(_config(2, 1), ranks=2)) == set()  # one worker rank
    assert losable(_config(2, 1), compile_config(_config(2, 1), ranks=1)) == set()  # one process


def test_a_rank_whose_workers_leave_another_rank_without_a_device_is_not_losable():
    config = _config(2, 1, stages=2)  # rank 0 holds replica 0's first stage, rank 2 its second
    assert losable(config, compile_config(config, ranks=5)) == set()


def _steps(config, values, first: int, last: int, origin=(0, 0)) -> tuple[list[float], dict]:
    """Steps first..last of ``config`` in one process from ``values`` (the data from
    ``origin``, as ``data.position`` takes it): losses, values."""
    plan = compile_config(config, ranks=1)
    data, parts = dataset(config), local_feeds(plan, 0)
    with Session(plan) as session:
        if values is not None:
            session.load(values)
        losses = [
            float(np.mean([o["loss"] for o in session.run(step_feeds(config, data, s, parts, origin))]))
            for s in range(first, last)
        ]
        return losses, session.values()


@pytest.mark.parametrize(
    ("ending", "status"),
    [("sys.exit(3)", 0), ("raise ValueError('no')", 1), ("leave(3)", 3)],
)
def test_a_process_that_survived_a_lost_rank_ends_unfinalized_with_its_status(ending, status):
    """0 at exit (or 1 after an uncaught exception) unless it ``leave``s with its own, as
    ``actorflow``'s commands do; never through ``MPI_Finalize``, which would wait for the lost rank."""
    code = f"import sys\nfrom actorflow.runtime.mpi_world import exit_unfinalized, leave\nexit_unfinalized(0)\n{ending}\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr


def _killed_mid_run(tmp_path, parallel: str, kills: list[int], steps: int, n: int = 3) -> tuple[str, dict]:
    """Run MODEL with ``parallel`` on ``n`` ranks and SIGKILL the ranks ``kills`` one
    after another: the first once a checkpoint was written, each next once one was
    written by the ranks left. Their output and --metrics; no process is left."""
    import ranks

    path, metrics, ck = tmp_path / "ps.yaml", tmp_path / "m.json", tmp_path / "ck"
    path.write_text(MODEL + f"parallel: {parallel}\nruntime: {{lost_after: 1.5}}\n")
    run = [
        sys.executable,
        "-m",
        "actorflow.cli",
        "run",
        str(path),
        "--steps",
        str(steps),
        "--metrics",
        str(metrics),
    ]
    proc = ranks.start(n, *run, "--set", f"output.checkpoint={{path: {ck}, every: 16}}")
    try:
        pids = ranks.wait_for_checkpoint(proc, ck, n)
        for k, rank in enumerate(kills):
            deadline = time.monotonic() + 60
            while k and _world_of_latest(ck) != n - k:
                assert proc.poll() is None and time.monotonic() < deadline, f"no checkpoint of {n - k} ranks"
                time.sleep(0.02)
            os.kill(pids[rank], signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        ranks.kill(proc)
    for r in range(n):
        assert (f"rank {r} exited with status 137" in out) == (r in kills), out
        assert (f"[{r}] actorflow: rank {r} was killed by SIGKILL" in out) == (r in kills), out  # its guard
    assert not any(f"rank {r} exited" in out for r in range(n) if r not in kills), out
    assert ranks.wait_gone(pids, within=5) == []
    return out, json.loads(metrics.read_text())


def _world_of_latest(folder) -> int | None:
    """The ranks that wrote the newest checkpoint in ``folder``, if one is there."""
    try:
        return json.loads((Path(checkpoint.latest(str(folder))) / "manifest.json").read_text())["world"]
    except (CheckpointError, OSError, ValueError):
        return None


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(120)
def test_two_workers_killed_one_after_another_the_others_finish_from_the_step_every_rank_holds(tmp_path):
    """Sync, 3 workers and a server; rank 0 (the lead) killed, then rank 1: each time the
    next rank reports, and the losses equal one process training the workers there were
    between the losses, each time from the step the ranks went on from."""
    steps = 400
    parallel = "{stages: [[cpu:0, cpu:1, cpu:2]], data_parallel: 3, micro_batches: 2, parameter_server: {servers: 1}}"
    out, result = _killed_mid_run(tmp_path, parallel, [0, 1], steps, n=4)
    told = [
        re.search(
            rf"\[{lead}\] actorflow run: (lost the worker on cpu:{lost} \(rank {lost}\): going on from "
            rf"step (\d+) with {left} on {ranks} ranks)",
            out,
        )
        for lead, lost, left, ranks in [(1, 0, "2 workers", 3), (2, 1, "1 worker", 2)]
    ]
    assert all(told), out
    assert result["steps_run"] == steps and result["lost_workers"] == [t.group(1) for t in told]
    first, second = (int(t.group(2)) for t in told)
    # each loss drops the replica 0 of its config; the data goes on from where it was
    # (1000 samples: the origin changes which samples a step reads at all but a few steps)
    configs = [_config(3, 1)]
    configs += [without(configs[0], [0]), without(without(configs[0], [0]), [0])]
    data = dataset(configs[0])
    origins = [(0, 0), (first, position(configs[0], data, first))]
    origins.append((second, position(configs[1], data, second, origins[1])))
    losses, values = [], None
    for config, origin, (a, b) in zip(configs, origins, [(0, first), (first, second), (second, steps)]):
        ran, values = _steps(config, values, a, b, origin)
        losses += ran
    np.testing.assert_allclose(result["losses"], losses, rtol=0, atol=1e-9)
    _resumes_without_the_lost_workers(
        tmp_path, 2, steps, _steps(configs[2], values, steps, steps + 8, origins[2])[0]
    )


def _resumes_without_the_lost_workers(tmp_path, ranks_left: int, step: int, expected: list[float]) -> None:
    """``_killed_mid_run``'s checkpoint at ``step`` resumes on the ranks left for 8 more
    steps, equal to ``expected`` (1e-9); on other ranks, it is a one-line error."""
    import ranks

    run = [
        sys.executable,
        "-m",
        "actorflow.cli",
        "run",
        str(tmp_path / "ps.yaml"),
        "--resume",
        str(tmp_path / "ck"),
    ]
    metrics = tmp_path / "resumed.json"
    code, out = ranks.launch(
        ranks_left, *run, "--steps", str(step + 8), "--metrics", str(metrics), timeout=60
    )
    assert code == 0, out
    resumed = json.loads(metrics.read_text())
    assert (resumed["first_step"], resumed["steps_run"]) == (step, 8)
    assert resumed["config"]["parallel"]["data_parallel"] == ranks_left - 1  # reported as it ran
    np.testing.assert_allclose(resumed["losses"], expected, rtol=0, atol=1e-9)
    code, out = ranks.launch(ranks_left + 1, *run, "--steps", str(step + 8), timeout=60)
    refused = [line for line in out.splitlines() if "actorflow run: error: checkpoint" in line]
    assert code == 2 and refused and "Traceback" not in out, out
    assert all(line.endswith(f"resume it on {ranks_left} ranks, not {ranks_left + 1}") for line in refused), (
        out
    )


def test_a_checkpoint_says_which_workers_its_run_lost_and_a_bad_word_of_it_is_one_line(tmp_path):
    ck = tmp_path / "ck"
    config = _config(2, 1, "train.steps=2", f"output.checkpoint={{path: {ck}, every: 2}}")
    train(config)
    manifest = next(ck.glob("step-*")) / "manifest.json"
    written = json.loads(manifest.read_text())
    assert "lost_workers" not in written

    def said(**changed) -> checkpoint.LostWorkers:
        manifest.write_text(json.dumps(written | changed))
        return checkpoint.lost_workers(str(ck), config, 1)

    assert said(data_origin=[2, 48]) == checkpoint.LostWorkers()  # no loss: as before
    lost = said(lost_workers=[[1]], data_origin=[2, 48])
    assert lost == checkpoint.LostWorkers(((1,),), (2, 48))
    assert lost.applied(config).parallel.stages == (("cpu:0",),)
    for changed, problem in [
        ({"lost_workers": [[True]], "data_origin": [2, 48]}, "is malformed"),
        ({"lost_workers": [[1]]}, "is malformed"),
        ({"lost_workers": [[5]], "data_origin": [2, 48]}, "are not workers of this config"),
        ({"lost_workers": [[1], [0]], "data_origin": [2, 48]}, "are not workers of this config"),
        ({"lost_workers": [[1]], "data_origin": [2, 48], "world": 2}, "resume it on 2 ranks, not 1"),
    ]:
        with pytest.raises(CheckpointError, match=f"^checkpoint .*{problem}$"):
            said(**changed)


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(120)
def test_async_training_loses_rank_0_and_the_next_rank_reports_with_staleness_within_k(tmp_path):
    parallel = (
        "{stages: [[cpu:0, cpu:1]], data_parallel: 2, micro_batches: 2, "
        "parameter_server: {servers: 1, mode: async, staleness: 1}}"
    )
    out, result = _killed_mid_run(tmp_path, parallel, [0], 480)
    told = re.search(
        r"\[1\] actorflow run: (lost the worker on cpu:0 \(rank 0\): going on from step \d+)", out
    )
    assert told, out
    assert result["lost_workers"][0].startswith(told.group(1))
    assert result["steps_run"] == 480 and len(result["losses"]) == 480
    assert 0 <= result["staleness"]["mean"] <= result["staleness"]["max"] <= 1
    assert np.median(result["losses"][-160:]) < 0.9 * np.median(result["losses"][:16])


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(60)
def test_ctrl_c_reaches_each_guarded_rank_once_the_run_stops_after_its_step(tmp_path):
    """Through the guard, which passes the signal on to its child (in a process group of
    its own, so that it does not hear it twice: the second raises KeyboardInterrupt)."""
    import ranks

    path = tmp_path / "ps.yaml"
    path.write_text(
        MODEL + "parallel: {stages: [[cpu:0, cpu:1]], data_parallel: 2, parameter_server: {servers: 1}}\n"
    )
    ck = tmp_path / "ck"
    keep = ["--set", f"output.checkpoint={{path: {ck}, every: 5}}"]
    proc = ranks.start(
        3, sys.executable, "-m", "actorflow.cli", "run", str(path), "--steps", "1000000", *keep
    )
    try:
        pids = ranks.wait_for_checkpoint(proc, ck, 3)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        ranks.kill(proc)
    assert proc.returncode == 130, out
    assert re.search(r"\[0\] actorflow run: interrupted at step \d+ of 1000000", out), out
    assert "KeyboardInterrupt" not in out and "Traceback" not in out, out
    assert ranks.wait_gone(pids, within=5) == []
