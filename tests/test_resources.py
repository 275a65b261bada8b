"""The device resource model: collective streams per communication group filled in
order, the stream limit, the memory limit, and what the summary shows."""

from __future__ import annotations

import numpy as np
import pytest

import actorflow as af
from actorflow.config import load_config
from actorflow.training import compile_config

DEVICES = ["cpu:0", "cpu:1"]


def same_key_all_reduces(n: int = 30, devices=DEVICES, shape=(4, 3)) -> af.Graph:
    """``n`` all-reduces with one key (sum over the same devices, shape and dtype), each of
    x times its own factor; the output sums every device's results."""
    with af.Graph() as g:
        xs = [af.placeholder(f"x[{d}]", shape, "float64", d) for d in devices]
        total = None
        for k in range(n):
            parts = [
                af.ops.mul(x, af.parameter(f"c{k}[{d}]", np.full(shape, k + 1.0), d))
                for x, d in zip(xs, devices)
            ]
            reduced = af.ops.all_reduce(parts, op="sum")[0]
            total = reduced if total is None else af.ops.add(total, reduced)
        af.output("y", total)
    return g


def expected(n: int, x: np.ndarray, devices=DEVICES) -> np.ndarray:
    return sum((k + 1.0) * x * len(devices) for k in range(n))


def collective_streams(plan: af.Plan) -> list:
    return [s for s in plan.streams if s.kind == "collective"]


def test_thirty_all_reduces_at_three_a_stream_take_ten_streams_filled_in_order():
    plan = af.compile(same_key_all_reduces(30), max_ops_per_stream=3, fusion=False)
    streams = collective_streams(plan)
    assert [s.channel for s in streams] == list(range(10))
    assert {s.group for s in streams} == {tuple(DEVICES)}
    on = [plan.actors[c.actors[0]].stream for c in plan.collectives]
    assert on == [streams[k // 3].id for k in range(30)]  # in execution order, three each
    x = np.arange(12.0).reshape(4, 3)
    np.testing.assert_allclose(af.run(plan, {"x[cpu:0]": x, "x[cpu:1]": x})["y"], expected(30, x))


def test_each_communication_group_has_its_own_stream():
    devices = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    with af.Graph() as g:
        xs = [af.placeholder(f"x[{d}]", (2,), "float64", d) for d in devices]
        low = af.ops.all_reduce(xs[:2], op="sum")
        high = af.ops.all_reduce(xs[2:], op="max")
        af.output("y", af.ops.add(low[0], af.ops.to_device(high[0], "cpu:0")))
    plan = af.compile(g)
    assert sorted(s.group for s in collective_streams(plan)) == [("cpu:0", "cpu:1"), ("cpu:2", "cpu:3")]
    assert sorted(s.name for s in collective_streams(plan)) == ["rank0/collective", "rank0/collective1"]
    feeds = {f"x[{d}]": np.full(2, k + 1.0) for k, d in enumerate(devices)}
    np.testing.assert_allclose(af.run(plan, feeds)["y"], [1 + 2 + 4, 1 + 2 + 4])


def test_more_streams_than_the_limit_say_how_many_and_that_reuse_would_help():
    with pytest.raises(af.CompileError) as caught:
        af.compile(same_key_all_reduces(30), max_ops_per_stream=3, max_streams=8, fusion=False)
    message = str(caught.value)
    assert "rank 0 needs 14 streams (10 collective, 2 compute, 2 copy), more than max_streams=8" in message
    assert "30 collectives over cpu:0,cpu:1 at max_ops_per_stream=3 need 10 streams" in message
    assert "ACTORFLOW_COMM_REUSE=-1" in message


@pytest.mark.parametrize("option", ["max_streams", "max_ops_per_stream", "max_labels", "max_memory"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_limits_are_ints_of_at_least_one(option, value):
    with pytest.raises(af.CompileError, match=f"{option}: an int >= 1, got {value!r}"):
        af.compile(same_key_all_reduces(1), **{option: value})


def test_a_plan_over_the_memory_limit_names_the_device_the_bytes_and_the_largest_registers():
    with af.Graph() as g:
        x = af.placeholder("x", (1024, 1024), "float32", "cpu:0")  # 4 MiB
        af.output("y", af.ops.relu(x, name="big"))
    with pytest.raises(af.CompileError) as caught:
        af.compile(g, quota=100000, max_memory=8 << 30)
    message = str(caught.value)
    assert message.startswith("cpu:0 plans 781.2 GiB (838860800000 bytes)")
    assert "more than max_memory 8.0 GiB" in message
    assert "big float32[1024, 1024] x quota 100000 = 390.6 GiB" in message
    with pytest.raises(af.CompileError, match="cpu:0 plans"):
        af.compile(g, quota=100000)  # the default: what this machine has available
    assert af.compile(g, quota=2, max_memory=16 << 20).memory == {"cpu:0": 16 << 20}


def test_the_default_memory_limit_is_checked_but_not_recorded_so_compiles_are_equal(monkeypatch):
    """Free memory moves between two compiles (and between ranks); the Plan, and so its
    digest, must not."""
    from actorflow.compiler import resources

    g = same_key_all_reduces(2)
    free = iter([3 << 30, 5 << 30])
    monkeypatch.setattr(resources, "available_memory", lambda: next(free))
    first, second = af.compile(g), af.compile(g)
    assert first == second and first.to_bytes() == second.to_bytes()
    assert first.resources.max_memory == 0
    monkeypatch.setattr(resources, "available_memory", lambda: 1024)
    with pytest.raises(af.CompileError, match="more than max_memory 1.0 KiB"):
        af.compile(g)


def test_the_summary_and_the_compile_command_show_streams_against_the_limit():
    plan = af.compile(same_key_all_reduces(6), max_ops_per_stream=2, max_streams=10, fusion=False)
    assert "streams of rank 0: 7 of max_streams 10 (3 collective, 2 compute, 2 copy)" in plan.summary()
    assert "stream rank0/collective2 (group cpu:0,cpu:1, " in plan.summary()
    assert af.Plan.from_bytes(plan.to_bytes()) == plan
    from actorflow.views import overview

    assert "streams of rank 0: 7 of max_streams 10" in overview(plan)


def test_the_yaml_runtime_keys_reach_the_compiler():
    config = load_config("configs/default.yaml", ["runtime.max_streams=5", "runtime.max_memory=1000000000"])
    plan = compile_config(config)
    assert (plan.resources.max_streams, plan.resources.max_memory) == (5, 10**9)
    with pytest.raises(af.CompileError, match="more than max_streams=3"):
        compile_config(load_config("configs/default.yaml", ["runtime.max_streams=3"]))
