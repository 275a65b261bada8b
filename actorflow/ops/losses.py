"""Loss ops: a scalar (shape ()) per batch, with the ops their gradients are built from."""

from __future__ import annotations

import numpy as np

from ..graph.builder import check_inputs, fail, is_float
from ..graph.dispatch import dispatchable
from ..graph.ir import Tensor
from . import loss_kernels
from .compute import _compute
from .registry import register

register("mse_loss", "compute", loss_kernels.mse_loss)
register("mse_loss_grad", "compute", loss_kernels.mse_loss_grad)
register("softmax_cross_entropy", "compute", loss_kernels.softmax_cross_entropy)
register("softmax_cross_entropy_grad", "compute", loss_kernels.softmax_cross_entropy_grad)


def _is_int(dtype: str) -> bool:
    return np.issubdtype(np.dtype(dtype), np.integer)


def _check_mse(op: str, pred: Tensor, target: Tensor) -> None:
    if pred.shape != target.shape:
        raise fail(op, f"pred {pred.shape} and target {target.shape} differ in shape")
    if pred.dtype != target.dtype:
        raise fail(op, f"pred is {pred.dtype}, target is {target.dtype}")
    if not is_float(pred.dtype):
        raise fail(op, f"needs floating-point tensors, got {pred.dtype}")
    if 0 in pred.shape:
        raise fail(op, f"the mean over an empty tensor {pred.shape} is undefined")


def _check_dy(op: str, dy: Tensor, like: Tensor) -> None:
    if dy.shape != () or dy.dtype != like.dtype:
        raise fail(op, f"dy must be a scalar {like.dtype}, got {dy.dtype}{list(dy.shape)}")


@dispatchable
def mse_loss(pred: Tensor, target: Tensor, *, name: str | None = None) -> Tensor:
    """mean((pred - target) ** 2) over all elements: a scalar of pred's dtype."""
    check_inputs("mse_loss", [pred, target])
    _check_mse("mse_loss", pred, target)
    return _compute("mse_loss", [pred, target], (), name=name)


def mse_loss_grad(dy: Tensor, pred: Tensor, target: Tensor, *, name: str | None = None) -> Tensor:
    """d mse_loss / d pred, times the scalar ``dy``: 2 (pred - target) dy / size."""
    check_inputs("mse_loss_grad", [dy, pred, target])
    _check_mse("mse_loss_grad", pred, target)
    _check_dy("mse_loss_grad", dy, pred)
    return _compute("mse_loss_grad", [dy, pred, target], pred.shape, name=name)


def _check_cross_entropy(op: str, logits: Tensor, labels: Tensor) -> None:
    if logits.ndim != 2:
        raise fail(op, f"logits must be (N, C), got shape {logits.shape}")
    if not is_float(logits.dtype):
        raise fail(op, f"logits must be floating-point, got {logits.dtype}")
    if labels.ndim != 1 or labels.shape[0] != logits.shape[0]:
        raise fail(
            op,
            f"labels must be ({logits.shape[0]},), one class id per row of the logits "
            f"{logits.shape}, got shape {labels.shape}",
        )
    if not _is_int(labels.dtype):
        raise fail(op, f"labels must be integer class ids, got {labels.dtype}")
    if 0 in logits.shape:
        raise fail(op, f"needs at least one example and one class, got logits {logits.shape}")


@dispatchable
def softmax_cross_entropy(logits: Tensor, labels: Tensor, *, name: str | None = None) -> Tensor:
    """mean over rows n of -log softmax(logits[n])[labels[n]]: a scalar of the logits'
    dtype, computed with log-sum-exp. ``logits`` (N, C) float, ``labels`` (N,) integer ids
    in [0, C) (others raise ValueError when the op runs)."""
    check_inputs("softmax_cross_entropy", [logits, labels])
    _check_cross_entropy("softmax_cross_entropy", logits, labels)
    return _compute("softmax_cross_entropy", [logits, labels], (), logits.dtype, name=name)


def softmax_cross_entropy_grad(
    dy: Tensor, logits: Tensor, labels: Tensor, *, name: str | None = None
) -> Tensor:
    """d softmax_cross_entropy / d logits, times the scalar ``dy``:
    (softmax(logits) - onehot(labels)) dy / N."""
    op = "softmax_cross_entropy_grad"
    check_inputs(op, [dy, logits, labels])
    _check_cross_entropy(op, logits, labels)
    _check_dy(op, dy, logits)
    return _compute(op, [dy, logits, labels], logits.shape, logits.dtype, name=name)
