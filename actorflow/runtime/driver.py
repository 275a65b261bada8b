"""The driver: the message loop of one stream's actors, run by that stream's own thread.

OneFlow's runtime is thin because each thread runs its own actors' messages: a kernel's
end readies its successors on the same stream and launches the next without a trip
through anyone else. Here too: a driver's thread drains its inbox (ready, free, kick,
fence) and launches, one at a time, the unit that can act with the lowest priority
number. A unit is one actor, or the participants of one collective, which act
together as one kernel. (A rank's communication stream has no thread of its own: the
transport's thread, which starts its sends and receives, runs its loop between polls,
``turn``.)

On a stream thread a launch runs the kernel at once, so consumers hear "ready" and
producers get their buffers back when the kernel ends: on the same stream by a plain
call, on another in one message to its driver's inbox. A hand-off is one wake-up of the
thread that has work; trio only hears of the end of a run and of failures. (The Plan's
events order what a GPU stream would launch ahead; a CPU stream thread, hearing only of
finished kernels, never has to wait on one.)
"""

from __future__ import annotations

import heapq
import queue
import threading
from typing import TYPE_CHECKING, Any

from .actor_state import ActorState
from .executor import Completion, Fence, StreamExecutor
from .transport import CommExecutor, Transport

if TYPE_CHECKING:
    from .runtime import Runtime

READY, FREE, DONE, KICK, FENCE, STOP = "ready", "free", "done", "kick", "fence", "stop"


class InputSpec:
    """How a member reads one input: a parameter buffer, or a producer's register."""

    __slots__ = ("param", "slot", "control", "buffers", "producer", "out")

    def __init__(self, param=None, slot=-1, control=False, buffers=None, producer=None, out=-1):
        self.param = param
        self.slot = slot
        self.control = control
        self.buffers = buffers
        self.producer = producer
        self.out = out


class OutputSpec:
    """``consumers``: (member, input slot). ``control``: an order-only register, never handed to the kernel. ``by_call``: for a
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

    def acts(self, iterations: int) -> int:
        """How many times this actor acts in a run of ``iterations``."""
        return iterations // self.actor.every * self.actor.calls


class Unit:
    """What a driver launches as one kernel: one actor, or a collective's participants.
    ``fences``: the drivers of streams this unit holds while it runs (overlap off)."""

    __slots__ = (
        "id",
        "name",
        "priority",
        "members",
        "kernel",
        "driver",
        "feed",
        "fetch",
        "fences",
        "can_act",
        "queued",
        "entry",
    )

    driver: Driver
    """Set by the Driver of the unit's stream."""
    entry: tuple[int, int, Unit]
    """Its place in that driver's queue of units to try: (priority, id, unit), set with
    ``driver`` once the priority is final."""

    def __init__(self, id: int, name: str, priority: int, members: list[Member], kernel) -> None:
        self.id = id
        self.name = name
        self.priority = priority
        self.members = members
        self.kernel = kernel
        self.feed: str | None = None
        self.fetch: str | None = None
        self.fences: list[Driver] = []
        self.queued = False  # in its driver's queue of units to try
        for m in members:
            m.unit = self
        self.can_act = members[0].state.can_act if len(members) == 1 else self._all_can_act
        """Whether every member can act (see ``ActorState.can_act``)."""

    def _all_can_act(self) -> bool:
        for m in self.members:
            if not m.state.can_act():
                return False
        return True


def step_order(units: list[Unit], micro_batches: int) -> list[Unit]:
    """A collective stream's launches in one step, from its units in the collective
    order: a run of units that act once per micro-batch repeats for each micro-batch
    (all of micro-batch 0's, then 1's, ...); a unit that acts once per step launches
    once (the compiler puts those reading only per-step values before the
    per-micro-batch run and those reading accumulated ones after it)."""
    order: list[Unit] = []
    run: list[Unit] = []
    for unit in [*units, None]:
        if unit is not None and unit.members[0].actor.every < micro_batches:
            run.append(unit)
            continue
        order += run * micro_batches
        run = []
        if unit is not None:
            order.append(unit)
    return order


