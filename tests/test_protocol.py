"""The sans-IO actor protocol: plain method calls, no trio, no threads."""

from __future__ import annotations

import copy
import random
from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from actorflow.errors import ProtocolError
from actorflow.runtime.protocol import ActorProtocol


def make(n_inputs=1, quotas=(2,), consumers=(1,), acts=10) -> ActorProtocol:
    s = ActorProtocol(n_inputs, list(quotas), list(consumers))
    s.start(acts)
    return s


# -- can_act -----------------------------------------------------------------------


def test_fresh_state_has_all_credits_and_nothing_ready():
    s = ActorProtocol(2, [3, 1], [1, 2])
    assert s.acts_left == 0
    assert s.number == 0
    assert [s.held(0), s.held(1)] == [0, 0]
    assert s.max_held == [0, 0]
    assert s.lacking() == ([0, 1], [])


def test_cannot_act_without_acts_left():
    s = make(n_inputs=0, acts=0)
    assert not s.can_act()
    s.start(1)
    assert s.can_act()


def test_cannot_act_until_every_input_is_ready():
    s = make(n_inputs=2)
    assert not s.can_act()
    s.on_ready(0, 0)
    assert not s.can_act()
    assert s.lacking() == ([1], [])
    s.on_ready(1, 1)
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
    s = ActorProtocol(1, [], [])
    s.start(3)
    assert not s.can_act()
    s.on_ready(0, 0)
    assert s.can_act()
    assert s.take()[:3] == (0, [0], [])
    assert not s.can_act()
    assert s.lacking() == ([0], [])


# -- take ---------------------------------------------------------------------------


def test_take_consumes_one_ready_register_per_input_in_fifo_order():
    s = make(n_inputs=2, quotas=(4,), consumers=(1,))
    s.on_ready(0, 0)
    s.on_ready(0, 1)
    s.on_ready(1, 3)
    s.on_ready(1, 2)
    it, ins, outs = s.take()[:3]
    assert it == 0
    assert ins == [0, 3]
    assert outs == [0]
    it, ins, outs = s.take()[:3]
    assert it == 1
    assert ins == [1, 2]
    assert outs == [1]
    assert not s.can_act()
    assert s.lacking() == ([0, 1], [])


def test_take_counts_iterations_and_acts_left():
    s = make(n_inputs=0, quotas=(3,), consumers=(0,), acts=3)
    assert [s.take()[0] for _ in range(3)] == [0, 1, 2]
    assert s.number == 3
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
    outs = s.take().outputs
    assert outs == [0, 0]
    assert s.held(0) == 1 and s.held(1) == 1
    # the second output (quota 1) has no credit left, even though the first has one
    assert not s.can_act()
    assert s.lacking() == ([], [1])


# -- credits -------------------------------------------------------------------------


def test_credit_comes_back_on_free():
    s = make(n_inputs=0, quotas=(1,), consumers=(1,))
    [b] = s.take().outputs
    assert not s.can_act()
    assert s.on_free(0, b) is True
    assert s.held(0) == 0
    assert s.can_act()


def test_credit_returns_only_when_every_consumer_freed_it():
    s = make(n_inputs=0, quotas=(1,), consumers=(3,))
    [b] = s.take().outputs
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
    [b0] = s.take().outputs
    [b1] = s.take().outputs
    assert b0 != b1
    assert s.on_free(0, b0) is False
    assert s.on_free(0, b1) is False
    assert s.on_free(0, b1) is True  # b1 done first: it is the one that comes back
    assert s.held(0) == 1
    [again] = s.take().outputs
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
            [b] = s.take().outputs
        s.on_free(0, b)
    assert s.max_held == [2]


# -- lacking ------------------------------------------------------------------------------


def test_lacking_names_missing_inputs_and_outputs_by_index():
    s = make(n_inputs=3, quotas=(1, 1, 2), consumers=(1, 1, 1))
    s.on_ready(1, 0)
    assert s.lacking() == ([0, 2], [])
    for slot in (0, 1, 2):
        s.on_ready(slot, 0)
    s.take()  # input 1 had two ready registers; outputs 0 and 1 are now out of credit
    assert s.lacking() == ([0, 2], [0, 1])


