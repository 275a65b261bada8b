"""Ops that backward passes are built from. Users may call them too."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from ..graph.builder import axis_of, check_inputs, fail, float_dtype, is_float
from ..graph.dispatch import dispatchable
from ..graph.ir import Tensor
from . import gradient_kernels
from .compute import _compute
from .registry import register

register("sum_to", "compute", gradient_kernels.sum_to)
register("relu_grad", "compute", gradient_kernels.relu_grad)
register("scale", "compute", gradient_kernels.scale)
register("broadcast_to", "compute", gradient_kernels.broadcast_to)
register("pad", "compute", gradient_kernels.pad)
register("gelu_grad", "compute", gradient_kernels.gelu_grad)
register("tanh_grad", "compute", gradient_kernels.tanh_grad)
register("softmax_grad", "compute", gradient_kernels.softmax_grad)
register("max_grad", "compute", gradient_kernels.max_grad)
register("equal_mask", "compute", gradient_kernels.equal_mask)


def sum_to(x: Tensor, shape: Sequence[int], *, name: str | None = None) -> Tensor:
    """Sum ``x`` down to ``shape``, which must broadcast to x's shape (x itself if equal)."""
    check_inputs("sum_to", [x])
    shape = tuple(int(d) for d in shape)
    if shape == x.shape:
        return x
    try:
        ok = len(shape) <= x.ndim and np.broadcast_shapes(shape, x.shape) == x.shape
    except ValueError:
        ok = False
    if not ok:
        raise fail("sum_to", f"{shape} does not broadcast to {x.shape}")
    return _compute("sum_to", [x], shape, name=name)


def broadcast_to(x: Tensor, shape: Sequence[int], *, name: str | None = None) -> Tensor:
    """``x`` repeated to ``shape`` by numpy broadcasting (x itself if the shapes are equal);
    the inverse of ``sum_to``."""
    check_inputs("broadcast_to", [x])
    shape = tuple(int(d) for d in shape)
    if shape == x.shape:
        return x
    try:
        ok = len(shape) >= x.ndim and np.broadcast_shapes(x.shape, shape) == shape
    except ValueError:
        ok = False
    if not ok:
        raise fail("broadcast_to", f"{x.shape} does not broadcast to {shape}")
    return _compute("broadcast_to", [x], shape, name=name)


@dispatchable
def scale(x: Tensor, factor: float, *, name: str | None = None) -> Tensor:
    """x * factor for a constant ``factor``; the dtype stays (x itself if factor is 1)."""
    check_inputs("scale", [x])
    _floats("scale", [x])
    if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not math.isfinite(factor):
        raise fail("scale", f"factor {factor!r} is not a finite real number")
    if factor == 1:
        return x
    return _compute("scale", [x], x.shape, attrs={"factor": float(factor)}, name=name)


def pad(x: Tensor, begin: Sequence[int], shape: Sequence[int], *, name: str | None = None) -> Tensor:
    """Zeros of ``shape`` with ``x`` written at offset ``begin``: the gradient of ``slice``."""
    check_inputs("pad", [x])
    begin = tuple(int(b) for b in begin)
    shape = tuple(int(d) for d in shape)
    if (
        len(begin) != x.ndim
        or len(shape) != x.ndim
        or any(b < 0 or b + n > s for b, n, s in zip(begin, x.shape, shape))
    ):
        raise fail("pad", f"{x.shape} at offset {begin} does not fit in {shape}")
    return _compute("pad", [x], shape, attrs={"begin": begin}, name=name)


def _same_shapes(op: str, tensors: Sequence[Tensor]) -> None:
    check_inputs(op, tensors)
    shapes = [t.shape for t in tensors]
    if len(set(shapes)) > 1:
        raise fail(op, f"shapes {' and '.join(map(str, shapes))} differ")


def _floats(op: str, tensors: Sequence[Tensor]) -> None:
    for t in tensors:
        if not is_float(t.dtype):
            raise fail(op, f"needs floating-point tensors, got {t.dtype} ({t.name})")


def relu_grad(dy: Tensor, x: Tensor, *, name: str | None = None) -> Tensor:
    """dy where x > 0, else 0."""
    _same_shapes("relu_grad", [dy, x])
    return _compute("relu_grad", [dy, x], x.shape, name=name)


def gelu_grad(dy: Tensor, x: Tensor, *, name: str | None = None) -> Tensor:
    """dy * gelu'(x), for gelu's tanh approximation."""
    _same_shapes("gelu_grad", [dy, x])
    _floats("gelu_grad", [dy, x])
    return _compute("gelu_grad", [dy, x], x.shape, name=name)


def tanh_grad(dy: Tensor, y: Tensor, *, name: str | None = None) -> Tensor:
    """dy * (1 - y**2), where ``y`` is tanh's output."""
    _same_shapes("tanh_grad", [dy, y])
    _floats("tanh_grad", [dy, y])
    return _compute("tanh_grad", [dy, y], y.shape, name=name)


def softmax_grad(dy: Tensor, y: Tensor, axis: int = -1, *, name: str | None = None) -> Tensor:
    """y * (dy - sum(dy * y, axis)), where ``y`` is softmax's output along ``axis``."""
    _same_shapes("softmax_grad", [dy, y])
    _floats("softmax_grad", [dy, y])
    axis = axis_of("softmax_grad", axis, y.ndim)
    return _compute("softmax_grad", [dy, y], y.shape, attrs={"axis": axis}, name=name)


def max_grad(
    dy: Tensor, x: Tensor, y: Tensor, axis=None, keepdims: bool = False, *, name: str | None = None
) -> Tensor:
    """The gradient of ``y = max(x, axis, keepdims)``: each of ``dy``'s elements goes to the
    elements of x that equal the maximum, split evenly among them when several do."""
    check_inputs("max_grad", [dy, x, y])
    _floats("max_grad", [dy, x, y])
    if axis is None:
        axes = tuple(range(x.ndim))
    else:
        raw = axis if isinstance(axis, (tuple, list)) else (axis,)
        axes = tuple(sorted({axis_of("max_grad", a, x.ndim) for a in raw}))
    reduced = tuple(1 if d in axes else n for d, n in enumerate(x.shape) if keepdims or d not in axes)
    if dy.shape != reduced or y.shape != reduced:
        raise fail(
            "max_grad",
            f"dy {dy.shape} and y {y.shape} should both be {reduced}, the max of {x.shape} over {axes}",
        )
    attrs = {"axis": axes, "keepdims": bool(keepdims)}
    return _compute("max_grad", [dy, x, y], x.shape, attrs=attrs, name=name)


def equal_mask(a: Tensor, b: Tensor, *, name: str | None = None) -> Tensor:
    """1 where a == b, else 0, in a's (real) dtype."""
    _same_shapes("equal_mask", [a, b])
    return _compute("equal_mask", [a, b], a.shape, float_dtype(a.dtype), name=name)
