"""Optimizer parallel (``af.minimize(..., shard=True)``, ``train.optimizer.shard``): each
data-parallel replica keeps and updates one shard of a parameter and of its optimizer
state. Training ends where the replicated run ends, with 1/replicas of the state."""

import numpy as np
import pytest

import actorflow as af
from actorflow.config import parse_config
from actorflow.errors import ConfigError, GraphError
from actorflow.training import train

N, D, H, C = 24, 6, 8, 4
RNG = np.random.default_rng(0)
W1, B1, W2 = (
    RNG.standard_normal((D, H)) * 0.3,
    RNG.standard_normal(H) * 0.1,
    RNG.standard_normal((H, C)) * 0.3,
)
STEPS = 10
FEEDS = [{"x": RNG.standard_normal((N, D)), "y": RNG.integers(0, C, N)} for _ in range(STEPS)]
OPTIMIZERS = [af.optim.SGD(lr=0.1, momentum=0.9), af.optim.Adam(lr=0.05)]


def mlp(optimizer, devices=2, micro_batches=1, fuse_kernels=True, **shard):
    place = [f"cpu:{k}" for k in range(devices)]
    with af.Graph() as g:
        x = af.placeholder("x", (N, D), "float64", place, af.S(0))
        y = af.placeholder("y", (N,), "int64", place, af.S(0))
        w1, b1, w2 = (af.parameter(n, v, place, af.B) for n, v in (("w1", W1), ("b1", B1), ("w2", W2)))
        loss = af.ops.softmax_cross_entropy(
            af.ops.matmul(af.ops.tanh(af.ops.bias_add(af.ops.matmul(x, w1), b1)), w2), y
        )
        af.minimize(loss, optimizer, **shard)
        af.output("loss", loss)
    return af.compile(g, micro_batches=micro_batches, fuse_kernels=fuse_kernels)


def trained(plan):
    with af.Session(plan) as s:
        for feed in FEEDS:
            s.run([feed] * plan.micro_batches)
        return s.parameters()


def state_bytes(plan, device):
    """Bytes of optimizer state on ``device``, but for Adam's step count (a scalar)."""
    states = {p.register for p in plan.parameters if p.state and p.value.ndim}
    return sum(r.nbytes for r in plan.registers if r.id in states and r.device == device)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize(
    "micro_batches, accumulate_sharded",
    [(1, True), (2, True), (2, False)],
    ids=["m1", "m2-zero2", "m2-zero1"],
)
@pytest.mark.parametrize("devices", [2, 4])
def test_sharded_training_equals_replicated(optimizer, micro_batches, accumulate_sharded, devices):
    plain = mlp(optimizer, devices, micro_batches)
    sharded = mlp(
        optimizer,
        devices,
        micro_batches,
        shard=True,
        shard_threshold_kb=0,
        gradient_accumulation_shard=accumulate_sharded,
    )
    expected, got = trained(plain), trained(sharded)
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-9, atol=0, err_msg=name)
    for device in (f"cpu:{k}" for k in range(devices)):
        assert state_bytes(sharded, device) * devices == state_bytes(plain, device)
        assert sharded.memory[device] < plain.memory[device]


def collectives(plan):
    """(op, micro-batches per act) of each collective."""
    return sorted((c.op, plan.actors[c.actors[0]].every) for c in plan.collectives)


def test_each_step_gathers_the_parameter_once_and_reduce_scatters_its_gradient():
    zero2 = mlp(OPTIMIZERS[0], 2, 4, shard=True, shard_threshold_kb=0)
    zero1 = mlp(OPTIMIZERS[0], 2, 4, shard=True, shard_threshold_kb=0, gradient_accumulation_shard=False)
    # unfused, each gradient keeps its own buffers beside what accumulates it
    zero2_unfused, zero1_unfused = (
        mlp(OPTIMIZERS[0], 2, 4, False, shard=True, shard_threshold_kb=0, gradient_accumulation_shard=z2)
        for z2 in (True, False)
    )
    assert collectives(zero2) == [("all_gather", 4)] * 3 + [("reduce_scatter", 1)] * 3
    assert collectives(zero1) == [("all_gather", 4)] * 3 + [("reduce_scatter", 4)] * 3
    assert [(lt.name, lt.sbp, lt.axis) for lt in zero2.logical if lt.kind == "parameter"] == [
        ("w1", "S", 0),
        ("b1", "S", 0),
        ("w2", "S", 0),
    ]
    # accumulating the shard (ZeRO-2) holds less than accumulating the whole gradient
    assert zero2_unfused.memory["cpu:0"] < zero1_unfused.memory["cpu:0"]
    # fused, the whole gradient is one buffer inside its accumulate's act, as small
    assert zero2.memory["cpu:0"] <= zero1.memory["cpu:0"]
    gathered = [r for r in zero2.registers if r.name.endswith(".gathered")]
    assert len(gathered) == 6 and all(r.quota == 1 and r.shape in ((D, H), (H,), (H, C)) for r in gathered)


