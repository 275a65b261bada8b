"""Boxing: turning a global tensor from one SBP into another with collectives or local
slices: P->B all-reduce, P->S reduce-scatter, S->B all-gather, S(i)->S(j) all-to-all,
B->S a local slice, B->P the whole on the first device and zeros elsewhere."""

from __future__ import annotations

from .. import ops
from ..errors import GraphError
from .global_tensor import GlobalTensor, local_shape
from .sbp import SBP, B, Broadcast, Partial, Split


def box(x: GlobalTensor, to: SBP) -> GlobalTensor:
    """``x`` with SBP ``to``, same placement and logical value."""
    if isinstance(to, Split):
        if not -x.ndim <= to.axis < x.ndim:
            raise GraphError(f"box: axis {to.axis} is out of range for {x!r}")
        to = Split(to.axis % x.ndim)
        local_shape("box", x.shape, to, len(x.locals))
    frm = x.sbp
    if frm == to:
        return x
    parts = list(x.locals)
    if isinstance(frm, Partial) and isinstance(to, Broadcast):
        new = ops.all_reduce(parts, op="sum")
    elif isinstance(frm, Partial) and isinstance(to, Split):
        new = ops.reduce_scatter(parts, axis=to.axis)
    elif isinstance(frm, Split) and isinstance(to, Broadcast):
        new = ops.all_gather(parts, axis=frm.axis)
    elif isinstance(frm, Split) and isinstance(to, Split):
        new = ops.all_to_all(parts, split_axis=to.axis, concat_axis=frm.axis)
    elif isinstance(frm, Broadcast) and isinstance(to, Split):
        n = len(parts)
        size = x.shape[to.axis] // n
        new = [
            ops.slice(t, [0] * to.axis + [k * size], list(x.shape[: to.axis]) + [(k + 1) * size])
            for k, t in enumerate(parts)
        ]
    elif isinstance(frm, Broadcast) and isinstance(to, Partial):
        new = [parts[0]] + [ops.full(t.shape, 0, t.dtype, t.device) for t in parts[1:]]
    else:
        return box(box(x, B), to)
    return GlobalTensor(x.shape, to, tuple(new))
