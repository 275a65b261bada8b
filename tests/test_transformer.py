"""The transformer model (``model.kind: transformer``): trained on one device and split
over several (tensor parallel Megatron-style, data parallel, pipeline stages), it ends
with the same parameters; the Megatron annotations make exactly two all-reduces per
block forward and two backward; its loss falls on the shipped text."""

import numpy as np
import pytest

from actorflow.config import load_config, parse_config
from actorflow.simulate import predict
from actorflow.simulate.costs import shipped
from actorflow.trace.parse import parse
from actorflow.training import compile_config, train
from actorflow.training.data import TEXT, dataset, text_ids
from actorflow.views import overview

SMALL = {
    "model": {
        "kind": "transformer",
        "vocab": 64,
        "d_model": 16,
        "heads": 4,
        "layers": 2,
        "seq_len": 8,
        "dtype": "float64",
    },
    "data": {"kind": "text", "samples": 64, "seed": 0},
    "train": {"steps": 5, "batch_size": 8, "optimizer": {"kind": "adam", "lr": 0.01}},
    "parallel": {"stages": ["cpu:0"]},
}


def config(parallel=None, **model):
    return parse_config(SMALL | {"parallel": parallel or SMALL["parallel"], "model": SMALL["model"] | model})


def test_text_windows_predict_the_next_character():
    data = dataset(config())
    text, vocab = TEXT.read_text(encoding="utf-8"), text_ids(TEXT)[1]
    assert data["x"].shape == data["labels"].shape == (64, 8)
    np.testing.assert_array_equal(data["x"][:, 1:], data["labels"][:, :-1])
    first = "".join(vocab[i] for i in [*data["x"][0], data["labels"][0, -1]])
    assert first in text


LAYOUTS = {
    "tensor-parallel-2": {"stages": [["cpu:0", "cpu:1"]], "tensor_parallel": 2},
    "tensor-parallel-4": {"stages": [["cpu:0", "cpu:1", "cpu:2", "cpu:3"]], "tensor_parallel": 4},
    "data-parallel-2": {"stages": [["cpu:0", "cpu:1"]], "data_parallel": 2},
    "data-parallel-4": {"stages": [["cpu:0", "cpu:1", "cpu:2", "cpu:3"]], "data_parallel": 4},
    "pipeline-2": {"stages": ["cpu:0", "cpu:1"], "micro_batches": 2},
    "data-parallel-2-tensor-parallel-2": {
        "stages": [["cpu:0", "cpu:1", "cpu:2", "cpu:3"]],
        "data_parallel": 2,
        "tensor_parallel": 2,
    },
    "pipeline-2-data-parallel-2-tensor-parallel-2": {
        "stages": [[f"cpu:{k}" for k in range(4)], [f"cpu:{k}" for k in range(4, 8)]],
        "data_parallel": 2,
        "tensor_parallel": 2,
        "micro_batches": 2,
    },
    "pipeline-2-tensor-parallel-2": {
        "stages": [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]],
        "tensor_parallel": 2,
        "micro_batches": 2,
    },
}


@pytest.fixture(scope="module")
def one_device():
    return train(config())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_training_equals_one_device(layout, one_device):
    got = train(config(LAYOUTS[layout]))
    np.testing.assert_allclose(got.losses, one_device.losses, rtol=1e-6)
    replicas = LAYOUTS[layout].get("data_parallel", 1) if LAYOUTS[layout].get("tensor_parallel") else 1
    # with tensor and data parallelism at once each replica has its own parameters, NAME@r
    names = [f"{name}@{r}" if r else name for name in one_device.parameters for r in range(replicas)]
    assert sorted(got.parameters) == sorted(names)
    for name in names:
        want = one_device.parameters[name.split("@")[0]]
        np.testing.assert_allclose(got.parameters[name], want, rtol=1e-6, atol=1e-12, err_msg=name)


