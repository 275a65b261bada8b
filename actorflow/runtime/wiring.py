"""Wiring: what one rank runs of a Plan, as a pure function of (plan, rank).

``wire`` allocates every register buffer this rank holds once, makes each local actor's
protocol state (``protocol.ActorProtocol``) and routing tables (who reads what, who is
told "ready" and "free"), groups actors into the units a stream launches as one kernel,
and hands each stream its units. Nothing here runs: the drivers do (``driver``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Collection
from typing import Any

import attrs
import numpy as np

from ..collector import cyclic_gc_paused
from ..devices import is_cuda
from ..plan import Actor, Collective, Input, Plan, Register, Stream
from .cuda import Gpus, cuda_stream
from .protocol import Act, ActorProtocol

HOSTED_MOVE_BYTES = 1 << 18  # copied in about the time it takes to wake a thread
HOSTED_PRIORITY = -1  # ahead of every priority the compiler gives


class InputSpec:
    """How a member reads one input: a parameter buffer, or a producer's register."""

    __slots__ = ("param", "slot", "control", "buffers", "producer", "out")

    def __init__(
        self,
        param: np.ndarray | None = None,
        slot: int = -1,
        control: bool = False,
        buffers: list[np.ndarray] | None = None,
        producer: Member | None = None,
        out: int = -1,
    ) -> None:
        self.param = param
        self.slot = slot
        self.control = control
        self.buffers = buffers
        self.producer = producer
        self.out = out


class OutputSpec:
    """``by_call``: per call of the actor (one, except for a reused communication
    subgraph), its consumers as (member, protocol slot). ``control``: an order-only
    register, never handed to the kernel."""

    __slots__ = ("buffers", "by_call", "control")

    def __init__(self, buffers: list[np.ndarray], by_call: list[list], control: bool = False) -> None:
        self.buffers = buffers
        self.by_call = by_call
        self.control = control

    @property
    def consumers(self) -> list[tuple[Member, int]]:
        """Every consumer, of every call."""
        return [c for call in self.by_call for c in call]


class Member:
    """One actor inside a unit: its protocol state and how its inputs and outputs are wired.

    ``phases``: for an actor that publishes its data output every p > 1 acts (an
    ``accumulate``), p; its kernel gets the act's phase, 0 .. p - 1, as its last input.
    ``fed``: its inputs that take part in the protocol, by protocol slot.
    """

    __slots__ = ("actor", "state", "unit", "inputs", "outputs", "fed", "phases")

    unit: Unit
    """Set by the Unit that takes this member in."""

    def __init__(self, actor: Actor, state: ActorProtocol, phases: int = 1) -> None:
        self.actor = actor
        self.state = state
        self.inputs: list[InputSpec] = []
        self.outputs: list[OutputSpec] = []
        self.fed: list[InputSpec] = []
        self.phases = phases

    def acts(self, iterations: int) -> int:
        """How many times this actor acts in a run of ``iterations``."""
        return acts_in(self.actor, iterations)


def acts_in(actor: Actor, iterations: int) -> int:
    """How many times ``actor`` acts in a run of ``iterations`` (whole steps): once per
    ``every`` iterations, and for a reused subgraph once per call."""
    return iterations // actor.every * actor.calls


class Unit:
    """What a stream launches as one kernel: one actor, or a collective's participants.

    ``stream``: the id of the plan stream whose thread runs it (its own, or a partner's
    for a small move, see ``_host_moves``); ``fences``: the ids of the streams it holds
    while it runs (overlap off); ``feed`` and ``fetch``: the names it reads from the
    caller or hands back."""

    __slots__ = ("id", "name", "priority", "members", "kernel", "stream", "feed", "fetch", "fences", "queued")

    def __init__(self, id: int, name: str, priority: int, members: list[Member], kernel: Callable) -> None:
        self.id = id
        self.name = name
        self.priority = priority
        self.members = members
        self.kernel = kernel
        self.stream = members[0].actor.stream
        self.feed: str | None = None
        self.fetch: str | None = None
        self.fences: list[int] = []
        self.queued = False  # in its driver's queue of units to try
        for m in members:
            m.unit = self

    @property
    def actor(self) -> Actor:
        """The first member's actor: the one that names the unit's op, stream and rates."""
        return self.members[0].actor


