"""Ops that backward passes are built from. Users may call them too."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..graph.builder import check_inputs, fail
from ..graph.ir import Tensor
from . import gradient_kernels
from .compute import _compute
from .registry import register

register("sum_to", "compute", gradient_kernels.sum_to)
register("relu_grad", "compute", gradient_kernels.relu_grad)


def sum_to(x: Tensor, shape: Sequence[int], *, name: str | None = None) -> Tensor:
    """Sum ``x`` down to ``shape``, which must broadcast to x's shape (x itself if equal)."""
    check_inputs("sum_to", [x])
    shape = tuple(int(d) for d in shape)
    if shape == x.shape:
        return x
    if len(shape) > x.ndim or np.broadcast_shapes(shape, x.shape) != x.shape:
        raise fail("sum_to", f"{shape} does not broadcast to {x.shape}")
    return _compute("sum_to", [x], shape, name=name)


def relu_grad(dy: Tensor, x: Tensor, *, name: str | None = None) -> Tensor:
    """dy where x > 0, else 0."""
    check_inputs("relu_grad", [dy, x])
    if dy.shape != x.shape:
        raise fail("relu_grad", f"shapes {dy.shape} and {x.shape} differ")
    return _compute("relu_grad", [dy, x], x.shape, name=name)
