"""Checkpoints: what a run needs to go on bit for bit where it stopped.

A checkpoint is a folder ``PATH/step-NNNNNNNN`` holding one shard per rank
(``rankR.npz``: that rank's parameters and optimizer state, by their plan names, one per
device, as ``Runtime.values`` gives them) and ``manifest.json``: the step, the number of
ranks, each shard's SHA-256, size and arrays (name, device, dtype, shape), the data
position (the sample the next step's batch starts at, ``data.position``) and the
config's data section, which holds every random state a run draws from: the dataset's
generator and the initial values' are seeded by ``data.seed``, and the initial values
are replaced by the checkpoint's. A resumed run must read the same data from the same
position (the same batch size), or its steps would not be the ones it skipped. A
parameter-server run that went on without lost workers (``survival``) also writes which
(``lost_workers``, per loss the replicas lost) and where its data went on from
(``data_origin``): a run resuming it goes on without them too (``lost_workers``), on the
ranks that wrote it.

Written so that a kill at any moment leaves the previous checkpoint whole: every rank
writes its shard into ``PATH/.step-NNNNNNNN.partial``, rank 0 gathers the checksums,
writes the manifest there and renames the folder into place (a rename is atomic), and
only then removes the older checkpoints. A folder named ``step-*`` is whole, or was
damaged after the fact, which the checksums tell.

Loading refuses, with one line, a checkpoint that is missing, partial or corrupt, or
that another model, layout (the plan's parameters on each rank) or data wrote. Every
rank checks the whole checkpoint against the whole plan before the run opens, so the
ranks agree on the verdict and none is left waiting for another that gave up; then each
reads its own shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ..config import Config
from ..errors import CheckpointError
from ..files import replaced, write_json
from ..plan import Plan
from . import parameter_server

FORMAT = "actorflow checkpoint 1"
MANIFEST = "manifest.json"
_STEP = re.compile(r"step-(\d{8,})")
_PARTIAL = re.compile(r"\.step-(\d{8,})\.partial")

Meet = Callable[[Any], list | None]
"""Every rank's object on rank 0, None on the others (``mpi_world.gather``)."""


@attrs.frozen
class Checkpoint:
    """What a rank resumes from: the step the run goes on from and its own shard."""

    step: int
    values: dict[str, np.ndarray]


def shard_name(rank: int) -> str:
    return f"rank{rank}.npz"


def step_folder(path: str, step: int) -> str:
    return os.path.join(path, f"step-{step:08d}")


@attrs.frozen
class LostWorkers:
    """The workers a parameter-server run went on without (``survival``), so that its
    checkpoints resume as the run went on: per loss, the replica numbers lost (in the
    config before it); and the data's ``origin`` (``data.position``)."""

    lost: tuple[tuple[int, ...], ...] = ()
    origin: tuple[int, int] = (0, 0)

    def applied(self, config: Config) -> Config:
        """``config`` without the workers lost."""
        for workers in self.lost:
            config = parameter_server.without(config, workers)
        return config


def save(
    path: str,
    step: int,
    values: dict[str, np.ndarray],
    arrays: dict[str, list],
    config: Config,
    position: int,
    rank: int,
    meet: Meet | None,
    lost: LostWorkers = LostWorkers(),
) -> str | None:
    """Write this rank's ``values`` after ``step`` steps as its shard of the checkpoint in
    ``path``, described by ``arrays`` (``arrays(plan, rank)``), with the data
    ``position`` the next step reads from and the workers the run ``lost``; ``meet``:
    over ranks, how the shards' descriptions reach rank 0. Returns the checkpoint's folder
    on rank 0, once it is in place; None on the others."""
    partial = os.path.join(path, f".step-{step:08d}.partial")
    os.makedirs(partial, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **values)
    data = buffer.getvalue()
    with replaced(os.path.join(partial, shard_name(rank)), "wb") as f:
        f.write(data)
    shard = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "arrays": arrays}
    shards = [shard] if meet is None else meet(shard)
    if shards is None:
        return None
    manifest = {
        "format": FORMAT,
        "step": step,
        "world": len(shards),
        "data_position": position,
        "data": config.to_dict()["data"],
        "shards": {shard_name(r): s for r, s in enumerate(shards)},
    }
    if lost.lost:
        manifest |= {"lost_workers": [list(w) for w in lost.lost], "data_origin": list(lost.origin)}
    write_json(manifest, os.path.join(partial, MANIFEST), indent=1)
    final = step_folder(path, step)
    if os.path.isdir(final):  # a checkpoint of this step from an earlier run: replaced
        shutil.rmtree(final)
    os.rename(partial, final)
    _sync_folder(path)
    for name in os.listdir(path):
        if _stale(name, step):
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    return final


def _stale(name: str, step: int) -> bool:
    """Whether a folder in a checkpoint's path goes once the checkpoint of ``step`` is in
    place: every other checkpoint, and what writers killed at ``step`` or before left."""
    if (folder := _STEP.fullmatch(name)) is not None:
        return int(folder[1]) != step
    partial = _PARTIAL.fullmatch(name)
    return partial is not None and int(partial[1]) <= step


