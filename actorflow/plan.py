"""The Plan: everything the compiler decided, as frozen data the runtime executes.

The compiler and the runtime share nothing but these classes. A Plan round-trips through
msgpack: kernels and user functions travel as import paths (by value, pickled with
cloudpickle, when they have none: lambdas, local functions, a script's own), arrays as raw
bytes, the whole sealed with a digest; what is read back is checked (digest, schema,
``plan_check.validate``) before anyone can run it.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import pickle
import reprlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, get_args, get_origin

import attrs
import cattrs
import cloudpickle
import msgpack
import numpy as np
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.gen import make_dict_structure_fn

from .collector import cyclic_gc_paused
from .errors import CompileError, PlanSerializationError
from .plan_check import transfers, validate

Kernel = Callable[..., Any]

FORMAT_VERSION = 3


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
        name, where)``, see ``ops.chain``)."""
        if len(self.ops) == 1:
            return [(self.kernel, self.attrs)]
        return [(part[0], part[1]) for part in self.attrs["parts"]]


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
class Plan:
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
    stages: tuple[tuple[str, ...], ...] = ()
    resources: Resources = DEFAULT_RESOURCES
    labels: int = 0
    """Labels the calls of reused communication subgraphs take (see ``Resources``)."""
    sbp: dict[str, str] = attrs.Factory(dict)
    """The SBP of every tensor on several devices, by its (logical) name: those the user
    annotated and those the ops' signatures (or the compiler) chose."""

    def rank_of(self, device: str) -> int:
        """The rank of a device, or of a rank's own streams (``rankN``)."""
        if device.startswith("rank"):
            return int(device[4:])
        return self.ranks.get(device, 0)

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

    @cyclic_gc_paused()
    def to_bytes(self) -> bytes:
        for actor in self.actors:
            for fn in [actor.kernel, *_functions(actor.attrs)]:
                try:
                    _function_entry(fn)
                except PlanSerializationError as e:
                    raise PlanSerializationError(f"actor {actor.name!r}: {e}") from None
        return _seal(msgpack.packb(_converter.unstructure(self), default=_encode))

    @classmethod
    @cyclic_gc_paused()
    def from_bytes(cls, data: bytes) -> Plan:
        """Read a Plan back, checked: its digest (so corrupted bytes are refused), its
        schema (no unknown or missing keys, no wrong types) and ``plan_check.validate``
        (ids, consumers, streams, events, ranks, deadlock). Any failure is one
        PlanSerializationError saying what is wrong. It imports the functions it names,
        unpickles those it carries by value, and runs them: like pickle, load only plans
        you trust."""
        try:
            decoded = msgpack.unpackb(
                _unseal(data), object_hook=_decode, use_list=False, strict_map_key=False
            )
            plan = _converter.structure(decoded, cls)
        except PlanSerializationError:
            raise
        except (cattrs.BaseValidationError, _Refused) as e:
            raise _schema_error(e) from None
        except Exception as e:
            raise PlanSerializationError(f"not a serialized Plan: {type(e).__name__}: {e}") from e
        try:
            validate(plan)
        except CompileError as e:
            raise PlanSerializationError(f"not a consistent Plan: {e}") from e
        return plan

    def summary(self) -> str:
        """The Plan for people: streams, actors, quotas, events, collective order, memory."""
        return "\n".join(_summary_lines(self))


def transfer_peers(plan: Plan) -> dict[int, Actor]:
    """Each send's receive and each receive's send (by actor id): the two halves of a
    register crossing ranks share a tag."""
    peers = {}
    for send, recv in transfers(plan):
        peers[send], peers[recv] = plan.actors[recv], plan.actors[send]
    return peers


def import_path(fn: Callable) -> str | None:
    """``module:qualname`` of a function that imports back as itself, else None."""
    module = getattr(fn, "__module__", None) or ("numpy" if isinstance(fn, np.ufunc) else None)
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


def _seal(payload: bytes) -> bytes:
    """The serialized form: the format, the plan's msgpack payload and its digest."""
    return msgpack.packb({"format": FORMAT_VERSION, "blake2b": _digest(payload), "plan": payload})


