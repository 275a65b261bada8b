"""``af.recompute``: activation checkpointing. The forward ops it marks keep no output for
the backward pass: the compiler (``compiler.recompute``) adds a copy of each to the
backward pass, fed by the inputs the marked ops leave kept and run just before the
backward ops that need it, trading one more forward kernel per op and micro-batch for
the memory of their outputs.

Compute ops are marked; communication (collectives, copies between devices) only with
``comm=True``, MindSpore's ``mp_comm_recompute``: by default what a collective gives is
kept, so recomputing never repeats communication. Kernels are assumed deterministic: a
recomputed op must give what it gave in the forward pass.
"""

from __future__ import annotations

from types import TracebackType
from typing import overload

from ..graph.builder import fail, graph_for
from ..graph.ir import Graph, Node, Tensor
from ..ops.registry import lookup
from ..records import evolve
from .global_tensor import GlobalTensor
from .program import Call, Pending, record_call

COMMUNICATION = ("collective", "copy")


class Block:
    """``with af.recompute():``: marks every forward op built inside that ``markable`` admits.
    Placeholders, parameters, outputs and updates built inside are left as they are."""

    def __init__(self, comm: bool) -> None:
        self.comm = comm
        self._open: list[tuple[Graph, int]] = []

    def __enter__(self) -> None:
        graph = graph_for("recompute")
        if graph.building_backward:
            raise fail("recompute", "the backward pass is not recomputed; mark forward ops only")
        self._open.append((graph, len(graph.nodes)))
        if graph.program is not None:  # so that a replay (parallel.replay) marks its ops too
            graph.program.append(Call(self.__enter__, (), {}, op=False))

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        graph, start = self._open.pop()
        if kind is not None:
            return
        for node in graph.nodes[start:]:
            if not node.backward and markable(node, self.comm):
                graph.nodes[node.id] = evolve(node, recompute=True)
        if graph.program is not None:
            graph.program.append(Call(self.__exit__, (None, None, None), {}, op=False))


def markable(node: Node, comm: bool) -> bool:
    """Whether ``node`` can be recomputed: a compute op, or with ``comm`` a communication op."""
    kind = lookup(node.op).kind
    return kind == "compute" or (comm and kind in COMMUNICATION)


@overload
def recompute(tensor: None = None, *, comm: bool = False) -> Block: ...


@overload
def recompute(tensor: Tensor, *, comm: bool = False) -> Tensor: ...


@overload
def recompute(tensor: GlobalTensor, *, comm: bool = False) -> GlobalTensor: ...


def recompute(
    tensor: Tensor | GlobalTensor | None = None, *, comm: bool = False
) -> Block | Tensor | GlobalTensor:
    """Recompute forward ops in the backward pass instead of keeping their outputs.

    ``with af.recompute():`` marks every forward op built inside; ``af.recompute(t)``
    marks the op that produced ``t`` (each part's, for a global tensor) and returns
    ``t``, so it reads inline: ``h = af.recompute(af.ops.relu(x))``. ``comm``: also
    recompute collectives and copies between devices (by default their results are kept).
    """
    if tensor is None:
        return Block(comm)
    if isinstance(tensor, Pending):
        return record_call(recompute, (tensor,), {"comm": comm}, tensor, op=False)
    parts = tensor.locals if isinstance(tensor, GlobalTensor) else (tensor,)
    for t in parts:
        if not isinstance(t, Tensor):
            raise fail("recompute", f"expected a tensor, got {type(t).__name__}")
        graph = graph_for("recompute")
        if t.graph is not graph:
            raise fail("recompute", f"tensor {t.name!r} belongs to another graph")
        node = graph.node_of(t)
        if node.backward:
            raise fail("recompute", f"{t.name!r} is made by the backward pass; mark forward ops only")
        if not markable(node, comm):
            kind = lookup(node.op).kind
            hint = "; pass comm=True to recompute it" if kind in COMMUNICATION else ", kept anyway"
            raise fail("recompute", f"{t.name!r} is made by a {kind} op ({node.op}){hint}")
        graph.nodes[node.id] = evolve(node, recompute=True)
    if isinstance(tensor, GlobalTensor):
        record_call(recompute, (tensor,), {"comm": comm}, tensor, op=False)
    return tensor
