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
    registers were held at once; ``activation_quotas``: per stage, the quota the
    schedule gave those registers (the bound on ``peak_activations``); ``memory``:
    planned bytes per device."""

    losses: list[float]
    seconds: float
    samples_per_second: float
    bubbles: list[float]
    theory: float
    peak_activations: list[int]
    activation_quotas: list[int]
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
    peaks, quotas = kept_per_stage(plan, stats, config.parallel.stages)
    return RunResult(
        losses=losses,
        seconds=seconds,
        samples_per_second=config.train.steps * config.train.batch_size / seconds,
        bubbles=[s.bubble for s in summarize(chrome, [stage[0] for stage in config.parallel.stages]).stages],
        theory=(p - 1) / (m + p - 1),
        peak_activations=peaks,
        activation_quotas=quotas,
        memory=dict(plan.memory),
        parameters=parameters,
    )


def kept_per_stage(
    plan: Plan, stats: dict[str, dict[str, int]], stages: tuple[tuple[str, ...], ...]
) -> tuple[list[int], list[int]]:
    """Per stage, over the registers it keeps for backward: (the most buffers one of them
    held at once, the largest quota among them)."""
    stage_of = {d: k for k, devices in enumerate(stages) for d in devices}
    peaks, quotas = [0] * len(stages), [0] * len(stages)
    for reg in kept_for_backward(plan):
        k = stage_of[reg.device]
        peaks[k] = max(peaks[k], stats[reg.name]["max_held"])
        quotas[k] = max(quotas[k], reg.quota)
    return peaks, quotas