def test_lacking_ignores_acts_left():
    s = make(n_inputs=0, acts=0)
    assert s.lacking() == ([], [])
    assert not s.can_act()


# -- holds (a parameter read per micro-batch) and periods (an accumulate's output) ----------


def held(hold: int, quotas=(1,), consumers=(0,), acts=20) -> ActorProtocol:
    """One input held for ``hold`` acts, outputs published every act."""
    s = ActorProtocol(1, list(quotas), list(consumers), holds=[hold])
    s.start(acts)
    return s


def periodic(period: int, quota: int = 2, consumers: int = 1, acts: int = 20) -> ActorProtocol:
    """A source whose one output is published every ``period`` acts."""
    s = ActorProtocol(0, [quota], [consumers], periods=[period])
    s.start(acts)
    return s


def test_a_held_register_serves_hold_acts_and_is_released_after_the_last():
    s = held(3)
    s.on_ready(0, 5)
    s.on_ready(0, 6)
    seen = []
    for _ in range(6):
        act = s.take()
        seen.append((act.inputs, 0 in act.releases))
    assert seen == [
        ([5], False),
        ([5], False),
        ([5], True),
        ([6], False),
        ([6], False),
        ([6], True),
    ]
    assert s.current_in == [6]


def test_a_held_input_needs_a_ready_register_only_at_the_first_act_of_a_hold():
    s = held(2)
    assert not s.can_act()
    assert s.lacking() == ([0], [])
    s.on_ready(0, 0)
    s.take()
    assert s.ready[0] == deque()
    assert s.can_act()  # act 1 still uses register 0
    assert s.lacking() == ([], [])
    s.take()
    assert not s.can_act()  # act 2 starts a new hold
    assert s.lacking() == ([0], [])


def test_a_register_held_for_one_act_is_released_at_every_act():
    s = ActorProtocol(2, [9], [0], holds=[1, 4])
    s.start(9)
    for k in range(9):
        s.on_ready(0, k)
    s.on_ready(1, 0)
    s.on_ready(1, 1)
    s.on_ready(1, 2)
    releases = [s.take().releases for _ in range(9)]
    assert [0 in r for r in releases] == [True] * 9
    assert [1 in r for r in releases] == [False, False, False, True] * 2 + [False]


def test_a_held_input_beside_a_plain_one_takes_each_at_its_own_rate():
    s = ActorProtocol(2, [4], [0], holds=[1, 3])
    s.start(3)
    for k in range(3):
        s.on_ready(0, k)
    s.on_ready(1, 9)
    acts = [s.take() for _ in range(3)]
    assert [a.inputs for a in acts] == [[0, 9], [1, 9], [2, 9]]
    assert [list(a.releases) for a in acts] == [[0], [0], [0, 1]]


def test_an_output_published_every_period_acts_keeps_its_buffer_until_published():
    s = periodic(3, quota=2)
    steps = []
    for _ in range(6):
        act = s.take()
        steps.append((act.outputs[0], 0 in act.publishes))
    assert steps == [(0, False), (0, False), (0, True), (1, False), (1, False), (1, True)]
    assert s.current_out == [1]
    assert s.held(0) == 2 and s.max_held == [2]


def test_a_periodic_output_needs_a_credit_only_at_the_first_act_of_a_period():
    s = periodic(2, quota=1)
    [b] = s.take().outputs
    assert s.can_act()  # the second write of the same buffer needs no credit
    assert s.lacking() == ([], [])
    s.take()
    assert not s.can_act()
    assert s.lacking() == ([], [0])
    assert s.on_free(0, b) is True
    assert s.can_act()
    assert s.take()[2] == [b]


def test_a_periodic_output_with_no_consumer_keeps_writing_one_buffer():
    s = periodic(2, quota=1, consumers=0, acts=6)
    outs = []
    while s.can_act():
        act = s.take()
        outs.append((act.outputs[0], 0 in act.publishes))
    assert outs == [(0, False), (0, True)] * 3
    assert s.held(0) == 0


def test_holds_and_periods_of_one_are_the_uniform_protocol():
    assert ActorProtocol(2, [1], [1], holds=[1, 1], periods=[1]).uniform
    assert not ActorProtocol(1, [1], [1], holds=[2]).uniform
    assert not ActorProtocol(0, [1], [1], periods=[2]).uniform