def arrays(unit: Unit, acts: list[Act]) -> tuple[list, list]:
    """What the kernel of ``unit`` reads and writes for ``acts`` (one per member): its
    inputs (parameters, the buffers the acts read, an accumulate's phase) and its output
    buffers, control registers left out; a feed's value is the caller's to add."""
    ins: list = []
    outs: list = []
    for m, act in zip(unit.members, acts):
        ready = act.inputs
        for spec in m.inputs:
            if spec.param is not None:
                ins.append(spec.param)
            elif not spec.control and (index := ready[spec.slot]) is not None:
                ins.append(spec.buffers[index])  # type: ignore[index]
        for output, index in zip(m.outputs, act.outputs):
            if not output.control:
                outs.append(output.buffers[index])
        if m.phases > 1:
            ins.append(act.number % m.phases)
    return ins, outs


@attrs.frozen
class StreamWiring:
    """One stream of this rank: its units, and for a collective stream the order they
    launch in within a step (``step_order``), which it follows strictly, step after step."""

    stream: Stream
    units: list[Unit]
    order: list[Unit] | None


@attrs.frozen
class Wiring:
    """What ``wire`` makes: ``members`` by actor id, ``units`` by unit id, ``streams`` of
    this rank in plan order, and ``buffers`` per register id (empty where another rank
    holds it), with ``views`` of them that its readers get (read-only)."""

    members: dict[int, Member]
    units: list[Unit]
    streams: list[StreamWiring]
    buffers: list[list[np.ndarray]]
    views: list[list[np.ndarray]]

    def release(self, keep: Collection[int]) -> None:
        """Let go of the buffers of every register but ``keep`` (ids), and of their views,
        once no thread runs a kernel on them: members, units, producers and consumers
        reference each other, so Python frees a wiring only at a collection over the
        whole heap, and its buffers would wait for it (``af.run`` of a plan of 256 MB of
        buffers three times in a row held 775 MB)."""
        for register, (buffers, views) in enumerate(zip(self.buffers, self.views)):
            if register not in keep:
                buffers.clear()
                views.clear()


Across = Callable[[Collective], Callable]
"""The kernel of this rank's participants of a collective whose others are on other ranks."""


