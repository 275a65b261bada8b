"""The driver: one trio task per stream that runs the message loop of that stream's actors.

It drains its inbox (ready, free and completion messages) in one batch, then launches
every unit that can act, lowest priority number first. A unit is one actor, or the
participants of one collective, which act together as one kernel. Launching is async like
a CUDA launch: the kernel is queued on the stream and consumers hear "ready" at once,
with the event their stream must wait on.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from .actor_state import ActorState
from .executor import StreamExecutor
from .transport import CommExecutor, Transport

if TYPE_CHECKING:
    from .runtime import Runtime

READY, FREE, DONE, KICK = "ready", "free", "done", "kick"


class InputSpec:
    """How a member reads one input: a parameter buffer, or a producer's register."""

    __slots__ = ("param", "slot", "control", "buffers", "event", "same_stream", "producer", "out")

    def __init__(
        self,
        param=None,
        slot=-1,
        control=False,
        buffers=None,
        event=False,
        same_stream=False,
        producer=None,
        out=-1,
    ):
        self.param = param
        self.slot = slot
        self.control = control
        self.buffers = buffers
        self.event = event
        self.same_stream = same_stream
        self.producer = producer
        self.out = out


class OutputSpec:
    """``consumers``: (member, input slot, early) where early = ready at launch, not completion.
    ``control``: an order-only register, never handed to the kernel. ``by_call``: for a
    reused communication subgraph, the consumers of each call (see ``ActorState``)."""

    __slots__ = ("buffers", "consumers", "control", "by_call")

    def __init__(
        self, buffers: list, consumers: list, control: bool = False, by_call: list[list] | None = None
    ) -> None:
        self.buffers = buffers
        self.consumers = consumers
        self.control = control
        self.by_call = by_call


class Member:
    """One actor inside a unit: its state and how its inputs and outputs are wired.

    ``phases``: for an actor that publishes its data output every p > 1 acts (an
    ``accumulate``), p; its kernel gets the act's phase, 0 .. p - 1, as its last input.
    """

    __slots__ = ("actor", "state", "unit", "inputs", "outputs", "phases")

    unit: Unit
    """Set by the Unit that takes this member in."""

    def __init__(self, actor: Any, state: ActorState, phases: int = 1) -> None:
        self.actor = actor
        self.state = state
        self.inputs: list[InputSpec] = []
        self.outputs: list[OutputSpec] = []
        self.phases = phases


class Unit:
    """What a driver launches as one kernel: one actor, or a collective's participants."""

    __slots__ = ("id", "name", "priority", "members", "kernel", "driver", "feed", "fetch", "urgent", "fences")

    driver: Driver
    """Set by the Driver of the unit's stream."""

    def __init__(self, id: int, name: str, priority: int, members: list[Member], kernel) -> None:
        self.id = id
        self.name = name
        self.priority = priority
        self.members = members
        self.kernel = kernel
        self.feed: str | None = None
        self.fetch: str | None = None
        self.urgent = False
        self.fences: list[StreamExecutor] = []
        for m in members:
            m.unit = self

    def finish_wiring(self) -> None:
        """Decide once whether another stream or the host waits on this unit's completions:
        it frees inputs of other streams, readies consumers at completion, or fetches."""
        self.urgent = (
            self.fetch is not None
            or any((spec.param is None and not spec.same_stream) for m in self.members for spec in m.inputs)
            or any(not early for m in self.members for o in m.outputs for _, _, early in o.consumers)
        )

    def can_act(self) -> bool:
        for m in self.members:
            if not m.state.can_act():
                return False
        return True