class Driver:
    """``order``: for a collective stream, the units in the order they launch within a
    step (see ``step_order``), which the stream follows strictly, step after step;
    ``transport``: the stream is the rank's communication stream, whose kernels
    the transport runs, completing in any order, and whose loop runs on the transport's
    thread (``turn``). ``start`` starts the stream's thread;
    ``post`` and ``close`` are safe from any thread; everything else runs on the
    stream's thread."""

    def __init__(
        self,
        runtime: Runtime,
        name: str,
        units: list[Unit],
        order: list[Unit] | None,
        transport: Transport | None = None,
    ) -> None:
        self.runtime = runtime
        self.name = name
        self.executor: StreamExecutor | CommExecutor = (
            StreamExecutor(name, self._complete, timed=runtime.recorder.enabled)
            if transport is None
            else CommExecutor(name, transport, self._on_comm_done)
        )
        self.units = units
        self.order = order or []
        self.ordered = order is not None
        self.cursor = 0
        self.acted = 0
        self.owed = 0  # acts of this run yet to complete
        self._recording = runtime.recorder.enabled
        self.closed = False
        self._heap: list[tuple[int, int, Unit]] = []
        for unit in units:
            unit.driver = self
            unit.entry = (unit.priority, unit.id, unit)
        self.inbox: queue.SimpleQueue
        self._own_thread = transport is None
        if transport is None:
            self.inbox = queue.SimpleQueue()
            self.thread = threading.Thread(target=self.serve, name=name, daemon=True)
        else:  # the transport's thread runs this loop between its polls (``turn``)
            self.inbox, self.thread = transport.inbox, transport.thread
            transport.serve(self.turn)

    def start(self) -> None:
        """Start the stream's thread (the transport starts its own)."""
        if self._own_thread:
            self.thread.start()

    def post(self, message: tuple) -> None:
        self.inbox.put(message)

    def close(self) -> None:
        """Stop after the kernel in progress; wakes the thread wherever it waits."""
        self.closed = True
        self.executor.close()
        self.inbox.put((STOP,))

    def _on_comm_done(self, completion: Completion) -> None:
        self.turn([(DONE, completion)])

    def serve(self) -> None:
        """The stream thread's loop: wait for news while nothing can act, then take a
        ``turn`` with all of it."""
        inbox = self.inbox
        while not self.closed:
            messages = [] if self._heap else [inbox.get()]
            while not inbox.empty():
                messages.append(inbox.get_nowait())
            self.turn(messages)

    def turn(self, messages: list[tuple]) -> None:
        """One pass of the loop: hear ``messages``, launch. The communication stream's
        loop is these turns, taken by the transport's thread between its polls (and at a
        finished send or receive). A failure of the loop itself (not of a kernel) goes
        to the host too."""
        if self.closed:
            return
        try:
            for message in messages:
                self._handle(message)
            self._launch_ready()
        except BaseException as exc:  # noqa: BLE001 - nothing may hang on a driver's bug
            self.closed = True
            self.runtime.fail_soon(exc)

    def _dirty(self, unit: Unit) -> None:
        if not unit.queued:
            unit.queued = True
            heapq.heappush(self._heap, unit.entry)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind is READY:
            _, member, slot, index = message
            member.state.on_ready(slot, index)
            self._dirty(member.unit)
        elif kind is FREE:
            _, member, out, index = message
            if member.state.on_free(out, index):
                self._dirty(member.unit)
        elif kind is DONE:
            self._complete(message[1])
        elif kind is KICK:
            for unit in self.units:
                for m in unit.members:
                    acts = m.acts(message[1])
                    m.state.acts_left += acts
                    self.owed += acts
                self._dirty(unit)
        elif kind is FENCE:
            message[1].park(lambda: self.closed)

    def _launch_ready(self) -> None:
        """Launch units in priority order until none can act, or news came (it may ready
        a unit that goes first)."""
        heap, log, inbox = self._heap, self.runtime.actor_log, self.inbox
        while heap and not self.closed:
            unit = heapq.heappop(heap)[2]
            unit.queued = False
            if self.ordered and unit is not self.order[self.cursor]:
                if log is not None:
                    log.turn(self.name, unit, self.order[self.cursor])
                continue
            if unit.can_act():
                if log is not None:
                    log.attempt(self.name, unit, True)
                if self.ordered:
                    self.cursor = (self.cursor + 1) % len(self.order)
                    self._dirty(self.order[self.cursor])
                self._launch(unit)
                if not self.ordered and unit.can_act():  # else news will tell when it can
                    self._dirty(unit)
            elif log is not None:
                log.attempt(self.name, unit, False)
            if not inbox.empty():
                return

    def _launch(self, unit: Unit) -> None:
        ins: list = []
        outs: list = []
        frees: list = []
        taken = []
        iteration = 0
        for m in unit.members:
            state = m.state
            iteration, ready, buffers = state.take()
            taken.append(buffers)
            every_act = state.uniform  # else only some acts release an input
            for spec in m.inputs:
                param = spec.param
                if param is not None:
                    ins.append(param)
                    continue
                index = ready[spec.slot]
                if index is None:  # another call's input (a reused subgraph)
                    continue
                if not spec.control:
                    ins.append(spec.buffers[index])
                if every_act or state.releases(spec.slot, iteration):
                    frees.append((spec.producer, spec.out, index))
            for output, index in zip(m.outputs, buffers):
                if not output.control:
                    outs.append(output.buffers[index])
            if m.phases > 1:
                ins.append(iteration % m.phases)
        if unit.feed is not None:
            ins.append(self.runtime.feed_value(unit.feed, iteration))
        self.acted += 1
        fence = self._hold(unit) if unit.fences else None
        self.executor.launch(unit.kernel, ins, outs, (unit, iteration, frees, taken))
        if fence is not None:
            fence.release()

    def _hold(self, unit: Unit) -> Fence:
        """Park the streams ``unit`` holds (overlap off) before its kernel runs."""
        fence = Fence(len(unit.fences))
        for driver in unit.fences:
            driver.post((FENCE, fence))
        fence.hold(lambda: self.closed)
        return fence

    def _send_ready(self, consumer: Member, slot: int, index: int) -> None:
        driver = consumer.unit.driver
        if driver is self:
            consumer.state.on_ready(slot, index)
            self._dirty(consumer.unit)
        else:
            driver.post((READY, consumer, slot, index))

    def _send_free(self, producer: Member, out: int, index: int) -> None:
        driver = producer.unit.driver
        if driver is self:
            if producer.state.on_free(out, index):
                self._dirty(producer.unit)
        else:
            driver.post((FREE, producer, out, index))

    def _complete(self, completion: Completion) -> None:
        (unit, iteration, frees, taken), result, start, end, ok = completion
        if not ok:
            self.closed = True
            self.runtime.fail_kernel_soon(result, unit, iteration)
            return
        self.acted += 1
        for producer, out, index in frees:
            self._send_free(producer, out, index)
        for m, buffers in zip(unit.members, taken):
            state = m.state
            for k, (output, index) in enumerate(zip(m.outputs, buffers)):
                if not state.uniform and not state.publishes(k, iteration):
                    continue
                consumers = (
                    output.consumers if output.by_call is None else output.by_call[iteration % state.calls]
                )
                for consumer, slot in consumers:
                    self._send_ready(consumer, slot, index)
        if unit.fetch is not None or self._recording:
            self.runtime.completed(unit, iteration, result, start, end, taken)
        self.owed -= len(unit.members)
        if self.owed == 0:
            self.runtime.stream_finished()
