"""SBP signatures: for an op on global tensors, which SBP each input takes and what the
output gets. Inputs that don't fit a signature are boxed first (see ``boxing``); the op
then runs on each device's parts. Ops without a rule run on broadcast inputs.

Signatures (S = split, B = broadcast, P = partial sum):
- elementwise: all S(a) -> S(a), all B -> B; a B operand beside an S(a) one is sliced
  (unless it broadcasts along a); add and sub: P, P -> P; mul and div: P with B -> P;
  nonlinear ops box P to B first;
- matmul (of any rank, either operand transposed): a's rows split x B -> S(rows),
  B x b's columns split -> S(columns), S(k) x S(k) on the contracted axis -> P,
  P x B -> P, B x P -> P, both split on one batch axis -> S(it), a batch-split operand
  beside a B one -> S(it) (the B one sliced where it spans that axis); 2-D: S(0) x B ->
  S(0), B x S(1) -> S(1), S(1) x S(0) -> P;
- bias_add: x's SBP with a broadcast bias (sliced along x's split when that is the
  bias's axis; a bias split that way already stays); scale (by a constant) keeps any
  SBP; softmax along an axis other than the split one keeps S;
- causal_softmax: S along a batch or heads axis (not the last two) stays S;
- layer_norm: x split along an axis other than the normalized one, with gamma and beta
  broadcast, stays split;
- embedding: ids S(a) (or B) with the table B -> S(a) (or B); the table S(1) (the
  embedding dim) with ids B -> S(last); the table P with ids B -> P (the lookup is linear
  in the table); a vocab-split table S(0) is gathered to B first;
- sum and mean over the split axis: S -> P (a mean scaled by 1/n); over other axes S
  stays S; P stays P; max boxes P and split-axis S to B;
- losses with the batch split, S(0) x S(0): P (each device's mean scaled by 1/n);
- reshape: S(a) -> S(b) where the split dim keeps its leading elements (else B first);
  transpose: S(a) -> S(perm.index(a)); both keep P and B;
- to_device onto as many devices: part k goes to the k-th, the SBP stays.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import ops
from ..errors import GraphError
from ..graph.dispatch import register
from ..graph.ir import Tensor
from .boxing import box
from .global_tensor import GlobalTensor
from .program import Pending, flat, map_tensors, record_call
from .sbp import SBP, B, Broadcast, P, Partial, S, Split

Rule = Callable[[Callable, tuple, dict], Any]


def dispatch(op: Callable, args: tuple, kwargs: dict) -> Any:
    """Expand ``op`` on global tensors by its signature (recorded in ``Graph.program``);
    with a tensor whose SBP the compiler will choose, only record it."""
    values = flat((args, kwargs))
    if any(isinstance(v, Pending) for v in values):
        return record_call(op, args, kwargs)
    name = op.__name__
    args, kwargs = _positional(op, args, kwargs)
    placements = {v.devices for v in values if isinstance(v, GlobalTensor)}
    if len(placements) > 1:
        raise GraphError(f"{name}: global tensors on different placements {sorted(placements)}")
    if any(isinstance(v, Tensor) for v in values):
        raise GraphError(f"{name}: mixes tensors on one device with tensors on several")
    return record_call(op, args, kwargs, _RULES.get(name, _on_broadcast)(op, args, kwargs))


def _positional(op: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Every argument that can go by position goes by position (defaults filled in), so
    rules can unpack tensors from args; keyword-only options stay keywords."""
    bound = _signature(op).bind(*args, **kwargs)
    bound.apply_defaults()
    options = {k: v for k, v in bound.kwargs.items() if not (k == "name" and v is None)}
    return bound.args, options


_signature = functools.cache(inspect.signature)


