"""Reverse-mode differentiation on the logical graph: ``gradients(y, xs)`` appends the
backward ops of ``y`` to y's graph and returns d(sum(y * dy))/dx for each x."""

from __future__ import annotations

from collections.abc import Sequence

from .. import ops
from ..errors import GraphError
from ..graph.ir import Graph, Tensor
from . import rules  # noqa: F401 - registers the rules
from .registry import rule_for

Ref = tuple[int, int]


def gradients(y: Tensor, xs: Sequence[Tensor], dy: Tensor | None = None) -> list[Tensor | None]:
    """Gradients of ``y`` with respect to each of ``xs`` (None where y does not depend on x).

    ``dy`` weights y's elements (default: ones, so for a scalar loss these are dloss/dx).
    The backward ops go into y's graph, wherever this is called from; a tensor used
    several times gets its gradients summed.
    """
    graph = y.graph
    if any(x.graph is not graph for x in xs) or (dy is not None and dy.graph is not graph):
        raise GraphError("gradients: y, xs and dy must belong to one graph")
    with graph:
        return _gradients(graph, y, xs, dy)


def _gradients(graph: Graph, y: Tensor, xs: Sequence[Tensor], dy: Tensor | None) -> list[Tensor | None]:
    if dy is None:
        dy = ops.full(y.shape, 1.0, y.dtype, y.device)
    elif (dy.shape, dy.dtype, dy.device) != (y.shape, y.dtype, y.device):
        raise GraphError(
            f"gradients: dy is {dy.dtype}{list(dy.shape)} on {dy.device}, "
            f"y is {y.dtype}{list(y.shape)} on {y.device}"
        )
    wanted = {(x.node, x.index) for x in xs}
    relevant = _between(graph, wanted, (y.node, y.index))
    grads: dict[Ref, Tensor] = {(y.node, y.index): dy}
    for node in reversed(graph.nodes[: y.node + 1]):
        if node.id not in relevant:
            continue
        douts = [grads.get((node.id, k)) for k in range(len(node.outputs))]
        if all(d is None for d in douts) or not node.inputs:
            continue
        fn = rule_for(node.op)
        if fn is None:
            raise GraphError(f"gradients: op {node.op!r} ({node.name}, built at {node.where}) is not differentiable")
        ins = [graph.tensor(ref) for ref in node.inputs]
        outs = [graph.tensor((node.id, k)) for k in range(len(node.outputs))]
        for ref, d in zip(node.inputs, fn(node, ins, outs, douts)):
            if d is not None and ref[0] in relevant:
                grads[ref] = ops.add(grads[ref], d) if ref in grads else d
    return [grads.get((x.node, x.index)) for x in xs]


def _between(graph: Graph, sources: set[Ref], target: Ref) -> set[int]:
    """Nodes on some path from a source tensor to the target (sources' nodes included)."""
    below = {target[0]}
    for node in reversed(graph.nodes[: target[0] + 1]):
        if node.id in below:
            below.update(ref[0] for ref in node.inputs)
    above = {ref[0] for ref in sources}
    for node in graph.nodes:
        if any(ref[0] in above for ref in node.inputs):
            above.add(node.id)
    return below & above
