"""The Plan's data: everything the compiler decided, as frozen records the runtime
executes. The compiler and the runtime share nothing but these classes.

``PlanData`` holds a Plan's fields and what derives from them alone; ``plan.Plan`` adds
its round trip through bytes (``plan_bytes``) and its summary (``plan_summary``), which
read it through the plan check (``plan_check``), so this module imports none of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import numpy as np

Kernel = Callable[..., Any]


@attrs.frozen
class Stream:
    """An in-order queue of kernels: a device's compute or copy stream, or a rank's
    collective or communication stream (``device`` is then ``rankN``). ``rank``: the
    process that runs it.

    A ``comm`` stream is the rank's MPI thread: it starts each send or receive without
    waiting and reports them as they complete, in any order, so its actors' inputs and
    outputs are synced at completion, never by events."""

    id: int
    name: str
    kind: str
    device: str
    rank: int = 0
    group: tuple[str, ...] = ()
    """For a collective stream: the devices of the communication group it serves."""
    channel: int = 0
    """For a collective stream: its place among its group's streams (the same on every rank)."""


@attrs.frozen
class Resources:
    """What a rank can hold, as the compiler was told (``compile``'s options of the same
    names): streams per rank, collectives per collective stream, labels (each call of a
    reused communication subgraph costs one), bytes of planned memory per device (0:
    what the compiling machine had available)."""

    max_streams: int = 64
    max_ops_per_stream: int = 1024
    max_labels: int = 65536
    max_memory: int = 0


DEFAULT_RESOURCES = Resources()


@attrs.frozen
class Input:
    """One input of an actor, and how it is kept in order with its producer (``sync``):

    - ``stream``: same stream (or a parameter); stream order suffices, ready at the
      producer's launch;
    - ``event``: another stream; ready at the producer's launch, and the consumer's
      stream waits on the producer's event before the kernel;
    - ``implied``: another stream; ready at launch, no wait: another input's event
      already implies this producer finished;
    - ``completion``: another stream; ready once the producer's kernel has finished.
      Used where the consumer's stream is fed by several streams, since a stream
      waiting on one of them would hold up work queued behind it.
    """

    register: int
    sync: str = "stream"

    @property
    def event(self) -> bool:
        return self.sync == "event"


@attrs.frozen
class Consumer:
    actor: int
    slot: int
    call: int = 0
    """Which call of a reused communication subgraph (``Actor.calls``) it reads."""


@attrs.frozen
class Register:
    """An actor output: ``quota`` buffers of one shape and dtype on one device.

    A parameter's register has no producer (``producer == -1``): it holds one buffer
    that is always readable and takes no part in the credit protocol. A parameter that
    an optimizer updates is instead produced by a ``variable`` actor, once per iteration,
    with quota 1, so the update can wait for every read. A ``control`` register carries
    no data, only the order "producer before consumer"; kernels never see it.
    """

    id: int
    name: str
    producer: int
    device: str
    shape: tuple[int, ...]
    dtype: str
    consumers: tuple[Consumer, ...] = ()
    quota: int = 1
    control: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def is_parameter(self) -> bool:
        return self.producer < 0