def _run(op: Callable, args: tuple, kwargs: dict, sbp: SBP) -> Any:
    """Apply ``op`` on each device's parts; the result(s) get ``sbp``."""
    first = next(v for v in flat((args, kwargs)) if isinstance(v, GlobalTensor))
    results = []
    for k, device in enumerate(first.devices):
        part = functools.partial(_part, k=k)
        local_kwargs = map_tensors(kwargs, part)
        if local_kwargs.get("name") is not None:
            local_kwargs["name"] = f"{local_kwargs['name']}[{device}]"
        results.append(op(*map_tensors(args, part), **local_kwargs))
    if isinstance(results[0], list):
        return [_wrap([r[j] for r in results], sbp) for j in range(len(results[0]))]
    return _wrap(results, sbp)


def _part(tensor: GlobalTensor, k: int) -> Tensor:
    """Device k's part of a global tensor."""
    return tensor.locals[k]


def _wrap(parts: Sequence[Tensor], sbp: SBP) -> GlobalTensor:
    shape = list(parts[0].shape)
    if isinstance(sbp, Split):
        shape[sbp.axis] *= len(parts)
    return GlobalTensor(tuple(shape), sbp, tuple(parts))


def _on_broadcast(op: Callable, args: tuple, kwargs: dict) -> Any:
    def boxed(v: Any) -> Any:
        if isinstance(v, GlobalTensor):
            return box(v, B)
        if isinstance(v, (list, tuple)):
            return type(v)(boxed(u) for u in v)
        return v

    return _run(op, tuple(boxed(a) for a in args), {k: boxed(v) for k, v in kwargs.items()}, B)


