"""The compiler's SBP search (``compiler.sbp_search``): placeholders and parameters on
several devices given no SBP get the one that makes a step cheapest. Annotations are
never changed; the chosen plan communicates no more than the hand strategies (data
parallel, Megatron) and trains to the one-device run's parameters."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actorflow as af
import test_transformer
from actorflow.compiler.sbp_search import predicted_cost
from actorflow.config import parse_config
from actorflow.training import transformer
from actorflow.training.data import dataset, step_feeds

RNG = np.random.default_rng(0)
N, D, H, C = 32, 16, 64, 8
W1, W2 = RNG.standard_normal((D, H)) * 0.3, RNG.standard_normal((H, C)) * 0.3
X, Y = RNG.standard_normal((N, D)), RNG.integers(0, C, N)
DP = {"x": af.S(0), "y": af.S(0), "w1": af.B, "w2": af.B}
MEGATRON = {"x": af.B, "y": af.B, "w1": af.S(1), "w2": af.S(0)}


def mlp(sbp, devices=2):
    """A two-layer MLP on ``devices`` devices, each tensor with ``sbp[name]`` (None: the
    compiler's choice), or on cpu:0 alone for ``sbp`` None."""
    place = [f"cpu:{k}" for k in range(devices)] if sbp is not None else "cpu:0"
    sbp = sbp or dict.fromkeys(DP)
    with af.Graph() as g:
        x = af.placeholder("x", (N, D), "float64", place, sbp["x"])
        y = af.placeholder("y", (N,), "int64", place, sbp["y"])
        w1 = af.parameter("w1", W1, place, sbp["w1"])
        w2 = af.parameter("w2", W2, place, sbp["w2"])
        loss = af.ops.softmax_cross_entropy(af.ops.matmul(af.ops.relu(af.ops.matmul(x, w1)), w2), y)
        af.minimize(loss, af.optim.SGD(0.1, momentum=0.5))
        af.output("loss", loss)
    return g


def trained(plan, feeds, steps=3):
    with af.Session(plan) as session:
        for _ in range(steps):
            session.run(feeds)
        return session.parameters()


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize(
    "given",
    [{}, {"x": af.S(0), "y": af.S(0)}, {"w1": af.S(1)}, {"w2": af.B}],
    ids=["nothing", "the batch", "w1 by column", "w2 replicated"],
)
def test_the_search_keeps_annotations_and_communicates_no_more_than_a_hand_strategy(given, devices):
    plan = af.compile(mlp({name: given.get(name) for name in DP}, devices))
    assert {name: plan.sbp[name] for name in given} == {name: repr(s) for name, s in given.items()}
    hand = [af.compile(mlp(strategy, devices)) for strategy in (DP, MEGATRON)]
    fitting = [h for h, s in zip(hand, (DP, MEGATRON)) if all(s[n] == v for n, v in given.items())]
    assert plan.communication_per_step() <= min(h.communication_per_step() for h in fitting or hand)
    want = trained(af.compile(mlp(None)), {"x": X, "y": Y})
    got = trained(plan, {"x": X, "y": Y})
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, err_msg=name)


def test_with_nothing_annotated_the_mlp_is_split_megatron_style():
    """Its activations (32 x 64) are smaller than its weights (16 x 64, 64 x 8): splitting
    the weights beats replicating them and all-reducing their gradients."""
    plan = af.compile(mlp(dict.fromkeys(DP)))
    assert {name: plan.sbp[name] for name in DP} == {name: repr(s) for name, s in MEGATRON.items()}


def test_the_chosen_strategy_costs_no_more_than_the_hand_ones():
    graph = mlp(dict.fromkeys(DP))
    plan = af.compile(graph)
    chosen = {name: _parse(plan.sbp[name]) for name in DP}
    assert predicted_cost(graph, chosen) <= min(predicted_cost(graph, s) for s in (DP, MEGATRON))


def _parse(text):
    return af.B if text == "B" else af.S(int(text[2]))


SMALL = test_transformer.SMALL | {
    "model": test_transformer.SMALL["model"] | {"d_model": 32, "layers": 1, "seq_len": 16},
    "train": test_transformer.SMALL["train"] | {"steps": 3},
}


def transformer_config(**parallel):
    return parse_config(SMALL | {"parallel": parallel})


def test_a_transformer_from_one_annotation_communicates_no_more_than_megatron_or_data_parallel():
    tp = transformer_config(stages=[["cpu:0", "cpu:1"]], tensor_parallel=2)
    dp = transformer_config(stages=[["cpu:0", "cpu:1"]], data_parallel=2)
    plan = af.compile(transformer.build_graph(tp, annotated={"h0.wq"}))
    assert plan.sbp["h0.wq"] == "S(1)"
    hand = [af.compile(transformer.build_graph(c)) for c in (tp, dp)]
    assert plan.communication_per_step() <= min(h.communication_per_step() for h in hand)
    one = transformer_config(stages=["cpu:0"])
    data = dataset(one)
    feeds = step_feeds(one, data, 0)
    want = trained(af.compile(transformer.build_graph(one)), feeds)
    got = trained(plan, feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-12, err_msg=name)


