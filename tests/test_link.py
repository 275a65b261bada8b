"""Link emulation: each collective lasts as long as a ring collective on the emulated link."""

import numpy as np
import pytest

import actorflow as af

GB = 1e9


def collective_graph(op: str, devices: int, shape=(8, 4)):
    with af.Graph() as g:
        xs = [af.placeholder(f"x{d}", shape, "float64", f"cpu:{d}") for d in range(devices)]
        if op == "broadcast":
            outs = af.ops.broadcast(xs[0], [f"cpu:{d}" for d in range(devices)])
        else:
            outs = getattr(af.ops, op)(xs)
        for d, out in enumerate(outs):
            af.output(f"y{d}", out)
    return g


@pytest.mark.parametrize("devices", [2, 3, 4])
@pytest.mark.parametrize(
    "op, factor",
    [
        ("all_reduce", lambda n: 2 * (n - 1) / n),
        ("all_gather", lambda n: n - 1),
        ("reduce_scatter", lambda n: (n - 1) / n),
        ("all_to_all", lambda n: (n - 1) / n),
        ("broadcast", lambda n: 1.0),
    ],
)
def test_each_collective_gets_its_ring_time(op, factor, devices):
    shape = (12, 4)
    nbytes = 12 * 4 * 8
    plan = af.compile(collective_graph(op, devices, shape), link_bandwidth=1 * GB, link_latency=20e-6)
    (coll,) = plan.collectives
    assert coll.seconds == pytest.approx(factor(devices) * nbytes / GB + 20e-6)
    assert plan.link == (1 * GB, 20e-6)


def test_off_by_default_and_said_in_the_summary_when_on():
    plan = af.compile(collective_graph("all_reduce", 2))
    assert plan.link is None and plan.collectives[0].seconds == 0.0
    assert "emulated" not in plan.summary()
    emulated = af.compile(collective_graph("all_reduce", 2), link_bandwidth=2 * GB, link_latency=1e-5)
    assert "link emulated: 2 GB/s, 10 us latency" in emulated.summary()
    assert af.Plan.from_bytes(emulated.to_bytes()) == emulated


def test_a_collective_lasts_at_least_its_emulated_time_and_computes_the_same():
    bandwidth = 8 * 4 * 8 / 0.01  # the all-reduce of one (8, 4) float64 tensor takes 10 ms
    plan = af.compile(collective_graph("all_reduce", 2), link_bandwidth=bandwidth)
    (coll,) = plan.collectives
    assert coll.seconds == pytest.approx(0.01)
    feeds = {"x0": np.ones((8, 4)), "x1": np.full((8, 4), 2.0)}
    with af.Session(plan, trace=True) as s:
        out = s.run([feeds] * 3)
        spans = [sp for sp in s.recorder.spans if sp.name == coll.name]
    assert len(spans) == 3
    assert all(sp.end - sp.start >= coll.seconds for sp in spans)
    for o in out:
        np.testing.assert_array_equal(o["y0"], np.full((8, 4), 3.0))
        np.testing.assert_array_equal(o["y1"], np.full((8, 4), 3.0))


@pytest.mark.parametrize(
    "bandwidth, latency, option",
    [(0, 0.0, "link_bandwidth"), (-1, 0.0, "link_bandwidth"), (1e9, -1e-6, "link_latency")],
)
def test_bad_link_options_are_refused(bandwidth, latency, option):
    with pytest.raises(af.CompileError, match=f"^{option}: "):
        af.compile(collective_graph("all_reduce", 2), link_bandwidth=bandwidth, link_latency=latency)