def _pointwise(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    (x, *rest) = args
    if isinstance(x.sbp, Partial):
        x = box(x, B)
    return _run(op, (x, *rest), kwargs, x.sbp)


def _split_axis_of(ndim: int, other_shape: tuple[int, ...], axis: int) -> int | None:
    """The axis of a tensor of ``other_shape`` that lines up with ``axis`` of an
    ``ndim``-dim result under numpy broadcasting, or None if it broadcasts along it."""
    k = axis - (ndim - len(other_shape))
    if k < 0 or other_shape[k] == 1:
        return None
    return k


def _binary(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    a, b = args[:2]
    linear = op.__name__ in ("add", "sub")
    scaling = op.__name__ in ("mul", "div")
    if isinstance(a.sbp, Partial) and isinstance(b.sbp, Partial) and linear:
        return _run(op, args, kwargs, P)
    if scaling and isinstance(a.sbp, Partial) and isinstance(b.sbp, Broadcast):
        return _run(op, args, kwargs, P)
    if op.__name__ == "mul" and isinstance(b.sbp, Partial) and isinstance(a.sbp, Broadcast):
        return _run(op, args, kwargs, P)
    a = box(a, B) if isinstance(a.sbp, Partial) else a
    b = box(b, B) if isinstance(b.sbp, Partial) else b
    out_ndim = max(a.ndim, b.ndim)
    if isinstance(a.sbp, Split) and isinstance(b.sbp, Split):
        axis = a.sbp.axis + out_ndim - a.ndim
        if axis == b.sbp.axis + out_ndim - b.ndim:
            return _run(op, (a, b, *args[2:]), kwargs, S(axis))
        b = box(b, B)
    if a.sbp == b.sbp:
        return _run(op, (a, b, *args[2:]), kwargs, a.sbp)
    split = a if isinstance(a.sbp, Split) else b
    other = b if split is a else a
    assert isinstance(split.sbp, Split), "of two different SBPs, neither partial, one is a split"
    axis = split.sbp.axis + (out_ndim - split.ndim)
    if isinstance(other.sbp, Broadcast):
        k = _split_axis_of(out_ndim, other.shape, axis)
        if k is not None:
            other = box(other, S(k))
        pair = (split, other) if split is a else (other, split)
        return _run(op, (*pair, *args[2:]), kwargs, S(axis))
    return _run(op, (box(a, B), box(b, B), *args[2:]), kwargs, B)


def _matmul_role(x: GlobalTensor, out_ndim: int, transposed: bool, left: bool) -> int | str | None:
    """What ``x``'s split axis is to the product: an output batch axis (an int), "m" or
    "n" (the product's rows or columns), "k" (contracted), or None if x is not split."""
    if not isinstance(x.sbp, Split):
        return None
    axis = x.sbp.axis
    if axis < x.ndim - 2:
        return axis + out_ndim - x.ndim
    last_is_k = left != transposed  # a is [..., m, k], b [..., k, n], unless transposed
    return "k" if (axis == x.ndim - 1) == last_is_k else ("m" if left else "n")


def _matmul(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    """Split batch dims line up (heads split, Megatron attention): S(j) x S(j) -> S(j),
    and a split operand beside a broadcast one keeps its split when it is a batch axis,
    a's rows or b's columns; the other operand is sliced along a batch axis it spans.
    Both split along k: P. A partial operand beside a broadcast one: P."""
    a, b = args
    if isinstance(a.sbp, Partial) or isinstance(b.sbp, Partial):
        if (a.sbp, b.sbp) in ((P, B), (B, P)):
            return _run(op, args, kwargs, P)
        a = box(a, B) if isinstance(a.sbp, Partial) else a
        b = box(b, B) if isinstance(b.sbp, Partial) else b
    out_ndim = max(a.ndim, b.ndim)
    ra = _matmul_role(a, out_ndim, bool(kwargs.get("transpose_a")), left=True)
    rb = _matmul_role(b, out_ndim, bool(kwargs.get("transpose_b")), left=False)
    if ra == rb == "k":
        return _run(op, (a, b), kwargs, P)
    if isinstance(ra, int) and ra == rb:
        return _run(op, (a, b), kwargs, S(ra))
    if ra is not None and ra not in ("k", "n"):
        return _run(op, (a, _matmul_fit(b, ra, out_ndim)), kwargs, _matmul_sbp(ra, out_ndim))
    if rb is not None and rb not in ("k", "m"):
        return _run(op, (_matmul_fit(a, rb, out_ndim), b), kwargs, _matmul_sbp(rb, out_ndim))
    return _run(op, (box(a, B), box(b, B)), kwargs, B)


def _matmul_sbp(role: int | str, out_ndim: int) -> SBP:
    return S(role if isinstance(role, int) else out_ndim - (2 if role == "m" else 1))


def _matmul_fit(other: GlobalTensor, role: int | str, out_ndim: int) -> GlobalTensor:
    """The operand beside a kept split: sliced along that batch axis if it spans it,
    else whole."""
    if isinstance(role, int):
        k = _split_axis_of(out_ndim, other.shape, role)
        if k is not None:
            return box(other, S(k))
    return box(other, B)


def _bias_add(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    x, bias = args
    x = box(x, B) if isinstance(x.sbp, Partial) else x
    k = _split_axis_of(x.ndim, bias.shape, x.sbp.axis) if isinstance(x.sbp, Split) else None
    return _run(op, (x, box(bias, B if k is None else S(k))), kwargs, x.sbp)


def _linear(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    return _run(op, args, kwargs, args[0].sbp)


def _softmax(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    x, axis = args[0], args[1] % args[0].ndim
    if isinstance(x.sbp, Partial) or x.sbp == S(axis):
        x = box(x, B)
    return _run(op, (x, *args[1:]), kwargs, x.sbp)


def _layer_norm(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    x, gamma, beta, axis = args[:4]
    if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        return _on_broadcast(op, args, kwargs)  # the op names the bad axis
    if isinstance(x.sbp, Partial) or x.sbp == S(axis % x.ndim):
        x = box(x, B)
    return _run(op, (x, box(gamma, B), box(beta, B), *args[3:]), kwargs, x.sbp)


def _causal_softmax(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    (x,) = args
    if not (isinstance(x.sbp, Split) and x.sbp.axis < x.ndim - 2):
        x = box(x, B)
    return _run(op, (x,), kwargs, x.sbp)


def _embedding(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    ids, table = args
    if isinstance(table.sbp, Partial):
        return _run(op, (box(ids, B), table), kwargs, P)
    if table.sbp == S(1):
        return _run(op, (box(ids, B), table), kwargs, S(ids.ndim))
    ids = box(ids, B) if isinstance(ids.sbp, Partial) else ids
    return _run(op, (ids, box(table, B)), kwargs, ids.sbp)


def _reduce(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    x, axis, keepdims = args[:3]
    axes = (
        set(range(x.ndim))
        if axis is None
        else {a % x.ndim for a in (axis if isinstance(axis, (tuple, list)) else (axis,))}
    )
    is_max = op.__name__ == "reduce_max"
    if isinstance(x.sbp, Partial):
        if is_max:
            return _reduce(op, (box(x, B), *args[1:]), kwargs)
        return _run(op, args, kwargs, P)
    if isinstance(x.sbp, Broadcast):
        return _run(op, args, kwargs, B)
    split = x.sbp.axis
    if split not in axes:
        shift = 0 if keepdims else sum(a < split for a in axes)
        return _run(op, args, kwargs, S(split - shift))
    if is_max:
        return _reduce(op, (box(x, B), *args[1:]), kwargs)
    out = _run(op, args, kwargs, P)
    if op.__name__ == "reduce_mean":
        out = _run(ops.scale, (out, 1.0 / len(x.locals)), {}, P)
    return out


def _batch_loss(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    a, b = args
    if a.sbp == S(0) and b.sbp == S(0):
        partial = _run(op, args, kwargs, P)
        return _run(ops.scale, (partial, 1.0 / len(a.locals)), {}, P)
    return _run(op, (box(a, B), box(b, B)), kwargs, B)


def _reshape(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    """P and B stay; S(a) becomes S(b) for the first output axis b whose leading dims
    hold as many elements as the input's before a and that the devices divide: each
    device's part is then a contiguous run of every leading index, on both sides
    (heads split after a column-split projection: [n, h*d] S(1) -> [n, h, d] S(1))."""
    x, shape = args[0], args[1]
    if not isinstance(x.sbp, Split):
        return _run(op, args, kwargs, x.sbp)
    new = np.empty(x.shape, dtype=np.bool_).reshape(tuple(shape)).shape
    n, lead = len(x.locals), int(np.prod(x.shape[: x.sbp.axis], dtype=np.int64))
    for b in range(len(new)):
        if int(np.prod(new[:b], dtype=np.int64)) == lead and new[b] % n == 0:
            local = list(new)
            local[b] //= n
            return _run(op, (x, tuple(local), *args[2:]), kwargs, S(b))
    return _run(op, (box(x, B), *args[1:]), kwargs, B)


def _transpose(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    x, perm = args[0], args[1]
    perm = tuple(reversed(range(x.ndim))) if perm is None else tuple(p % x.ndim for p in perm)
    sbp = S(perm.index(x.sbp.axis)) if isinstance(x.sbp, Split) else x.sbp
    return _run(op, (x, perm, *args[2:]), kwargs, sbp)


def _to_device(op: Callable, args: tuple, kwargs: dict) -> GlobalTensor:
    x, device = args
    devices = [device] if isinstance(device, str) else list(device)
    if len(devices) != len(x.locals):
        raise GraphError(
            f"to_device: a tensor on {len(x.locals)} devices moves to a list of {len(x.locals)} "
            f"devices (part k to the k-th), got {device!r}"
        )
    parts = []
    for part, d in zip(x.locals, devices):
        name = kwargs.get("name")
        parts.append(op(part, d, name=None if name is None else f"{name}[{d}]"))
    return GlobalTensor(x.shape, x.sbp, tuple(parts))


_RULES: dict[str, Rule] = {
    **{name: _pointwise for name in ("relu", "gelu", "tanh", "exp", "log")},
    **{name: _binary for name in ("add", "sub", "mul", "div")},
    "matmul": _matmul,
    "bias_add": _bias_add,
    "softmax": _softmax,
    "causal_softmax": _causal_softmax,
    "layer_norm": _layer_norm,
    "embedding": _embedding,
    "reduce_sum": _reduce,
    "reduce_mean": _reduce,
    "reduce_max": _reduce,
    "mse_loss": _batch_loss,
    "softmax_cross_entropy": _batch_loss,
    "to_device": _to_device,
    "scale": _linear,
    "reshape": _reshape,
    "transpose": _transpose,
}

register(GlobalTensor, dispatch)
