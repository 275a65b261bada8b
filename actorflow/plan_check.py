"""validate(plan): is a Plan whole, consistent and free of deadlock?

The compiler runs it as its last pass (``compiler.check``) and ``Plan.from_bytes`` on every
plan it reads, so a plan that loads is one the runtime can wire and run: every id points
at something that exists, every register's consumers read it, the streams, events and
ranks agree, each send has its receive, and no wait-for cycle can hang a run. The first
problem found is raised, naming the actor, register, stream or collective concerned.

It reads a plan's records (``plan_data``) and sits below the round trip through bytes
(``plan_bytes``), which runs it on what it reads.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import numpy as np

from .dag import find_cycle
from .errors import CompileError, DeadlockError
from .plan_data import Actor, Collective, PlanData, parts_count

ACTOR_KINDS = ("compute", "copy", "collective", "feed", "fetch", "variable", "update", "send", "recv")
SYNCS = ("stream", "event", "implied", "completion")
STREAM_KINDS = ("compute", "copy", "collective", "comm")
LOGICAL_KINDS = ("feed", "output", "parameter")


def validate(plan: PlanData) -> None:
    """Raise a ``DeadlockError`` for a wait-for cycle and a ``CompileError`` for anything
    else that would make a run fail, hang or go wrong before its kernels do."""
    _check(plan, final=True)


def lint(plan: PlanData) -> None:
    """What ``validate`` checks that holds between the compiler's passes too: all but
    the actors' and collectives' streams and syncs and the planned memory, which the
    later passes decide."""
    _check(plan, final=False)


def _check(plan: PlanData, final: bool) -> None:
    _check_header(plan)
    _check_streams(plan)
    _check_registers(plan)
    if final:
        _check_memory(plan)
        _check_actors(plan)
    _check_consumers(plan)
    _check_chains(plan)
    _check_transfers(plan)
    if final:
        _check_collectives(plan)
    _check_calls(plan)
    _check_ends(plan)
    _check_logical(plan)
    _check_deadlock(plan)


def unit_of(plan: PlanData) -> dict[int, int]:
    """Actor id -> unit id: the first participant's id for collectives, else the actor's own."""
    unit = {a.id: a.id for a in plan.actors}
    for coll in plan.collectives:
        for a in coll.actors:
            unit[a] = coll.actors[0]
    return unit


def data_edges(plan: PlanData, across_ranks: bool = True) -> dict[int, set[int]]:
    """Producer unit -> consumer units, over non-parameter registers, and each send ->
    its receive (a register crossing ranks: one edge, though no register joins them),
    unless not ``across_ranks``."""
    unit = unit_of(plan)
    edges: dict[int, set[int]] = {u: set() for u in unit.values()}
    for reg in plan.registers:
        if reg.producer < 0:
            continue
        producer = unit[reg.producer]
        out = edges[producer]
        for c in reg.consumers:
            consumer = unit[c.actor]
            if consumer != producer:
                out.add(consumer)
    for send, recv in transfers(plan) if across_ranks else ():
        edges[unit[send]].add(unit[recv])
    return edges


def transfers(plan: PlanData) -> list[tuple[int, int]]:
    """(send, receive) actor ids of each register crossing ranks (one ``tag`` each)."""
    halves: dict[tuple[str, Any], int] = {
        (a.kind, a.attrs["tag"]): a.id for a in plan.actors if a.kind in ("send", "recv")
    }
    return [(a, halves[("recv", tag)]) for (kind, tag), a in halves.items() if kind == "send"]


def transfer_peers(plan: PlanData) -> dict[int, Actor]:
    """Each send's receive and each receive's send (by actor id): the two halves of a
    register crossing ranks share a tag."""
    peers = {}
    for send, recv in transfers(plan):
        peers[send], peers[recv] = plan.actors[recv], plan.actors[send]
    return peers


def call_edges(
    plan: PlanData, across_ranks: bool = True
) -> tuple[dict[int, set[int]], dict[tuple[int, int], int]]:
    """``data_edges`` with each reused communication subgraph (``Actor.calls`` > 1) split
    into its calls, chained in call order: what waits on what at run time. As one node, a
    subgraph would join the inputs of late calls to the readers of early ones (a cycle,
    where one call feeds the next through data). Also (unit, call) -> its node: call 0
    keeps the unit's id, later calls get ids past the actors'."""
    unit = unit_of(plan)
    reused = {unit[a.id]: a.calls for a in plan.actors if a.calls > 1}
    edges = data_edges(plan, across_ranks)
    if not reused:
        return edges, {}
    calls: dict[tuple[int, int], int] = {}
    for u, n in reused.items():
        for j in range(n):
            calls[(u, j)] = u if j == 0 else len(plan.actors) + len(calls)
    edges = {u: vs - reused.keys() for u, vs in edges.items() if u not in reused}
    for (u, j), node in calls.items():
        edges[node] = {calls[(u, j + 1)]} if j + 1 < reused[u] else set()
    for a in plan.actors:
        for slot, i in enumerate(a.inputs):
            reg = plan.registers[i.register]
            if reg.is_parameter:
                continue
            p, c = unit[reg.producer], unit[a.id]
            if p == c or (p not in reused and c not in reused):
                continue
            read = next(x.call for x in reg.consumers if x.actor == a.id and x.slot == slot)
            edges[calls.get((p, read), p)].add(calls.get((c, slot), c))
    return edges, calls


def _check_header(plan: PlanData) -> None:
    numbered: tuple[tuple[str, Sequence[Any]], ...] = (
        ("actor", plan.actors),
        ("register", plan.registers),
        ("stream", plan.streams),
    )
    for kind, items in numbered:
        for k, item in enumerate(items):
            if item.id != k:
                raise CompileError(
                    f"{kind} {item.name!r} has id {item.id} but is number {k}; ids are positions"
                )
    if plan.micro_batches < 1:
        raise CompileError(f"micro_batches is {plan.micro_batches}; it must be >= 1")
    if plan.world < 1:
        raise CompileError(f"world is {plan.world}; it must be >= 1")
    for device, rank in plan.ranks.items():
        if not 0 <= rank < plan.world:
            raise CompileError(f"device {device!r} is on rank {rank}, outside world {plan.world}")
    placed = {a.device for a in plan.actors} | {r.device for r in plan.registers}
    devices = {d for d in placed if not d.startswith("rank")}
    if plan.ranks and not devices <= plan.ranks.keys():
        raise CompileError(
            f"ranks place devices {sorted(plan.ranks)}, not {sorted(devices - plan.ranks.keys())}"
        )
    if plan.link is not None:
        bandwidth, latency = plan.link
        if not (math.isfinite(bandwidth) and bandwidth > 0 and math.isfinite(latency) and latency >= 0):
            raise CompileError(f"link {plan.link}: bandwidth must be > 0 and latency >= 0")


def _rank_of(plan: PlanData, device: str, what: str) -> int:
    """``plan.rank_of``, refusing a rank's stream device (``rankN``) that names no rank."""
    if device.startswith("rank") and not (device[4:].isdigit() and int(device[4:]) < plan.world):
        raise CompileError(f"{what} is on {device!r}, which names no rank of world {plan.world}")
    return plan.rank_of(device)