def _unseal(data: bytes) -> bytes:
    """The payload of sealed bytes, or a PlanSerializationError if they aren't whole."""
    try:
        sealed = msgpack.unpackb(data)
    except Exception as e:
        raise PlanSerializationError(f"not a serialized Plan: {type(e).__name__}: {e}") from e
    if (
        isinstance(sealed, dict)
        and isinstance(sealed.get("format"), int)
        and sealed["format"] != FORMAT_VERSION
    ):
        raise PlanSerializationError(
            f"a serialized Plan of format {sealed['format']}; this actorflow reads format {FORMAT_VERSION} "
            "(compile the plan again)"
        )
    if not isinstance(sealed, dict) or set(sealed) != {"format", "blake2b", "plan"}:
        raise PlanSerializationError(f"not a serialized Plan of format {FORMAT_VERSION}")
    payload = sealed["plan"]
    if not isinstance(payload, bytes) or sealed["blake2b"] != _digest(payload):
        raise PlanSerializationError("the serialized Plan is corrupt: its digest does not match its contents")
    return payload


def _functions(value: Any) -> Iterator[Callable]:
    """The functions in an actor's attrs, also inside tuples, lists and dicts (a fused
    chain's parts carry their members' kernels and attrs)."""
    if callable(value):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _functions(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _functions(item)


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


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


class _Refused(ValueError):
    """A value the Plan's schema refuses; the message says why."""


def _exactly(*types: Any) -> Callable[[Any, Any], Any]:
    """A structure hook that takes a value of these types as it is and refuses the rest
    (cattrs would convert: int("3"), str(3), bool(5))."""

    def structure(value: Any, target: Any) -> Any:
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            expected = getattr(target, "__name__", target)
            raise _Refused(f"expected {expected}, got {reprlib.repr(value)}")
        return value

    return structure


def _strict_tuple(target: Any, converter: cattrs.Converter) -> Callable[[Any, Any], tuple]:
    """``tuple[X, ...]`` only from an array (cattrs would take any iterable: bytes, a
    string, a map's keys), each element structured as X."""
    (element,) = [a for a in get_args(target) if a is not Ellipsis]
    hook = converter.get_structure_hook(element)

    def structure(value: Any, _: Any) -> tuple:
        if not isinstance(value, (tuple, list)):
            raise _Refused(f"expected an array, got {reprlib.repr(value)}")
        items, errors = [], []
        for k, v in enumerate(value):
            try:
                items.append(hook(v, element))
            except Exception as e:  # noqa: BLE001 - collected, raised together below
                e.__notes__ = [
                    *getattr(e, "__notes__", []),
                    IterableValidationNote(f"@ index {k}", k, element),
                ]
                errors.append(e)
        if errors:
            raise IterableValidationError(f"While structuring {target}", errors, target)
        return tuple(items)

    return structure


def _complete(cls: type, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
    """An attrs class only from a map with every field (to_bytes writes them all, so a
    missing one, even one with a default, means the bytes were changed) and no other
    (cattrs would ignore an unknown key, such as a misspelt ``consulers``)."""
    structure: Callable[[Any, Any], Any] = make_dict_structure_fn(cls, converter)
    fields = {f.name for f in attrs.fields(cls)}

    def hook(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise _Refused(f"expected a map of {cls.__name__}, got {reprlib.repr(value)}")
        if value.keys() != fields:
            missing, unknown = sorted(fields - value.keys()), sorted(value.keys() - fields, key=str)
            said = [f"without {missing}"] * bool(missing) + [f"with unknown keys {unknown}"] * bool(unknown)
            raise _Refused(f"{cls.__name__} {' and '.join(said)}")
        return structure(value, cls)

    return hook


def _schema_error(e: Exception) -> PlanSerializationError:
    def describe(exc: BaseException, target: type | None) -> str:
        return str(exc) if isinstance(exc, _Refused) else cattrs.v.format_exception(exc, target)

    return PlanSerializationError(
        f"not a valid Plan: {'; '.join(cattrs.transform_error(e, '$plan', describe))}"
    )


_converter = cattrs.Converter()
_converter.register_unstructure_hook(np.ndarray, lambda a: a)
_converter.register_structure_hook(np.ndarray, _exactly(np.ndarray))
_converter.register_unstructure_hook_func(lambda t: get_origin(t) is Callable, lambda fn: fn)
_converter.register_structure_hook_func(lambda t: get_origin(t) is Callable, _exactly(Callable))
for _type, _accepted in ((int, (int,)), (float, (float, int)), (str, (str,)), (bool, (bool,))):
    _converter.register_structure_hook(_type, _exactly(*_accepted))
_converter.register_structure_hook_factory(
    lambda t: get_origin(t) is tuple and Ellipsis in get_args(t), _strict_tuple
)
_converter.register_structure_hook_factory(attrs.has, _complete)


def headline(plan: Plan) -> str:
    """The summary's first line: how many actors, streams, collectives and events."""
    m = plan.micro_batches
    steps = f"; {m} micro-batches a step ([step]: acts once per step)" if m > 1 else ""
    ranks = f" over {plan.world} ranks" if plan.world > 1 else ""
    return (
        f"Plan: {len(plan.actors)} actors on {len(plan.streams)} streams{ranks}, "
        f"{len(plan.collectives)} collectives, {len(plan.events)} events{steps}"
    )


def streams_per_rank(streams: Iterable[Stream]) -> dict[int, Counter[str]]:
    """Per rank, how many streams of each kind it runs."""
    kinds: dict[int, Counter[str]] = {}
    for s in streams:
        kinds.setdefault(s.rank, Counter())[s.kind] += 1
    return kinds


def kinds_text(counts: Counter[str]) -> str:
    """``2 collective, 1 comm, 2 copy``: stream counts by kind, for messages."""
    return ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))


def stream_usage(plan: Plan) -> list[str]:
    """Per rank, the streams it runs against ``max_streams``, by kind; labels, where used."""
    limit = plan.resources.max_streams
    lines = [
        f"streams of rank {rank}: {n.total()} of max_streams {limit} ({kinds_text(n)})"
        for rank, n in sorted(streams_per_rank(plan.streams).items())
    ]
    if plan.labels:
        lines.append(f"labels: {plan.labels} of max_labels {plan.resources.max_labels}")
    return lines


def _summary_lines(plan: Plan) -> list[str]:
    names = {a.id: a.name for a in plan.actors}
    lines = [headline(plan), *stream_usage(plan)]
    for stream in plan.streams:
        actors = sorted((a for a in plan.actors if a.stream == stream.id), key=lambda a: a.priority)
        rank = f"rank {stream.rank}, " if plan.world > 1 else ""
        group = f"group {','.join(stream.group)}, " if stream.group else ""
        lines.append(f"stream {stream.name} ({rank}{group}{len(actors)} actors)")
        for a in actors:
            ins = ", ".join(_input_text(plan, i) for i in a.inputs) or "-"
            rate = " [step]" if a.every > 1 else ""
            lines.append(f"  [{a.priority:>3}] {a.name:<24} {a.op:<14} in: {ins}{rate}")
            for r in (plan.registers[o] for o in a.outputs):
                to = ", ".join(names[c.actor] for c in r.consumers) or "-"
                lines.append(f"        out {r.name}: {r.dtype}{list(r.shape)} quota {r.quota} -> {to}")
    lines.append("events (producer -> consumer, the consumer's stream waits)")
    stream_name = {s.id: s.name for s in plan.streams}
    stream_of = {a.id: a.stream for a in plan.actors}
    for p, c in plan.events:
        lines.append(
            f"  {names[p]} ({stream_name.get(stream_of[p])}) -> {names[c]} ({stream_name.get(stream_of[c])})"
        )
    lines.append("collective order")
    if plan.link is not None:
        bandwidth, latency = plan.link
        lines.append(f"  (link emulated: {bandwidth / 1e9:g} GB/s, {latency * 1e6:g} us latency)")
    for k, coll in enumerate(plan.collectives):
        emulated = f", {coll.seconds * 1e3:.3f} ms emulated" if plan.link is not None else ""
        moved = f", {coll.nbytes} bytes an act"
        lines.append(f"  {k}. {coll.name} ({coll.op} over {len(coll.actors)} devices{moved}{emulated})")
    lines.append(f"predicted communication: {plan.communication_per_step()} bytes a step over the links")
    if plan.sbp:
        lines.append("SBP of the tensors on several devices")
        lines += [f"  {name}: {sbp}" for name, sbp in plan.sbp.items()]
    lines.append("planned memory (registers x quota + parameters)")
    for device, nbytes in sorted(plan.memory.items()):
        lines.append(f"  {device}: {nbytes / 1024:.1f} KiB")
    return lines


def _input_text(plan: Plan, i: Input) -> str:
    r = plan.registers[i.register]
    if r.is_parameter:
        return f"{r.name} (parameter)"
    return r.name if i.sync == "stream" else f"{r.name} ({i.sync})"
