"""Pipelined training from a config (``actorflow.training``): GPipe, 1F1B and replicated
stages end where one device with the whole batch ends, the loss falls, and the measured
pipeline stays within its schedule's bounds."""

import functools
from collections import Counter

import numpy as np
import pytest

from actorflow.compiler.schedules import kept_for_backward
from actorflow.config import parse_config
from actorflow.training import compile_config, train

SMALL_YAML = """\
model: {kind: mlp, sizes: [8, 16, 16, 4], activation: tanh, dtype: float64}
data: {kind: synthetic_classification, samples: 64, seed: 5}
train: {steps: 10, batch_size: 16, optimizer: {kind: sgd, lr: 0.2, momentum: 0.5}}
parallel: {stages: [cpu:0, cpu:1], micro_batches: 4, schedule: 1f1b}
runtime: {quota: 2}
"""

ONE_DEVICE = ("parallel.stages=[cpu:0]", "parallel.micro_batches=1", "parallel.data_parallel=1")
REPLICATED = ("parallel.data_parallel=2", "parallel.stages=[[cpu:0, cpu:1], [cpu:2, cpu:3]]")

PIPELINES = {
    "gpipe": ("parallel.schedule=gpipe",),
    "1f1b": ("parallel.schedule=1f1b",),
    "2x2-1f1b": REPLICATED,
    "2x2-gpipe": (*REPLICATED, "parallel.schedule=gpipe"),
    "partition-2-1": ("parallel.partition=[2, 1]",),
    "adam-gpipe": ("parallel.schedule=gpipe", "train.optimizer={kind: adam, lr: 0.01}"),
}

_reference: dict[tuple[str, ...], object] = {}


def reference(extra=()):
    """The same run on one device, the whole batch a step (cached per optimizer override)."""
    key = tuple(o for o in extra if o.startswith("train."))
    if key not in _reference:
        _reference[key] = train(parse_config(SMALL_YAML, [*key, *ONE_DEVICE]))
    return _reference[key]


@pytest.mark.parametrize("name", list(PIPELINES))
def test_pipelined_run_equals_one_device(name):
    overrides = PIPELINES[name]
    config = parse_config(SMALL_YAML, overrides)
    want = reference(overrides)
    got = train(config)
    assert set(got.parameters) == set(want.parameters) == {f"{k}{n}" for k in "wb" for n in range(3)}
    for param, value in want.parameters.items():
        np.testing.assert_allclose(got.parameters[param], value, rtol=1e-6, atol=1e-12, err_msg=param)
    # each step's loss is the mean of its micro-batches', the whole batch's loss
    assert len(got.losses) == config.train.steps
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-9)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_loss_falls(name):
    config = parse_config(SMALL_YAML, PIPELINES[name])
    losses = train(config).losses
    cycle = config.data.samples // config.train.batch_size  # steps that see every sample once
    assert all(np.isfinite(losses))
    assert np.mean(losses[-cycle:]) < np.mean(losses[:cycle])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("layout", ["1x2", "2x2"])
def test_measured_pipeline_stays_within_the_schedule(schedule, layout):
    overrides = [f"parallel.schedule={schedule}", *(REPLICATED if layout == "2x2" else ())]
    config = parse_config(SMALL_YAML, overrides)
    result = train(config)
    p, m = len(config.parallel.stages), config.parallel.micro_batches
    assert result.theory == pytest.approx((p - 1) / (m + p - 1))
    assert len(result.bubbles) == len(result.peak_activations) == len(result.balanced) == p
    assert all(0.0 <= b <= 1.0 for b in result.bubbles + result.balanced), (result.bubbles, result.balanced)
    for s, peak in enumerate(result.peak_activations):
        bound = m if schedule == "gpipe" else p - s
        assert 1 <= peak <= bound, (s, peak, bound)
    # the planned memory covers every device of every stage
    assert set(result.memory) == set(config.parallel.devices)
    assert all(nbytes > 0 for nbytes in result.memory.values())


def test_one_stage_has_no_theoretical_bubble():
    result = train(parse_config(SMALL_YAML, [*ONE_DEVICE, "train.steps=2"]))
    assert result.theory == 0.0
    assert len(result.bubbles) == 1 and 0.0 <= result.bubbles[0] <= 1.0
    assert result.peak_activations == [1]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_compiled_quotas_follow_the_schedule(schedule):
    config = parse_config(SMALL_YAML, [f"parallel.schedule={schedule}", *REPLICATED])
    plan = compile_config(config)
    assert plan.micro_batches == config.parallel.micro_batches
    stage_of = {d: s for s, devices in enumerate(config.parallel.stages) for d in devices}
    kept = kept_for_backward(plan)
    assert {stage_of[r.device] for r in kept} == {0, 1}
    p, m = len(config.parallel.stages), config.parallel.micro_batches
    for reg in kept:
        assert reg.quota == (m if schedule == "gpipe" else p - stage_of[reg.device]), reg.name


def forward_matmuls(plan):
    counts: Counter = Counter()
    for a in plan.actors:
        if not a.backward:
            counts[a.device] += a.ops.count("matmul")  # a fused chain's too
    return +counts


