"""The program a graph of global tensors records, so that the compiler can choose the SBP
of the tensors the user left unannotated and build the graph again with its choice.

Every placeholder or parameter on several devices, every op on global tensors,
``box``, ``minimize`` and ``output`` is a step of ``Graph.program``. A placeholder or
parameter given ``sbp=None`` is *undecided*: it and whatever depends on it are
``Pending`` tensors, which know their logical shape and dtype only (inferred by building
the op once on one device, in a scratch graph); their ops are recorded, not expanded.
``parallel.replay`` builds the recorded program into a new graph, each undecided leaf
with the SBP it is given and each op through the ops' signatures, as if the user had
written those annotations (see ``compiler.sbp_search``, which chooses them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs

from ..errors import GraphError
from ..graph import builder as g
from ..graph.dispatch import register
from ..graph.ir import Graph, Tensor
from .global_tensor import GlobalTensor
from .sbp import SBP


@attrs.frozen(eq=False)
class Pending:
    """A tensor on several devices whose SBP the compiler will choose."""

    shape: tuple[int, ...]
    dtype: str
    devices: tuple[str, ...]
    graph: Graph = attrs.field(repr=False)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@attrs.frozen(eq=False)
class Leaf:
    """A placeholder or parameter on several devices; ``sbp`` None: undecided."""

    kind: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    devices: tuple[str, ...]
    sbp: SBP | None
    value: Any = None
    result: Any = None


@attrs.frozen(eq=False)
class Call:
    """``fn(*args, **kwargs)`` with global or pending tensors among the arguments;
    ``result``: what it gave when recorded; ``op``: fn is an op, called through the SBP
    signatures (else an entry point of the parallel layer: box, minimize, output)."""

    fn: Callable
    args: tuple
    kwargs: dict
    result: Any = None
    op: bool = True


def undecided(graph: Graph) -> list[Leaf]:
    """The placeholders and parameters on several devices given no SBP."""
    return [step for step in graph.program or () if isinstance(step, Leaf) and step.sbp is None]


def is_pending(value: Any) -> bool:
    return any(isinstance(v, Pending) for v in flat(value))


def pending_leaf(kind: str, name: str, shape: tuple[int, ...], dtype: str, devices: list[str], value=None):
    graph = g.graph_for(kind)
    graph.unique_name(name, kind)
    result = Pending(tuple(shape), dtype, tuple(devices), graph)
    graph.program.append(Leaf(kind, name, tuple(shape), dtype, tuple(devices), None, value, result))
    return result


def record_leaf(kind: str, name: str, devices: list[str], sbp: SBP, tensor: GlobalTensor, value=None) -> None:
    program = tensor.locals[0].graph.program
    if program is not None:
        program.append(Leaf(kind, name, tensor.shape, tensor.dtype, tuple(devices), sbp, value, tensor))


def record_call(fn: Callable, args: tuple, kwargs: dict, result: Any = None, op: bool = True) -> Any:
    """A call on global tensors, recorded. With a pending argument, an op is not run:
    its results are pending tensors of the shapes it gives on one device."""
    values = flat((args, kwargs))
    tensors = [v for v in values if isinstance(v, (Pending, GlobalTensor))]
    graph = tensors[0].graph if isinstance(tensors[0], Pending) else tensors[0].locals[0].graph
    if graph.program is None:
        return result
    if op and any(isinstance(v, Pending) for v in tensors):
        if any(isinstance(v, Tensor) for v in values):
            raise GraphError(f"{fn.__name__}: mixes tensors on one device with tensors on several")
        if fn.__name__ == "to_device":  # onto as many devices, part k to the k-th
            x, devices = args[0], args[1]
            result = Pending(
                x.shape, x.dtype, tuple([devices] if isinstance(devices, str) else devices), graph
            )
        else:
            names = itertools.count()

            def probe(t: Pending | GlobalTensor) -> Tensor:
                """A one-device stand-in: a placeholder of the logical shape."""
                return g.placeholder(f"probe{next(names)}", t.shape, t.dtype)

            with Graph():
                made = fn(*map_tensors(args, probe), **map_tensors(kwargs, probe))
            result = _pending(made, tensors[0].devices, graph)
    graph.program.append(Call(fn, args, kwargs, result, op))
    return result


def flat(value: Any) -> list:
    """The leaves of nested lists, tuples and dicts' values."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [u for v in value for u in flat(v)]
    return [value]


def map_tensors(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with ``fn(t)`` in place of each global or pending tensor ``t`` in it
    (through lists, tuples and dicts' values)."""
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, fn) for v in value)
    return fn(value) if isinstance(value, (Pending, GlobalTensor)) else value


def _pending(probe: Any, devices: tuple[str, ...], graph: Graph) -> Any:
    if isinstance(probe, (list, tuple)):
        return type(probe)(_pending(p, devices, graph) for p in probe)
    if probe is None:
        return None
    return Pending(probe.shape, probe.dtype, devices, graph)


register(Pending, record_call)
