"""The driver: the message loop of one stream's units, run by that stream's own thread.

OneFlow's runtime is thin because each thread runs its own actors' messages: a kernel's
end readies its successors on the same stream and launches the next without a trip
through anyone else. Here too: a driver's thread drains its inbox (typed messages:
``Ready``, ``Free``, ``Start``, ``Hold``, ``Stop``) and launches, one at a time, the
unit that can act with the lowest priority number. What a unit's act takes, releases
and publishes, and when its run ends, the protocol decides (``protocol``); the driver
only carries the answers to the streams and to other drivers. (A rank's communication
stream has no thread of its own: the transport's thread, which starts its sends and
receives, runs its loop between polls, ``turn``.)

On a stream thread a launch runs the kernel at once, so consumers hear "ready" and
producers get their buffers back when the kernel ends: on the same stream by a plain
call, on another in one message to its driver's inbox. A hand-off is one wake-up of the
thread that has work; the host (``Host``: the Runtime) only hears of fetches, traced
spans, the end of a run and failures.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from .device import CpuStream, Fence, OnDone, Stream
from .launching import LaunchQueue, can_act
from .protocol import Act
from .transport import CommExecutor, Transport
from .wiring import Member, Unit, arrays


class Ready(NamedTuple):
    """Buffer ``buffer`` of a producer's register is ready for input ``slot`` of ``consumer``
    (on a GPU: once ``event`` is, see ``device.Stream.event``)."""

    consumer: Member
    slot: int
    buffer: int
    event: Any = None


class Free(NamedTuple):
    """A consumer is done with buffer ``buffer`` of output ``out`` of ``producer`` (on a
    GPU: once ``event`` is)."""

    producer: Member
    out: int
    buffer: int
    event: Any = None


class Start(NamedTuple):
    """A run of ``iterations`` begins."""

    iterations: int


class Hold(NamedTuple):
    """Park at ``fence`` until the collective that holds this stream has run."""

    fence: Fence


class Stop(NamedTuple):
    """Wake up to see that the stream is closed."""


class Done(NamedTuple):
    """A communication kernel ended (on the transport's thread; see ``device.OnDone``)."""

    ctx: tuple[Unit, list[Act]]
    result: Any
    start: float
    end: float
    ok: bool


Message = Ready | Free | Start | Hold | Stop | Done


class Host(Protocol):
    """What a driver tells the runtime that hosts it; every call comes from the driver's
    thread, so the host hands on to its own what must run there."""

    def feed_value(self, name: str, iteration: int) -> Any: ...

    def completed(
        self, unit: Unit, number: int, result: Any, start: float, end: float, acts: list[Act]
    ) -> None:
        """A fetched or traced unit's kernel ended."""

    def stream_finished(self) -> None:
        """Every actor of a stream completed its acts of the run."""

    def fail_soon(self, exc: BaseException) -> None: ...

    def fail_kernel_soon(self, exc: BaseException, unit: Unit, number: int) -> None: ...


class Driver:
    """``order``: for a collective stream, the units in the order they launch within a
    step (``wiring.step_order``), which the stream follows strictly, step after step;
    ``transport``: the stream is the rank's communication stream, whose kernels
    the transport runs, completing in any order, and whose loop runs on the transport's
    thread (``turn``). ``start`` starts the stream's thread; ``post`` and ``close``
    are safe from any thread; everything else runs on the stream's thread.
    ``actor_log``: None, or the ``debug.ActorLog`` told of every act attempt;
    ``make_stream``: makes the stream its kernels run on, given its ``on_done``, where that is
    not a host thread (a GPU's: ``cuda.CudaStream``)."""

    def __init__(
        self,
        host: Host,
        name: str,
        units: list[Unit],
        order: list[Unit] | None,
        transport: Transport | None = None,
        recording: bool = False,
        actor_log: Any = None,
        make_stream: Callable[[OnDone], Stream] | None = None,
    ) -> None:
        self.host = host
        self.name = name
        self.stream: Stream = (
            make_stream(self._complete)
            if make_stream is not None
            else CpuStream(name, self._complete, timed=recording)
            if transport is None
            else CommExecutor(name, transport, self._on_comm_done)
        )
        self.units = units
        self.queue = LaunchQueue(units, order)
        self.acted = 0
        self.unfinished = 0  # actors of this stream with acts of this run to complete
        self._recording = recording
        self._log = actor_log
        self.closed = False
        self.idle = False
        """Its thread waits on its inbox with nothing to launch (what the transport's
        ``busy`` asks of the rank's compute and copy streams)."""
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

    def post(self, message: Message) -> None:
        self.inbox.put(message)

    def close(self) -> None:
        """Stop after the kernel in progress; wakes the thread wherever it waits."""
        self.closed = True
        self.stream.close()
        self.inbox.put(Stop())

    def _on_comm_done(self, ctx: Any, result: Any, start: float, end: float, ok: bool) -> None:
        self.turn([Done(ctx, result, start, end, ok)])

    def serve(self) -> None:
        """The stream thread's loop: wait for news while nothing can act, then take a
        ``turn`` with all of it."""
        inbox = self.inbox
        while not self.closed:
            if self.queue:
                messages = []
            else:
                self.idle = True
                messages = [inbox.get()]
                self.idle = False
            while not inbox.empty():
                messages.append(inbox.get_nowait())
            self.turn(messages)

    def turn(self, messages: list[Message]) -> None:
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
            self.host.fail_soon(exc)

    def _handle(self, message: Message) -> None:
        if type(message) is Ready:
            member = message.consumer
            if message.event is not None:
                self.stream.wait(message.event)
            member.state.on_ready(message.slot, message.buffer)
            self.queue.dirty(member.unit)
        elif type(message) is Free:
            member = message.producer
            if message.event is not None:
                self.stream.wait(message.event)
            if member.state.on_free(message.out, message.buffer):
                self.queue.dirty(member.unit)
        elif type(message) is Done:
            self._complete(*message)
        elif type(message) is Start:
            for unit in self.units:
                for m in unit.members:
                    acts = m.acts(message.iterations)
                    if acts:
                        m.state.start(acts)
                        self.unfinished += 1
                self.queue.dirty(unit)
        elif type(message) is Hold:
            event = message.fence.park(lambda: self.closed)
            if event is not None:
                self.stream.wait(event)

    def _launch_ready(self) -> None:
        """Launch units in priority order until none can act, or news came (it may ready
        a unit that goes first)."""
        queue, inbox = self.queue, self.inbox
        attempt = self._attempt if self._log is not None else None
        while queue and not self.closed:
            unit = queue.pop(attempt)
            if unit is None:
                return
            self._launch(unit)
            queue.requeue(unit)
            if not inbox.empty():
                return

    def _attempt(self, unit: Unit, first: Unit | None) -> None:
        """Tell the actor log of an act attempt (``ACTORFLOW_DEBUG=actors``)."""
        if first is not None:
            self._log.turn(self.name, unit, first)
        else:
            self._log.attempt(self.name, unit, can_act(unit))

    def _launch(self, unit: Unit) -> None:
        acts = [m.state.take() for m in unit.members]
        ins, outs = arrays(unit, acts)
        if unit.feed is not None:
            ins.append(self.host.feed_value(unit.feed, acts[0].number))
        self.acted += 1
        fence = self._hold(unit) if unit.fences else None
        self.stream.launch(unit.kernel, ins, outs, (unit, acts))
        if fence is not None:
            fence.release(self.stream.event)

    def _hold(self, unit: Unit) -> Fence:
        """Park the streams ``unit`` holds (overlap off) before its kernel runs."""
        fence = Fence(len(unit.fences))
        for driver in unit.fences:
            self.peers[driver].post(Hold(fence))
        fence.hold(lambda: self.closed)
        for driver in unit.fences:  # parked: on a GPU, what they launched runs before it
            if (event := self.peers[driver].stream.event) is not None:
                self.stream.wait(event)
        return fence

    peers: dict[int, Driver]
    """Every driver of this rank, by plan stream id: set by the runtime."""

    def _complete(self, ctx: tuple[Unit, list[Act]], result: Any, start: float, end: float, ok: bool) -> None:
        unit, acts = ctx
        number = acts[0].number
        if not ok:
            self.closed = True
            self.host.fail_kernel_soon(result, unit, number)
            return
        self.acted += 1
        finished = 0
        for m, act in zip(unit.members, acts):
            for slot in act.releases:
                spec = m.fed[slot]
                self._send_free(spec.producer, spec.out, act.inputs[slot])  # type: ignore[arg-type]
            for k in act.publishes:
                index = act.outputs[k]
                for consumer, slot in m.outputs[k].by_call[act.call]:
                    self._send_ready(consumer, slot, index)
            if m.state.complete():
                finished += 1
        if unit.fetch is not None or self._recording:
            self.host.completed(unit, number, result, start, end, acts)
        if finished:
            self.unfinished -= finished
            if self.unfinished == 0:
                self.stream.finish()
                self.host.stream_finished()

    def _send_ready(self, consumer: Member, slot: int, index: int) -> None:
        driver = self.peers[consumer.unit.stream]
        if driver is self:
            consumer.state.on_ready(slot, index)
            self.queue.dirty(consumer.unit)
        else:
            driver.post(Ready(consumer, slot, index, self.stream.event))

    def _send_free(self, producer: Member, out: int, index: int) -> None:
        driver = self.peers[producer.unit.stream]
        if driver is self:
            if producer.state.on_free(out, index):
                self.queue.dirty(producer.unit)
        else:
            driver.post(Free(producer, out, index, self.stream.event))
