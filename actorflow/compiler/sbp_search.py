"""SBP search: the compiler chooses the SBP of the placeholders and parameters the user
placed on several devices without one (``sbp=None``), so that a step costs least.

The user's annotations are never changed. Every other tensor's SBP follows from its
inputs' through the ops' signatures (``parallel.signatures``), so a choice for the
undecided leaves is a whole strategy, and ``parallel.replay`` builds it. Its
cost, for one step, is predicted from the forward graph that replay builds (OneFlow's
cost model):

- communication: each collective moves what a ring implementation moves (the boxing
  table: P->B 2s(p-1), S->B and P->S s(p-1), S(i)->S(j) s(p-1)/p, B->S nothing), once
  forward and once backward, where autodiff puts its transpose (an all-reduce's is an
  all-reduce, an all-gather's a reduce-scatter, of the same bytes); and each broadcast
  parameter an optimizer updates all-reduces its gradient (2s(p-1)), as a split one
  needs not; priced at ``bandwidth`` bytes/s;
- compute: the busiest device's multiply-adds (a matmul's 2mnk; any other op, one per
  element of its output), three times over for the forward and backward passes, at
  ``flops`` per second.

The search starts from every undecided leaf broadcast, the strategy any op accepts,
and improves it greedily (OneFlow's neighbourhood search): it moves to the cheapest
strategy that changes one leaf, or two weights first read within a few steps of each
other (a matmul's and the next one's, which Megatron splits together), until no such
move costs less.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping

import numpy as np

from ..errors import CompileError
from ..graph.ir import Graph, Node
from ..ops.collective import ring_total_bytes
from ..ops.registry import lookup
from ..parallel.build import minimize
from ..parallel.program import Call, Leaf, undecided
from ..parallel.replay import replay
from ..parallel.sbp import SBP, B, S

log = logging.getLogger("actorflow.compiler")

BANDWIDTH = 10e9
"""Bytes/s of a link, when compile is given no link_bandwidth."""

FLOPS = 100e9
"""Multiply-adds/s of a device."""

NEARBY = 12
"""Two undecided leaves of two dims or more (weights) first read at most this many
program steps apart may move together."""


def choose_sbp(graph: Graph, bandwidth: float | None = None, flops: float = FLOPS) -> Graph:
    """The graph ``graph`` records, with an SBP chosen for each undecided leaf."""
    parts = {part for lt in graph.logical for part in lt.parts}
    alone = [
        n.name
        for n in graph.nodes
        if lookup(n.op).kind in ("feed", "parameter") and n.name not in parts and not n.attrs.get("state")
    ]
    if alone:
        raise CompileError(
            f"a graph whose SBP the compiler chooses holds tensors on several devices only; {alone} "
            "are on one (give them a list of devices)"
        )
    leaves = undecided(graph)
    options = {leaf.name: _options(leaf) for leaf in leaves}
    model = _CostModel(graph, bandwidth or BANDWIDTH, flops)
    choice: dict[str, SBP] = {leaf.name: B for leaf in leaves}
    best = model.cost(choice)
    singles = [[(leaf.name, sbp)] for leaf in leaves for sbp in options[leaf.name]]
    pairs = [
        [(a, sa), (b, sb)]
        for a, b in _nearby_pairs(graph, [leaf for leaf in leaves if len(leaf.shape) >= 2])
        for sa, sb in itertools.product(options[a], options[b])
    ]
    log.info(
        "SBP search: %d undecided tensors, %d moves, from all B at %.3g s a step",
        len(leaves),
        len(singles) + len(pairs),
        best,
    )
    while True:
        cost, trial = _best_move(model, choice, singles + pairs)
        if not cost < best * (1 - 1e-9):
            break
        changed = ", ".join(f"{name} {sbp!r}" for name, sbp in trial.items() if choice[name] != sbp)
        log.info("SBP search: %s: %.3g s a step", changed, cost)
        best, choice = cost, trial
    log.info("SBP search: done after %d strategies", len(model.seen))
    return replay(graph, choice)


def _best_move(model: _CostModel, choice: dict[str, SBP], moves: list) -> tuple[float, dict[str, SBP]]:
    trials = [choice | dict(move) for move in moves]
    return min(
        ((model.cost(t), t) for t in trials if t != choice), key=lambda t: t[0], default=(math.inf, choice)
    )


def predicted_cost(graph: Graph, sbp: Mapping[str, SBP], bandwidth: float | None = None) -> float:
    """The search's cost of one strategy (seconds a step), for comparing with others."""
    return _CostModel(graph, bandwidth or BANDWIDTH, FLOPS).cost(sbp)


