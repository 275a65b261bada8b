"""The actor DAG as the passes see it: a collective's participants form one unit, since they
run as one kernel."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence

from ..dag import Edges, topological_order
from ..plan import Actor, Collective, Consumer, Input, Plan, Register
from ..plan_check import call_edges, data_edges
from ..plan_check import unit_of as unit_of  # the passes take both from here
from ..records import evolve


def with_consumers(actors: Sequence[Actor], registers: Sequence[Register]) -> tuple[Register, ...]:
    """The registers with their consumers read off the actors' inputs, in actor order
    (for passes that rewire inputs and leave the consumers to this)."""
    consumers: list[list[Consumer]] = [[] for _ in registers]
    for actor in actors:
        for slot, i in enumerate(actor.inputs):
            consumers[i.register].append(Consumer(actor.id, slot))
    return tuple(evolve(r, consumers=tuple(c)) for r, c in zip(registers, consumers))


def positions(edges: Edges) -> dict[int, int]:
    """Unit -> its place in the deterministic topological order of ``edges`` (the unit
    DAG, ``data_edges``)."""
    return {u: k for k, u in enumerate(topological_order(edges))}


def unit_positions(plan: Plan, across_ranks: bool = True) -> dict[int, int]:
    """Unit -> its place in the deterministic topological order of the units, a reused
    communication subgraph at its first call's (its calls ordered apart, as
    ``call_edges`` does: one call may feed the next through data)."""
    return positions(call_edges(plan, across_ranks)[0])


def ready_order(plan: Plan) -> dict[int, tuple[int, int, int]]:
    """Unit -> a key that sorts units in the order their inputs are made: (where its
    producers could all start, the latest topological position among their own
    producers; minus its latest producer's position; its own position).

    Sorting by it puts a unit as early as its inputs allow: a gradient's all-reduce
    comes right after the backward op that made the gradient (gradient-ready order).
    Where producers could start at once (a layer's weight and bias gradients, both
    reading its output gradient), the deeper goes first, as ``priorities`` launches
    them, so the collectives' fixed order waits for neither out of turn (producers that
    wait on nothing, feeds, keep their order). It is consistent with every dependency:
    whatever a unit reaches, it reaches through a producer of that unit, which can start
    only after it, so its first figure is larger.
    """
    edges = data_edges(plan)
    position = positions(edges)
    producers: dict[int, list[int]] = {u: [] for u in position}
    for producer, consumers in edges.items():
        for consumer in consumers:
            producers[consumer].append(producer)
    start = {u: max((position[p] for p in ps), default=-1) for u, ps in producers.items()}
    order = {}
    for u, ps in producers.items():
        ready = max((start[p] for p in ps), default=-1)
        order[u] = (ready, -start[u] if ready >= 0 else start[u], position[u])
    return order


def reach_bits(edges: Edges, sources: Iterable[int], bit: Mapping[int, int]) -> dict[int, int]:
    """Source -> the OR of ``bit[v]`` over the nodes v in ``bit`` it reaches by a path of
    length >= 1.

    One sweep in reverse topological order carries, per node, the bits of what it
    reaches, and drops them once every predecessor has read them: (n + m) big-int ORs as
    wide as ``bit``'s bits, and only the sweep's frontier in memory (a bitset of every
    node's descendants would grow as n squared on a deep graph)."""
    wanted = set(sources)
    readers = dict.fromkeys(edges, 0)
    for u in edges:
        for v in edges[u]:
            readers[v] += 1
    reach: dict[int, int] = {}
    found: dict[int, int] = {}
    for u in reversed(topological_order(edges)):
        bits = 0
        for v in edges[u]:
            bits |= reach[v] | bit.get(v, 0)
            readers[v] -= 1
            if not readers[v]:
                del reach[v]
        if u in wanted:
            found[u] = bits
        reach[u] = bits
    return found


def reachable(edges: Edges, pairs: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
    """The pairs (u, v) with a path of length >= 1 from u to v (see ``reach_bits``)."""
    pairs = list(pairs)
    bit: dict[int, int] = {}
    for _, v in pairs:
        bit.setdefault(v, 1 << len(bit))
    reach = reach_bits(edges, (u for u, _ in pairs), bit)
    return {(u, v) for u, v in pairs if reach[u] & bit[v]}


def descendants(edges: Edges, sources: Iterable[int]) -> set[int]:
    """The nodes some source reaches by a path of length >= 1."""
    stack = [v for u in sources for v in edges[u]]
    seen = set(stack)
    while stack:
        for w in edges[stack.pop()]:
            if w not in seen:
                seen.add(w)
                stack.append(w)
    return seen


def reaches_any(
    edges: Edges, position: Mapping[int, int], start: int, targets: Container[int], bound: int, budget: int
) -> bool | None:
    """Whether ``start`` reaches one of ``targets`` (all at topological positions <= ``bound``)
    by a path of length >= 1: a search that never leaves the window up to ``bound``, so
    a question about near neighbours costs little on a deep graph. None once it has
    visited ``budget`` nodes without an answer."""
    stack = [v for v in edges[start] if position[v] <= bound]
    seen = set(stack)
    while stack:
        v = stack.pop()
        if v in targets:
            return True
        budget -= 1
        if budget < 0:
            return None
        for w in edges[v]:
            if w not in seen and position[w] <= bound:
                seen.add(w)
                stack.append(w)
    return False


class Contracted:
    """The unit DAG with some sets of units merged into one (their first unit), and which
    of the ``candidates`` (a bit each) each candidate reaches."""

    def __init__(self, edges: dict[int, set[int]], candidates: Sequence[int]) -> None:
        self.edges = {u: set(vs) for u, vs in edges.items()}
        self.merged: dict[int, int] = {}
        self.bit = {u: 1 << k for k, u in enumerate(candidates)}

    def find(self, u: int) -> int:
        while u in self.merged:
            u = self.merged[u]
        return u

    def contract(self, units: Sequence[int]) -> None:
        members = {self.find(u) for u in units}
        head = self.find(units[0])
        out: set[int] = set()
        for u in members:
            out |= self.edges.pop(u)
        for u in members - {head}:
            self.merged[u] = head
        for u, vs in self.edges.items():
            if vs & members:
                self.edges[u] = (vs - members) | {head}
        self.edges[head] = out - members

    def independent(self) -> Independent:
        """An empty set of candidates none of which reaches another, to grow one at a time."""
        return Independent(self.reaches(), self.bit)

    def reaches(self) -> dict[int, int]:
        """Candidate -> the bits of the candidates it reaches (merged ones through their head)."""
        heads = {u for u in self.bit if u not in self.merged}
        return reach_bits(self.edges, heads, {u: self.bit[u] for u in heads})


class Independent:
    """Candidates of a ``Contracted`` graph none of which reaches another (so they can run
    as one kernel without a cycle), as bitsets: the members and what they reach."""

    def __init__(self, reach: dict[int, int], bit: dict[int, int]) -> None:
        self.reach, self.bit = reach, bit
        self.clear()

    def clear(self) -> None:
        self.inside = self.below = 0

    def admits(self, u: int) -> bool:
        return not (self.reach[u] & self.inside or self.below & self.bit[u])

    def add(self, u: int) -> None:
        self.inside |= self.bit[u]
        self.below |= self.reach[u]


def renumber(
    plan: Plan, collectives: Sequence[Collective], dead_actors: set[int], dead_registers: set[int]
) -> Plan:
    """``plan`` without the dead actors and registers, with ``collectives`` (some of
    its own, in order), every id renumbered to stay equal to its index and every
    reference to one rewritten."""
    actor_id = _compact(len(plan.actors), dead_actors)
    register_id = _compact(len(plan.registers), dead_registers)
    group_of = {c.id: k for k, c in enumerate(collectives)}
    actors = tuple(
        evolve(
            a,
            id=actor_id[a.id],
            inputs=tuple(Input(register_id[i.register], i.sync) for i in a.inputs),
            outputs=tuple(register_id[o] for o in a.outputs),
            group=group_of.get(a.group, -1),
        )
        for a in plan.actors
        if a.id not in dead_actors
    )
    registers = tuple(
        evolve(
            r,
            id=register_id[r.id],
            producer=actor_id.get(r.producer, r.producer),
            consumers=tuple(Consumer(actor_id[c.actor], c.slot, c.call) for c in r.consumers),
        )
        for r in plan.registers
        if r.id not in dead_registers
    )
    return evolve(
        plan,
        actors=actors,
        registers=registers,
        collectives=tuple(
            evolve(c, id=k, actors=tuple(actor_id[a] for a in c.actors)) for k, c in enumerate(collectives)
        ),
        feeds=tuple(evolve(f, actor=actor_id[f.actor]) for f in plan.feeds),
        outputs=tuple(evolve(o, actor=actor_id[o.actor]) for o in plan.outputs),
        parameters=tuple(evolve(p, register=register_id[p.register]) for p in plan.parameters),
    )


def _compact(n: int, dead: set[int]) -> Mapping[int, int]:
    """Old id -> new id, for the ids below ``n`` that are not ``dead``."""
    new: dict[int, int] = {}
    for old in range(n):
        if old not in dead:
            new[old] = len(new)
    return new