class Driver:
    """``ordered``: launch units strictly in list order, round after round (collective
    stream); ``transport``: the stream is the rank's communication stream."""

    def __init__(
        self,
        runtime: Runtime,
        name: str,
        units: list[Unit],
        ordered: bool,
        token: trio.lowlevel.TrioToken,
        transport: Transport | None = None,
    ) -> None:
        self.runtime = runtime
        self.name = name
        self.executor: StreamExecutor | CommExecutor = (
            StreamExecutor(name, token, self._on_completions)
            if transport is None
            else CommExecutor(name, token, self._on_completions, transport)
        )
        self.units = units
        self.ordered = ordered
        self.cursor = 0
        self.inbox: deque = deque()
        self._wake = trio.Event()
        self._heap: list[tuple[int, int]] = []
        self._queued: set[int] = set()
        for unit in units:
            unit.driver = self

    def _on_completions(self, batch: list) -> None:
        self.post((DONE, batch))

    def post(self, message: tuple) -> None:
        self.inbox.append(message)
        self._wake.set()

    async def serve(self) -> None:
        while not self.runtime.failed:
            await self._wake.wait()
            self._wake = trio.Event()
            self._drain()
            self._launch_ready()

    def _dirty(self, unit: Unit) -> None:
        if unit.id not in self._queued:
            self._queued.add(unit.id)
            heapq.heappush(self._heap, (unit.priority, unit.id))

    def _drain(self) -> None:
        inbox = self.inbox
        while inbox:
            message = inbox.popleft()
            kind = message[0]
            if kind is READY:
                _, member, slot, index, event = message
                member.state.on_ready(slot, index, event)
                self._dirty(member.unit)
            elif kind is FREE:
                _, member, out, index = message
                if member.state.on_free(out, index):
                    self._dirty(member.unit)
            elif kind is DONE:
                self._complete(message[1])
            else:
                for unit in self.units:
                    self._dirty(unit)

    def _launch_ready(self) -> None:
        heap, units, log = self._heap, self.runtime.units, self.runtime.actor_log
        while heap:
            _, uid = heapq.heappop(heap)
            self._queued.discard(uid)
            unit = units[uid]
            if self.ordered and unit is not self.units[self.cursor]:
                if log is not None:
                    log.turn(self.name, unit, self.units[self.cursor])
                continue
            if unit.can_act():
                if log is not None:
                    log.attempt(self.name, unit, True)
                self._launch(unit)
                if self.ordered:
                    self.cursor = (self.cursor + 1) % len(self.units)
                    self._dirty(self.units[self.cursor])
                else:
                    self._dirty(unit)
            elif log is not None:
                log.attempt(self.name, unit, False)

    def _launch(self, unit: Unit) -> None:
        ins: list = []
        outs: list = []
        waits: list = []
        frees: list = []
        taken = []
        iteration = 0
        for m in unit.members:
            state = m.state
            iteration, ready, buffers = state.take()
            taken.append(buffers)
            for spec in m.inputs:
                if spec.param is not None:
                    ins.append(spec.param)
                    continue
                if ready[spec.slot] is None:  # another call's input (a reused subgraph)
                    continue
                index, event = ready[spec.slot]
                if not spec.control:
                    ins.append(spec.buffers[index])
                if spec.event:
                    waits.append(event)
                if not state.uniform and not state.releases(spec.slot, iteration):
                    continue
                if spec.same_stream:
                    self._send_free(spec.producer, spec.out, index)
                else:
                    frees.append((spec.producer, spec.out, index))
            for output, index in zip(m.outputs, buffers):
                if not output.control:
                    outs.append(output.buffers[index])
            if m.phases > 1:
                ins.append(iteration % m.phases)
        if unit.feed is not None:
            ins.append(self.runtime.feed_value(unit.feed, iteration))
        for stream in unit.fences:
            if stream.submitted:
                waits.append((stream, stream.submitted))
        # Filled after submit: safe, since the completion that reads it is handled on this
        # (trio) thread, never before this launch returns.
        later: list = []
        seq = self.executor.submit(
            unit.kernel, ins, outs, waits, (unit, iteration, frees, later, taken), unit.urgent
        )
        self.runtime.progress += 1
        event = (self.executor, seq)
        for stream in unit.fences:
            stream.submit(_fence, [], [], [event], None, False)
        for m, buffers in zip(unit.members, taken):
            for k, (output, index) in enumerate(zip(m.outputs, buffers)):
                if not m.state.uniform and not m.state.publishes(k, iteration):
                    continue
                consumers = (
                    output.consumers if output.by_call is None else output.by_call[iteration % m.state.calls]
                )
                for consumer, slot, early in consumers:
                    if early:
                        self._send_ready(consumer, slot, index, event)
                    else:
                        later.append((consumer, slot, index, event))

    def _send_ready(self, consumer: Member, slot: int, index: int, event) -> None:
        driver = consumer.unit.driver
        if driver is self:
            consumer.state.on_ready(slot, index, event)
            self._dirty(consumer.unit)
        else:
            driver.post((READY, consumer, slot, index, event))

    def _send_free(self, producer: Member, out: int, index: int) -> None:
        driver = producer.unit.driver
        if driver is self:
            if producer.state.on_free(out, index):
                self._dirty(producer.unit)
        else:
            driver.post((FREE, producer, out, index))

    def _complete(self, batch: list) -> None:
        for (unit, iteration, frees, later, taken), result, start, end, ok, waited in batch:
            if not ok:
                self.runtime.fail_kernel(result, unit, iteration)
                return
            for producer, out, index in frees:
                self._send_free(producer, out, index)
            for consumer, slot, index, event in later:
                self._send_ready(consumer, slot, index, event)
            self.runtime.completed(unit, iteration, result, start, end, taken, waited)


def _fence(ins: list, outs: list) -> None:
    """Holds a compute stream until a collective that shares it (overlap off) is done."""