def _options(leaf: Leaf) -> list[SBP]:
    n = len(leaf.devices)
    return [B, *(S(axis) for axis, size in enumerate(leaf.shape) if size % n == 0)]


def _nearby_pairs(graph: Graph, leaves: list[Leaf]) -> list[tuple[str, str]]:
    """Undecided leaves first read within ``NEARBY`` steps of each other."""
    first_read: dict[str, int] = {}
    ids = {id(leaf.result): leaf.name for leaf in leaves}
    for k, step in enumerate(graph.program or ()):
        if isinstance(step, Call):
            for value in (*step.args, *step.kwargs.values()):
                name = ids.get(id(value))
                if name is not None:
                    first_read.setdefault(name, k)
    names = sorted(first_read, key=first_read.__getitem__)
    return [(a, b) for a, b in itertools.combinations(names, 2) if first_read[b] - first_read[a] <= NEARBY]


class _CostModel:
    def __init__(self, graph: Graph, bandwidth: float, flops: float) -> None:
        self.graph, self.bandwidth, self.flops = graph, bandwidth, flops
        self.updated = _updated_parameters(graph)
        self.seen: dict[tuple, float] = {}

    def cost(self, sbp: Mapping[str, SBP]) -> float:
        key = tuple(sorted((name, repr(s)) for name, s in sbp.items()))
        if key not in self.seen:
            self.seen[key] = self._cost(sbp)
        return self.seen[key]

    def _cost(self, sbp: Mapping[str, SBP]) -> float:
        forward = replay(self.graph, sbp, until=lambda call: call.fn is minimize)
        moved = 2 * sum(_ring_bytes(forward, node) for node in forward.nodes)
        for leaf in self.graph.program or ():
            if isinstance(leaf, Leaf) and leaf.name in self.updated and (leaf.sbp or sbp[leaf.name]) == B:
                nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
                moved += ring_total_bytes("all_reduce", nbytes, len(leaf.devices))
        busiest = max(_work_per_device(forward).values(), default=0)
        return moved / self.bandwidth + 3 * busiest / self.flops


def _updated_parameters(graph: Graph) -> set[str]:
    """The parameter leaves a minimize updates (all of them unless it names some)."""
    names: set[str] = set()
    parameters = [s for s in graph.program or () if isinstance(s, Leaf) and s.kind == "parameter"]
    for step in graph.program or ():
        if isinstance(step, Call) and step.fn is minimize:
            chosen = step.args[2]
            ids = {id(p) for p in chosen} if chosen is not None else None
            names |= {p.name for p in parameters if ids is None or id(p.result) in ids}
    return names


def _ring_bytes(graph: Graph, node: Node) -> float:
    if lookup(node.op).kind != "collective":
        return 0.0
    n = len({graph.meta(ref).device for ref in node.inputs} | {m.device for m in node.outputs})
    return ring_total_bytes(node.op, graph.meta(node.inputs[0]).nbytes, n)


def _work_per_device(graph: Graph) -> dict[str, float]:
    work: dict[str, float] = {}
    for node in graph.nodes:
        if not node.outputs or lookup(node.op).kind not in ("compute", "backward"):
            continue
        out = node.outputs[0]
        size = float(np.prod(out.shape, dtype=np.int64))
        if node.op == "matmul":
            a = graph.meta(node.inputs[0]).shape
            size *= 2 * (a[-2] if node.attrs.get("transpose_a") else a[-1])
        work[out.device] = work.get(out.device, 0.0) + size
    return work
