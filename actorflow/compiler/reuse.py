"""reuse communication subgraphs (MindSpore's MS_COMM_COMPILER_OPT, seed 001): collectives
with the same key (op, shapes and dtypes, communication group, attributes such as the
reduce op, rate) form a group; a group with more collectives than one stream carries
(``max_ops_per_stream``) becomes one communication subgraph, a single collective with a
stream of its own that every call site invokes in one fixed order (the collective
order), its output register shared by the call sites instead of one set each.

Off unless turned on: by ``ACTORFLOW_COMM_REUSE`` (the variable wins when set) or the
``comm_reuse`` option, with MS_COMM_COMPILER_OPT's meaning: -1 on with the default limit
of 1000 reused operators, a positive integer on with that limit, unset off, 0 or
another negative number off with a warning, anything else a CompileError.

A subgraph's calls run in the collective order, which is topological: a call that reads
what an earlier one made (through a layer, as the all-reduces of a tensor-parallel
model's layers do) comes after it. So every edge a run waits on, data, each subgraph's
calls one after another, and each collective stream's share of the order, goes forward
in that order, and no choice of calls can close a wait-for cycle: a group's calls join
its subgraph in order up to the limit, but for one reading an earlier call's result
with nothing between (the rest stay as they are), and a subgraph that
would not leave its group fewer streams is not made. The passes after this one and the
plan check see a subgraph as its calls, chained (``plan_check.call_edges``), never as
one node. Each call takes one label, and each subgraph one more (its entry): past
``max_labels`` is a CompileError. The shared register gets as many buffers as calls can hold at once: the
buffer of call i stays held until every consumer of it has run, which may wait on
later calls (through data, or the collective order).

In the Plan a subgraph is one participant per device with ``calls`` = its call sites:
act n is call n % calls, reading input n % calls; the shared register's consumers say
which call they read (``Consumer.call``).
"""

from __future__ import annotations

import logging
import os

from ..errors import CompileError
from ..plan import Collective, Consumer, Input, Plan
from ..records import evolve
from .topology import data_edges, reach_bits, renumber, unit_of

ENV = "ACTORFLOW_COMM_REUSE"
DEFAULT_LIMIT = 1000
log = logging.getLogger("actorflow.compiler")


def reuse_limit(option: int | None) -> int:
    """How many collectives may be reused; 0: reuse is off. ``ACTORFLOW_COMM_REUSE`` wins
    over the ``comm_reuse`` option when set."""
    raw = os.environ.get(ENV)
    if raw is not None:
        source = ENV
        try:
            value = int(raw.strip())
        except ValueError:
            raise CompileError(
                f"{ENV}={raw!r} is not an integer: -1 turns communication subgraph reuse on with the default "
                f"limit of {DEFAULT_LIMIT} operators, a positive integer on with that limit; unset it for off"
            ) from None
    elif option is None:
        return 0
    elif not isinstance(option, int) or isinstance(option, bool):
        raise CompileError(f"comm_reuse: an int (-1, or a positive limit) or None, got {option!r}")
    else:
        source, value = "comm_reuse", option
    if value == -1:
        return DEFAULT_LIMIT
    if value > 0:
        return value
    log.warning(
        "%s=%d: communication subgraph reuse stays off (-1 or a positive integer turns it on)", source, value
    )
    return 0