def activation_all_reduces(plan):
    """(forward, backward) all-reduces that carry activations or their gradients, not a
    parameter's gradient (what an update reads)."""
    updates = {a.id for a in plan.actors if a.kind == "update"}
    forward = backward = 0
    for coll in plan.collectives:
        if coll.op != "all_reduce":
            continue
        actor = plan.actors[coll.actors[0]]
        readers = {c.actor for o in actor.outputs for c in plan.registers[o].consumers}
        if readers & updates:
            continue
        if actor.backward:
            backward += 1
        else:
            forward += 1
    return forward, backward


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_annotations_make_two_all_reduces_per_block_each_way(layers, tp):
    cfg = parse_config(
        SMALL
        | {
            "model": SMALL["model"] | {"layers": layers},
            "parallel": {"stages": [[f"cpu:{k}" for k in range(tp)]], "tensor_parallel": tp},
            "runtime": {"fusion": False},
        }
    )
    plan = compile_config(cfg)
    assert activation_all_reduces(plan) == (2 * layers, 2 * layers)
    assert {c.op for c in plan.collectives} == {"all_reduce"}
    annotated = {
        f"h0.{w}": sbp for w, sbp in [("wq", "S(1)"), ("wk", "S(1)"), ("w1", "S(1)"), ("wo", "S(0)")]
    }
    assert {name: plan.sbp[name] for name in annotated} == annotated
    assert plan.sbp["h0.ln1.gamma"] == "B" and plan.sbp["x"] == "B"
    assert "SBP of the tensors on several devices\n" in plan.summary()
    shown = overview(plan)
    assert "h0.wq S(1), h0.wk S(1)" in shown
    assert f"predicted communication: {plan.communication_per_step():,} bytes a step" in shown


def test_a_pipeline_of_tensor_parallel_stages_has_several_micro_batches_in_flight():
    """A stage's all-reduces within its process launch when they can act, by priority, not
    in the collective order: in that order each micro-batch's backward all-reduces came
    before the next one's forward ones, and one micro-batch went through the pipeline at
    a time. Under 1F1B the first stage ends its second forward while the last one runs
    the first forward and backward. On the virtual clock, with the shipped calibration's
    durations, so that a loaded machine's timing cannot decide it; the clock follows the
    same wiring as a real run."""
    layout = {"stages": [["cpu:0", "cpu:1"], ["cpu:2", "cpu:3"]], "tensor_parallel": 2, "micro_batches": 4}
    prediction = predict(config(layout), shipped("transformer"))
    assert prediction.result.ordered_by == "replay"
    chrome = prediction.chrome
    spans = [s for s in parse(chrome).spans if s.category == "compute"]

    def of(stage: int, phase: str, micro_batch: int) -> list:
        return [
            s
            for s in spans
            if tuple(s.args.get(k) for k in ("iteration", "stage", "phase", "micro_batch"))
            == (0, stage, phase, micro_batch)
        ]

    second_forward_ends = max(s.end for s in of(0, "forward", 1))
    assert second_forward_ends < min(s.start for s in of(0, "backward", 0))


def test_the_shipped_config_trains_and_its_loss_falls():
    result = train(load_config("configs/transformer.yaml", ["train.steps=20"]))
    assert np.mean(result.losses[-5:]) < np.mean(result.losses[:5]) - 0.5


def test_bad_transformer_configs_are_refused():
    from actorflow.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^model\.heads: 3 does not divide model\.d_model 16$"):
        config(heads=3)
    with pytest.raises(ConfigError, match=r"^parallel\.tensor_parallel: 3 does not divide model\.heads 4$"):
        config({"stages": [["cpu:0", "cpu:1", "cpu:2"]], "tensor_parallel": 3})
    with pytest.raises(
        ConfigError, match=r"^model\.vocab: sonnets\.txt has 54 distinct characters, more than 40$"
    ):
        dataset(config(vocab=40))
    with pytest.raises(ConfigError, match=r"^model\.sizes: only mlp uses sizes"):
        config(sizes=[4, 2])
    with pytest.raises(ConfigError, match=r"^train\.optimizer\.shard: not with tensor and data parallelism"):
        parse_config(
            SMALL
            | {
                "train": SMALL["train"] | {"optimizer": {"kind": "adam", "lr": 0.01, "shard": True}},
                "parallel": {
                    "stages": [["cpu:0", "cpu:1", "cpu:2", "cpu:3"]],
                    "tensor_parallel": 2,
                    "data_parallel": 2,
                },
            }
        )


def test_the_shipped_config_with_reuse_reuses_its_layers_all_reduces_and_trains_as_without():
    """Each stage's per-layer all-reduces (forward and backward) read what the layers
    before them computed from the last ones: chained calls, one subgraph per stage."""
    base = ["train.steps=4", "runtime.max_ops_per_stream=1"]
    plain = load_config("configs/transformer.yaml", base)
    reusing = load_config("configs/transformer.yaml", [*base, "runtime.comm_reuse=-1"])
    plans = [compile_config(c) for c in (plain, reusing)]
    streams = [sum(s.kind == "collective" for s in p.streams) for p in plans]
    assert streams == [10, 4]
    calls = sorted(plans[1].actors[c.actors[0]].calls for c in plans[1].collectives)
    assert calls == [1, 1, 4, 4]
    want, got = train(plain), train(reusing)
    assert got.losses == want.losses
    for name, value in want.parameters.items():
        np.testing.assert_array_equal(got.parameters[name], value, err_msg=name)
