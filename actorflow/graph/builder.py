"""Building graphs: the user-facing constructors and the one place nodes are added."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import numpy as np

from ..devices import parse_device
from ..errors import GraphError
from .ir import Node, Tensor, TensorMeta, current_graph

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def _ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR)


def user_line() -> str:
    """``file:line`` of the innermost caller outside actorflow: where the user built the op."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _ours(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def fail(op: str, message: str) -> GraphError:
    """The error for a bad op, naming the op and the user's line; the caller raises it."""
    return GraphError(f"{op}: {message} (at {user_line()})")


def axis_of(op: str, axis: Any, ndim: int) -> int:
    """``axis`` of a tensor with ``ndim`` dims, negatives counted from the end."""
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -ndim <= axis < ndim:
        raise fail(op, f"axis {axis!r} is out of range for a tensor of {ndim} dims")
    return int(axis) % ndim


def is_float(dtype: str) -> bool:
    return bool(np.issubdtype(np.dtype(dtype), np.floating))


def float_dtype(dtype: str) -> str:
    """The dtype of a result that must be real-valued: floats stay, integers become float64."""
    return dtype if is_float(dtype) else "float64"


def graph_for(op: str):
    graph = current_graph()
    if graph is None:
        raise GraphError(f"{op}: no graph is being built: create ops inside `with af.Graph() as g:`")
    return graph


def check_inputs(op: str, inputs: Sequence[Any]) -> None:
    graph = graph_for(op)
    for t in inputs:
        if not isinstance(t, Tensor):
            raise fail(op, f"expected a tensor, got {type(t).__name__}")
        if t.graph is not graph:
            raise fail(op, f"tensor {t.name!r} belongs to another graph")


def add_node(
    op: str,
    inputs: Sequence[Tensor],
    outputs: Sequence[tuple[tuple[int, ...], str, str]],
    attrs: dict[str, Any] | None = None,
    name: str | None = None,
    label: str | None = None,
) -> list[Tensor]:
    """Add one node; ``outputs`` are (shape, dtype, device) triples; returns their tensors.

    ``label``: the op's name as the user called it, for errors (``placeholder`` adds a
    ``feed`` node).
    """
    label = label or op
    check_inputs(label, inputs)
    graph = graph_for(label)
    try:
        name = graph.unique_name(name, op)
    except ValueError as e:
        raise fail(label, str(e)) from None
    metas = tuple(
        TensorMeta(
            tuple(int(d) for d in shape),
            dtype,
            device,
            name if len(outputs) == 1 else f"{name}:{k}",
        )
        for k, (shape, dtype, device) in enumerate(outputs)
    )
    node = Node(
        id=len(graph.nodes),
        name=name,
        op=op,
        inputs=tuple((t.node, t.index) for t in inputs),
        attrs=dict(attrs or {}),
        outputs=metas,
        where=user_line(),
        backward=graph.building_backward,
    )
    graph.nodes.append(node)
    return [Tensor(graph, node.id, k, meta) for k, meta in enumerate(metas)]


def device_of(op: str, device: str) -> str:
    try:
        return parse_device(device)
    except ValueError as e:
        raise fail(op, str(e)) from None


def dtype_of(op: str, dtype: Any) -> str:
    """The name of a numeric dtype (bool, int, uint, float, complex); others are refused."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise fail(op, f"unknown dtype {dtype!r}: {e}") from None
    if dt.kind not in "biufc":
        raise fail(op, f"dtype {dt} is not numeric; tensors hold bool, int, uint, float or complex")
    return dt.name


def placeholder(name: str, shape: Sequence[int], dtype: Any = "float32", device: str = "cpu:0") -> Tensor:
    """A tensor fed by the caller at each iteration, under ``name``."""
    shape = tuple(shape)
    if any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
        raise fail("placeholder", f"{name!r}: shape {shape} must hold non-negative ints")
    (t,) = add_node(
        "feed",
        [],
        [(shape, dtype_of("placeholder", dtype), device_of("placeholder", device))],
        name=name,
        label="placeholder",
    )
    return t


def shape_only(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """A parameter's value with its shape and dtype and no data (one zero, seen
    everywhere: a read-only view of no memory), for a graph that is compiled to be
    simulated, never run (``actorflow simulate``)."""
    return np.broadcast_to(np.zeros((), dtype), tuple(shape))


def is_shape_only(value: Any) -> bool:
    """Whether ``value`` is a ``shape_only`` one (or another view that holds one element)."""
    return isinstance(value, np.ndarray) and value.size > 1 and not any(value.strides)


def parameter(name: str, value: Any, device: str = "cpu:0", *, state: bool = False) -> Tensor:
    """A tensor that lives on its device across iterations, starting at ``value`` (copied,
    but for a ``shape_only`` one).

    ``state``: an optimizer's own tensor (momentum, moments), not a model parameter.
    """
    value = value if is_shape_only(value) else np.array(value)
    (t,) = add_node(
        "parameter",
        [],
        [(value.shape, dtype_of("parameter", value.dtype), device_of("parameter", device))],
        attrs={"value": value, "state": state},
        name=name,
        label="parameter",
    )
    return t


def output(name: str, tensor: Tensor) -> None:
    """Return ``tensor`` from each iteration under ``name``."""
    add_node("fetch", [tensor], [], name=name, label="output")
