"""Every single-bit flip of a serialized Plan is refused at load, or the plan runs to the
original's result (or to another result where the flip changed a value the plan carries),
with no raw exception, stall or hang (see ``plan_fuzz``; ``python tests/plan_fuzz.py``
prints the counts)."""

from __future__ import annotations

import pytest

import plan_fuzz

# flipped parameter values may overflow in the kernels: a result, not a failure
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def plan():
    return plan_fuzz.small_plan()


def test_every_flip_of_the_sealed_bytes_is_refused_at_load(plan):
    counts = plan_fuzz.fuzz_sealed(plan)
    print(plan_fuzz.table(counts))
    assert sum(counts.values()) == len(plan.to_bytes()) * 8
    assert all(k.startswith("rejected at load") for k in counts)
    # what the digest doesn't see is the envelope around it: its keys, format and lengths
    assert counts["rejected at load: digest"] > 0.95 * sum(counts.values())


@pytest.mark.long
def test_every_flip_of_the_resealed_payload_is_refused_or_runs_right(plan):
    counts = plan_fuzz.fuzz_payload(plan)
    print(plan_fuzz.table(counts))
    assert {k: n for k, n in counts.items() if k.startswith("FAILED")} == {}
    assert sum(counts.values()) == len(plan_fuzz._unseal(plan.to_bytes())) * 8
    for check in ("msgpack decode", "schema", "consistency"):
        assert counts[f"rejected at load: {check}"] > 0, check
    assert counts["ran equal"] > 0
    assert counts["ran different: a value changed"] > 0
