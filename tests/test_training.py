"""Parameters updated in place by optimizers: same results as plain numpy training, and
every update ordered after every read of its parameter."""

import numpy as np
import pytest

import actorflow as af

RNG = np.random.default_rng(7)
X = RNG.standard_normal((8, 3))
W1 = RNG.standard_normal((3, 4)) * 0.5
W2 = RNG.standard_normal((4, 2)) * 0.5


def two_layer_graph(optimizer, devices=("cpu:0", "cpu:1")):
    """loss = relu(relu(x W1) W2), summed by gradients' default dy = ones; W1 and W2 on two devices."""
    with af.Graph() as g:
        x = af.placeholder("x", (8, 3), "float64", devices[0])
        w1 = af.parameter("w1", W1, devices[0])
        w2 = af.parameter("w2", W2, devices[1])
        h = af.ops.to_device(af.ops.relu(af.ops.matmul(x, w1)), devices[1])
        loss = af.ops.relu(af.ops.matmul(h, w2))
        af.minimize(loss, optimizer)
        af.output("loss", loss)
    return g


def numpy_grads(x, w1, w2):
    a = x @ w1
    h = np.maximum(a, 0)
    b = h @ w2
    d_b = (b > 0).astype(float)
    d_w2 = h.T @ d_b
    d_a = (d_b @ w2.T) * (a > 0)
    return x.T @ d_a, d_w2, np.maximum(b, 0)


def numpy_sgd(steps, lr, momentum):
    w1, w2 = W1.copy(), W2.copy()
    v1, v2 = np.zeros_like(w1), np.zeros_like(w2)
    losses = []
    for _ in range(steps):
        g1, g2, loss = numpy_grads(X, w1, w2)
        losses.append(loss)
        v1, v2 = momentum * v1 + g1, momentum * v2 + g2
        w1, w2 = w1 - lr * v1, w2 - lr * v2
    return w1, w2, losses


def numpy_adam(steps, lr, b1=0.9, b2=0.999, eps=1e-8):
    ws = [W1.copy(), W2.copy()]
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for t in range(1, steps + 1):
        grads = numpy_grads(X, *ws)[:2]
        for k, g in enumerate(grads):
            ms[k] = b1 * ms[k] + (1 - b1) * g
            vs[k] = b2 * vs[k] + (1 - b2) * g * g
            m_hat, v_hat = ms[k] / (1 - b1**t), vs[k] / (1 - b2**t)
            ws[k] = ws[k] - lr * m_hat / (np.sqrt(v_hat) + eps)
    return ws


@pytest.mark.parametrize("quota", [1, 2, 3])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_on_two_devices_matches_numpy(quota, momentum):
    plan = af.compile(two_layer_graph(af.optim.SGD(lr=0.01, momentum=momentum)), quota=quota)
    with af.Session(plan) as s:
        outs = s.run([{"x": X}] * 6)
        params = s.parameters()
    w1, w2, losses = numpy_sgd(6, 0.01, momentum)
    np.testing.assert_allclose(params["w1"], w1, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(params["w2"], w2, rtol=1e-12, atol=1e-14)
    for out, loss in zip(outs, losses):
        np.testing.assert_allclose(out["loss"], loss, rtol=1e-12, atol=1e-14)
    assert set(params) == {"w1", "w2"}


def test_adam_matches_numpy_across_runs():
    plan = af.compile(two_layer_graph(af.optim.Adam(lr=0.05)))
    with af.Session(plan) as s:
        for _ in range(3):
            s.run([{"x": X}] * 2)
        params = s.parameters()
    w1, w2 = numpy_adam(6, 0.05)
    np.testing.assert_allclose(params["w1"], w1, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(params["w2"], w2, rtol=1e-12, atol=1e-14)


def test_updated_parameters_become_variables_and_unordered_readers_get_control_edges():
    plan = af.compile(two_layer_graph(af.optim.SGD(lr=0.1)))
    kinds = {a.name: a.kind for a in plan.actors}
    assert kinds["w1"] == kinds["w2"] == "variable"
    variables = {a.outputs[0] for a in plan.actors if a.kind == "variable"}
    assert {plan.registers[r].quota for r in variables} == {1}
    control = [r for r in plan.registers if r.control]
    # W2 is read by the backward matmul for dh, which does not lead to W2's update
    assert control and all(plan.actors[r.consumers[0].actor].name == "w2.sgd_update" for r in control)
    assert all(r.nbytes == 0 for r in control)


def test_each_update_runs_after_every_read_of_its_iteration():
    plan = af.compile(two_layer_graph(af.optim.SGD(lr=0.1)), quota=3)
    with af.Session(plan, trace=True) as s:
        s.run([{"x": X}] * 5)
        spans = {(sp.args["actor"], sp.args["iteration"]): sp for sp in s.recorder.kernels()}
    for p in plan.parameters:
        reg = plan.registers[p.register]
        update = next(plan.actors[c.actor] for c in reg.consumers if plan.actors[c.actor].kind == "update")
        readers = [plan.actors[c.actor].name for c in reg.consumers if c.actor != update.id]
        for it in range(5):
            done = spans[(update.name, it)]
            for r in readers:
                assert spans[(r, it)].end <= done.start, (r, it)
                if it + 1 < 5:
                    assert done.end <= spans[(r, it + 1)].start, (r, it + 1)


def test_minimize_refuses_a_loss_without_parameters():
    with af.Graph():
        x = af.placeholder("x", (2, 2))
        with pytest.raises(af.GraphError, match="depends on no parameter"):
            af.minimize(af.ops.relu(x), af.optim.SGD(lr=0.1))


def test_updated_plan_round_trips():
    plan = af.compile(two_layer_graph(af.optim.Adam(lr=0.05)))
    same = af.Plan.from_bytes(plan.to_bytes())
    assert same == plan
    a = af.run(plan, [{"x": X}] * 3)
    b = af.run(same, [{"x": X}] * 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["loss"], y["loss"])