@pytest.mark.parametrize("partition", [[1, 2], [2, 1]])
@pytest.mark.parametrize("replicated", [False, True], ids=["1x2", "2x2"])
def test_explicit_partition_is_honoured(partition, replicated):
    overrides = [f"parallel.partition={partition}", *(REPLICATED if replicated else ())]
    config = parse_config(SMALL_YAML, overrides)
    assert config.stage_layers == tuple(partition)
    want = {d: layers for devices, layers in zip(config.parallel.stages, partition) for d in devices}
    plan = compile_config(config)
    assert forward_matmuls(plan) == want
    # every layer's parameters live on (each replica of) its stage
    layer_device = {}
    for s, (devices, layers) in enumerate(zip(config.parallel.stages, partition)):
        first = sum(partition[:s])
        for k in range(first, first + layers):
            layer_device[f"w{k}"] = set(devices)
    for name, devices in layer_device.items():
        placed = {a.device for a in plan.actors if a.kind == "variable" and a.name.split("[")[0] == name}
        assert placed == devices, name


@pytest.mark.parametrize("replicated", [False, True], ids=["1x2", "2x2"])
def test_without_a_partition_the_plan_follows_the_configs_split(replicated):
    config = parse_config(SMALL_YAML, REPLICATED if replicated else ())
    assert config.parallel.partition is None
    layers = config.stage_layers
    assert sum(layers) == config.layers and all(n >= 1 for n in layers)
    want = {d: n for devices, n in zip(config.parallel.stages, layers) for d in devices}
    assert forward_matmuls(compile_config(config)) == want


def test_on_step_sees_every_step_and_its_loss():
    config = parse_config(SMALL_YAML, ["train.steps=3"])
    seen = []
    result = train(config, on_step=lambda step, loss: seen.append((step, loss)))
    assert [s for s, _ in seen] == [0, 1, 2]
    assert [loss for _, loss in seen] == result.losses


@pytest.mark.parametrize(
    ("per_run", "every", "runs"),
    [(1, None, [1] * 10), (3, None, [3, 3, 3, 1]), (16, None, [10]), (4, 3, [3, 3, 3, 1])],
    ids=["1", "3", "16", "4-checkpoint-every-3"],
)
def test_steps_go_to_runs_steps_per_run_at_a_time_computing_the_same(
    monkeypatch, tmp_path, per_run, every, runs
):
    from actorflow.runtime.session import Session

    options = [f"train.steps_per_run={per_run}"]
    if every is not None:
        options.append(f"output.checkpoint={{path: {tmp_path / 'ck'}, every: {every}}}")
    config = parse_config(SMALL_YAML, options)
    seen = []
    run = Session.run

    def counted(self, feeds=None):
        seen.append(len(feeds) // config.parallel.micro_batches)
        return run(self, feeds)

    monkeypatch.setattr(Session, "run", counted)
    result = train(config)
    assert seen == runs
    alone = reference_steps()
    assert result.losses == alone.losses
    for name, value in alone.parameters.items():
        np.testing.assert_array_equal(result.parameters[name], value)


@functools.cache
def reference_steps():
    """SMALL_YAML trained one step a run."""
    return train(parse_config(SMALL_YAML, ["train.steps_per_run=1"]))


def test_the_report_measures_the_steps_its_spans_allow(monkeypatch):
    from actorflow.training import report, runner

    config = parse_config(SMALL_YAML)  # 10 steps, 4 a run: the first run is a warm-up
    whole = train(config)
    assert (whole.bubble_from, whole.bubble_steps) == (4, 6)
    assert "bubble measured over steps 4-9 (6 of the 10)" in report.table(config, whole)
    # a run of no more than one Session.run measured its bubble over every step: nothing to say
    short = parse_config(SMALL_YAML, ["train.steps=3"])
    alone = train(short)
    assert alone.bubble_steps == 3 and "bubble measured" not in report.table(short, alone)
    monkeypatch.setattr(runner, "REPORT_SPANS", 100)
    windowed = train(config)
    assert 0 < windowed.bubble_steps < 6 and windowed.bubble_from + windowed.bubble_steps == 10
    assert all(0.0 <= b < 1.0 for b in windowed.bubbles)
    assert report.metrics(config, windowed)["bubble_steps"] == windowed.bubble_steps
    assert report.metrics(config, windowed)["bubble_from"] == windowed.bubble_from
    assert len(windowed.losses) == config.train.steps  # every step's loss, all the same


def test_an_untraced_run_times_only_the_report_steps_after_its_first_run(monkeypatch):
    """Its other acts cost what an untraced run's do: their kernels are never timed or told
    to the host (the replay skips them), yet every step's loss comes back."""
    from actorflow.runtime.runtime import Runtime
    from actorflow.training import runner

    told: Counter[int] = Counter()
    completed = Runtime.completed

    def counted(self, unit, number, *args):
        if unit.fetch is None:
            actor = unit.actor
            told[number // actor.calls * actor.every // self.plan.micro_batches] += 1
        return completed(self, unit, number, *args)

    monkeypatch.setattr(Runtime, "completed", counted)
    config = parse_config(SMALL_YAML, ["train.steps=40"])
    result = train(config)
    assert sorted(told) == list(range(4 + runner.REPORT_STEPS))  # the first run, then the report's
    assert (result.bubble_from, result.bubble_steps) == (4, runner.REPORT_STEPS)
    assert len(result.losses) == 40 and all(np.isfinite(result.losses))