@attrs.frozen
class Actor:
    """One physical op instance on one device: it reads its inputs and writes its outputs.

    ``every``: micro-batches per act. 1 for most actors; with micro-batching (m > 1),
    m for the actors that act once per step (variables, updates, what sits between an
    ``accumulate`` and an update). Where rates differ on an edge, a once-per-micro-batch
    consumer holds a once-per-step register for m acts, or an ``accumulate`` actor
    publishes its output every m acts; the runtime derives both from the actors'
    ``every``. ``backward``: added by autodiff (its activations' inputs are what pipeline
    schedules keep); ``weight_grad``:
    a backward actor that computes only weight gradients (the W of zero-bubble
    pipelines), which no other stage waits for; ``recompute``:
    a forward actor marked by ``af.recompute``, or the backward copy the compiler's
    ``recompute`` pass made of one (``NAME.recompute``), which the original's backward
    readers read instead, so the original's outputs are free once the forward pass is
    done with them.
    """

    id: int
    name: str
    kind: str
    op: str
    kernel: Kernel
    attrs: dict[str, Any]
    device: str
    inputs: tuple[Input, ...]
    outputs: tuple[int, ...]
    stream: int = -1
    priority: int = 0
    group: int = -1
    where: str = ""
    every: int = 1
    backward: bool = False
    weight_grad: bool = False
    recompute: bool = False
    calls: int = 1
    """A participant of a reused communication subgraph acts ``calls`` times per
    iteration, once per call site in a fixed order: call k reads input k and writes the
    one shared output register, which only call k's consumers (``Consumer.call``) read."""

    @property
    def ops(self) -> tuple[str, ...]:
        """The ops its act runs: its own, or a fused chain's members' in order (its op is
        theirs joined by ``+``, see ``compiler.chains``)."""
        return tuple(self.op.split("+"))

    def kernels(self) -> list[tuple[Kernel, dict[str, Any]]]:
        """(kernel, attrs) of each kernel its act runs: its own, or each part of a fused
        chain (``attrs["parts"]``: per member ``(kernel, attrs, sources, targets, phased,
        name, where)``, see ``ops.chain``; a part that is itself a chain of parts, one
        kernel for several members, gives theirs)."""
        if "parts" not in self.attrs:
            return [(self.kernel, self.attrs)]
        return [(part[0], part[1]) for part in leaf_parts(self.attrs["parts"])]


def leaf_parts(parts: tuple) -> Iterator[tuple]:
    """Each member a chain's ``parts`` run, in order: a part, or a nested part's own
    members, their sources and targets mapped to the chain's inputs and outputs."""
    for part in parts:
        if "parts" not in part[1]:
            yield part
            continue
        sources, targets = part[2], part[3]
        for inner in leaf_parts(part[1]["parts"]):
            mapped = tuple(sources[s] if s >= 0 else ~targets[~s] for s in inner[2])
            yield (inner[0], inner[1], mapped, tuple(targets[t] for t in inner[3]), *inner[4:])


def parts_count(parts: tuple) -> int:
    """The members a chain's ``parts`` run: one a part, or a nested part's own count (as
    ``leaf_parts`` gives them, but without reading their sources, which the plan check
    has yet to check)."""
    return sum(parts_count(p[1]["parts"]) if "parts" in p[1] else 1 for p in parts)


@attrs.frozen
class Collective:
    """The actors (one per participating device) that run one collective together.

    ``seconds``: with link emulation on, the time the collective takes on the emulated
    link; the runtime pads the kernel to last that long after the real data movement.
    Participants on several ranks run it together as one MPI collective (see ``Plan.ranks``).
    """

    id: int
    name: str
    op: str
    actors: tuple[int, ...]
    seconds: float = 0.0
    nbytes: int = 0
    """What a ring implementation moves over the links at one act, summed over the
    participants (the compiler's prediction; see ``compiler.link``)."""


@attrs.frozen
class Feed:
    name: str
    actor: int
    shape: tuple[int, ...]
    dtype: str


@attrs.frozen
class Output:
    name: str
    actor: int


@attrs.frozen
class Parameter:
    """A tensor that lives across iterations, with its initial value. ``state``: an
    optimizer's own (momentum, moments), not a model parameter."""

    name: str
    register: int
    value: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
    state: bool = False


@attrs.frozen
class LogicalTensor:
    """A tensor placed on several devices, as the user sees it: fed, fetched or read as
    one array, kept as one part per device. ``sbp``: "S" (parts split along ``axis``),
    "B" (every part is the whole), "P" (the parts sum to it). ``parts``: the names of the
    per-device feeds, outputs or parameters, in device order."""

    kind: str
    name: str
    sbp: str
    axis: int
    parts: tuple[str, ...]


