"""The logical graph: ops on tensors, each tensor placed on one device."""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import Any

import attrs
import numpy as np

from ..plan import LogicalTensor


@attrs.frozen
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str
    device: str
    name: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@attrs.frozen
class Node:
    """One op application. ``inputs`` are (node id, output index) pairs; ``where`` is the user's line.

    ``backward``: built by autodiff; ``weight_grad``: a backward node only the gradients of
    the requested xs (parameters) need, not the gradients autodiff passes on to earlier
    nodes, so a pipeline stage may defer it (see ``autodiff.gradients``); ``recompute``:
    marked by ``af.recompute``: the backward pass reads a copy of its outputs recomputed
    from its inputs, so they need not be kept."""

    id: int
    name: str
    op: str
    inputs: tuple[tuple[int, int], ...]
    attrs: dict[str, Any]
    outputs: tuple[TensorMeta, ...]
    where: str
    backward: bool = False
    weight_grad: bool = False
    recompute: bool = False


@attrs.frozen
class OptimizerShard:
    """A data-parallel parameter whose optimizer runs sharded over its replicas (see
    ``compiler.optimizer_shards``): the logical ``parameter``'s name, the ``axis`` its
    parts are cut along, and whether a step's gradient is reduce-scattered at every
    micro-batch and accumulated sharded (``accumulate_sharded``) or accumulated whole
    and reduce-scattered once."""

    parameter: str
    axis: int
    accumulate_sharded: bool = True


@attrs.frozen(eq=False)
class Tensor:
    """A handle on one output of a node, as the user holds it while building."""

    graph: Graph = attrs.field(repr=False)
    node: int
    index: int
    meta: TensorMeta

    @property
    def shape(self) -> tuple[int, ...]:
        return self.meta.shape

    @property
    def dtype(self) -> str:
        return self.meta.dtype

    @property
    def device(self) -> str:
        return self.meta.device

    @property
    def name(self) -> str:
        return self.meta.name

    @property
    def ndim(self) -> int:
        return len(self.meta.shape)


class Graph:
    """The ops a user built, in build order (a topological order by construction).

    Use it as a context manager: ops created inside ``with af.Graph() as g:`` land in ``g``.
    """

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.logical: list[LogicalTensor] = []
        self.optimizer_shards: list[OptimizerShard] = []
        self.sbp: dict[str, str] = {}
        """The SBP of each tensor on several devices, by name (see ``Plan.sbp``)."""
        self.program: list | None = []
        """What was built on tensors on several devices (see ``parallel.program``);
        None: not recorded (a graph built only to be costed)."""
        self._names: set[str] = set()
        self._tokens: list = []
        self.building_backward = False

    def __enter__(self) -> Graph:
        self._tokens.append(_current.set(self))
        return self

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._tokens.pop())

    def node_of(self, tensor: Tensor) -> Node:
        return self.nodes[tensor.node]

    def meta(self, ref: tuple[int, int]) -> TensorMeta:
        return self.nodes[ref[0]].outputs[ref[1]]

    def tensor(self, ref: tuple[int, int]) -> Tensor:
        """The handle on output ``ref[1]`` of node ``ref[0]``."""
        return Tensor(self, ref[0], ref[1], self.meta(ref))

    def unique_name(self, name: str | None, op: str) -> str:
        """``name``, refused if taken; or a fresh ``op_N`` that no user name has taken."""
        if name is None:
            n = len(self.nodes)
            while f"{op}_{n}" in self._names:
                n += 1
            name = f"{op}_{n}"
        elif name in self._names:
            raise ValueError(f"the name {name!r} is used twice in this graph")
        self._names.add(name)
        return name


_current: ContextVar[Graph | None] = ContextVar("actorflow_graph", default=None)


def current_graph() -> Graph | None:
    """The graph being built by the innermost ``with af.Graph()``, if any."""
    return _current.get()
