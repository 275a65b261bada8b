"""Layouts: a config's devices as data x tensor x pipeline degrees, and the search for the
fastest ones on N devices that fit ``runtime.max_memory``."""

from __future__ import annotations

import attrs

from ..config import Config, parse_config
from ..errors import CompileError, ConfigError
from .costs import CostModel
from .predict import Prediction, predict

SCHEDULES = ("1f1b", "zb1", "gpipe")


def parse_layout(text: str) -> tuple[int, int, int]:
    """``D,T,P`` -> (data, tensor, pipeline) degrees, each >= 1."""
    parts = text.split(",")
    try:
        degrees = tuple(int(p) for p in parts)
    except ValueError:
        degrees = ()
    if len(degrees) != 3 or min(degrees) < 1:
        raise ConfigError(f"--layout: expected D,T,P, three integers >= 1, got {text!r}")
    return degrees


def with_layout(
    config: Config,
    data: int,
    tensor: int,
    pipeline: int,
    micro_batches: int | None = None,
    schedule: str | None = None,
    batch_size: int | None = None,
) -> Config:
    """``config`` over data x tensor x pipeline devices (``cpu:0`` on), replacing its
    ``parallel.stages`` (stage s holds the next data x tensor devices, each tensor-parallel
    group consecutive), checked as a config is."""
    raw = config.to_dict()
    if batch_size is not None:
        raw["train"] = raw["train"] | {"batch_size": batch_size}
    width = data * tensor
    parallel = raw["parallel"] | {
        "stages": [[f"cpu:{s * width + k}" for k in range(width)] for s in range(pipeline)],
        "data_parallel": data,
        "tensor_parallel": tensor,
    }
    if parallel.get("partition") is not None and len(parallel["partition"]) != pipeline:
        parallel["partition"] = None
    if isinstance(parallel.get("recompute"), list):
        parallel["recompute"] = any(parallel["recompute"])
    if micro_batches is not None:
        parallel["micro_batches"] = micro_batches
    if schedule is not None:
        parallel["schedule"] = schedule
    return parse_config(raw | {"parallel": parallel}, source=f"layout {data},{tensor},{pipeline}")


def predict_layout(
    config: Config,
    model: CostModel,
    layout: tuple[int, int, int],
    micro_batches: int | None = None,
    schedule: str | None = None,
    ranks: int | None = None,
) -> tuple[Config, Prediction]:
    """``config`` over a data x tensor x pipeline layout, predicted by symmetry: the data-
    parallel replicas run the same acts at the same times, so one replica (its share of
    the batch, over tensor x pipeline devices) is simulated and each update charged its
    gradient's all-reduce over the replicas (``predict``'s ``replicas``): the plan and the
    simulation grow with tensor x pipeline, not with the devices. ``ranks``: default one a
    pipeline stage, as a cluster runs (each stage's devices a process on one machine).
    Returns the replica's config and its prediction."""
    data, tensor, pipeline = layout
    if config.train.batch_size % data:
        raise ConfigError(
            f"--layout: train.batch_size {config.train.batch_size} is not a multiple of {data} replicas"
        )
    replica = with_layout(
        config, 1, tensor, pipeline, micro_batches, schedule, config.train.batch_size // data
    )
    return replica, predict(replica, model, ranks=ranks or pipeline, replicas=data)


@attrs.frozen
class Candidate:
    layout: tuple[int, int, int]
    micro_batches: int
    schedule: str
    step_seconds: float
    memory: int
    """The most planned bytes on one device."""


def search(config: Config, devices: int, model: CostModel, keep: int = 5) -> list[Candidate]:
    """The ``keep`` fastest layouts of ``config``'s model on ``devices`` devices (data x
    tensor x pipeline degrees, micro-batches p, 2p or 4p, each schedule) whose planned
    memory fits ``runtime.max_memory`` (every one, where it is unset), by predicted step
    time; a layout the config's checks or the compiler refuse is left out."""
    found = []
    limit = config.runtime.max_memory
    for p in range(1, devices + 1):
        for t in range(1, devices // p + 1):
            if devices % (p * t):
                continue
            d = devices // (p * t)
            for m in (p, 2 * p, 4 * p):
                for schedule in SCHEDULES:
                    try:
                        _, prediction = predict_layout(config, model, (d, t, p), m, schedule)
                    except (ConfigError, CompileError):
                        continue
                    peak = max(prediction.result.memory.values(), default=0)
                    if limit is None or peak <= limit:
                        found.append(Candidate((d, t, p), m, schedule, prediction.step_seconds, peak))
    return sorted(found, key=lambda c: c.step_seconds)[:keep]