def _check_streams(plan: PlanData) -> None:
    for s in plan.streams:
        if s.kind not in STREAM_KINDS:
            raise CompileError(f"stream {s.name!r} has kind {s.kind!r}, not one of {list(STREAM_KINDS)}")
        if s.rank != _rank_of(plan, s.device, f"stream {s.name!r}"):
            raise CompileError(f"stream {s.name!r} is on rank {s.rank} but its device {s.device!r} is not")


@functools.lru_cache(maxsize=64)
def _numeric_dtype(name: str) -> bool:
    """Whether ``name`` is the name of a numeric numpy dtype (as ``dtype.name`` spells it)."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        return False
    return dtype.name == name and dtype.kind in "biufc"


def _check_registers(plan: PlanData) -> None:
    n = len(plan.actors)
    first_on: dict[str, str] = {}
    for r in plan.registers:
        first_on.setdefault(r.device, r.name)
    for device, name in first_on.items():
        _rank_of(plan, device, f"register {name!r}")
    output_of = {o: a.id for a in plan.actors for o in a.outputs}  # a fused collective has thousands
    for r in plan.registers:
        if not -1 <= r.producer < n:
            raise CompileError(f"register {r.name!r} has producer {r.producer}; there are {n} actors")
        if r.quota < 1:
            raise CompileError(f"register {r.name!r} has quota {r.quota}; it must be >= 1")
        if r.shape and min(r.shape) < 0:
            raise CompileError(f"register {r.name!r} has shape {list(r.shape)}")
        if not _numeric_dtype(r.dtype):
            raise CompileError(f"register {r.name!r} has dtype {r.dtype!r}, not a numeric numpy dtype name")
        if r.control and r.nbytes:
            raise CompileError(f"control register {r.name!r} is {r.dtype}{list(r.shape)}; it carries no data")
        if r.producer >= 0:
            producer = plan.actors[r.producer]
            if output_of.get(r.id) != r.producer and r.id not in producer.outputs:
                raise CompileError(
                    f"register {r.name!r} names {producer.name!r} as producer, which does not output it"
                )
            if r.device != producer.device:
                raise CompileError(
                    f"register {r.name!r} is on {r.device!r} but its producer {producer.name!r} on {producer.device!r}"
                )


def _check_memory(plan: PlanData) -> None:
    """The planned memory per device is what its registers take (bytes x quota), so a
    register whose shape, dtype or quota changed after planning is noticed."""
    needed: dict[str, int] = {}
    for r in plan.registers:
        needed[r.device] = needed.get(r.device, 0) + r.nbytes * r.quota
    if needed != plan.memory:
        wrong = sorted(d for d in needed.keys() | plan.memory.keys() if needed.get(d) != plan.memory.get(d))
        raise CompileError(
            "the planned memory does not match the registers (bytes x quota): "
            + ", ".join(f"{d}: planned {plan.memory.get(d)}, registers take {needed.get(d)}" for d in wrong)
        )


def _check_actors(plan: PlanData) -> None:
    for a in plan.actors:
        if a.kind not in ACTOR_KINDS:
            raise CompileError(f"actor {a.name!r} has kind {a.kind!r}, not one of {list(ACTOR_KINDS)}")
        if not 0 <= a.stream < len(plan.streams):
            raise CompileError(f"actor {a.name!r} has no stream")
        stream = plan.streams[a.stream]
        if stream.rank != _rank_of(plan, a.device, f"actor {a.name!r}"):
            raise CompileError(
                f"actor {a.name!r} on {a.device!r} is on stream {stream.name!r} of another rank"
            )
        if stream.kind in ("compute", "copy") and stream.device != a.device:
            raise CompileError(
                f"actor {a.name!r} on {a.device!r} is on stream {stream.name!r} of another device"
            )
        if a.every not in (1, plan.micro_batches):
            raise CompileError(
                f"actor {a.name!r} acts every {a.every} micro-batches; a plan of {plan.micro_batches} "
                "micro-batches a step has actors acting every 1 or every step"
            )
        for k, o in enumerate(a.outputs):
            if not 0 <= o < len(plan.registers) or plan.registers[o].producer != a.id:
                raise CompileError(f"actor {a.name!r}: output {k} is register {o}, which it does not produce")
        if len(set(a.outputs)) != len(a.outputs):
            raise CompileError(f"actor {a.name!r} lists an output twice: {list(a.outputs)}")
    for a in plan.actors:  # once every actor's stream is known to exist
        for k, i in enumerate(a.inputs):
            _check_input(plan, a, k, i)
        _check_attrs(a, a.kernel, a.attrs)


def _check_input(plan: PlanData, a: Actor, k: int, i: Any) -> None:
    where = f"actor {a.name!r}: input {k}"
    if not 0 <= i.register < len(plan.registers):
        raise CompileError(f"{where} reads register {i.register}; there are {len(plan.registers)}")
    reg = plan.registers[i.register]
    if i.sync not in SYNCS:
        raise CompileError(f"{where} ({reg.name!r}) has sync {i.sync!r}, not one of {list(SYNCS)}")
    if reg.is_parameter:
        if i.sync != "stream":
            raise CompileError(
                f"{where} reads parameter {reg.name!r} with sync {i.sync!r}; a parameter needs none"
            )
        return
    producer = plan.actors[reg.producer].stream
    if i.sync == "stream" and producer != a.stream:
        raise CompileError(
            f"{where} reads {reg.name!r} from stream {plan.streams[producer].name!r} with sync 'stream', "
            "which only the producer's own stream keeps in order"
        )


@functools.lru_cache(maxsize=4096)
def _refused_attrs(kernel: Callable, names: tuple[str, ...]) -> str | None:
    """Why ``kernel`` can't be called as ``kernel(ins, outs, **attrs)`` with these attribute
    names (it depends on the names only), or None; None too when it has no signature."""
    try:
        signature = inspect.signature(kernel)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind_partial(None, None, **dict.fromkeys(names))
    except TypeError as e:
        return str(e)
    return None


def _check_parts(plan: PlanData, a: Actor) -> None:
    """A fused chain (an op of several, ``Actor.ops``) carries one part per op: its
    kernel, attrs, sources and targets (within the actor's data inputs and outputs),
    phase flag, name and where (``ops.chain``); a part may run several ops as one
    kernel, with their parts in its attrs (``compiler.chains.cuda_chains``), their
    sources and targets its own inputs and outputs, checked the same way."""
    parts = a.attrs.get("parts")
    if not isinstance(parts, tuple) or _members(parts) != len(a.ops):
        raise CompileError(f"actor {a.name!r} runs ops {list(a.ops)}, so its attrs need one part each")
    data_in = sum(not plan.registers[i.register].control for i in a.inputs)
    data_out = sum(not plan.registers[o].control for o in a.outputs)
    _check_part_list(a, parts, data_in, data_out, plan.phases(a) > 1)


def _check_part_list(a: Actor, parts: tuple, data_in: int, data_out: int, phased: bool) -> None:
    written: set[int] = set()
    for k, part in enumerate(parts):
        if not (
            isinstance(part, tuple)
            and len(part) == 7
            and callable(part[0])
            and isinstance(part[1], dict)
            and all(isinstance(p, tuple) and all(type(i) is int for i in p) for p in part[2:4])
            and type(part[4]) is bool
            and all(isinstance(text, str) for text in part[5:])
        ):
            raise CompileError(
                f"actor {a.name!r}: part {k} of its chain is not (kernel, attrs, sources, ...)"
            )
        if not all(-data_out <= i < data_in for i in part[2]) or not all(0 <= i < data_out for i in part[3]):
            raise CompileError(
                f"actor {a.name!r}: part {k} of its chain reads {list(part[2])} or writes {list(part[3])}, "
                f"past its {data_in} data inputs and {data_out} data outputs"
            )
        unwritten = [~i for i in part[2] if i < 0 and ~i not in written]
        if unwritten:
            raise CompileError(
                f"actor {a.name!r}: part {k} of its chain reads outputs {unwritten} no part before wrote"
            )
        _check_attrs(a, part[0], part[1])
        if part[4] and not phased:
            raise CompileError(
                f"actor {a.name!r}: part {k} of its chain takes a phase, but the actor acts at one rate"
            )
        if "parts" in part[1]:
            _check_part_list(a, part[1]["parts"], len(part[2]), len(part[3]), part[4])
        written.update(part[3])


def _members(parts: tuple) -> int | None:
    """The ops ``parts`` run (``plan_data.parts_count``), or None for a malformed part."""
    if not all(isinstance(p, tuple) and len(p) > 1 and isinstance(p[1], dict) for p in parts):
        return None
    nested = [p[1]["parts"] for p in parts if "parts" in p[1]]
    if not all(isinstance(n, tuple) and _members(n) is not None for n in nested):
        return None
    return parts_count(parts)


def _check_chains(plan: PlanData) -> None:
    """Each fused chain's parts (once consumers are known good: a part's phase depends on
    who reads the actor's outputs)."""
    for a in plan.actors:
        if len(a.ops) > 1 or "parts" in a.attrs:
            _check_parts(plan, a)


def _check_attrs(a: Actor, kernel: Callable, attrs: dict[str, Any]) -> None:
    """The kernel takes ``(ins, outs, **attrs)``: attrs it has no parameter for would fail
    every act (``a``'s own, or one of its chain's parts')."""
    names = tuple(sorted(attrs))
    try:
        refused = _refused_attrs(kernel, names)
    except TypeError:  # an unhashable callable object
        refused = _refused_attrs.__wrapped__(kernel, names)
    if refused is not None:
        raise CompileError(
            f"actor {a.name!r}: kernel {_name(kernel)} does not take attributes {list(names)}: {refused}"
        )


def _name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _check_consumers(plan: PlanData) -> None:
    """Each consumer of a register reads it at the slot it names, each input of a produced
    register is among its consumers, and both sides are on one rank (a send and a receive
    carry what crosses ranks)."""
    listed: set[tuple[int, int, int]] = set()
    for r in plan.registers:
        for c in r.consumers:
            if not 0 <= c.actor < len(plan.actors):
                raise CompileError(f"register {r.name!r}: consumer actor {c.actor} does not exist")
            consumer = plan.actors[c.actor]
            if not 0 <= c.slot < len(consumer.inputs) or consumer.inputs[c.slot].register != r.id:
                raise CompileError(
                    f"register {r.name!r} lists consumer {consumer.name!r} at input {c.slot}, which reads something else"
                )
            if (r.id, c.actor, c.slot) in listed:
                raise CompileError(
                    f"register {r.name!r} lists consumer {consumer.name!r} at input {c.slot} twice"
                )
            listed.add((r.id, c.actor, c.slot))
            if not r.is_parameter and plan.rank_of(consumer.device) != plan.rank_of(r.device):
                raise CompileError(
                    f"register {r.name!r} on {r.device!r} is read by {consumer.name!r} on another rank"
                )
    for a in plan.actors:
        for k, i in enumerate(a.inputs):
            reg = plan.registers[i.register]
            if not reg.is_parameter and (reg.id, a.id, k) not in listed:
                raise CompileError(
                    f"actor {a.name!r} reads register {reg.name!r} (input {k}), which does not list it"
                )


def _check_transfers(plan: PlanData) -> None:
    """Each send has one receive with its tag on the rank it names, and the other way
    round; both carry one shape and dtype."""
    halves: dict[tuple[str, int], Actor] = {}
    for a in plan.actors:
        if a.kind not in ("send", "recv"):
            continue
        peer, tag = a.attrs.get("peer"), a.attrs.get("tag")
        if not is_int(peer) or not is_int(tag):
            raise CompileError(
                f"{a.kind} actor {a.name!r} needs integer attributes peer and tag, has {a.attrs}"
            )
        if (a.kind, tag) in halves:
            raise CompileError(
                f"{a.kind} actors {halves[(a.kind, tag)].name!r} and {a.name!r} share tag {tag}"
            )
        halves[(a.kind, tag)] = a
    other = {"send": "recv", "recv": "send"}
    for (kind, tag), a in halves.items():
        peer = halves.get((other[kind], tag))
        if peer is None:
            raise CompileError(f"{kind} actor {a.name!r} (tag {tag}) has no {other[kind]} actor")
        if a.attrs["peer"] != plan.rank_of(peer.device) or plan.rank_of(a.device) == plan.rank_of(
            peer.device
        ):
            raise CompileError(
                f"{kind} actor {a.name!r} names rank {a.attrs['peer']}; its {other[kind]} {peer.name!r} "
                f"is on rank {plan.rank_of(peer.device)}, it on rank {plan.rank_of(a.device)}"
            )
        if kind == "send":
            sent = [r for r in (plan.registers[i.register] for i in a.inputs) if not r.control]
            received = [r for r in (plan.registers[o] for o in peer.outputs) if not r.control]
            if [(r.shape, r.dtype) for r in sent] != [(r.shape, r.dtype) for r in received]:
                raise CompileError(
                    f"send {a.name!r} sends {_specs(sent)} but receive {peer.name!r} takes {_specs(received)}"
                )


def _specs(registers: Sequence[Any]) -> str:
    return ", ".join(f"{r.dtype}{list(r.shape)}" for r in registers) or "nothing"


def is_int(value: Any) -> TypeGuard[int]:
    """An int, not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_collectives(plan: PlanData) -> None:
    """Each collective actor takes part in one collective, the one its ``group`` names;
    a collective's participants act at one rate, on one stream per rank."""
    owner: dict[int, Any] = {}
    for coll in plan.collectives:
        if not coll.actors:
            raise CompileError(f"collective {coll.name!r} has no participants")
        for a in coll.actors:
            if not 0 <= a < len(plan.actors):
                raise CompileError(f"collective {coll.name!r}: participant {a} does not exist")
            if a in owner:
                raise CompileError(
                    f"actor {plan.actors[a].name!r} takes part in {owner[a].name!r} and {coll.name!r}"
                )
            owner[a] = coll
        first = plan.actors[coll.actors[0]]
        for actor in (plan.actors[k] for k in coll.actors):
            if actor.every != first.every:
                raise CompileError(
                    f"collective {coll.name!r}: participants {first.name!r} and {actor.name!r} differ in rate"
                )
        streams = {plan.actors[a].stream for a in coll.actors}
        if len(streams) != len({plan.streams[s].rank for s in streams}):
            raise CompileError(f"the participants of {coll.name!r} on one rank are on different streams")
        if not math.isfinite(coll.seconds) or coll.seconds < 0:
            raise CompileError(f"collective {coll.name!r} lasts {coll.seconds} s")
    for actor in plan.actors:
        group = owner.get(actor.id)
        if (actor.kind == "collective") != (group is not None) or actor.group != (group.id if group else -1):
            raise CompileError(
                f"actor {actor.name!r} ({actor.kind}, group {actor.group}) takes part in "
                + (f"collective {group.name!r} (id {group.id})" if group else "no collective")
            )
    _check_collective_rates(plan)


def _check_collective_rates(plan: PlanData) -> None:
    """A collective stream runs its once-per-micro-batch collectives as one run repeated
    for each micro-batch (``runtime.driver.step_order``): in the collective order, a
    stream's collectives acting once per step may come before that run and after it,
    not inside it."""
    runs: dict[int, list[tuple[bool, str]]] = {}
    for coll in plan.collectives:
        first = plan.actors[coll.actors[0]]
        rates = runs.setdefault(first.stream, [])
        per_micro_batch = first.every < plan.micro_batches
        if not rates or rates[-1][0] != per_micro_batch:
            rates.append((per_micro_batch, coll.name))
    for stream, rates in runs.items():
        if [p for p, _ in rates].count(True) > 1:
            names = [name for _, name in rates]
            raise CompileError(
                f"collective stream {stream} runs per-micro-batch collectives in more than one "
                f"run, split by per-step ones: {names}; its per-step collectives must all come "
                "before or after its per-micro-batch ones in the collective order"
            )


def _check_calls(plan: PlanData) -> None:
    """A reused communication subgraph (``Actor.calls`` > 1, see the compiler's ``reuse``)
    is a collective whose participants read one input per call; each consumer of what it
    makes reads one of its calls (``Consumer.call``), every other consumer call 0."""
    for a in plan.actors:
        if a.calls < 1:
            raise CompileError(f"actor {a.name!r} has {a.calls} calls; it must have >= 1")
        if a.calls > 1 and (a.kind != "collective" or len(a.inputs) != a.calls):
            raise CompileError(
                f"actor {a.name!r} ({a.kind}, {len(a.inputs)} inputs) has {a.calls} calls: only a reused "
                "collective has several, one input each"
            )
    on_stream: dict[int, list[str]] = {}
    for coll in plan.collectives:
        for stream in {plan.actors[a].stream for a in coll.actors}:
            on_stream.setdefault(stream, []).append(coll.name)
    for coll in plan.collectives:
        counts = {plan.actors[a].calls for a in coll.actors}
        if len(counts) > 1:
            raise CompileError(
                f"the participants of collective {coll.name!r} differ in calls: {sorted(counts)}"
            )
        shared = {n for a in coll.actors for n in on_stream[plan.actors[a].stream]} - {coll.name}
        if counts != {1} and shared:
            raise CompileError(
                f"reused collective {coll.name!r} shares its streams with {sorted(shared)}; "
                "a reused communication subgraph has streams of its own"
            )
    for r in plan.registers:
        calls = plan.actors[r.producer].calls if r.producer >= 0 else 1
        for c in r.consumers:
            if not 0 <= c.call < calls:
                raise CompileError(
                    f"register {r.name!r}: consumer {plan.actors[c.actor].name!r} reads call {c.call} "
                    f"of a producer with {calls}"
                )


def _check_ends(plan: PlanData) -> None:
    """Feeds, outputs and parameters: each names an actor or register that exists and
    fits, once (an output once per rank: every rank gets every output); each feed and
    fetch actor has its feed or output."""
    for kind, ends, actor_kind in (("feed", plan.feeds, "feed"), ("output", plan.outputs, "fetch")):
        named, actors = set(), set()
        for e in ends:
            if not 0 <= e.actor < len(plan.actors) or plan.actors[e.actor].kind != actor_kind:
                raise CompileError(
                    f"{kind} {e.name!r} names actor {e.actor}, which is not a {actor_kind} actor"
                )
            key = (e.name, plan.rank_of(plan.actors[e.actor].device))
            if key in named or e.actor in actors:
                raise CompileError(
                    f"{kind} {e.name!r} (actor {plan.actors[e.actor].name!r}) appears twice on a rank"
                )
            named.add(key)
            actors.add(e.actor)
        unnamed = [a.name for a in plan.actors if a.kind == actor_kind and a.id not in actors]
        if unnamed:
            raise CompileError(f"{actor_kind} actors {unnamed} have no {kind}")
    for f in plan.feeds:
        out = [plan.registers[o] for o in plan.actors[f.actor].outputs]
        if [(r.shape, r.dtype) for r in out] != [(f.shape, f.dtype)]:
            raise CompileError(
                f"feed {f.name!r} is {f.dtype}{list(f.shape)} but its actor writes {_specs(out)}"
            )
    named_registers: dict[int, str] = {}
    names = set()
    for p in plan.parameters:
        if not 0 <= p.register < len(plan.registers):
            raise CompileError(f"parameter {p.name!r} names register {p.register}, which does not exist")
        reg = plan.registers[p.register]
        if p.name in names or p.register in named_registers:
            raise CompileError(f"parameter {p.name!r} (register {reg.name!r}) appears twice")
        names.add(p.name)
        named_registers[p.register] = p.name
        if not (reg.is_parameter or plan.actors[reg.producer].kind == "variable") or reg.quota != 1:
            raise CompileError(
                f"parameter {p.name!r} names register {reg.name!r}, which is not a parameter's or a "
                "variable's one buffer"
            )
        if p.value.shape != reg.shape or p.value.dtype != np.dtype(reg.dtype):
            raise CompileError(
                f"parameter {p.name!r} is {p.value.dtype}{list(p.value.shape)} but its register {reg.name!r} "
                f"is {reg.dtype}{list(reg.shape)}"
            )
    unvalued = [
        r.name
        for r in plan.registers
        if (r.is_parameter or plan.actors[r.producer].kind == "variable") and r.id not in named_registers
    ]
    if unvalued:
        raise CompileError(f"parameter and variable registers {unvalued} have no initial value")


def _check_logical(plan: PlanData) -> None:
    """A logical tensor's parts fit together (a part this plan lacks is left out: the
    runtime puts one together only from all its parts)."""
    shapes: dict[str, dict[str, Any]] = {
        "feed": {f.name: f.shape for f in plan.feeds},
        "output": {o.name: _read_shape(plan, plan.actors[o.actor]) for o in plan.outputs},
        "parameter": {p.name: p.value.shape for p in plan.parameters},
    }
    seen = set()
    for lt in plan.logical:
        where = f"logical {lt.kind} {lt.name!r}"
        if lt.kind not in LOGICAL_KINDS:
            raise CompileError(f"{where}: kind is not one of {list(LOGICAL_KINDS)}")
        if (lt.kind, lt.name) in seen:
            raise CompileError(f"{where} appears twice")
        seen.add((lt.kind, lt.name))
        if lt.sbp not in ("S", "B", "P"):
            raise CompileError(f"{where} has sbp {lt.sbp!r}, not S, B or P")
        if not lt.parts or len(set(lt.parts)) != len(lt.parts):
            raise CompileError(f"{where}: parts {list(lt.parts)} are not distinct names")
        parts = [shapes[lt.kind][p] for p in lt.parts if shapes[lt.kind].get(p) is not None]
        if lt.sbp == "S":
            if (
                not all(0 <= lt.axis < len(s) for s in parts)
                or len({s[: lt.axis] + s[lt.axis + 1 :] for s in parts}) > 1
            ):
                raise CompileError(f"{where}: parts of shapes {parts} do not split along axis {lt.axis}")
        elif len(set(parts)) > 1:
            raise CompileError(f"{where}: parts of sbp {lt.sbp} have shapes {parts}, not one shape")


def _read_shape(plan: PlanData, fetch: Actor) -> tuple[int, ...] | None:
    return plan.registers[fetch.inputs[0].register].shape if fetch.inputs else None


def _check_deadlock(plan: PlanData) -> None:
    """The wait-for graph has the data edges (producer before consumer, within an
    iteration; a reused communication subgraph split into its calls) and the collective
    order (each collective stream runs its collectives one after another in that order);
    a cycle there hangs every run. Quotas only add edges from iteration i to iteration
    i + quota, which cannot close a cycle while every quota is at least 1; stream order is
    decided at launch, in dependency order."""
    unit = unit_of(plan)
    data, calls = call_edges(plan)
    order = {(unit[earlier.actors[0]], unit[later.actors[0]]) for earlier, later in stream_order_pairs(plan)}
    edges = dict(data)
    for u, v in order:
        edges[u] = edges[u] | {v}
    cycle = find_cycle(edges)
    if cycle is None:
        return
    names: dict[Any, str] = {a.id: a.name for a in plan.actors}
    names.update({coll.actors[0]: coll.name for coll in plan.collectives})
    names.update({node: f"{names[u]} call {j}" for (u, j), node in calls.items()})
    steps = [names[cycle[0]]]
    for u, v in zip(cycle, cycle[1:]):
        kinds = ["collective order"] * ((u, v) in order) + ["data"] * (v in data[u])
        steps.append(f"-({'/'.join(kinds)})-> {names[v]}")
    raise DeadlockError("the plan can deadlock: wait-for cycle " + " ".join(steps))


def stream_order_pairs(plan: PlanData) -> list[tuple[Collective, Collective]]:
    """Consecutive collectives of each collective stream, in the collective order: what
    the streams wait on (each runs its part of the order, one after another)."""
    last: dict[int, Collective] = {}
    pairs = []
    for coll in plan.collectives:
        stream = plan.actors[coll.actors[0]].stream
        if stream in last:
            pairs.append((last[stream], coll))
        last[stream] = coll
    return pairs
