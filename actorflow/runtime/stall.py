"""Stalls: the watchdog that notices no actor acted for a while, and the StallError's
report: who waits on what, and the wait-for chain from a waiting actor to the actor that
everything waits on, followed across ranks (a stalled rank asks the next one)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum

import msgpack
import trio

from ..dag import topological_order
from ..errors import StallError
from ..plan import Plan
from ..plan_check import transfer_peers
from .debug import lacking
from .device import Programs, WaitChain
from .driver import Driver
from .protocol import act_text
from .transport import QUERY, REPLY, Transport
from .wiring import Member

ASK_TIMEOUT = 2.0


class _Look(Enum):
    """How the chain looks at an actor: at what its next act waits on (WAIT), or at a kernel
    of it that was launched and has not finished (KERNEL), which waits on its stream."""

    WAIT = "wait"
    KERNEL = "kernel"


_Step = tuple[Member, _Look]


def wait_for_chain(
    plan: Plan,
    members: Mapping[int, Member],
    drivers: Mapping[int, Driver],
    base: int,
    start: int | None = None,
) -> WaitChain:
    """``wait-for chain: a -> b -> c, which waits on nothing: ...``, or ``... -> a (a cycle)``.

    It starts at ``start`` (an actor id) if given, else at the waiting actor (one with
    acts left) earliest in the plan's topological order, the one furthest upstream, so
    the chain covers as much of the plan as it can; with no waiting actor, at the kernel
    a stream is running. Edges: an actor missing an input waits on the input's producer;
    one missing a credit, on the first consumer still holding one of the buffers; a
    collective participant that could act, on a partner that can't; a launched kernel
    that has not finished, on the kernel its stream is running. The chain ends at an
    actor that waits on nothing: its kernel is the one running, or it could act but is
    behind another collective in its stream's order; or at one that waits on another
    rank: a launched send or receive waits on its peer, a collective over ranks on the
    participants of the other ranks (``WaitChain.remote``).
    ``members``: this rank's, by actor id; ``drivers``: by plan stream id; ``base``:
    the run's first iteration, to number iterations.
    """
    step = (members[start], _Look.WAIT) if start is not None else _start(plan, members, drivers)
    chain = _Chain(plan, members, drivers, base)
    text = chain.walk(step)
    return WaitChain("wait-for chain: " + text if start is None else text, chain.remote)


def _start(plan: Plan, members: Mapping[int, Member], drivers: Mapping[int, Driver]) -> _Step | None:
    for a in _topological(plan):
        if a in members and members[a].state.acts_left > 0:
            return members[a], _Look.WAIT
    for driver in drivers.values():
        if driver.stream.running is not None:
            return driver.stream.running[0].members[0], _Look.KERNEL
    return None


def _topological(plan: Plan) -> list[int]:
    """Actor ids in a topological order of the data and control edges, smallest id first;
    a reused communication subgraph's calls may feed one another through data, so the
    edges into it are left out (it comes as early as its first call can)."""
    edges: dict[int, list[int]] = {a.id: [] for a in plan.actors}
    for reg in plan.registers:
        if not reg.is_parameter:
            edges[reg.producer].extend(c.actor for c in reg.consumers if plan.actors[c.actor].calls == 1)
    return topological_order(edges)


class _Chain:
    def __init__(
        self, plan: Plan, members: Mapping[int, Member], drivers: Mapping[int, Driver], base: int
    ) -> None:
        self.plan = plan
        self.members = members
        self.drivers = drivers
        self.base = base
        self.remote: tuple[int, int] | None = None
        self.peers = transfer_peers(plan)
        self.participants = {a: c.actors for c in plan.collectives for a in c.actors}

    def walk(self, step: _Step | None) -> str:
        if step is None:
            return "none: no actor waits to act and no stream is running a kernel"
        names: list[str] = []
        seen: set[tuple[int, _Look]] = set()
        while True:
            member, look = step
            names.append(member.actor.name)
            if (member.actor.id, look) in seen:
                return " -> ".join(names) + " (a cycle)"
            seen.add((member.actor.id, look))
            after = self._kernel(member) if look is _Look.KERNEL else self._wait(member)
            if isinstance(after, str):
                return " -> ".join(names) + after
            step = after

    def _wait(self, member: Member) -> _Step | str:
        """What ``member``'s next act waits on."""
        missing_in, missing_out = member.state.lacking()
        if missing_in:
            return self._producer(member, missing_in[0])
        if missing_out:
            return self._holder(member, missing_out[0])
        for partner in member.unit.members:
            if partner is not member and not partner.state.can_act():
                return partner, _Look.WAIT
        driver = self.drivers[member.unit.stream]
        queue = driver.queue
        first = queue.order[queue.cursor] if queue.ordered else member.unit
        if first is not member.unit:
            return (
                f", which waits on nothing: it can act, but its stream {driver.name} launches "
                f"collectives in plan order and {first.name!r} comes first"
            )
        return f", which waits on nothing: its stream {driver.name} {self._stream(driver)}"

    def _producer(self, member: Member, slot: int) -> _Step:
        """The producer of input ``slot``: its act that makes the register ``member`` needs was
        launched (the register is ready when that kernel finishes), or not yet."""
        spec = member.fed[slot]
        producer = spec.producer
        assert producer is not None, "a fed input has a producer"
        every = member.actor.every
        needed = (member.state.number // member.actor.calls * every + every - 1) // producer.actor.every
        if producer.actor.calls > 1:  # a reused subgraph's act for the call this input reads
            reg = self.plan.registers[producer.actor.outputs[spec.out]]
            read = (member.actor.id, member.inputs.index(spec))  # the actor's input, params counted
            needed = needed * producer.actor.calls + next(
                c.call for c in reg.consumers if (c.actor, c.slot) == read
            )
        return producer, (_Look.KERNEL if producer.state.number > needed else _Look.WAIT)

    def _holder(self, member: Member, out: int) -> _Step:
        """The first consumer still holding a buffer of output ``out``.

        A consumer holds one that is ready for it but not taken, or kept for its next acts
        (an input held over several acts): then it waits on what its own next act waits
        on. A consumer on another stream frees a buffer when the kernel that read it
        finishes: if its stream has unfinished kernels, that kernel is taken to be the
        holder. With no such consumer, the buffers are not handed on yet: consumers that
        hear "ready" at completion wait on ``member``'s own launched kernel.
        """
        held = member.state.in_use(out)
        for consumer, slot in member.outputs[out].consumers:
            if consumer.state.keeps(slot, held):
                return consumer, _Look.WAIT
            stream = self.drivers[consumer.unit.stream].stream
            if stream.done < stream.submitted:
                return consumer, _Look.KERNEL
        return member, _Look.KERNEL

    def _kernel(self, member: Member) -> _Step | str:
        """A launched kernel of ``member`` has not finished: what its stream is doing, or
        the other rank it waits on."""
        actor = member.actor
        if actor.kind in ("send", "recv"):
            peer = self.peers[actor.id]
            return self._across(peer.id, f"its {actor.kind} waits on {peer.name!r}")
        elsewhere = [a for a in self.participants.get(actor.id, ()) if a not in self.members]
        driver = self.drivers[member.unit.stream]
        if elsewhere and driver.stream.running is not None:
            return self._across(
                elsewhere[0], f"its collective waits on {self.plan.actors[elsewhere[0]].name!r}"
            )
        running = driver.stream.running
        if running is None:
            return (
                f", whose launched kernel has not finished: its stream {driver.name} {self._stream(driver)}"
            )
        if running[0] is not member.unit:
            return running[0].members[0], _Look.KERNEL
        return f", which waits on nothing: its stream {driver.name} {self._stream(driver)}"

    def _across(self, actor: int, what: str) -> str:
        end = WaitChain.across(self.plan, "", actor, what)
        self.remote = end.remote
        return end.text

    def _stream(self, driver: Driver) -> str:
        stream = driver.stream
        if stream.running is not None:
            unit, acts = stream.running
            return f"is running {unit.name!r} (iteration {acts[0].number - self.base})"
        unfinished = stream.submitted - stream.done
        if unfinished:
            return f"has {unfinished} launched kernels not finished, the first waiting on another stream"
        return "is idle"


class Watchdog:
    """Fails the run with a StallError when no actor acted for ``timeout`` seconds while a
    run is on. Over ranks, the report follows the wait-for chain into the other ranks:
    this rank asks the rank its chain ends at (``QUERY``) and that rank answers with its
    own chain from there (``REPLY``), and so on, each rank once."""

    def __init__(
        self,
        plan: Plan,
        members: Mapping[int, Member],
        drivers: Mapping[int, Driver],
        timeout: float,
        transport: Transport | None,
        window: Callable[[], tuple[int, int]],
        replay: Programs | None = None,
    ) -> None:
        self.plan = plan
        self.window = window
        """(the current run's first iteration, iterations run since the runtime opened)."""
        self.replay = replay
        self.members = members
        self.drivers = drivers
        self.timeout = timeout
        self.transport = transport
        self.rank = transport.rank if transport is not None else 0
        self.running = False
        """A run is on: only then is a lack of progress a stall."""
        self._answer: tuple[str, tuple[int, int] | None] | None = None
        self._answered = trio.Event()

    @property
    def base(self) -> int:
        return self.window()[0]

    @property
    def progress(self) -> int:
        """Launches and completions so far."""
        if self.replay is not None:
            return self.replay.progress
        return sum(d.acted for d in self.drivers.values())

    async def watch(self, failed: Callable[[], bool], fail: Callable[[BaseException], None]) -> None:
        seen, since = -1, trio.current_time()
        while not failed():
            await trio.sleep(min(1.0, self.timeout / 4))
            now = trio.current_time()
            if not self.running or self.progress != seen:
                seen, since = self.progress, now
            elif now - since >= self.timeout:
                report = self.report(now - since)
                if self.transport is not None:
                    report = "\n".join([report, *await self._chain_across_ranks()])
                fail(StallError(report))
                return

    def report(self, idle: float) -> str:
        """Every actor with acts left and what it lacks, what each stream is doing, and the
        wait-for chain from a waiting actor to the one everything waits on."""
        plan = self.plan
        head = (
            f"no actor acted for {idle:.1f} s (stall_timeout={self.timeout} s); "
            f"the run has {self.window()[1] - self.base} iterations."
        )
        if self.replay is not None:
            lines = [f"{head} Streams, replaying their order:", *self.replay.report()]
            return "\n".join([*lines, self.chain().text])
        lines = [f"{head} Waiting actors:"]
        for member in self.members.values():
            actor, state = member.actor, member.state
            if state.acts_left == 0:
                continue
            where = plan.streams[actor.stream].name
            lines.append(
                f"  {actor.name} on {where}, {act_text(actor.calls, state.number, self.base)}: "
                + ("; ".join(lacking(plan, member)) or "can act, waiting for its turn")
            )
        for driver in self.drivers.values():
            stream = driver.stream
            if stream.running is not None:
                unit, acts = stream.running
                lines.append(
                    f"  stream {driver.name} is still running {unit.name!r} "
                    f"(iteration {acts[0].number - self.base})"
                )
            if stream.submitted > stream.done:
                lines.append(
                    f"  stream {driver.name}: {stream.submitted - stream.done} launched kernels not finished"
                )
            if driver.queue.order:
                lines.append(
                    f"  stream {driver.name}: next in collective order is {driver.queue.order[driver.queue.cursor].name!r}"
                )
        lines.append(self.chain().text)
        return "\n".join(lines)

    def chain(self, start: int | None = None) -> WaitChain:
        if self.replay is not None:
            return self.replay.chain(start)
        return wait_for_chain(self.plan, self.members, self.drivers, self.base, start)

    async def _chain_across_ranks(self) -> list[str]:
        """Where this rank's wait-for chain ends at another rank, the chain there, asked of
        that rank (and so on, each rank once)."""
        assert self.transport is not None
        remote = self.chain().remote
        lines, seen = [], {self.rank}
        while remote is not None and remote[0] not in seen:
            rank, actor = remote
            seen.add(rank)
            self._answer, self._answered = None, trio.Event()
            self.transport.tell(rank, QUERY, msgpack.packb(actor))
            with trio.move_on_after(ASK_TIMEOUT):
                await self._answered.wait()
            if self._answer is None:
                lines.append(f"  on rank {rank}: no answer within {ASK_TIMEOUT} s")
                return lines
            text, remote = self._answer
            lines.append(f"  on rank {rank}: {text}")
        if remote is not None:
            lines.append(f"  back on rank {remote[0]}: a cycle across ranks")
        return lines

    def answer_query(self, asker: int, payload: bytes) -> None:
        """Another rank's stall chain reached one of this rank's actors: the chain from it
        (on the trio thread)."""
        actor = msgpack.unpackb(payload)
        if actor in self.members:
            chain = self.chain(actor)
            answer = [chain.text, chain.remote]
        else:
            answer = [f"actor {actor} is not on rank {self.rank}", None]
        assert self.transport is not None, "queries come only over ranks"
        self.transport.tell(asker, REPLY, msgpack.packb(answer))

    def got_answer(self, payload: bytes) -> None:
        """The answer to this rank's query (on the trio thread)."""
        text, remote = msgpack.unpackb(payload)
        self._answer = (text, tuple(remote) if remote is not None else None)
        self._answered.set()
