"""Reverse-mode differentiation on the logical graph: ``gradients(y, xs)`` appends the
backward ops of ``y`` to y's graph and returns d(sum(y * dy))/dx for each x."""

from __future__ import annotations

from collections.abc import Sequence

from .. import ops
from ..errors import GraphError
from ..graph.builder import is_float
from ..graph.ir import Graph, Node, Tensor
from ..records import evolve
from . import rules  # noqa: F401 - registers the rules
from .registry import rule_for

Ref = tuple[int, int]


def gradients(
    y: Tensor | Sequence[Tensor], xs: Sequence[Tensor], dy: Tensor | None = None
) -> list[Tensor | None]:
    """Gradients of ``y`` with respect to each of ``xs`` (None where y does not depend on x).

    ``dy`` weights y's elements (default: ones, so for a scalar loss these are dloss/dx).
    ``y`` may be several tensors (say the partial losses of several devices): the
    gradients are then those of their sum, each weighted by ones. The backward ops go
    into y's graph, wherever this is called from; a tensor used several times gets its
    gradients summed. Backward ops that only the returned gradients need are marked
    ``weight_grad`` (see ``_mark_weight_grads``).
    """
    ys = [y] if isinstance(y, Tensor) else list(y)
    if not ys or (dy is not None and len(ys) > 1):
        raise GraphError("gradients: give one y with dy, or one or more ys without")
    graph = ys[0].graph
    if any(t.graph is not graph for t in (*ys, *xs)) or (dy is not None and dy.graph is not graph):
        raise GraphError("gradients: y, xs and dy must belong to one graph")
    outer = graph.building_backward
    graph.building_backward = True
    first = len(graph.nodes)
    passed_on: set[int] = set()
    try:
        with graph:
            grads = _gradients(graph, ys, xs, dy, passed_on)
    finally:
        graph.building_backward = outer
    _mark_weight_grads(graph, first, passed_on)
    return grads


def _gradients(
    graph: Graph, ys: list[Tensor], xs: Sequence[Tensor], dy: Tensor | None, passed_on: set[int]
) -> list[Tensor | None]:
    """``passed_on`` gets the nodes of the output gradients handed to a rule."""
    grads: dict[Ref, Tensor] = {}
    for y in ys:
        seed = ops.full(y.shape, 1.0, y.dtype, y.device) if dy is None else dy
        if (seed.shape, seed.dtype, seed.device) != (y.shape, y.dtype, y.device):
            raise GraphError(
                f"gradients: dy is {seed.dtype}{list(seed.shape)} on {seed.device}, "
                f"y is {y.dtype}{list(y.shape)} on {y.device}"
            )
        ref = (y.node, y.index)
        grads[ref] = ops.add(grads[ref], seed) if ref in grads else seed
    wanted = {(x.node, x.index) for x in xs}
    relevant = set().union(*(_between(graph, wanted, (y.node, y.index)) for y in ys))
    for node in reversed(graph.nodes[: max(y.node for y in ys) + 1]):
        if node.id not in relevant:
            continue
        douts = [grads.get((node.id, k)) for k in range(len(node.outputs))]
        if all(d is None for d in douts) or not node.inputs:
            continue
        fn = rule_for(node.op)
        if fn is None:
            raise GraphError(
                f"gradients: op {node.op!r} ({node.name}, built at {node.where}) is not differentiable"
            )
        ins = [graph.tensor(ref) for ref in node.inputs]
        if not any(is_float(t.dtype) for t in ins):
            continue
        outs = [graph.tensor((node.id, k)) for k in range(len(node.outputs))]
        passed_on.update(d.node for d in douts if d is not None)
        for ref, d in zip(node.inputs, _checked(node, ins, fn(node, ins, outs, douts))):
            if d is not None and ref[0] in relevant:
                grads[ref] = ops.add(grads[ref], d) if ref in grads else d
    return [grads.get((x.node, x.index)) for x in xs]


def _mark_weight_grads(graph: Graph, first: int, passed_on: set[int]) -> None:
    """Mark the backward nodes from ``first`` on that no output gradient handed to a rule
    depends on: they compute only the requested gradients (dW = x.T @ dy, db = sum(dy)),
    while the others (dx = dy @ W.T, the activations' gradients) carry the backward pass
    on to earlier nodes and, across a pipeline, to the previous stage (zero-bubble
    pipelines' W and B)."""
    needed = set(passed_on)
    for k in range(len(graph.nodes) - 1, first - 1, -1):
        node = graph.nodes[k]
        if node.id in needed:
            needed.update(ref[0] for ref in node.inputs)
        elif node.backward:
            graph.nodes[k] = evolve(node, weight_grad=True)


def _checked(node: Node, ins: list[Tensor], grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    """A rule's gradients, held to the contract: one per input, none for an integer input
    (class labels, say), each with its input's shape, dtype and device."""
    grads = list(grads)
    if len(grads) != len(ins):
        raise GraphError(f"gradient rule of {node.op!r} gave {len(grads)} gradients for {len(ins)} inputs")
    for k, (x, d) in enumerate(zip(ins, grads)):
        if d is None:
            continue
        if not is_float(x.dtype):
            grads[k] = None
        elif (d.shape, d.dtype, d.device) != (x.shape, x.dtype, x.device):
            raise GraphError(
                f"gradient rule of {node.op!r} ({node.name}) gave input {k} a gradient "
                f"{d.dtype}{list(d.shape)} on {d.device}, but the input is {x.dtype}{list(x.shape)} on {x.device}"
            )
    return grads


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