# -- a run's end, and what breaks the protocol --------------------------------------------


def test_complete_says_when_the_actor_finished_its_run():
    s = make(n_inputs=0, quotas=(3,), consumers=(0,), acts=2)
    s.take()
    s.take()
    assert s.complete() is False  # one act still in flight
    assert s.complete() is True
    s.start(1)
    s.take()
    assert s.complete() is True


def test_a_second_free_is_a_protocol_error_naming_actor_and_register():
    s = ActorProtocol(0, [2], [1], name="producer", registers=["producer:out"])
    s.start(1)
    [b] = s.take().outputs
    assert s.on_free(0, b) is True
    with pytest.raises(ProtocolError, match=r"'producer'.*'producer:out' buffer 0 was freed"):
        s.on_free(0, b)
    assert s.held(0) == 0


def test_a_free_of_a_buffer_never_published_is_a_protocol_error():
    s = ActorProtocol(0, [2], [1], name="p")
    with pytest.raises(ProtocolError, match="never published"):
        s.on_free(0, 1)


def test_a_take_before_an_input_is_ready_is_a_protocol_error():
    s = ActorProtocol(1, [1], [1], name="consumer")
    s.start(1)
    with pytest.raises(ProtocolError, match="'consumer' took act 0 before it could act"):
        s.take()


def test_a_take_without_a_credit_is_a_protocol_error():
    s = make(n_inputs=0, quotas=(1,), consumers=(1,), acts=2)
    s.take()
    with pytest.raises(ProtocolError, match="before it could act"):
        s.take()


def test_a_take_with_no_act_left_is_a_protocol_error():
    s = ActorProtocol(0, [1], [0], name="source")
    with pytest.raises(ProtocolError, match="no act left"):
        s.take()


def test_a_completion_of_an_act_never_taken_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="never taken"):
        ActorProtocol(0, [1], [0]).complete()


# -- random sequences against a reference model ----------------------------------------------


class ProtocolModel:
    """The protocol from its rules, written apart from ActorProtocol: per input a queue and the
    register in use with the acts it still serves; per output the free buffers (reused in
    free order) and the buffer being written with the writes it still takes; buffers
    published to consumers wait for every consumer's free, and one nobody consumes is
    free again after its last write."""

    def __init__(self, holds, quotas, consumers, periods):
        self.holds, self.quotas, self.consumers, self.periods = holds, quotas, consumers, periods
        self.queues = [deque() for _ in holds]
        self.using: list[list] = [[None, 0] for _ in holds]  # [register, acts left]
        self.free = [deque(range(q)) for q in quotas]
        self.writing: list[list] = [[None, 0] for _ in quotas]  # [buffer, writes left]
        self.owed: dict[tuple[int, int], int] = {}  # published (out, buffer) -> frees owed
        self.acts_left = 0
        self.acts = 0
        self.peak = [0] * len(quotas)

    def lacking(self) -> tuple[list[int], list[int]]:
        ins = [k for k, q in enumerate(self.queues) if not q and self.using[k][1] == 0]
        outs = [k for k, f in enumerate(self.free) if not f and self.writing[k][1] == 0]
        return ins, outs

    def can_act(self) -> bool:
        return self.acts_left > 0 and self.lacking() == ([], [])

    def act(self):
        """One act: (iteration, inputs, outputs, released input slots, published outputs)."""
        ins, released = [], []
        for k, use in enumerate(self.using):
            if use[1] == 0:
                use[:] = [self.queues[k].popleft(), self.holds[k]]
            use[1] -= 1
            ins.append(use[0])
            if use[1] == 0:
                released.append(k)
        outs, published = [], []
        for k, w in enumerate(self.writing):
            if w[1] == 0:
                w[:] = [self.free[k].popleft(), self.periods[k]]
                in_use = self.quotas[k] - len(self.free[k])
                self.peak[k] = max(self.peak[k], in_use)
            w[1] -= 1
            outs.append(w[0])
            if w[1] == 0:
                published.append(k)
                if self.consumers[k]:
                    self.owed[(k, w[0])] = self.consumers[k]
                else:
                    self.free[k].append(w[0])
        self.acts_left -= 1
        self.acts += 1
        return self.acts - 1, ins, outs, released, published

    def on_free(self, key: tuple[int, int]) -> bool:
        self.owed[key] -= 1
        if self.owed[key]:
            return False
        del self.owed[key]
        self.free[key[0]].append(key[1])
        return True

    def in_use(self, out: int) -> int:
        return self.quotas[out] - len(self.free[out])


