"""The gradient rules of the ops (see ``registry`` for the contract).

``max`` (and ``all_reduce`` with op="max") sends each gradient element to the maximal
input elements, split evenly among them when several tie.
"""

from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..errors import GraphError
from ..graph.builder import is_float
from .registry import rule


def _zeros_for_none(douts, outs):
    """The output gradients, with zeros where an output got none."""
    return [d if d is not None else ops.full(t.shape, 0.0, t.dtype, t.device) for d, t in zip(douts, outs)]


# -- elementwise -------------------------------------------------------------------------


@rule("add")
def _add(node, ins, outs, douts):
    (d,) = douts
    return [ops.sum_to(d, ins[0].shape), ops.sum_to(d, ins[1].shape)]


@rule("sub")
def _sub(node, ins, outs, douts):
    (d,) = douts
    return [ops.sum_to(d, ins[0].shape), ops.scale(ops.sum_to(d, ins[1].shape), -1.0)]


@rule("mul")
def _mul(node, ins, outs, douts):
    (d,) = douts
    a, b = ins
    return [ops.sum_to(ops.mul(d, b), a.shape), ops.sum_to(ops.mul(d, a), b.shape)]


@rule("div")
def _div(node, ins, outs, douts):
    # y = a / b: da = d / b, db = -d a / b**2 = -(d / b) * y
    (d,) = douts
    a, b = ins
    d_over_b = ops.div(d, b)
    db = ops.scale(ops.sum_to(ops.mul(d_over_b, outs[0]), b.shape), -1.0)
    return [ops.sum_to(d_over_b, a.shape), db]


@rule("bias_add")
def _bias_add(node, ins, outs, douts):
    (d,) = douts
    return [d, ops.sum_to(d, ins[1].shape)]


@rule("relu")
def _relu(node, ins, outs, douts):
    return [ops.relu_grad(douts[0], ins[0])]


@rule("gelu")
def _gelu(node, ins, outs, douts):
    return [ops.gelu_grad(douts[0], ins[0])]


@rule("tanh")
def _tanh(node, ins, outs, douts):
    return [ops.tanh_grad(douts[0], outs[0])]


@rule("exp")
def _exp(node, ins, outs, douts):
    return [ops.mul(douts[0], outs[0])]


@rule("log")
def _log(node, ins, outs, douts):
    return [ops.div(douts[0], ins[0])]


@rule("softmax")
def _softmax(node, ins, outs, douts):
    return [ops.softmax_grad(douts[0], outs[0], node.attrs["axis"])]


# -- matmul and reductions ---------------------------------------------------------------


@rule("matmul")
def _matmul(node, ins, outs, douts):
    # C = op(A) op(B), op a transpose where flagged; the gradients read operands
    # transposed in place (no copy). Batch dims broadcast: the products have the output's
    # batch dims, sum_to folds the broadcast ones back.
    (d,) = douts
    a, b = ins
    ta, tb = node.attrs.get("transpose_a", False), node.attrs.get("transpose_b", False)
    if not ta:
        da = ops.matmul(d, b, transpose_b=not tb)
    else:
        da = ops.matmul(b, d, transpose_a=tb, transpose_b=True)
    if not tb:
        db = ops.matmul(a, d, transpose_a=not ta)
    else:
        db = ops.matmul(d, a, transpose_a=True, transpose_b=ta)
    return [ops.sum_to(da, a.shape), ops.sum_to(db, b.shape)]


def _expand(d, x, axes, keepdims):
    """The reduced gradient ``d`` broadcast back over the reduced ``axes`` of x."""
    kept = tuple(1 if k in axes else n for k, n in enumerate(x.shape))
    if not keepdims and d.shape != kept:
        d = ops.reshape(d, kept)
    return ops.broadcast_to(d, x.shape)


@rule("sum")
def _sum(node, ins, outs, douts):
    return [_expand(douts[0], ins[0], node.attrs["axis"], node.attrs["keepdims"])]


@rule("mean")
def _mean(node, ins, outs, douts):
    (x,), axes = ins, node.attrs["axis"]
    count = math.prod(x.shape[k] for k in axes)
    d = ops.scale(douts[0], 1.0 / max(count, 1))
    return [_expand(d, x, axes, node.attrs["keepdims"])]


@rule("max")
def _max(node, ins, outs, douts):
    return [ops.max_grad(douts[0], ins[0], outs[0], node.attrs["axis"], node.attrs["keepdims"])]


# -- shapes ------------------------------------------------------------------------------


@rule("reshape")
def _reshape(node, ins, outs, douts):
    return [ops.reshape(douts[0], ins[0].shape)]


@rule("transpose")
def _transpose(node, ins, outs, douts):
    inverse = tuple(int(k) for k in np.argsort(node.attrs["perm"]))
    return [ops.transpose(douts[0], inverse)]


