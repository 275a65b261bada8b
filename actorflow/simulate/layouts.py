"""Layouts: a config's devices as data x tensor x pipeline degrees, and the search for the
fastest ones on N devices that fit ``runtime.max_memory``."""

from __future__ import annotations

import collections
import hashlib
import multiprocessing
from collections.abc import Callable
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from typing import Any

import attrs

from ..config import Config, parse_config
from ..errors import CompileError, ConfigError
from ..training.parameter_server import run_end
from ..training.runner import compile_config
from .costs import CostModel
from .predict import Prediction, predict, step_time, work

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


def candidates(config: Config, devices: int) -> list[tuple[Config, tuple[int, int, int], int, str]]:
    """Every layout of ``config``'s model on ``devices`` devices the search weighs (data x
    tensor x pipeline degrees, micro-batches p, 2p or 4p, each schedule) that the config's
    checks accept: (its replica's config, as ``predict_layout`` simulates it, the layout,
    micro-batches, schedule)."""
    found = []
    for p in range(1, devices + 1):
        for t in range(1, devices // p + 1):
            if devices % (p * t):
                continue
            d = devices // (p * t)
            if config.train.batch_size % d:
                continue
            for m in (p, 2 * p, 4 * p):
                for schedule in SCHEDULES:
                    try:
                        replica = with_layout(config, 1, t, p, m, schedule, config.train.batch_size // d)
                    except ConfigError:
                        continue
                    found.append((replica, (d, t, p), m, schedule))
    return found


def search(
    config: Config, devices: int, model: CostModel, keep: int = 5, workers: int = 1
) -> list[Candidate]:
    """The ``keep`` fastest of ``candidates`` by predicted step time (the earlier candidate
    first at a tie), each with its planned memory; a layout the compiler refuses (over
    ``runtime.max_memory``, or the machine's memory where it is unset) or that stalls is
    left out. The same as predicting each candidate (``predict_layout``), in a fraction
    of the time:

    - a lower bound first, from a plan of the replica's model on one device (its batch in
      one micro-batch; one per batch size): the replica's devices plan at least its
      parameters' bytes between them, and its kernels do at least that plan's work
      (splitting over devices and micro-batches only splits, repeats or adds kernels, of
      the same op kinds) on its ranks' machines' cores (``bound``);
    - candidates in the order of their bound, until the bound of the next can't beat the
      ``keep``-th fastest found (branch and bound);
    - each compiled (the compiler refuses a plan over ``max_memory``) and clocked without
      its trace and report, and a plan equal to one clocked before (a schedule that
      changes nothing on one stage) not clocked again.

    ``workers`` > 1: that many processes compile and clock the next candidates at once.
    The answer is the same: a candidate clocked ahead whose bound turned out unable to
    beat the ``keep``-th fastest is slower than it, so it falls behind."""
    limit = config.runtime.max_memory
    shares: dict[int, tuple[int, float]] = {}
    weighed = []
    for n, (replica, layout, m, schedule) in enumerate(candidates(config, devices)):
        batch = replica.train.batch_size
        if batch not in shares:
            shares[batch] = one_device(replica, model)
        parameters, seconds = shares[batch]
        d, t, p = layout
        if limit is not None and parameters > limit * t * p:
            continue
        weighed.append((bound(seconds, t, p, model, run_end(replica, 0)), n, replica, layout, m, schedule))
    weighed.sort(key=lambda w: w[:2])
    found: list[tuple[float, int, Candidate]] = []
    clocked: dict[bytes, float] = {}

    def beaten(lower: float) -> bool:
        return len(found) >= keep and lower > found[keep - 1][0]

    def take(n: int, layout: tuple[int, int, int], m: int, schedule: str, answer: Future) -> None:
        result = answer.result()
        if result is None:  # refused
            return
        key, seconds, peak = result
        seconds = clocked[key] if seconds is None else clocked.setdefault(key, seconds)
        found.append((seconds, n, Candidate(layout, m, schedule, seconds, peak)))
        found.sort(key=lambda f: f[:2])

    with _pool(workers) as pool:
        ahead: collections.deque = collections.deque()
        for lower, n, replica, layout, m, schedule in weighed:
            if beaten(lower):
                break
            answer = pool.submit(_clock_candidate, replica, layout, model, frozenset(clocked))
            ahead.append((n, layout, m, schedule, answer))
            if len(ahead) >= workers:
                take(*ahead.popleft())
        while ahead:
            take(*ahead.popleft())
    return [c for _, _, c in found[:keep]]


def _clock_candidate(
    replica: Config, layout: tuple[int, int, int], model: CostModel, known: frozenset[bytes]
) -> tuple[bytes, float | None, int] | None:
    """A candidate of ``search`` compiled and clocked (here or in a worker process): its
    plan's key, its step time (None where ``known`` holds the key: an equal plan was
    clocked before) and its most planned bytes on one device; None where the compiler
    refuses it (over ``max_memory``) or it stalls."""
    try:
        plan = compile_config(replica, layout[2], values=False)
        key = hashlib.sha256(attrs.evolve(plan, parameters=()).to_bytes()).digest()
        seconds = None if key in known else step_time(replica, plan, model, replicas=layout[0])
    except (ConfigError, CompileError):
        return None
    return key, seconds, max(plan.memory.values(), default=0)


class _Here(Executor):
    """Runs what it is handed at once, in this process: ``search`` with one worker."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        done: Future = Future()
        done.set_result(fn(*args, **kwargs))
        return done


def _pool(workers: int) -> Executor:
    """Where ``search`` clocks its candidates: here, or in ``workers`` processes (spawned:
    a fork would copy the stream threads' locks of a process that ran anything)."""
    if workers <= 1:
        return _Here()
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))


def bound(work_seconds: float, tensor: int, pipeline: int, model: CostModel, steps_per_run: int) -> float:
    """The least step time of a replica of ``tensor`` x ``pipeline`` devices whose kernels
    take ``work_seconds`` of a core: its ranks' machines (one rank a stage, on its first
    device's node, as ``predict.rank_nodes`` places it) run that work on ``model.cores``
    cores each, at best evenly shared, and a run of ``steps_per_run`` steps ends the
    host's time before the next."""
    machines = len({s * tensor // model.node_size for s in range(pipeline)})
    return work_seconds / (machines * model.cores) + model.between / steps_per_run


def one_device(replica: Config, model: CostModel) -> tuple[int, float]:
    """(parameter bytes, seconds of a core a step's kernels take) of ``replica``'s model on
    one device, its whole batch one micro-batch, no memory limit."""
    raw = replica.to_dict()
    raw["parallel"] = raw["parallel"] | {
        "stages": [["cpu:0"]],
        "tensor_parallel": 1,
        "micro_batches": 1,
        "partition": None,
    }
    raw["runtime"] = raw["runtime"] | {"max_memory": 2**62}
    plan = compile_config(parse_config(raw, source="one device"), 1, values=False)
    parameters = sum(r.nbytes for r in plan.registers if r.is_parameter)
    return parameters, work(plan, model, 1)
