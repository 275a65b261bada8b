"""Ops a transformer needs beyond the elementwise, matmul and softmax ones: embedding
lookup, layer norm and causal softmax, with the backward ops of the first two (causal
softmax's gradient is softmax's)."""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..graph.builder import add_node, axis_of, check_inputs, fail, float_dtype, is_float
from ..graph.dispatch import dispatchable
from ..graph.ir import Tensor
from . import transformer_kernels
from .compute import _compute, _device, _dtype
from .registry import register

register("embedding", "compute", transformer_kernels.embedding)
register("embedding_grad", "compute", transformer_kernels.embedding_grad)
register("layer_norm", "compute", transformer_kernels.layer_norm)
register("layer_norm_grad", "compute", transformer_kernels.layer_norm_grad)
register("causal_softmax", "compute", transformer_kernels.causal_softmax)


def _check_ids(op: str, ids: Tensor) -> None:
    if not np.issubdtype(np.dtype(ids.dtype), np.integer):
        raise fail(op, f"ids must be integers, got {ids.dtype}")


def _check_float(op: str, what: str, t: Tensor) -> None:
    if not is_float(t.dtype):
        raise fail(op, f"{what} must be floating-point, got {t.dtype}")


@dispatchable
def embedding(ids: Tensor, table: Tensor, *, name: str | None = None) -> Tensor:
    """Rows of ``table`` (vocab, d) picked by integer ``ids`` of any shape: ids.shape + (d,).
    Ids outside [0, vocab) raise ValueError when the op runs."""
    check_inputs("embedding", [ids, table])
    _check_ids("embedding", ids)
    _check_float("embedding", "the table", table)
    if table.ndim != 2:
        raise fail("embedding", f"the table must be (vocab, d), got shape {table.shape}")
    return _compute("embedding", [ids, table], (*ids.shape, table.shape[1]), table.dtype, name=name)


def embedding_grad(dy: Tensor, ids: Tensor, vocab: int, *, name: str | None = None) -> Tensor:
    """The gradient of ``embedding`` for its table: (vocab, d) zeros with each of dy's
    rows added into the row its id picked."""
    check_inputs("embedding_grad", [dy, ids])
    _check_ids("embedding_grad", ids)
    _check_float("embedding_grad", "dy", dy)
    if dy.shape[:-1] != ids.shape or dy.ndim != ids.ndim + 1:
        raise fail("embedding_grad", f"dy {dy.shape} should be the ids' shape {ids.shape} plus one dim")
    if not isinstance(vocab, numbers.Integral) or isinstance(vocab, bool) or vocab <= 0:
        raise fail("embedding_grad", f"vocab {vocab!r} is not a positive int")
    return _compute("embedding_grad", [dy, ids], (int(vocab), dy.shape[-1]), dy.dtype, name=name)


def _check_layer_norm(op: str, x: Tensor, gamma: Tensor, axis: int, eps: float) -> int:
    """The normalized axis, counted from 0, once x, gamma and eps are fit for it."""
    axis = axis_of(op, axis, x.ndim)
    _check_float(op, "x", x)
    if gamma.shape != (x.shape[axis],):
        raise fail(
            op, f"gamma and beta must be ({x.shape[axis]},), axis {axis} of x {x.shape}, got {gamma.shape}"
        )
    if x.shape[axis] == 0:
        raise fail(op, f"axis {axis} of x {x.shape} is empty")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool) or not (eps > 0 and math.isfinite(eps)):
        raise fail(op, f"eps {eps!r} is not a positive finite number")
    return axis


@dispatchable
def layer_norm(
    x: Tensor, gamma: Tensor, beta: Tensor, axis: int = -1, eps: float = 1e-5, *, name: str | None = None
) -> Tensor:
    """(x - mean) / sqrt(var + eps) * gamma + beta, mean and (biased) variance along
    ``axis``; ``gamma`` and ``beta`` hold one value per position along it."""
    check_inputs("layer_norm", [x, gamma, beta])
    axis = _check_layer_norm("layer_norm", x, gamma, axis, eps)
    if beta.shape != gamma.shape:
        raise fail("layer_norm", f"gamma {gamma.shape} and beta {beta.shape} differ in shape")
    attrs = {"axis": axis, "eps": float(eps)}
    return _compute("layer_norm", [x, gamma, beta], x.shape, attrs=attrs, name=name)


def layer_norm_grad(
    dy: Tensor, x: Tensor, gamma: Tensor, axis: int = -1, eps: float = 1e-5, *, name: str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``layer_norm`` for x, gamma and beta in one op, which recomputes
    the mean and variance from x rather than keeping them from the forward pass."""
    check_inputs("layer_norm_grad", [dy, x, gamma])
    axis = _check_layer_norm("layer_norm_grad", x, gamma, axis, eps)
    if dy.shape != x.shape:
        raise fail("layer_norm_grad", f"dy {dy.shape} and x {x.shape} differ in shape")
    dtype = _dtype("layer_norm_grad", [dy, x, gamma])
    device = _device("layer_norm_grad", [dy, x, gamma])
    dx, dgamma, dbeta = add_node(
        "layer_norm_grad",
        [dy, x, gamma],
        [(x.shape, dtype, device), (gamma.shape, dtype, device), (gamma.shape, dtype, device)],
        {"axis": axis, "eps": float(eps)},
        name,
    )
    return dx, dgamma, dbeta


@dispatchable
def causal_softmax(x: Tensor, *, name: str | None = None) -> Tensor:
    """Softmax along the last axis of attention scores [..., s, s], where query i (axis -2)
    sees keys j <= i only: the others get probability exactly 0."""
    check_inputs("causal_softmax", [x])
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise fail("causal_softmax", f"needs scores [..., s, s] (queries by keys), got shape {x.shape}")
    if x.shape[-1] == 0:
        raise fail("causal_softmax", f"needs at least one position, got shape {x.shape}")
    return _compute("causal_softmax", [x], x.shape, float_dtype(x.dtype), name=name)