@rule("concat")
def _concat(node, ins, outs, douts):
    axis = node.attrs["axis"]
    return list(ops.split(douts[0], [t.shape[axis] for t in ins], axis))


@rule("split")
def _split(node, ins, outs, douts):
    return [ops.concat(_zeros_for_none(douts, outs), node.attrs["axis"])]


@rule("slice")
def _slice(node, ins, outs, douts):
    return [ops.pad(douts[0], node.attrs["begin"], ins[0].shape)]


@rule("scale")
def _scale(node, ins, outs, douts):
    return [ops.scale(douts[0], node.attrs["factor"])]


@rule("call")
def _call(node, ins, outs, douts):
    grad = node.attrs.get("grad")
    if grad is None:
        raise GraphError(
            f"gradients: af.ops.call {node.name!r} (built at {node.where}) has no gradient: "
            "give it grad=fn_grad, fn_grad(*inputs, dout) returning one gradient per input"
        )
    wanted = [k for k, x in enumerate(ins) if is_float(x.dtype)]
    grads = dict(zip(wanted, ops.call_grad(grad, ins, douts[0], wanted)))
    return [grads.get(k) for k in range(len(ins))]


@rule("full")
def _full(node, ins, outs, douts):
    return []


@rule("copy")  # to_device
def _copy(node, ins, outs, douts):
    return [ops.to_device(douts[0], ins[0].device)]


# -- collectives -------------------------------------------------------------------------


@rule("all_reduce")
def _all_reduce(node, ins, outs, douts):
    ds = _zeros_for_none(douts, outs)
    op = node.attrs["op"]
    if op != "max":
        return ops.all_reduce(ds, op)  # sum: every input gets sum(ds); mean: mean(ds)
    # max: the summed gradient goes to the devices holding the maximum, split evenly.
    total = ops.all_reduce(ds, "sum")
    masks = [ops.equal_mask(x, y) for x, y in zip(ins, outs)]
    counts = ops.all_reduce(masks, "sum")
    return [ops.mul(t, ops.div(m, c)) for t, m, c in zip(total, masks, counts)]


@rule("all_gather")
def _all_gather(node, ins, outs, douts):
    # Input k is chunk k of every result: its gradient is the sum over devices of chunk k.
    return ops.reduce_scatter(_zeros_for_none(douts, outs), node.attrs["axis"])


@rule("reduce_scatter")
def _reduce_scatter(node, ins, outs, douts):
    # Chunk k of every input went (summed) into result k: each input gets all the results.
    return ops.all_gather(_zeros_for_none(douts, outs), node.attrs["axis"])


@rule("broadcast")
def _broadcast(node, ins, outs, douts):
    (x,) = ins
    parts = [ops.to_device(d, x.device) for d in douts if d is not None]
    total = parts[0]
    for part in parts[1:]:
        total = ops.add(total, part)
    return [total]


@rule("all_to_all")
def _all_to_all(node, ins, outs, douts):
    # The inverse exchange: split where the forward concatenated, concatenate where it split.
    split_axis, concat_axis = node.attrs["split_axis"], node.attrs["concat_axis"]
    return ops.all_to_all(_zeros_for_none(douts, outs), split_axis=concat_axis, concat_axis=split_axis)


# -- transformer ops ---------------------------------------------------------------------


@rule("embedding")
def _embedding(node, ins, outs, douts):
    ids, table = ins
    return [None, ops.embedding_grad(douts[0], ids, table.shape[0])]


@rule("layer_norm")
def _layer_norm(node, ins, outs, douts):
    x, gamma, _ = ins
    return list(ops.layer_norm_grad(douts[0], x, gamma, node.attrs["axis"], node.attrs["eps"]))


@rule("causal_softmax")
def _causal_softmax(node, ins, outs, douts):
    # The masked probabilities are exactly 0, so softmax's gradient gives them none.
    return [ops.softmax_grad(douts[0], outs[0], -1)]


# -- losses ------------------------------------------------------------------------------


@rule("mse_loss")
def _mse_loss(node, ins, outs, douts):
    pred, target = ins
    dpred = ops.mse_loss_grad(douts[0], pred, target)
    return [dpred, ops.scale(dpred, -1.0)]


@rule("softmax_cross_entropy")
def _softmax_cross_entropy(node, ins, outs, douts):
    logits, labels = ins
    return [ops.softmax_cross_entropy_grad(douts[0], logits, labels), None]


# -- parameter servers -------------------------------------------------------------------


@rule("snapshot")
def _snapshot(node, ins, outs, douts):
    """An async pull's gradient is its worker's, which an update of its own takes
    (``optim.update_as_arriving``): none flows on into the parameter."""
    return [None, None]
