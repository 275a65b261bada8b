"""Every training feature at once, drawn at random: pipeline stages, data-parallel
replicas, micro-batches, the schedule (GPipe, 1F1B, ZB-H1), recompute per stage,
optimizer sharding and the optimizer for the MLP; stages, replicas, tensor parallelism,
micro-batches, schedule and recompute for the transformer. Whatever the draw, training
ends where the same model trained on one device with the whole batch ends."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actorflow.config import parse_config
from actorflow.training import train


@st.composite
def runs(draw):
    p = draw(st.integers(1, 3), label="stages")
    dp = draw(st.sampled_from([1, 2]), label="replicas")
    m = draw(st.sampled_from([1, 2, 4]), label="micro-batches")
    layers = draw(st.integers(p, p + 2), label="layers")
    sizes = [8] + [draw(st.sampled_from([4, 8, 12])) for _ in range(layers - 1)] + [4]
    devices = iter(f"cpu:{k}" for k in range(p * dp))
    stages = [[next(devices) for _ in range(dp)] for _ in range(p)]
    optimizer = draw(
        st.sampled_from([{"kind": "sgd", "lr": 0.1, "momentum": 0.9}, {"kind": "adam", "lr": 0.01}]),
        label="optimizer",
    )
    if dp > 1 and draw(st.booleans(), label="shard"):
        optimizer |= {"shard": True, "shard_threshold_kb": 0}
        optimizer |= {"gradient_accumulation_shard": draw(st.booleans(), label="accumulate sharded")}
    parallel = {
        "stages": stages,
        "data_parallel": dp,
        "micro_batches": m,
        "schedule": draw(st.sampled_from(["gpipe", "1f1b", "zb1"]), label="schedule"),
        "recompute": [draw(st.booleans(), label="recompute") for _ in range(p)],
    }
    return {
        "model": {
            "sizes": sizes,
            "activation": draw(st.sampled_from(["relu", "tanh", "gelu"])),
            "dtype": "float64",
        },
        "data": {"samples": 64, "seed": draw(st.integers(0, 9), label="seed")},
        "train": {"steps": 2, "batch_size": 16, "optimizer": optimizer},
        "parallel": parallel,
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(runs())
def test_any_combination_trains_as_one_device(run):
    got = train(parse_config(run))
    optimizer = {k: v for k, v in run["train"]["optimizer"].items() if "shard" not in k}
    alone = run | {"parallel": {"stages": ["cpu:0"]}, "train": run["train"] | {"optimizer": optimizer}}
    want = train(parse_config(alone))
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-9)
    for name, value in want.parameters.items():
        np.testing.assert_allclose(got.parameters[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


@st.composite
def transformer_runs(draw):
    p, dp, tp = (draw(st.sampled_from([1, 2]), label=k) for k in ("stages", "replicas", "tensor parallel"))
    devices = iter(f"cpu:{k}" for k in range(p * dp * tp))
    return {
        "model": {
            "kind": "transformer",
            "vocab": 64,
            "d_model": 8,
            "heads": 2,
            "layers": draw(st.integers(p, 2), label="layers"),
            "seq_len": 4,
            "dtype": "float64",
        },
        "data": {"kind": "text", "samples": 32, "seed": draw(st.integers(0, 9), label="seed")},
        "train": {"steps": 2, "batch_size": 8, "optimizer": {"kind": "adam", "lr": 0.01}},
        "parallel": {
            "stages": [[next(devices) for _ in range(dp * tp)] for _ in range(p)],
            "data_parallel": dp,
            "tensor_parallel": tp,
            "micro_batches": draw(st.sampled_from([1, 2]), label="micro-batches"),
            "schedule": draw(st.sampled_from(["gpipe", "1f1b", "zb1"]), label="schedule"),
            "recompute": draw(st.booleans(), label="recompute"),
        },
    }


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transformer_runs())
def test_any_transformer_layout_trains_as_one_device(run):
    got = train(parse_config(run))
    want = train(parse_config(run | {"parallel": {"stages": ["cpu:0"]}}))
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-6)
    assert {name.split("@")[0] for name in got.parameters} == set(want.parameters)
    for name, value in got.parameters.items():  # with tensor and data parallelism, NAME@r per replica
        np.testing.assert_allclose(
            value, want.parameters[name.split("@")[0]], rtol=1e-6, atol=1e-12, err_msg=name
        )
