"""overlap=False: collectives act as if they shared their devices' compute streams."""

import numpy as np
import pytest

import actorflow as af
import userfns


def plan_with_independent_compute(overlap: bool) -> af.Plan:
    """An all-reduce lasting 30 ms (emulated) beside compute on cpu:0 that does not need it."""
    with af.Graph() as g:
        x0 = af.placeholder("x0", (4,), "float64", "cpu:0")
        x1 = af.placeholder("x1", (4,), "float64", "cpu:1")
        r = af.ops.all_reduce([af.ops.relu(x0), af.ops.relu(x1)], name="ar")
        af.output("r0", r[0])
        af.output("r1", r[1])
        side = af.ops.call(userfns.sleep_20ms, x0, shape=(4,), dtype="float64", name="side")
        af.output("side_out", side)
    return af.compile(g, link_bandwidth=4 * 8 / 0.03, overlap=overlap)


def spans(plan: af.Plan, iterations: int = 3):
    feeds = {"x0": np.ones(4), "x1": np.full(4, 2.0)}
    with af.Session(plan, trace=True) as s:
        outs = s.run([feeds] * iterations)
        recorded = s.recorder.kernels()
    for out in outs:
        np.testing.assert_array_equal(out["r0"], np.full(4, 3.0))
        np.testing.assert_array_equal(out["side_out"], np.ones(4))
    return recorded


def overlapping(a, b) -> bool:
    return a.start < b.end and b.start < a.end


@pytest.mark.parametrize("overlap", [False, True])
def test_fenced_collectives_never_run_beside_compute_on_their_devices(overlap):
    plan = plan_with_independent_compute(overlap)
    assert plan.overlap is overlap
    recorded = spans(plan)
    collective = [s for s in recorded if s.name == "ar"]
    compute = [s for s in recorded if s.thread.endswith("/compute")]
    together = [(c, k) for c in collective for k in compute if overlapping(c, k)]
    if overlap:
        assert together, "independent compute should run while the collective is on the link"
    else:
        assert not together