def test_parameters_below_the_threshold_stay_replicated_and_all_reduced():
    plan = mlp(OPTIMIZERS[0], 2, 4, shard=True, shard_threshold_kb=0.1)  # b1 is 64 bytes, w1 384
    assert [(lt.name, lt.sbp) for lt in plan.logical if lt.kind == "parameter"] == [
        ("w1", "S"),
        ("b1", "B"),
        ("w2", "S"),
    ]
    # one collective stream, three rates of acting in a step: gathers, then a
    # reduce-scatter per micro-batch, then the accumulated bias gradient's all-reduce
    order = [(c.op, plan.actors[c.actors[0]].every) for c in plan.collectives]
    assert order == [("all_gather", 4)] * 2 + [("reduce_scatter", 1)] * 2 + [("all_reduce", 4)]
    np.testing.assert_allclose(trained(plan)["b1"], trained(mlp(OPTIMIZERS[0], 2, 4))["b1"], rtol=1e-9)


def test_a_dim_the_replicas_do_not_divide_is_not_sharded():
    plan = mlp(OPTIMIZERS[0], 3, shard=True, shard_threshold_kb=0)  # 6 x 8, 8 and 8 x 4 over 3
    assert [(lt.name, lt.sbp, lt.axis) for lt in plan.logical if lt.kind == "parameter"] == [
        ("w1", "S", 0),
        ("b1", "B", 0),
        ("w2", "B", 0),
    ]


@pytest.mark.parametrize("schedule, recompute", [("gpipe", False), ("1f1b", False), ("1f1b", True)])
def test_sharded_pipeline_with_replicated_stages_equals_replicated(schedule, recompute):
    sets = {
        "model": {"sizes": [8, 16, 16, 4], "activation": "tanh", "dtype": "float64"},
        "data": {"samples": 64, "seed": 0},
        "train": {"steps": STEPS, "batch_size": 16, "optimizer": {"kind": "adam", "lr": 0.01}},
        "parallel": {
            "stages": [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]],
            "data_parallel": 2,
            "micro_batches": 4,
            "schedule": schedule,
        },
    }
    plain = train(parse_config(sets))
    sets["parallel"]["recompute"] = recompute
    sets["train"]["optimizer"] |= {"shard": True, "shard_threshold_kb": 0}
    sharded = train(parse_config(sets))
    np.testing.assert_allclose(sharded.losses, plain.losses, rtol=1e-9)
    for name, value in plain.parameters.items():
        np.testing.assert_allclose(sharded.parameters[name], value, rtol=1e-9, atol=0, err_msg=name)
    for d in plain.memory:
        assert sharded.memory[d] < plain.memory[d]
        assert 0 < sharded.held_memory[d] <= sharded.memory[d]


def test_bad_shard_settings_are_refused():
    with pytest.raises(GraphError, match="shard_threshold_kb"):
        mlp(OPTIMIZERS[0], shard=True, shard_threshold_kb=-1)
    config = {
        "model": {"sizes": [4, 2]},
        "data": {"samples": 8},
        "train": {"steps": 1, "batch_size": 8, "optimizer": {"lr": 0.1, "shard": True}},
        "parallel": {"stages": ["cpu:0"]},
    }
    with pytest.raises(ConfigError, match=r"^train\.optimizer\.shard: .*data_parallel > 1"):
        parse_config(config)