@cyclic_gc_paused()
def wire(
    plan: Plan,
    rank: int | None,
    across: Across | None = None,
    allocate: bool = True,
    gpus: Gpus | None = None,
) -> Wiring:
    """Everything ``rank`` runs of ``plan``, wired (see the module's docstring).
    ``allocate=False``: no buffers, only their places (None), for a simulated run;
    ``gpus``: the rank's ``cuda.Gpus``, which allocates the registers of cuda devices;
    ``rank`` None: what every rank runs, as one (a simulated run over ranks, where a
    collective's unit holds every participant)."""
    local = [a for a in plan.actors if rank in (None, plan.rank_of(a.device))]
    mine = {a.id for a in local}
    buffers = _allocate(plan, rank, local, allocate, gpus)
    slots = {a.id: _protocol_slots(plan, a) for a in local}  # dicts: a fused collective has thousands
    output_index = {o: k for a in plan.actors for k, o in enumerate(a.outputs)}
    members = {a.id: _member(plan, a, slots[a.id]) for a in local}
    readable = [[_read_only(b) for b in bs] for bs in buffers] if allocate else buffers
    for actor in local:
        _wire_member(plan, members[actor.id], members, slots, output_index, buffers, readable)

    units: list[Unit] = []

    def add_unit(name: str, actors: list[Actor]) -> Unit:
        first = actors[0]
        unit = Unit(len(units), name, first.priority, [members[a.id] for a in actors], bound(first, allocate))
        units.append(unit)
        return unit

    in_collective: set[int] = set()
    for coll in plan.collectives:
        here = [plan.actors[a] for a in coll.actors if a in mine]
        in_collective.update(coll.actors)
        if not here:
            continue
        unit = add_unit(coll.name, here)
        if len(here) < len(coll.actors):
            assert across is not None, "a collective spans ranks only in a run over several"
            unit.kernel = across(coll)
        if coll.seconds > 0:  # an emulated link: on a GPU, its time is spent on the GPU
            lasting = gpus.link if gpus is not None and gpus.on_gpu(unit.stream) else _lasting
            unit.kernel = functools.partial(lasting, unit.kernel, coll.seconds)
        if not plan.overlap:
            devices = dict.fromkeys(plan.actors[a].device for a in coll.actors)
            unit.fences = [
                s.id
                for s in plan.streams
                if rank in (None, s.rank) and s.kind == "compute" and s.device in devices
            ]
    for actor in local:
        if actor.id not in in_collective:
            add_unit(actor.name, [actor])
    for feed in plan.feeds:
        if feed.actor in mine:
            members[feed.actor].unit.feed = feed.name
    for out in plan.outputs:
        if out.actor in mine:
            members[out.actor].unit.fetch = out.name
    _host_moves(plan, units)

    streams = []
    spanning = _spanning_ranks(plan)
    for stream in plan.streams:
        if rank not in (None, stream.rank):
            continue
        on_it = [u for u in units if u.stream == stream.id]
        if stream.id in spanning:  # the collective order, as the plan lists collectives
            streams.append(StreamWiring(stream, on_it, step_order(on_it, plan.micro_batches)))
        else:
            streams.append(StreamWiring(stream, sorted(on_it, key=lambda u: u.priority), None))
    return Wiring(members, units, streams, buffers, readable)


def _spanning_ranks(plan: Plan) -> set[int]:
    """The collective streams that run a collective with participants on several ranks:
    those follow the collective order, which every rank follows alike. A collective
    within one process is one unit of all its participants, and launches, as a compute
    stream's units do, when it can act, by priority: in a fixed order, a stage's tensor-
    parallel all-reduces ran each micro-batch's backward ones before the next
    micro-batch's forward ones, one micro-batch in flight through the pipeline."""
    return {plan.actors[a].stream for c in plan.collectives if len(ranks_of(plan, c)) > 1 for a in c.actors}


def ranks_of(plan: Plan, coll: Collective) -> tuple[int, ...]:
    """The ranks a collective's participants are on, in order: its group."""
    return tuple(sorted({plan.rank_of(plan.actors[a].device) for a in coll.actors}))


def step_order(units: list[Unit], micro_batches: int) -> list[Unit]:
    """A collective stream's launches in one step, from its units in the collective
    order: a run of units that act once per micro-batch repeats for each micro-batch
    (all of micro-batch 0's, then 1's, ...); a unit that acts once per step launches
    once (the compiler puts those reading only per-step values before the
    per-micro-batch run and those reading accumulated ones after it)."""
    order: list[Unit] = []
    run: list[Unit] = []
    for unit in [*units, None]:
        if unit is not None and unit.actor.every < micro_batches:
            run.append(unit)
            continue
        order += run * micro_batches
        run = []
        if unit is not None:
            order.append(unit)
    return order


