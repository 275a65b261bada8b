"""The sans-IO ActorState: plain method calls, no trio, no threads."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actorflow.runtime.actor_state import ActorState


def make(n_inputs=1, quotas=(2,), consumers=(1,), acts=10) -> ActorState:
    s = ActorState(n_inputs, list(quotas), list(consumers))
    s.acts_left = acts
    return s


# -- can_act -----------------------------------------------------------------------


def test_fresh_state_has_all_credits_and_nothing_ready():
    s = ActorState(2, [3, 1], [1, 2])
    assert s.acts_left == 0
    assert s.iteration == 0
    assert [s.held(0), s.held(1)] == [0, 0]
    assert s.max_held == [0, 0]
    assert s.lacking() == ([0, 1], [])


def test_cannot_act_without_acts_left():
    s = make(n_inputs=0, acts=0)
    assert not s.can_act()
    s.acts_left = 1
    assert s.can_act()


def test_cannot_act_until_every_input_is_ready():
    s = make(n_inputs=2)
    assert not s.can_act()
    s.on_ready(0, 0, "ev0")
    assert not s.can_act()
    assert s.lacking() == ([1], [])
    s.on_ready(1, 1, "ev1")
    assert s.can_act()
    assert s.lacking() == ([], [])


def test_source_actor_with_no_inputs_acts_while_it_has_credits():
    s = make(n_inputs=0, quotas=(2,), consumers=(1,), acts=5)
    assert s.can_act()
    s.take()
    assert s.can_act()
    s.take()
    assert not s.can_act()
    assert s.lacking() == ([], [0])


def test_sink_actor_with_no_outputs_acts_once_per_ready_input():
    s = ActorState(1, [], [])
    s.acts_left = 3
    assert not s.can_act()
    s.on_ready(0, 0, None)
    assert s.can_act()
    assert s.take() == (0, [(0, None)], [])
    assert not s.can_act()
    assert s.lacking() == ([0], [])


# -- take ---------------------------------------------------------------------------


def test_take_consumes_one_ready_register_per_input_in_fifo_order():
    s = make(n_inputs=2, quotas=(4,), consumers=(1,))
    s.on_ready(0, 0, "a0")
    s.on_ready(0, 1, "a1")
    s.on_ready(1, 3, "b3")
    s.on_ready(1, 2, "b2")
    it, ins, outs = s.take()
    assert it == 0
    assert ins == [(0, "a0"), (3, "b3")]
    assert outs == [0]
    it, ins, outs = s.take()
    assert it == 1
    assert ins == [(1, "a1"), (2, "b2")]
    assert outs == [1]
    assert not s.can_act()
    assert s.lacking() == ([0, 1], [])


def test_take_counts_iterations_and_acts_left():
    s = make(n_inputs=0, quotas=(3,), consumers=(0,), acts=3)
    assert [s.take()[0] for _ in range(3)] == [0, 1, 2]
    assert s.iteration == 3
    assert s.acts_left == 0
    assert not s.can_act()


def test_take_hands_out_distinct_buffers_until_the_quota_is_used():
    s = make(n_inputs=0, quotas=(3,), consumers=(1,))
    outs = [s.take()[2][0] for _ in range(3)]
    assert sorted(outs) == [0, 1, 2]
    assert s.held(0) == 3
    assert not s.can_act()


def test_take_one_credit_per_output():
    s = make(n_inputs=0, quotas=(2, 1), consumers=(1, 1))
    _, _, outs = s.take()
    assert outs == [0, 0]
    assert s.held(0) == 1 and s.held(1) == 1
    # the second output (quota 1) has no credit left, even though the first has one
    assert not s.can_act()
    assert s.lacking() == ([], [1])


# -- credits -------------------------------------------------------------------------


def test_credit_comes_back_on_free():
    s = make(n_inputs=0, quotas=(1,), consumers=(1,))
    _, _, [b] = s.take()
    assert not s.can_act()
    assert s.on_free(0, b) is True
    assert s.held(0) == 0
    assert s.can_act()


def test_credit_returns_only_when_every_consumer_freed_it():
    s = make(n_inputs=0, quotas=(1,), consumers=(3,))
    _, _, [b] = s.take()
    assert s.on_free(0, b) is False
    assert not s.can_act()
    assert s.on_free(0, b) is False
    assert not s.can_act()
    assert s.held(0) == 1
    assert s.on_free(0, b) is True
    assert s.held(0) == 0
    assert s.can_act()


def test_frees_of_different_buffers_are_counted_separately():
    s = make(n_inputs=0, quotas=(2,), consumers=(2,))
    _, _, [b0] = s.take()
    _, _, [b1] = s.take()
    assert b0 != b1
    assert s.on_free(0, b0) is False
    assert s.on_free(0, b1) is False
    assert s.on_free(0, b1) is True  # b1 done first: it is the one that comes back
    assert s.held(0) == 1
    _, _, [again] = s.take()
    assert again == b1
    assert s.on_free(0, b0) is True
    assert s.held(0) == 1


def test_freed_buffers_are_reused_in_free_order():
    s = make(n_inputs=0, quotas=(3,), consumers=(1,))
    bufs = [s.take()[2][0] for _ in range(3)]
    for b in reversed(bufs):
        s.on_free(0, b)
    assert [s.take()[2][0] for _ in range(3)] == list(reversed(bufs))


def test_output_with_no_consumer_gets_its_credit_back_at_once():
    s = make(n_inputs=0, quotas=(1,), consumers=(0,), acts=5)
    seen = []
    for _ in range(5):
        assert s.can_act()
        seen.append(s.take()[2][0])
    assert seen == [0] * 5
    assert s.held(0) == 0
    assert s.lacking() == ([], [])


def test_output_with_no_consumer_beside_one_with_consumers():
    s = make(n_inputs=0, quotas=(2, 2), consumers=(0, 1), acts=5)
    s.take()
    s.take()
    assert s.held(0) == 0
    assert s.held(1) == 2
    assert s.lacking() == ([], [1])
    assert not s.can_act()


# -- max_held --------------------------------------------------------------------------


def test_max_held_records_the_peak_not_the_current_count():
    s = make(n_inputs=0, quotas=(3,), consumers=(1,))
    b0 = s.take()[2][0]
    b1 = s.take()[2][0]
    assert s.max_held == [2]
    s.on_free(0, b0)
    s.on_free(0, b1)
    assert s.held(0) == 0
    assert s.max_held == [2]
    s.take()
    assert s.max_held == [2]
    s.take()
    s.take()
    assert s.max_held == [3]


def test_max_held_is_per_output():
    s = make(n_inputs=0, quotas=(1, 3), consumers=(0, 1), acts=3)
    for _ in range(3):
        s.take()
    assert s.max_held == [1, 3]


def test_max_held_never_exceeds_the_quota():
    s = make(n_inputs=0, quotas=(2,), consumers=(1,), acts=100)
    for _ in range(50):
        while s.can_act():
            _, _, [b] = s.take()
        s.on_free(0, b)
    assert s.max_held == [2]


# -- lacking ------------------------------------------------------------------------------


def test_lacking_names_missing_inputs_and_outputs_by_index():
    s = make(n_inputs=3, quotas=(1, 1, 2), consumers=(1, 1, 1))
    s.on_ready(1, 0, None)
    assert s.lacking() == ([0, 2], [])
    for slot in (0, 1, 2):
        s.on_ready(slot, 0, None)
    s.take()  # input 1 had two ready registers; outputs 0 and 1 are now out of credit
    assert s.lacking() == ([0, 2], [0, 1])


def test_lacking_ignores_acts_left():
    s = make(n_inputs=0, acts=0)
    assert s.lacking() == ([], [])
    assert not s.can_act()


# -- random sequences ----------------------------------------------------------------------


class ActorStateMachine(RuleBasedStateMachine):
    """Drive one ActorState the way drivers do; a model tracks what it must hold."""

    @initialize(
        n_inputs=st.integers(0, 3),
        outputs=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 3)), min_size=0, max_size=3),
    )
    def setup(self, n_inputs, outputs):
        self.quotas = [q for q, _ in outputs]
        self.n_consumers = [c for _, c in outputs]
        self.state = ActorState(n_inputs, self.quotas, self.n_consumers)
        self.n_inputs = n_inputs
        # (out, index) -> consumers that still have to free it
        self.outstanding: dict[tuple[int, int], int] = {}
        self.ready = [0] * n_inputs
        self.taken = 0

    @rule(n=st.integers(1, 3))
    def add_acts(self, n):
        self.state.acts_left += n

    @precondition(lambda self: self.n_inputs > 0)
    @rule(data=st.data())
    def input_ready(self, data):
        slot = data.draw(st.integers(0, self.n_inputs - 1))
        self.state.on_ready(slot, data.draw(st.integers(0, 3)), ("event", slot))
        self.ready[slot] += 1

    @rule()
    def take(self):
        can = (
            self.state.acts_left > 0
            and all(self.ready)
            and all(self.state.held(k) < q for k, q in enumerate(self.quotas))
        )
        assert self.state.can_act() == can
        if not can:
            return
        iteration, ins, outs = self.state.take()
        assert iteration == self.taken
        self.taken += 1
        assert len(ins) == self.n_inputs
        assert len(outs) == len(self.quotas)
        self.ready = [r - 1 for r in self.ready]
        for k, index in enumerate(outs):
            assert 0 <= index < self.quotas[k]
            assert (k, index) not in self.outstanding, "handed out a buffer still in use"
            if self.n_consumers[k]:
                self.outstanding[(k, index)] = self.n_consumers[k]

    @precondition(lambda self: bool(self.outstanding))
    @rule(data=st.data())
    def free(self, data):
        key = data.draw(st.sampled_from(sorted(self.outstanding)))
        self.outstanding[key] -= 1
        back = self.state.on_free(*key)
        assert back == (self.outstanding[key] == 0)
        if back:
            del self.outstanding[key]

    @invariant()
    def held_within_quota(self):
        if not hasattr(self, "state"):
            return
        for k, q in enumerate(self.quotas):
            held = self.state.held(k)
            assert 0 <= held <= q
            assert held == sum(1 for (out, _) in self.outstanding if out == k)
            assert 0 <= self.state.max_held[k] <= q
            assert len(set(self.state.free[k])) == len(self.state.free[k])

    @invariant()
    def lacking_matches(self):
        if not hasattr(self, "state"):
            return
        ins, outs = self.state.lacking()
        assert ins == [k for k, r in enumerate(self.ready) if r == 0]
        assert outs == [k for k, q in enumerate(self.quotas) if self.state.held(k) == q]


TestActorStateMachine = ActorStateMachine.TestCase
TestActorStateMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("seed", range(20))
def test_random_protocol_sequence_keeps_held_within_quota(seed):
    """A producer with two outputs and several consumers, driven by random interleavings."""
    rng = random.Random(seed)
    quotas = [rng.randint(1, 3), rng.randint(1, 3)]
    consumers = [rng.randint(1, 3), rng.randint(0, 2)]
    s = ActorState(0, quotas, consumers)
    s.acts_left = 200
    pending: list[tuple[int, int]] = []  # one entry per (out, index) free still owed
    acted = 0
    for _ in range(2000):
        if s.can_act() and (not pending or rng.random() < 0.5):
            _, _, outs = s.take()
            acted += 1
            for k, index in enumerate(outs):
                pending.extend([(k, index)] * consumers[k])
        elif pending:
            out, index = pending.pop(rng.randrange(len(pending)))
            s.on_free(out, index)
        for k, q in enumerate(quotas):
            assert 0 <= s.held(k) <= q
        if not s.can_act() and not pending:
            break
    assert acted == 200
    assert not pending
    assert [s.held(0), s.held(1)] == [0, 0]
    assert s.max_held[0] <= quotas[0] and s.max_held[1] <= quotas[1]
