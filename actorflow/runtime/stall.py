"""The wait-for chain of a StallError: from a waiting actor, follow what it waits on to
the actor that everything waits on."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum

import attrs

from ..dag import topological_order
from ..plan import Plan, transfer_peers
from .debug import fed_inputs
from .driver import Driver, Member


class _Look(Enum):
    """How the chain looks at an actor: at what its next act waits on (WAIT), or at a kernel
    of it that was launched and has not finished (KERNEL), which waits on its stream."""

    WAIT = "wait"
    KERNEL = "kernel"


_Step = tuple[Member, _Look]


@attrs.frozen
class WaitChain:
    """``text``: the chain for people; ``remote``: (rank, actor id) where the chain's last
    actor waits on another rank (a send or receive in flight, a collective over ranks),
    so the chain goes on there; None otherwise."""

    text: str
    remote: tuple[int, int] | None = None


def wait_for_chain(
    plan: Plan, members: Mapping[int, Member], drivers: Sequence[Driver], base: int, start: int | None = None
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
    ``members``: this rank's, by actor id; ``base``: the run's first iteration, to
    number iterations.
    """
    step = (members[start], _Look.WAIT) if start is not None else _start(plan, members, drivers)
    chain = _Chain(plan, members, base)
    text = chain.walk(step)
    return WaitChain("wait-for chain: " + text if start is None else text, chain.remote)


def _start(plan: Plan, members: Mapping[int, Member], drivers: Sequence[Driver]) -> _Step | None:
    for a in _topological(plan):
        if a in members and members[a].state.acts_left > 0:
            return members[a], _Look.WAIT
    for driver in drivers:
        if driver.executor.running is not None:
            return driver.executor.running[0].members[0], _Look.KERNEL
    return None


def _topological(plan: Plan) -> list[int]:
    """Actor ids in a topological order of the data and control edges, smallest id first."""
    edges: dict[int, list[int]] = {a.id: [] for a in plan.actors}
    for reg in plan.registers:
        if not reg.is_parameter:
            edges[reg.producer].extend(c.actor for c in reg.consumers)
    return topological_order(edges)


class _Chain:
    def __init__(self, plan: Plan, members: Mapping[int, Member], base: int) -> None:
        self.plan = plan
        self.members = members
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
        driver = member.unit.driver
        first = driver.units[driver.cursor] if driver.ordered else member.unit
        if first is not member.unit:
            return (
                f", which waits on nothing: it can act, but its stream {driver.name} launches "
                f"collectives in plan order and {first.name!r} comes first"
            )
        return f", which waits on nothing: its stream {driver.name} {self._stream(driver)}"

    def _producer(self, member: Member, slot: int) -> _Step:
        """The producer of input ``slot``: its act that makes the register ``member`` needs was
        launched (the register is ready when that kernel finishes), or not yet."""
        spec = fed_inputs(member)[slot]
        producer = spec.producer
        every = member.actor.every
        needed = (member.state.iteration // member.actor.calls * every + every - 1) // producer.actor.every
        if producer.actor.calls > 1:  # a reused subgraph's act for the call this input reads
            reg = self.plan.registers[producer.actor.outputs[spec.out]]
            read = (member.actor.id, member.inputs.index(spec))  # the actor's input, params counted
            needed = needed * producer.actor.calls + next(
                c.call for c in reg.consumers if (c.actor, c.slot) == read
            )
        return producer, (_Look.KERNEL if producer.state.iteration > needed else _Look.WAIT)

    def _holder(self, member: Member, out: int) -> _Step:
        """The first consumer still holding a buffer of output ``out``.

        A consumer holds one that is ready for it but not taken, or kept for its next acts
        (an input held over several acts): then it waits on what its own next act waits
        on. A consumer on another stream frees a buffer when the kernel that read it
        finishes: if its stream has unfinished kernels, that kernel is taken to be the
        holder. With no such consumer, the buffers are not handed on yet: consumers that
        hear "ready" at completion wait on ``member``'s own launched kernel.
        """
        held = {i for i, n in enumerate(member.state.pending[out]) if n}
        for consumer, slot in member.outputs[out].consumers:
            state = consumer.state
            if any(i in held for i in state.ready[slot]):
                return consumer, _Look.WAIT
            current = state.current_in[slot]
            if state.iteration % state.holds[slot] and current is not None and current in held:
                return consumer, _Look.WAIT
            executor = consumer.unit.driver.executor
            if executor.done < executor.submitted:
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
        if elsewhere and member.unit.driver.executor.running is not None:
            return self._across(
                elsewhere[0], f"its collective waits on {self.plan.actors[elsewhere[0]].name!r}"
            )
        driver = member.unit.driver
        running = driver.executor.running
        if running is None:
            return (
                f", whose launched kernel has not finished: its stream {driver.name} {self._stream(driver)}"
            )
        if running[0] is not member.unit:
            return running[0].members[0], _Look.KERNEL
        return f", which waits on nothing: its stream {driver.name} {self._stream(driver)}"

    def _across(self, actor: int, what: str) -> str:
        rank = self.plan.rank_of(self.plan.actors[actor].device)
        self.remote = (rank, actor)
        return f", which waits on rank {rank}: {what}"

    def _stream(self, driver: Driver) -> str:
        executor = driver.executor
        if executor.running is not None:
            unit, iteration = executor.running[0], executor.running[1]
            return f"is running {unit.name!r} (iteration {iteration - self.base})"
        unfinished = executor.submitted - executor.done
        if unfinished:
            return f"has {unfinished} launched kernels not finished, the first waiting on another stream"
        return "is idle"