def _allocate(
    plan: Plan, rank: int | None, local: list[Actor], allocate: bool, gpus: Gpus | None
) -> list[list[Any]]:
    """Every register buffer this rank holds or reads, allocated once, on its device: its
    quota of buffers, or a parameter's one, holding its initial value."""
    held = {r.id for r in plan.registers if rank in (None, plan.rank_of(r.device))}
    held |= {i.register for a in local for i in a.inputs}
    initial = {p.register: p.value for p in plan.parameters}
    if not allocate:
        return [[None] * (1 if r.id in initial else r.quota) if r.id in held else [] for r in plan.registers]

    def buffers(r: Register) -> list[Any]:
        if r.id not in held:
            return []
        if gpus is not None and is_cuda(r.device):
            return (
                [gpus.array(r, initial[r.id])] if r.id in initial else [gpus.zeros(r) for _ in range(r.quota)]
            )
        if r.id in initial:
            return [np.array(initial[r.id], dtype=r.dtype, copy=True)]
        return [np.zeros(r.shape, r.dtype) for _ in range(r.quota)]

    return [buffers(r) for r in plan.registers]


def bound(actor: Actor, runs: bool = True) -> Callable:
    """The actor's kernel with its attributes bound: where it ``runs`` (not in a simulated
    run, which calls no kernel), by the kernel's own ``actorflow_bind`` where it has one
    (a fused chain's, ``ops.chain.bind``, generated), else as a partial."""
    if not actor.attrs:
        return actor.kernel
    bind = getattr(actor.kernel, "actorflow_bind", None) if runs else None
    return bind(**actor.attrs) if bind is not None else functools.partial(actor.kernel, **actor.attrs)


def _read_only(buffer: Any) -> Any:
    """A view kernels can't write through (a host array's; CuPy's arrays have no such flag)."""
    if not isinstance(buffer, np.ndarray):
        return buffer
    view = buffer.view()
    view.flags.writeable = False
    return view


def _member(plan: Plan, actor: Actor, slots: dict[int, int]) -> Member:
    state = ActorProtocol(
        len(slots),
        [plan.registers[o].quota for o in actor.outputs],
        [len(plan.registers[o].consumers) for o in actor.outputs],
        holds=[_hold(plan, actor, actor.inputs[k]) for k in slots],
        periods=[plan.period(actor, o) for o in actor.outputs],
        call_consumers=_call_consumers(plan, actor),
        name=actor.name,
        registers=[plan.registers[o].name for o in actor.outputs],
    )
    return Member(actor, state, plan.phases(actor))


def _wire_member(
    plan: Plan,
    member: Member,
    members: dict[int, Member],
    slots: dict[int, dict[int, int]],
    output_index: dict[int, int],
    buffers: list[list[np.ndarray]],
    readable: list[list[Any]],
) -> None:
    """Kernels read their inputs through read-only views (``readable``), so a kernel that
    writes into an input fails instead of changing what another reader or the next run
    sees; an update op writes its parameter and optimizer state (what variables publish)
    in place."""
    actor = member.actor
    slot_of = slots[actor.id]
    for k, i in enumerate(actor.inputs):
        reg = plan.registers[i.register]
        written = actor.kind == "update" and (
            reg.is_parameter or plan.actors[reg.producer].kind == "variable"
        )
        view = (buffers if written else readable)[reg.id]
        if reg.is_parameter:
            member.inputs.append(InputSpec(param=view[0]))
            continue
        spec = InputSpec(
            slot=slot_of[k],
            control=reg.control,
            buffers=view,
            producer=members[reg.producer],
            out=output_index[reg.id],
        )
        member.inputs.append(spec)
        member.fed.append(spec)
    for o in actor.outputs:
        reg = plan.registers[o]
        consumers = [(members[c.actor], slots[c.actor][c.slot]) for c in reg.consumers]
        by_call = [[t for t, c in zip(consumers, reg.consumers) if c.call == j] for j in range(actor.calls)]
        member.outputs.append(OutputSpec(buffers[o], by_call, reg.control))