@attrs.frozen
class PlanData:
    """``collectives`` is in one global order, each collective stream running its share of
    them in that order;
    ``link``: (bytes/s, seconds) of the emulated link between devices, if emulated;
    ``overlap=False``: collectives act as if they shared their devices' compute streams
    (each waits for the compute queued before it and holds up the compute queued after
    it), the schedule of frameworks with one stream, for comparison; ``micro_batches``:
    feeds per step (a run takes whole steps; see ``Actor.every``); ``world``: the
    number of ranks (processes) that run it together, and ``ranks`` the rank of each
    device (one process holding every device: world 1, every device on rank 0).
    A register crossing ranks is a ``send`` actor on one rank and a ``recv`` actor on
    the other; each rank runs only its own devices' actors.

    The data only: ``plan.Plan`` adds its round trip through bytes and its summary."""

    actors: tuple[Actor, ...]
    registers: tuple[Register, ...]
    streams: tuple[Stream, ...] = ()
    collectives: tuple[Collective, ...] = ()
    feeds: tuple[Feed, ...] = ()
    outputs: tuple[Output, ...] = ()
    parameters: tuple[Parameter, ...] = ()
    memory: dict[str, int] = attrs.Factory(dict)
    link: tuple[float, float] | None = None
    logical: tuple[LogicalTensor, ...] = ()
    overlap: bool = True
    micro_batches: int = 1
    world: int = 1
    ranks: dict[str, int] = attrs.Factory(dict)
    stages: tuple[tuple[str, ...], ...] = ()
    resources: Resources = DEFAULT_RESOURCES
    labels: int = 0
    """Labels the calls of reused communication subgraphs take (see ``Resources``)."""
    sbp: dict[str, str] = attrs.Factory(dict)
    """The SBP of every tensor on several devices, by its (logical) name: those the user
    annotated and those the ops' signatures (or the compiler) chose."""
    quota_wishes: dict[str, int] = attrs.Factory(dict)
    """Register name -> the quota a pass asked for (a pipeline schedule's, 1 inside a
    fused chain, ...), where an earlier pass's wish stands; ``quotas`` given to
    ``compile`` override them and ``plan_registers`` applies them."""
    quota_floors: dict[str, int] = attrs.Factory(dict)
    """Register name -> the fewest buffers it needs not to deadlock (a reused
    communication subgraph's shared register), raising any quota below it."""

    def rank_of(self, device: str) -> int:
        """The rank of a device, or of a rank's own streams (``rankN``)."""
        if device.startswith("rank"):
            return int(device[4:])
        return self.ranks.get(device, 0)

    def devices_of(self, rank: int) -> list[str]:
        """The devices ``rank`` holds (none in one process: ``ranks`` is empty there)."""
        return [d for d, r in self.ranks.items() if r == rank]

    def parameters_of(self, rank: int) -> list[Parameter]:
        """The parameters (and optimizer state) ``rank`` holds: those of its devices."""
        return [p for p in self.parameters if self.rank_of(self.registers[p.register].device) == rank]

    def period(self, actor: Actor, register: int) -> int:
        """Every how many acts ``actor`` hands its output ``register`` on: 1, or m where
        once-per-step actors read what it makes once per micro-batch (an accumulate)."""
        every = max((self.actors[c.actor].every for c in self.registers[register].consumers), default=1)
        return max(1, every // actor.every)

    def phases(self, actor: Actor) -> int:
        """How many phases ``actor``'s acts cycle through, the longest period of its data
        outputs: the runtime hands a kernel of more than one its act's phase (an
        accumulate's, which needs to know the first and last micro-batch of a step)."""
        return max((self.period(actor, o) for o in actor.outputs if not self.registers[o].control), default=1)

    def as_arriving(self, actor: Actor) -> bool:
        """Whether ``actor`` is an update of a parameter with no variable, one of the
        several that apply its workers' gradients as they arrive (async parameter servers;
        see ``compiler.expand``)."""
        return actor.kind == "update" and self.registers[actor.inputs[0].register].is_parameter

    def stage_of(self, device: str) -> int | None:
        """The pipeline stage holding ``device``, or None (not in a stage, or no stages)."""
        return next((k for k, devices in enumerate(self.stages) if device in devices), None)

    def communication_per_step(self) -> int:
        """Bytes the collectives move over the links in one step (``Collective.nbytes``
        times its acts a step)."""
        firsts = (self.actors[c.actors[0]] for c in self.collectives)
        return sum(
            c.nbytes * (self.micro_batches // a.every) * a.calls for c, a in zip(self.collectives, firsts)
        )

    @property
    def events(self) -> tuple[tuple[int, int], ...]:
        """(producer actor, consumer actor) for every input whose stream waits on an event."""
        return tuple(
            (self.registers[i.register].producer, actor.id)
            for actor in self.actors
            for i in actor.inputs
            if i.event
        )
