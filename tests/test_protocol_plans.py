"""The actor protocol over whole plans, sans-IO: every actor of a random compiled plan,
wired as the runtime wires it (``wiring.wire``), driven by a hypothesis state machine
through random acts, completions and deliveries of "ready" and "free" messages, with no
thread and no kernel. Each step checks the protocol's invariants: no buffer is written
while a consumer may still read it, no register ever holds more buffers than its quota,
and a run ends with every act done, every credit back and nothing left ready."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import actorflow as af
import graph_strategies as gs
from actorflow.errors import ProtocolError
from actorflow.runtime.protocol import Act
from actorflow.runtime.wiring import Member, Unit, Wiring, step_order, wire
from test_properties import compile_random


def training_plan(data) -> af.Plan:
    recipe = data.draw(gs.training_recipes(), label="recipe")
    return af.compile(
        gs.build_training(recipe),
        quota=data.draw(st.sampled_from([1, 2, 3]), label="quota"),
        micro_batches=recipe.micro_batches,
        stages=list(recipe.stages) if recipe.schedule else None,
        schedule=recipe.schedule,
    )


class PlanProtocolMachine(RuleBasedStateMachine):
    """One process's runtime, as data: units launch when every member can act (a
    collective stream only at its place in the collective order); a launched act
    completes later, in any order; its "ready" and "free" messages travel on channels,
    one per pair of streams, each in order, delivered in any interleaving (a message to
    one's own stream is heard at once, as a driver does)."""

    @initialize(data=st.data())
    def setup(self, data):
        if data.draw(st.booleans(), label="training"):
            plan = training_plan(data)
        else:
            plan = compile_random(data, data.draw(gs.recipes(), label="recipe"))
        self.plan = plan
        self.wiring: Wiring = wire(plan, 0)
        self.orders = {s.stream.id: (s.order, 0) for s in self.wiring.streams if s.order is not None}
        self.in_flight: list[tuple[Unit, list[Act]]] = []
        self.channels: dict[tuple[int, int], deque] = {}
        self.readers: dict[tuple[int, int], int] = {}  # (register, buffer) -> consumers yet to free it
        self.running = False
        self.start_run(data.draw(st.integers(1, 3), label="steps"))

    # -- runs ---------------------------------------------------------------------------

    @precondition(lambda self: not self.running)
    @rule(steps=st.integers(1, 3))
    def start_run(self, steps):
        iterations = steps * self.plan.micro_batches
        for member in self.wiring.members.values():
            if acts := member.acts(iterations):
                member.state.start(acts)
        self.running = True

    # -- acts ---------------------------------------------------------------------------

    def launchable(self) -> list[Unit]:
        units = []
        for unit in self.wiring.units:
            if unit.stream in self.orders:
                order, cursor = self.orders[unit.stream]
                if order[cursor] is not unit:
                    continue
            if all(m.state.can_act() for m in unit.members):
                units.append(unit)
        return units

    @rule(data=st.data())
    def launch(self, data):
        if units := self.launchable():
            self._launch(data.draw(st.sampled_from(units), label="unit"))

    def _launch(self, unit: Unit) -> None:
        if unit.stream in self.orders:
            order, cursor = self.orders[unit.stream]
            self.orders[unit.stream] = (order, (cursor + 1) % len(order))
        acts = []
        for m in unit.members:
            act = m.state.take()
            acts.append(act)
            for k, reg in enumerate(m.actor.outputs):
                key = (reg, act.outputs[k])
                assert self.readers.get(key, 0) == 0, f"{m.actor.name} writes {key} while it is read"
        self.in_flight.append((unit, acts))

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def complete(self, data):
        self._complete(data.draw(st.integers(0, len(self.in_flight) - 1), label="act"))

    def _complete(self, index: int) -> None:
        unit, acts = self.in_flight.pop(index)
        for m, act in zip(unit.members, acts):
            for slot in act.releases:
                spec = m.fed[slot]
                assert spec.producer is not None
                self.send(unit, spec.producer.unit, ("free", spec.producer, spec.out, act.inputs[slot]))
            for k in act.publishes:
                key = (m.actor.outputs[k], act.outputs[k])
                for consumer, slot in m.outputs[k].by_call[act.call]:
                    self.readers[key] = self.readers.get(key, 0) + 1
                    self.send(unit, consumer.unit, ("ready", consumer, slot, act.outputs[k]))
            m.state.complete()

    def send(self, source: Unit, dest: Unit, message: tuple) -> None:
        if source.stream == dest.stream:
            self.hear(message)
        else:
            self.channels.setdefault((source.stream, dest.stream), deque()).append(message)

    def hear(self, message: tuple) -> None:
        kind, member, k, buffer = message
        if kind == "ready":
            member.state.on_ready(k, buffer)
            return
        key = (member.actor.outputs[k], buffer)
        self.readers[key] -= 1
        member.state.on_free(k, buffer)

    @precondition(lambda self: any(self.channels.values()))
    @rule(data=st.data())
    def deliver(self, data):
        busy = sorted(k for k, q in self.channels.items() if q)
        self.hear(self.channels[data.draw(st.sampled_from(busy), label="channel")].popleft())

    # -- what must never pass -------------------------------------------------------------

    @rule(data=st.data())
    def stray_free(self, data):
        """A free of a buffer no consumer holds is refused, and changes nothing."""
        member: Member = data.draw(st.sampled_from(list(self.wiring.members.values())), label="producer")
        if not member.outputs:
            return
        k = data.draw(st.integers(0, len(member.outputs) - 1), label="output")
        buffer = data.draw(st.integers(0, len(member.outputs[k].buffers) - 1), label="buffer")
        if buffer in member.state.in_use(k):
            return
        held = member.state.held(k)
        with pytest.raises(ProtocolError):
            member.state.on_free(k, buffer)
        assert member.state.held(k) == held

    # -- invariants and the run's end -----------------------------------------------------

    @invariant()
    def quotas_hold(self):
        if not hasattr(self, "wiring"):
            return
        for member in self.wiring.members.values():
            for k, reg in enumerate(member.actor.outputs):
                assert 0 <= member.state.held(k) <= self.plan.registers[reg].quota

    def drain(self) -> None:
        """Run on, in a fixed order, until nothing can happen."""
        while True:
            if self.in_flight:
                self._complete(0)
            elif any(self.channels.values()):
                for q in self.channels.values():
                    while q:
                        self.hear(q.popleft())
            elif units := self.launchable():
                self._launch(units[0])
            else:
                return

    @precondition(lambda self: self.running)
    @rule()
    def finish_run(self):
        """Run on to the end: every act done, every credit back, nothing left ready."""
        self.drain()
        for member in self.wiring.members.values():
            state = member.state
            assert state.acts_left == 0, f"{member.actor.name} never got to act: {state!r}"
            assert state.in_flight == 0
            assert not any(state.ready), f"{member.actor.name} has registers ready after the run"
            for k in range(len(member.outputs)):
                assert state.in_use(k) == set(), f"{member.actor.name} output {k} not freed"
        assert not any(self.readers.values())
        self.running = False

    def teardown(self):
        if getattr(self, "running", False):
            self.finish_run()


TestPlanProtocol = PlanProtocolMachine.TestCase
TestPlanProtocol.settings = settings(
    max_examples=40,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_step_order_repeats_per_micro_batch_runs_once_per_micro_batch():
    class U:
        def __init__(self, every):
            self.actor = type("A", (), {"every": every})()

    a, b, c = U(1), U(1), U(4)
    assert step_order([a, b, c], 4) == [a, b, a, b, a, b, a, b, c]
