"""The gradient rules of the ops (see ``registry`` for the contract)."""

from __future__ import annotations

from .. import ops
from .registry import rule


@rule("add")
def _add(node, ins, outs, douts):
    (d,) = douts
    return [ops.sum_to(d, ins[0].shape), ops.sum_to(d, ins[1].shape)]


@rule("matmul")
def _matmul(node, ins, outs, douts):
    (d,) = douts
    a, b = ins
    da = ops.matmul(d, ops.transpose(b, _swap_last(b.ndim)))
    db = ops.matmul(ops.transpose(a, _swap_last(a.ndim)), d)
    return [ops.sum_to(da, a.shape), ops.sum_to(db, b.shape)]


@rule("relu")
def _relu(node, ins, outs, douts):
    return [ops.relu_grad(douts[0], ins[0])]


def _swap_last(ndim: int) -> tuple[int, ...]:
    return (*range(ndim - 2), ndim - 1, ndim - 2)
