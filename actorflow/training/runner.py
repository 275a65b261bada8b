"""Compile a config's run, train it step by step, and measure what the pipeline did."""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
import numpy as np

from ..compiler import compile
from ..compiler.schedules import kept_for_backward
from ..config import Config
from ..plan import Plan
from ..runtime import Session
from ..trace.metrics import summarize
from .data import step_feeds, synthetic_classification
from .model import build_graph


@attrs.frozen
class RunResult:
    """What a run did. ``bubbles``: per stage, the measured idle fraction of its (first
    replica's) compute stream within the steps (see ``trace.metrics``); ``theory``: (p-1)/(m+p-1);
    ``peak_activations``: per stage, the most micro-batches whose kept-for-backward
    registers were held at once; ``memory``: planned bytes per device."""

    losses: list[float]
    seconds: float
    samples_per_second: float
    bubbles: list[float]
    theory: float
    peak_activations: list[int]
    memory: dict[str, int]
    parameters: dict[str, np.ndarray]


def compile_config(config: Config) -> Plan:
    parallel, runtime = config.parallel, config.runtime
    return compile(
        build_graph(config),
        quota=runtime.quota,
        priority=runtime.priority,
        fusion=runtime.fusion,
        link_bandwidth=runtime.link_bandwidth,
        link_latency=runtime.link_latency,
        micro_batches=parallel.micro_batches,
        stages=parallel.stages,
        schedule=parallel.schedule,
    )


def train(config: Config, on_step: Callable[[int, float], None] | None = None, trace: str | None = None) -> RunResult:
    """Run train.steps steps; ``on_step(step, loss)`` after each; ``trace``: write a Chrome trace."""
    plan = compile_config(config)
    data = synthetic_classification(config)
    losses = []
    with Session(plan, trace=True) as session:
        start = time.perf_counter()
        for step in range(config.train.steps):
            outputs = session.run(step_feeds(config, data, step))
            losses.append(float(np.mean([o["loss"] for o in outputs])))
            if on_step is not None:
                on_step(step, losses[-1])
        seconds = time.perf_counter() - start
        chrome = session.recorder.to_chrome()
        stats = session.register_stats()
        parameters = session.parameters()
        if trace is not None:
            session.recorder.write(trace)
    p, m = len(config.parallel.stages), config.parallel.micro_batches
    return RunResult(
        losses=losses,
        seconds=seconds,
        samples_per_second=config.train.steps * config.train.batch_size / seconds,
        bubbles=[s.bubble for s in summarize(chrome, [stage[0] for stage in config.parallel.stages]).stages],
        theory=(p - 1) / (m + p - 1),
        peak_activations=peak_activations(plan, stats, config.parallel.stages),
        memory=dict(plan.memory),
        parameters=parameters,
    )


def peak_activations(plan: Plan, stats: dict[str, dict[str, int]], stages: tuple[tuple[str, ...], ...]) -> list[int]:
    stage_of = {d: k for k, devices in enumerate(stages) for d in devices}
    peaks = [0] * len(stages)
    for reg in kept_for_backward(plan):
        k = stage_of[reg.device]
        peaks[k] = max(peaks[k], stats[reg.name]["max_held"])
    return peaks