class ActorProtocolMachine(RuleBasedStateMachine):
    """Drive one ActorProtocol the way drivers do (readies, acts, frees of what was published)
    and compare every decision with ProtocolModel's: whether it may act, what it takes,
    which held registers it releases, which outputs it publishes, what it lacks."""

    @initialize(
        holds=st.lists(st.sampled_from([1, 1, 2, 3, 4]), max_size=3),
        outputs=st.lists(
            st.tuples(st.integers(1, 4), st.integers(0, 3), st.sampled_from([1, 1, 2, 3])), max_size=3
        ),
    )
    def setup(self, holds, outputs):
        quotas, consumers, periods = ([o[i] for o in outputs] for i in range(3))
        self.state = ActorProtocol(len(holds), quotas, consumers, holds=holds, periods=periods)
        self.model = ProtocolModel(holds, quotas, consumers, periods)
        self.next_register = 0

    @rule(n=st.integers(1, 4))
    def add_acts(self, n):
        self.state.start(n)
        self.model.acts_left += n

    @precondition(lambda self: self.model.holds)
    @rule(data=st.data())
    def input_ready(self, data):
        slot = data.draw(st.integers(0, len(self.model.holds) - 1))
        register = self.next_register
        self.next_register += 1
        self.state.on_ready(slot, register)
        self.model.queues[slot].append(register)

    @rule()
    def take(self):
        can = self.model.can_act()
        assert self.state.can_act() == can
        if not can:
            return
        act = self.state.take()
        want_it, want_ins, want_outs, released, published = self.model.act()
        assert (act.number, act.inputs, act.outputs) == (want_it, want_ins, want_outs)
        assert list(act.releases) == released
        assert list(act.publishes) == published
        if not self.state.uniform:  # the uniform protocol keeps no current register
            assert self.state.current_in == want_ins
            assert self.state.current_out == want_outs

    @precondition(lambda self: self.model.owed)
    @rule(data=st.data())
    def free(self, data):
        key = data.draw(st.sampled_from(sorted(self.model.owed)))
        assert self.state.on_free(*key) == self.model.on_free(key)

    @precondition(lambda self: self.model.quotas)
    @rule(data=st.data())
    def free_of_a_buffer_nobody_holds(self, data):
        out = data.draw(st.integers(0, len(self.model.quotas) - 1))
        index = data.draw(st.integers(0, self.model.quotas[out] - 1))
        if (out, index) in self.model.owed:
            return
        with pytest.raises(ProtocolError):
            self.state.on_free(out, index)

    @rule()
    def take_too_early(self):
        if self.model.can_act():
            return
        with pytest.raises(ProtocolError):
            copy.deepcopy(self.state).take()  # a failed take leaves the state half done

    @invariant()
    def agrees_with_the_model(self):
        if not hasattr(self, "state"):
            return
        assert self.state.lacking() == self.model.lacking()
        for k in range(len(self.model.quotas)):
            assert self.state.held(k) == self.model.in_use(k)
            assert list(self.state.free[k]) == list(self.model.free[k])
        assert self.state.max_held == self.model.peak


TestActorProtocolMachine = ActorProtocolMachine.TestCase
TestActorProtocolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("seed", range(20))
def test_random_protocol_sequence_keeps_held_within_quota(seed):
    """A producer with two outputs and several consumers, driven by random interleavings."""
    rng = random.Random(seed)
    quotas = [rng.randint(1, 3), rng.randint(1, 3)]
    consumers = [rng.randint(1, 3), rng.randint(0, 2)]
    s = ActorProtocol(0, quotas, consumers)
    s.start(200)
    pending: list[tuple[int, int]] = []  # one entry per (out, index) free still owed
    acted = 0
    for _ in range(2000):
        if s.can_act() and (not pending or rng.random() < 0.5):
            outs = s.take().outputs
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