def test_what_the_search_cannot_replay_is_refused():
    with af.Graph() as g:
        x = af.placeholder("x", (N, D), "float64", ["cpu:0", "cpu:1"])
        alone = af.placeholder("alone", (N, D), "float64")
        af.output("y", af.ops.relu(x))
        af.output("z", af.ops.relu(alone))
        with pytest.raises(af.GraphError, match="compiler chooses"):
            af.gradients(af.ops.reduce_sum(x), [x])
        with pytest.raises(af.GraphError, match="compiler chooses"):
            af.box(x, af.B)
    with pytest.raises(af.CompileError, match=r"\['alone'\] are on one"):
        af.compile(g)


# -- random MLPs, random annotations --------------------------------------------------------

ACTIVATIONS = [af.ops.relu, af.ops.tanh, af.ops.gelu]


def random_mlp(data, devices):
    """An MLP of 1 to 3 layers whose widths the devices divide, each placeholder and
    parameter given a random valid SBP or left to the search (None); with the model's
    values for the one-device twin."""
    n = len(devices)
    widths = [
        data.draw(st.sampled_from([n * k for k in (2, 3, 4)]), label="width")
        for _ in range(data.draw(st.integers(2, 4)))
    ]
    rows = 2 * n
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    values = {f"w{k}": rng.standard_normal((a, b)) * 0.3 for k, (a, b) in enumerate(zip(widths, widths[1:]))}
    values |= {f"b{k}": rng.standard_normal(b) * 0.1 for k, b in enumerate(widths[1:])}
    activation = data.draw(st.sampled_from(ACTIVATIONS), label="activation")

    def sbp(shape):
        options = [None, af.B, *(af.S(a) for a in range(len(shape)))]
        return data.draw(st.sampled_from(options))

    x_sbp = data.draw(st.sampled_from([None, af.B, af.S(0)]), label="batch")
    given = {"x": x_sbp, "y": x_sbp} | {name: sbp(v.shape) for name, v in values.items()}

    def build(place):
        with af.Graph() as g:
            if place is None:
                h = af.placeholder("x", (rows, widths[0]), "float64")
                y = af.placeholder("y", (rows,), "int64")
                params = {name: af.parameter(name, v) for name, v in values.items()}
            else:
                h = af.placeholder("x", (rows, widths[0]), "float64", place, given["x"])
                y = af.placeholder("y", (rows,), "int64", place, given["y"])
                params = {name: af.parameter(name, v, place, given[name]) for name, v in values.items()}
            for k in range(len(widths) - 1):
                h = af.ops.bias_add(af.ops.matmul(h, params[f"w{k}"]), params[f"b{k}"])
                if k < len(widths) - 2:
                    h = activation(h)
            loss = af.ops.softmax_cross_entropy(h, y)
            af.minimize(loss, af.optim.SGD(0.1))
            af.output("loss", loss)
        return g

    feeds = {"x": rng.standard_normal((rows, widths[0])), "y": rng.integers(0, widths[-1], rows)}
    return build, given, feeds


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_annotations_are_kept_and_train_as_one_device(data):
    devices = [f"cpu:{k}" for k in range(data.draw(st.integers(2, 3), label="devices"))]
    build, given, feeds = random_mlp(data, devices)
    plan = af.compile(build(devices))
    assert {n: plan.sbp[n] for n, s in given.items() if s is not None} == {
        n: repr(s) for n, s in given.items() if s is not None
    }
    want = trained(af.compile(build(None)), feeds, steps=2)
    got = trained(plan, feeds, steps=2)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def test_the_search_logs_its_moves(caplog):
    with caplog.at_level("INFO", logger="actorflow.compiler"):
        af.compile(mlp(dict.fromkeys(DP)))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("SBP search")]
    assert lines[0].startswith("SBP search: 4 undecided tensors")
    assert any("w1 S(1)" in line for line in lines[1:-1])
    assert lines[-1].startswith("SBP search: done after")


@pytest.mark.parametrize("form", ["block", "per op"])
def test_recompute_marks_survive_the_search(form):
    place = ["cpu:0", "cpu:1"]
    with af.Graph() as g:
        x = af.placeholder("x", (N, D), "float64", place, af.S(0))
        y = af.placeholder("y", (N,), "int64", place)
        w1, w2 = af.parameter("w1", W1, place), af.parameter("w2", W2, place)
        if form == "block":
            with af.recompute():
                h = af.ops.relu(af.ops.matmul(x, w1))
        else:
            h = af.recompute(af.ops.relu(af.recompute(af.ops.matmul(x, w1))))
        loss = af.ops.softmax_cross_entropy(af.ops.matmul(h, w2), y)
        af.minimize(loss, af.optim.SGD(0.1, momentum=0.5))
        af.output("loss", loss)
    plan = af.compile(g)
    assert sorted(a.op for a in plan.actors if a.name.endswith(".recompute")) == [
        "matmul",
        "matmul",
        "relu",
        "relu",
    ]
    want = trained(af.compile(mlp(None)), {"x": X, "y": Y})
    got = trained(plan, {"x": X, "y": Y})
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, err_msg=name)
