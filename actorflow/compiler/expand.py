"""expand: the logical graph -> actors and registers, one actor per op per device.

Ops that no output or update depends on are dropped, except placeholders: a declared
feed is always accepted. A collective becomes one actor per participating device;
``to_device`` becomes a copy actor; placeholders and outputs become feed and fetch actors
at the host's edge; parameters become registers with no producer, except those an
optimizer updates, which become variable actors (see ``plan.Register``). A parameter
that several updates write (async parameter servers: one per worker, each applied as its
gradient arrives) stays a register with no producer, which they all write in place: a
variable, acting once per step, would make each update wait for the others.
"""

from __future__ import annotations

from collections import Counter

from ..graph.ir import Graph, Node
from ..ops.registry import lookup
from ..plan import Actor, Collective, Feed, Input, Output, Parameter, Plan, Register
from ..records import evolve
from .topology import with_consumers


def expand(graph: Graph) -> Plan:
    live = _live_nodes(graph)
    actors: list[Actor] = []
    registers: list[Register] = []
    collectives: list[Collective] = []
    feeds, outputs, parameters = [], [], []
    register_of: dict[tuple[int, int], int] = {}

    def new_register(producer: int, node: Node, index: int) -> int:
        meta = node.outputs[index]
        reg = Register(len(registers), meta.name, producer, meta.device, meta.shape, meta.dtype)
        registers.append(reg)
        register_of[(node.id, index)] = reg.id
        return reg.id

    def new_actor(node: Node, name: str, device: str, ins: list, outs: list[int], group=-1) -> int:
        opdef = lookup(node.op)
        assert opdef.kernel is not None, "a parameter becomes a variable actor or no actor"
        actor = Actor(
            id=len(actors),
            name=name,
            kind=opdef.kind,
            op=node.op,
            kernel=opdef.kernel,
            attrs=node.attrs,
            device=device,
            inputs=tuple(Input(register_of[ref]) for ref in ins),
            outputs=tuple(new_register(len(actors), node, k) for k in outs),
            group=group,
            where=node.where,
            backward=node.backward,
            weight_grad=node.weight_grad,
            recompute=node.recompute,
        )
        actors.append(actor)
        return actor.id

    updates = Counter(n.inputs[0][0] for n in graph.nodes if n.id in live and lookup(n.op).kind == "update")
    updated = {node for node, count in updates.items() if count == 1}
    for node in graph.nodes:
        if node.id not in live:
            continue
        kind = lookup(node.op).kind
        if kind == "parameter" and node.id in updated:
            variable = new_actor(
                evolve(node, op="variable", attrs={}), node.name, node.outputs[0].device, [], [0]
            )
            reg = actors[variable].outputs[0]
            parameters.append(Parameter(node.name, reg, node.attrs["value"]))
        elif kind == "parameter":
            reg = new_register(-1, node, 0)
            parameters.append(Parameter(node.name, reg, node.attrs["value"], node.attrs["state"]))
        elif kind == "collective":
            participants = []
            group = len(collectives)
            for device in _participant_devices(graph, node):
                ins = [ref for ref in node.inputs if graph.meta(ref).device == device]
                outs = [k for k, m in enumerate(node.outputs) if m.device == device]
                name = f"{node.name}[{device}]"
                participants.append(new_actor(node, name, device, ins, outs, group))
            collectives.append(Collective(group, node.name, node.op, tuple(participants)))
        else:
            device = node.outputs[0].device if node.outputs else graph.meta(node.inputs[0]).device
            actor_id = new_actor(node, node.name, device, list(node.inputs), list(range(len(node.outputs))))
            if kind == "feed":
                meta = node.outputs[0]
                feeds.append(Feed(node.name, actor_id, meta.shape, meta.dtype))
            elif kind == "fetch":
                outputs.append(Output(node.name, actor_id))

    return Plan(
        actors=tuple(actors),
        registers=with_consumers(actors, registers),
        collectives=tuple(collectives),
        feeds=tuple(feeds),
        outputs=tuple(outputs),
        parameters=tuple(parameters),
        logical=tuple(graph.logical),
        sbp=dict(graph.sbp),
    )


def _participant_devices(graph: Graph, node: Node) -> list[str]:
    devices = [graph.meta(ref).device for ref in node.inputs] + [m.device for m in node.outputs]
    return list(dict.fromkeys(devices))


def _live_nodes(graph: Graph) -> set[int]:
    """Placeholders, and nodes some output or update depends on; a collective is live if
    any of its results is used."""
    live: set[int] = set()
    stack = [n.id for n in graph.nodes if lookup(n.op).kind in ("fetch", "feed", "update")]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(ref[0] for ref in graph.nodes[node].inputs)
    return live
