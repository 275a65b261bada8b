"""The Plan: everything the compiler decided, as frozen data the runtime executes.

The compiler and the runtime share nothing but these classes. A Plan round-trips through
msgpack: kernels and user functions travel as import paths (by value, pickled with
cloudpickle, when they have none: lambdas, local functions, a script's own), arrays as raw
bytes.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable
from typing import Any, get_origin

import attrs
import cattrs
import cloudpickle
import msgpack
import numpy as np

from .errors import PlanSerializationError

Kernel = Callable[..., Any]

FORMAT_VERSION = 1


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
    reused communication subgraph costs one), bytes of planned memory per device."""

    max_streams: int = 64
    max_ops_per_stream: int = 1024
    max_labels: int = 65536
    max_memory: int = 0


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
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def is_parameter(self) -> bool:
        return self.producer < 0


@attrs.frozen
class Actor:
    """One physical op instance on one device: it reads its inputs and writes its outputs.

    ``every``: micro-batches per act. 1 for most actors; with micro-batching (m > 1),
    m for the actors that act once per step (variables, updates, what sits between an
    ``accumulate`` and an update). Where rates differ on an edge, a ``repeat`` actor
    keeps its input for m acts and an ``accumulate`` actor publishes its output every
    m acts; the runtime derives both from the actors' ``every``. ``backward``: added by
    autodiff (its activations' inputs are what pipeline schedules keep).
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
    calls: int = 1
    """A participant of a reused communication subgraph acts ``calls`` times per
    iteration, once per call site in a fixed order: call k reads input k and writes the
    one shared output register, which only call k's consumers (``Consumer.call``) read."""


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
class Plan:
    """``collectives`` is in the one global order the collective stream runs them in;
    ``link``: (bytes/s, seconds) of the emulated link between devices, if emulated;
    ``overlap=False``: collectives act as if they shared their devices' compute streams
    (each waits for the compute queued before it and holds up the compute queued after
    it), the schedule of frameworks with one stream, for comparison; ``micro_batches``:
    feeds per step (a run takes whole steps; see ``Actor.every``); ``world``: the
    number of ranks (processes) that run it together, and ``ranks`` the rank of each
    device (one process holding every device: world 1, every device on rank 0).
    A register crossing ranks is a ``send`` actor on one rank and a ``recv`` actor on
    the other; each rank runs only its own devices' actors."""

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
    resources: Resources = Resources()
    labels: int = 0
    """Labels the calls of reused communication subgraphs take (see ``Resources``)."""

    def rank_of(self, device: str) -> int:
        """The rank of a device, or of a rank's own streams (``rankN``)."""
        if device.startswith("rank"):
            return int(device[4:])
        return self.ranks.get(device, 0)

    @property
    def events(self) -> tuple[tuple[int, int], ...]:
        """(producer actor, consumer actor) for every input whose stream waits on an event."""
        return tuple(
            (self.registers[i.register].producer, actor.id)
            for actor in self.actors
            for i in actor.inputs
            if i.event
        )

    def to_bytes(self) -> bytes:
        for actor in self.actors:
            for fn in [actor.kernel, *(v for v in actor.attrs.values() if callable(v))]:
                try:
                    _function_entry(fn)
                except PlanSerializationError as e:
                    raise PlanSerializationError(f"actor {actor.name!r}: {e}") from None
        data = {"format": FORMAT_VERSION, "plan": _converter.unstructure(self)}
        return msgpack.packb(data, default=_encode)

    @classmethod
    def from_bytes(cls, data: bytes) -> Plan:
        """Read a Plan back. It imports the functions it names, unpickles those it carries
        by value, and runs them: like pickle, load only plans you trust."""
        try:
            decoded = msgpack.unpackb(
                data, object_hook=_decode, use_list=False, strict_map_key=False
            )
            if not isinstance(decoded, dict) or decoded.get("format") != FORMAT_VERSION:
                raise PlanSerializationError(f"not a serialized Plan of format {FORMAT_VERSION}")
            return _converter.structure(decoded["plan"], cls)
        except PlanSerializationError:
            raise
        except Exception as e:
            raise PlanSerializationError(f"not a serialized Plan: {type(e).__name__}: {e}") from e

    def summary(self) -> str:
        """The Plan for people: streams, actors, quotas, events, collective order, memory."""
        return "\n".join(_summary_lines(self))


def transfer_peers(plan: Plan) -> dict[int, Actor]:
    """Each send's receive and each receive's send (by actor id): the two halves of a
    register crossing ranks share a tag."""
    halves = {(a.kind, a.attrs["tag"]): a for a in plan.actors if a.kind in ("send", "recv")}
    other = {"send": "recv", "recv": "send"}
    return {a.id: halves[(other[kind], tag)] for (kind, tag), a in halves.items()}


def import_path(fn: Callable) -> str | None:
    """``module:qualname`` of a function that imports back as itself, else None."""
    module = getattr(fn, "__module__", None) or (
        "numpy" if isinstance(fn, np.ufunc) else None
    )
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    path = f"{module}:{qualname}"
    try:
        return path if resolve(path) is fn else None
    except PlanSerializationError:
        return None