def _host_moves(plan: Plan, units: list[Unit]) -> None:
    """Small moves within this process get no thread of their own: a copy between
    devices or a fetch runs on its producer's stream, a feed on its consumer's, ahead
    of that stream's other work (they are quick, and another stream waits for them);
    where that is the rank's communication stream (a fetch or a copy of what another rank
    sent, a feed or a copy that a send reads), on the device's compute stream. In a
    replay its thread rides the communication stream where it is the rank's first
    (``replay._rider``); elsewhere it waits on it as the copy stream's thread did. A copy
    thread woken for each received loss took the rank's core from its kernels.
    A hand-off between two devices is then one message, from the producer's thread to
    the consumer's. Moves of over ``HOSTED_MOVE_BYTES`` keep their copy stream, where
    they overlap compute. A move between the host and a GPU keeps its own stream too (its
    destination device's copy stream), so a GPU's copy is ordered among that GPU's work
    and a host's copy waits for the GPU on the host."""
    host: dict[int, int] = {}  # unit id -> the stream whose thread runs it
    compute = {s.device: s.id for s in plan.streams if s.kind == "compute"}

    def stream_of(unit: Unit) -> int:
        if unit.id not in host:
            own = host[unit.id] = unit.actor.stream
            partners = {stream_of(p) for p in _partners(plan, unit)}
            if len(partners) == 1:
                stream = partners.pop()
                if plan.streams[stream].kind == "comm":
                    stream = compute.get(unit.actor.device, own)
                to, at = plan.streams[stream], plan.streams[own]
                if to.kind in ("compute", "copy") and cuda_stream(to) == cuda_stream(at):
                    host[unit.id] = stream
        return host[unit.id]

    for unit in units:
        stream = stream_of(unit)
        if stream != unit.actor.stream:
            unit.stream = stream
            unit.priority = HOSTED_PRIORITY


def _partners(plan: Plan, unit: Unit) -> list[Unit]:
    """The units on whose stream a small move within the process may run (see
    ``_host_moves``): a copy's or a fetch's producer, a feed's consumers; none where it
    keeps its own stream."""
    if len(unit.members) > 1:
        return []
    member = unit.members[0]
    actor = member.actor
    if actor.kind not in ("copy", "fetch", "feed") or not member.state.uniform:  # uniform: one call
        return []
    moved = [plan.registers[o] for o in actor.outputs] or [plan.registers[i.register] for i in actor.inputs]
    if sum(r.nbytes for r in moved) > HOSTED_MOVE_BYTES:
        return []
    if actor.kind == "feed":
        return [c.unit for o in member.outputs for c, _ in o.consumers]
    return [member.fed[0].producer.unit] if len(member.fed) == 1 and member.fed[0].producer else []


def _protocol_slots(plan: Plan, actor: Actor) -> dict[int, int]:
    """Input k -> its place among ``actor``'s inputs that take part in the credit protocol
    (a parameter's does not), in input order."""
    produced = [k for k, i in enumerate(actor.inputs) if not plan.registers[i.register].is_parameter]
    return {k: place for place, k in enumerate(produced)}


def _hold(plan: Plan, actor: Actor, i: Input) -> int:
    """How many of ``actor``'s acts one register of input ``i`` serves (a once-per-step register's m)."""
    producer = plan.actors[plan.registers[i.register].producer]
    return max(1, producer.every // actor.every)


def _call_consumers(plan: Plan, actor: Actor) -> list[list[int]] | None:
    """Per output of a reused communication subgraph's participant, its consumers per call."""
    if actor.calls == 1:
        return None
    counts = [[0] * actor.calls for _ in actor.outputs]
    for k, o in enumerate(actor.outputs):
        for c in plan.registers[o].consumers:
            counts[k][c.call] += 1
    return counts


def _lasting(kernel: Callable, seconds: float, ins: list, outs: list) -> Any:
    """Run ``kernel``, then wait out the rest of ``seconds`` (an emulated link's time)."""
    start = time.perf_counter()
    result = kernel(ins, outs)
    rest = seconds - (time.perf_counter() - start)
    if rest > 0:
        time.sleep(rest)
    return result