def _sync_folder(path: str) -> None:
    """Make a rename in ``path`` durable (where the OS lets a folder be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def latest(path: str) -> str:
    """The newest checkpoint folder in ``path``."""
    try:
        steps = [int(m.group(1)) for name in os.listdir(path) if (m := _STEP.fullmatch(name))]
    except OSError as err:
        raise CheckpointError(f"checkpoint {path}: cannot read: {err.strerror or err}") from None
    if not steps:
        raise CheckpointError(f"checkpoint {path}: no checkpoint there (no step-* folder)")
    return step_folder(path, max(steps))


def lost_workers(path: str, config: Config, world: int) -> LostWorkers:
    """The workers that the run which wrote the newest checkpoint in ``path`` had lost
    (none for most), which the run resuming it goes on without too: checked against
    ``config`` and the ``world`` of ranks it runs on. CheckpointError, one line, where
    they don't fit."""
    folder = latest(path)
    manifest = _manifest(folder)
    lost = manifest.get("lost_workers", [])
    if not lost:
        return LostWorkers()
    origin: Any = manifest.get("data_origin")
    wrote = manifest.get("world")
    shaped = (
        isinstance(lost, list)
        and all(isinstance(w, list) and all(type(k) is int for k in w) for w in lost)
        and isinstance(origin, list)
        and len(origin) == 2
        and all(type(k) is int for k in origin)
        and type(wrote) is int
    )
    if not shaped:
        raise CheckpointError(
            f"checkpoint {folder}: its manifest's lost_workers, data_origin or world is malformed"
        )
    found = LostWorkers(tuple(tuple(w) for w in lost), (origin[0], origin[1]))
    if config.parallel.parameter_server is None:
        raise CheckpointError(f"checkpoint {folder}: written by a parameter-server run that lost workers")
    try:
        left = found.applied(config)
    except ValueError:
        raise CheckpointError(
            f"checkpoint {folder}: its lost workers {lost} are not workers of this config"
        ) from None
    if wrote != world:
        raise CheckpointError(
            f"checkpoint {folder}: written after the run lost workers {lost}, by {wrote} ranks "
            f"({left.parallel.data_parallel} workers left): resume it on {wrote} ranks, not {world}"
        )
    return found


def load(path: str, config: Config, plan: Plan, position: Callable[[int], int], rank: int) -> Checkpoint:
    """The newest checkpoint in ``path``, checked whole against ``config``, ``plan`` and
    this run's data ``position`` at a step, with ``rank``'s shard. Raises
    CheckpointError, one line, for anything amiss."""
    folder = latest(path)
    manifest = _manifest(folder)

    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {folder}: {problem}")

    if manifest.get("world") != plan.world:
        raise refuse(f"written by {manifest.get('world')} ranks, this run has {plan.world}")
    if manifest.get("data") != config.to_dict()["data"]:
        raise refuse("written by a run of other data (its data section differs from this config's)")
    shards = manifest.get("shards")
    if not isinstance(shards, dict) or set(shards) != {shard_name(r) for r in range(plan.world)}:
        raise refuse("its manifest does not list one shard per rank")
    for r in range(plan.world):
        _check_layout(shards[shard_name(r)].get("arrays"), arrays(plan, r), refuse)
    step = manifest.get("step")
    if not isinstance(step, int) or step < 1:
        raise refuse(f"its manifest gives no step ({step!r})")
    if step >= config.train.steps:
        raise refuse(
            f"it is at step {step}, and this run's total is {config.train.steps} steps: "
            "nothing left to run (raise --steps)"
        )
    if manifest.get("data_position") != position(step):
        raise refuse(
            f"its next step reads from sample {manifest.get('data_position')}, this run's step "
            f"{step + 1} from sample {position(step)} (another train.batch_size?)"
        )
    mine = b""
    for r in range(plan.world):
        name, shard = shard_name(r), shards[shard_name(r)]
        try:
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
        except OSError as err:
            raise refuse(f"cannot read {name}: {err.strerror or err} (a partial checkpoint)") from None
        if hashlib.sha256(data).hexdigest() != shard.get("sha256"):
            raise refuse(f"{name} is corrupt: its SHA-256 is not the manifest's")
        if r == rank:
            mine = data
    with np.load(io.BytesIO(mine)) as npz:
        values = {name: npz[name] for name in npz.files}
    return Checkpoint(step, values)


def _manifest(folder: str) -> dict[str, Any]:
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except OSError as err:
        raise CheckpointError(
            f"checkpoint {folder}: cannot read its {MANIFEST}: {err.strerror or err}"
        ) from None
    except ValueError:
        raise CheckpointError(f"checkpoint {folder}: its {MANIFEST} is not JSON (corrupt)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {folder}: its {MANIFEST} is not an {FORMAT!r} manifest")
    return manifest


def arrays(plan: Plan, rank: int) -> dict[str, list]:
    """What ``rank``'s shard holds under ``plan``, as the manifest lists it: per array its
    device, dtype and shape."""
    registers = plan.registers
    return {
        p.name: [
            registers[p.register].device,
            np.dtype(registers[p.register].dtype).name,
            list(p.value.shape),
        ]
        for p in plan.parameters_of(rank)
    }


def _check_layout(theirs: Any, ours: dict[str, list], refuse: Callable[[str], CheckpointError]) -> None:
    """The first way a shard's arrays differ from what this run's plan holds there."""
    if not isinstance(theirs, dict):
        raise refuse("its manifest lists no arrays for a shard")
    for name in sorted(theirs.keys() ^ ours.keys()):
        where = "only the checkpoint" if name in theirs else "only this run"
        raise refuse(f"written by another model or layout: {name!r} is in {where}")
    for name, (device, dtype, shape) in ours.items():
        if theirs[name] != [device, dtype, shape]:
            raise refuse(
                f"written by another model or layout: {name!r} is {_shown(theirs[name])} there, "
                f"{dtype}{shape} on {device} here"
            )


def _shown(array: Any) -> str:
    try:
        device, dtype, shape = array
        return f"{dtype}{shape} on {device}"
    except (TypeError, ValueError):
        return repr(array)