def reuse_communication(plan: Plan, limit: int) -> Plan:
    """The plan with its communication subgraphs, each shared register's least quota
    recorded (``Plan.quota_floors``), within its resources' ``max_ops_per_stream`` and
    ``max_labels``."""
    if not limit:
        return plan
    max_ops_per_stream, max_labels = plan.resources.max_ops_per_stream, plan.resources.max_labels
    log.info("MAX_COMM_OP_REUSE_NUM: %d", limit)
    groups: dict[tuple, list[Collective]] = {}
    for coll in plan.collectives:
        key = _key(plan, coll)
        if key is not None:
            groups.setdefault(key, []).append(coll)
    subgraphs: list[list[Collective]] = []
    left = limit
    for members in groups.values():
        if len(members) <= max_ops_per_stream or left < 2:
            continue
        calls = _calls(plan, members, left)
        streams_left = 1 + -(-(len(members) - len(calls)) // max_ops_per_stream)
        if len(calls) > 1 and streams_left < -(-len(members) // max_ops_per_stream):
            subgraphs.append(calls)
            left -= len(calls)
            first = plan.actors[calls[0].actors[0]]
            log.info(
                "Start reuse comm_subgraph_%d: %d calls of %s %s over %s",
                len(subgraphs) - 1,
                len(calls),
                calls[0].op,
                plan.registers[first.outputs[0]].shape,
                ",".join(plan.actors[a].device for a in calls[0].actors),
            )
    reused = sum(len(calls) for calls in subgraphs)
    labels = reused + len(subgraphs)
    log.info("Reuse comm op reused_comm_sub_graphs_ size: %d", reused)
    log.info("Label list size: %d", labels)
    if labels > max_labels:
        raise CompileError(
            f"communication subgraph reuse takes {labels} labels ({reused} calls of {len(subgraphs)} subgraphs: "
            f"one a call, one a subgraph), more than max_labels={max_labels}: lower the reuse limit "
            f"(comm_reuse or {ENV}, now {limit} operators), or raise max_labels"
        )
    if not subgraphs:
        return plan
    floors = _held_at_once(plan, subgraphs)
    return evolve(_rewrite(plan, subgraphs), labels=labels, quota_floors=plan.quota_floors | floors)


def _calls(plan: Plan, members: list[Collective], limit: int) -> list[Collective]:
    """Up to ``limit`` of a group's collectives, in order, leaving out one that reads what
    a call before it made straight from it (the subgraph would read its own register)."""
    calls: list[Collective] = []
    made: set[int] = set()
    for coll in members:
        if len(calls) == limit:
            break
        participants = [plan.actors[a] for a in coll.actors]
        if not any(p.inputs[0].register in made for p in participants):
            calls.append(coll)
            made.update(p.outputs[0] for p in participants)
    return calls


def _key(plan: Plan, coll: Collective) -> tuple | None:
    """What a call site of a subgraph must share with the others, or None if it can't be one:
    every participant reads one register some actor makes and writes one data register."""
    participants = [plan.actors[a] for a in coll.actors]
    shapes = []
    for p in participants:
        if len(p.inputs) != 1 or len(p.outputs) != 1:
            return None
        source, result = plan.registers[p.inputs[0].register], plan.registers[p.outputs[0]]
        if source.is_parameter or result.control:
            return None
        shapes.append((source.shape, source.dtype, result.shape, result.dtype))
    first = participants[0]
    attributes = tuple(sorted((k, repr(v)) for k, v in first.attrs.items()))
    return (coll.op, first.op, tuple(p.device for p in participants), tuple(shapes), attributes, first.every)


def _held_at_once(plan: Plan, subgraphs: list[list[Collective]]) -> dict[str, int]:
    """Per shared register (named as ``_rewrite`` names it), the most calls of one
    iteration whose buffers can be held at once: call i's buffer is free again only once
    each of its consumers has run, and a consumer may wait on a later call of the same
    subgraph, through data or the collective order (which every collective stream keeps
    a part of); so call i holds its buffer up to the latest call its consumers wait on."""
    unit = unit_of(plan)
    edges: dict[int, set[int]] = {u: set() for u in data_edges(plan)}
    for u, vs in data_edges(plan).items():
        for v in vs:
            edges[v].add(u)  # reversed: a node's bits are the calls it waits on
    for earlier, later in zip(plan.collectives, plan.collectives[1:]):
        edges[unit[later.actors[0]]].add(unit[earlier.actors[0]])
    floors = {}
    for s, calls in enumerate(subgraphs):
        bit = {unit[c.actors[0]]: 1 << i for i, c in enumerate(calls)}
        readers = {
            (i, unit[c.actor])
            for i, coll in enumerate(calls)
            for c in plan.registers[plan.actors[coll.actors[0]].outputs[0]].consumers
        }
        waits = reach_bits(edges, {r for _, r in readers}, bit)
        until = list(range(len(calls)))
        for i, reader in readers:
            until[i] = max(until[i], waits[reader].bit_length() - 1)
        change = [0] * (len(calls) + 1)
        for i, last in enumerate(until):
            change[i] += 1
            change[last + 1] -= 1
        held = running = 0
        for step in change:
            running += step
            held = max(held, running)
        for a in calls[0].actors:
            floors[f"{_name(s)}[{plan.actors[a].device}]"] = held
    return floors


def _name(subgraph: int) -> str:
    return f"comm_subgraph_{subgraph}"


def _rewrite(plan: Plan, subgraphs: list[list[Collective]]) -> Plan:
    """Each subgraph's first call becomes the subgraph (its participants read every call's
    input and write the first call's register, now shared); the other calls' actors,
    registers and collectives go, and ids are renumbered to stay equal to indexes."""
    actors = list(plan.actors)
    registers = list(plan.registers)
    dead_actors: set[int] = set()
    dead_registers: set[int] = set()
    dead_collectives: set[int] = set()
    renamed: dict[int, str] = {}
    for s, calls in enumerate(subgraphs):
        renamed[calls[0].id] = _name(s)
        dead_collectives.update(c.id for c in calls[1:])
        for d, head_id in enumerate(calls[0].actors):
            head = actors[head_id]
            shared = head.outputs[0]
            consumers: list[Consumer] = []
            inputs = []
            for j, coll in enumerate(calls):
                call = actors[coll.actors[d]]
                source = call.inputs[0].register
                registers[source] = evolve(
                    registers[source],
                    consumers=tuple(
                        Consumer(head_id, j, c.call) if c.actor == call.id else c
                        for c in registers[source].consumers
                    ),
                )
                inputs.append(Input(source))
                out = registers[call.outputs[0]]
                consumers.extend(Consumer(c.actor, c.slot, j) for c in out.consumers)
                if j:
                    dead_actors.add(call.id)
                    dead_registers.add(out.id)
                    for c in out.consumers:
                        reader = actors[c.actor]
                        ins = list(reader.inputs)
                        ins[c.slot] = evolve(ins[c.slot], register=shared)
                        actors[c.actor] = evolve(reader, inputs=tuple(ins))
            name = f"{_name(s)}[{head.device}]"
            registers[shared] = evolve(registers[shared], name=name, consumers=tuple(consumers))
            actors[head_id] = evolve(actors[head_id], name=name, inputs=tuple(inputs), calls=len(calls))
    collectives = [
        evolve(c, name=renamed.get(c.id, c.name)) for c in plan.collectives if c.id not in dead_collectives
    ]
    return renumber(
        evolve(plan, actors=tuple(actors), registers=tuple(registers)),
        collectives,
        dead_actors,
        dead_registers,
    )