def _function_entry(fn: Callable) -> dict:
    """A function by import path, which any program with its module can load; one without
    (a lambda, a local function, a kernel in the script run as ``__main__``) by value."""
    path = import_path(fn)
    if path is not None:
        return {"__function__": path}
    try:
        return {"__pickled_function__": cloudpickle.dumps(fn)}
    except Exception as e:
        raise PlanSerializationError(
            f"cannot serialize {fn!r}: it has no import path and cloudpickle cannot carry it "
            f"by value ({type(e).__name__}: {e}); define it at the top level of a module"
        ) from e


def resolve(path: str) -> Callable:
    module, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise PlanSerializationError(f"cannot import function {path}: {e}") from e
    return obj


def _encode(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return {"__array__": (obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())}
    if callable(obj):
        return _function_entry(obj)
    raise PlanSerializationError(f"cannot serialize {type(obj).__name__} in a Plan")


def _decode(obj: dict) -> Any:
    if "__array__" in obj:
        dtype, shape, raw = obj["__array__"]
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if "__function__" in obj:
        return resolve(obj["__function__"])
    if "__pickled_function__" in obj:
        return pickle.loads(obj["__pickled_function__"])
    return obj


_converter = cattrs.Converter()
_converter.register_unstructure_hook(np.ndarray, lambda a: a)
_converter.register_structure_hook(np.ndarray, lambda v, _: v)
_converter.register_unstructure_hook_func(
    lambda t: get_origin(t) is Callable, lambda fn: fn
)
_converter.register_structure_hook_func(
    lambda t: get_origin(t) is Callable, lambda v, _: v
)


def headline(plan: Plan) -> str:
    """The summary's first line: how many actors, streams, collectives and events."""
    m = plan.micro_batches
    steps = f"; {m} micro-batches a step ([step]: acts once per step)" if m > 1 else ""
    ranks = f" over {plan.world} ranks" if plan.world > 1 else ""
    return (
        f"Plan: {len(plan.actors)} actors on {len(plan.streams)} streams{ranks}, "
        f"{len(plan.collectives)} collectives, {len(plan.events)} events{steps}"
    )


def stream_usage(plan: Plan) -> list[str]:
    """Per rank, the streams it runs against ``max_streams``, by kind; labels, where used."""
    kinds: dict[int, dict[str, int]] = {}
    for s in plan.streams:
        kinds.setdefault(s.rank, {}).setdefault(s.kind, 0)
        kinds[s.rank][s.kind] += 1
    limit = plan.resources.max_streams
    lines = [
        f"streams of rank {rank}: {sum(n.values())} of max_streams {limit} ("
        + ", ".join(f"{count} {kind}" for kind, count in sorted(n.items())) + ")"
        for rank, n in sorted(kinds.items())
    ]
    if plan.labels:
        lines.append(f"labels: {plan.labels} of max_labels {plan.resources.max_labels}")
    return lines


def _summary_lines(plan: Plan) -> list[str]:
    names = {a.id: a.name for a in plan.actors}
    lines = [headline(plan), *stream_usage(plan)]
    for stream in plan.streams:
        actors = sorted(
            (a for a in plan.actors if a.stream == stream.id), key=lambda a: a.priority
        )
        rank = f"rank {stream.rank}, " if plan.world > 1 else ""
        group = f"group {','.join(stream.group)}, " if stream.group else ""
        lines.append(f"stream {stream.name} ({rank}{group}{len(actors)} actors)")
        for a in actors:
            ins = ", ".join(_input_text(plan, i) for i in a.inputs) or "-"
            rate = " [step]" if a.every > 1 else ""
            lines.append(f"  [{a.priority:>3}] {a.name:<24} {a.op:<14} in: {ins}{rate}")
            for r in (plan.registers[o] for o in a.outputs):
                to = ", ".join(names[c.actor] for c in r.consumers) or "-"
                lines.append(
                    f"        out {r.name}: {r.dtype}{list(r.shape)} quota {r.quota} -> {to}"
                )
    lines.append("events (producer -> consumer, the consumer's stream waits)")
    stream_name = {s.id: s.name for s in plan.streams}
    stream_of = {a.id: a.stream for a in plan.actors}
    for p, c in plan.events:
        lines.append(
            f"  {names[p]} ({stream_name.get(stream_of[p])}) -> "
            f"{names[c]} ({stream_name.get(stream_of[c])})"
        )
    lines.append("collective order")
    if plan.link is not None:
        bandwidth, latency = plan.link
        lines.append(f"  (link emulated: {bandwidth / 1e9:g} GB/s, {latency * 1e6:g} us latency)")
    for k, coll in enumerate(plan.collectives):
        emulated = f", {coll.seconds * 1e3:.3f} ms emulated" if plan.link is not None else ""
        lines.append(f"  {k}. {coll.name} ({coll.op} over {len(coll.actors)} devices{emulated})")
    lines.append("planned memory (registers x quota + parameters)")
    for device, nbytes in sorted(plan.memory.items()):
        lines.append(f"  {device}: {nbytes / 1024:.1f} KiB")
    return lines


def _input_text(plan: Plan, i: Input) -> str:
    r = plan.registers[i.register]
    if r.is_parameter:
        return f"{r.name} (parameter)"
    return r.name if i.sync == "stream" else f"{r.name} ({i.sync})"
