"""Replay: the program a graph recorded (``parallel.program``), built into a new graph
with an SBP for each leaf the user left undecided."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..graph.ir import Graph
from .build import parameter, placeholder
from .global_tensor import GlobalTensor
from .program import Call, Leaf, flat, map_tensors
from .sbp import SBP
from .signatures import dispatch


def replay(graph: Graph, sbp: Mapping[str, SBP], until: Callable[[Call], bool] | None = None) -> Graph:
    """The recorded program built into a new graph, each undecided leaf with ``sbp[name]``.

    ``until``: build only up to the first call it accepts, for the costing of a
    strategy: then nothing is recorded and parameters are built as placeholders of
    their shape (no values copied), which cost the same."""
    built = Graph()
    costing = until is not None
    if costing:
        built.program = None
    env: dict[int, Any] = {}
    with built:
        for step in graph.program or ():
            if isinstance(step, Leaf):
                env[id(step.result)] = _leaf(step, step.sbp or sbp[step.name], costing)
                continue
            if until is not None and until(step):
                break
            args, kwargs = (map_tensors(a, lambda t: env.get(id(t), t)) for a in (step.args, step.kwargs))
            result = dispatch(step.fn, args, kwargs) if step.op else step.fn(*args, **kwargs)
            for old, new in zip(flat(step.result), flat(result)):
                env[id(old)] = new
    return built


def _leaf(step: Leaf, sbp: SBP, costing: bool) -> GlobalTensor:
    if step.kind == "parameter" and not costing:
        return parameter(step.name, step.value, list(step.devices), sbp)
    return placeholder(step.name, step.shape, step.dtype, list(step.devices), sbp)
