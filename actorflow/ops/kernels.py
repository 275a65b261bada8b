"""The kernels behind every op.

A kernel is ``kernel(ins, outs, **attrs)``: it reads the input arrays and writes into the
preallocated output arrays (``out=``), so a run allocates no register memory. Collective
kernels get the inputs and outputs of all participants, in participant order. The Plan
names kernels by import path, so each one is a module-level function.

The same kernels run on a GPU: there the arrays are CuPy's, and numpy's functions and
ufuncs hand them to CuPy's (NEP 18 and 13); where that can't work (making an array,
mixing in a host array, a function CuPy lacks), a kernel asks the arrays for their
namespace (``arrays.namespace``).
"""

import math

import numpy as np

from ..arrays import copy_into, namespace, to_host_soon
from ..errors import KernelError
from . import cuda_matmul, cuda_rows


def matmul(ins, outs, transpose_a=False, transpose_b=False):
    """a @ b, either operand read transposed (a view: BLAS takes it as it is, no copy; on
    a GPU, a batched product through ``cuda_matmul``, which cupy.matmul would copy)."""
    a = ins[0].swapaxes(-1, -2) if transpose_a else ins[0]
    b = ins[1].swapaxes(-1, -2) if transpose_b else ins[1]
    if isinstance(a, np.ndarray):
        np.matmul(a, b, out=outs[0])
    elif (plan := cuda_matmul.fits(a, b, outs[0])) is not None:
        cuda_matmul.matmul(a, b, outs[0], plan)
    else:
        namespace(a).matmul(a, b, out=outs[0])


def add(ins, outs):
    np.add(ins[0], ins[1], out=outs[0])


def sub(ins, outs):
    np.subtract(ins[0], ins[1], out=outs[0])


def mul(ins, outs):
    np.multiply(ins[0], ins[1], out=outs[0])


def div(ins, outs):
    np.divide(ins[0], ins[1], out=outs[0])


def relu(ins, outs):
    np.maximum(ins[0], 0, out=outs[0])


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu(ins, outs):
    """The tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    x, out = ins[0], outs[0]
    np.multiply(x, x, out=out)
    out *= x
    out *= 0.044715
    out += x
    out *= _GELU_C
    np.tanh(out, out=out)
    out += 1
    out *= x
    out *= 0.5


def tanh(ins, outs):
    np.tanh(ins[0], out=outs[0])


def exp(ins, outs):
    np.exp(ins[0], out=outs[0])


def log(ins, outs):
    np.log(ins[0], out=outs[0])


def softmax(ins, outs, axis):
    x, out = ins[0], outs[0]
    if not isinstance(x, np.ndarray) and cuda_rows.fits(x, axis, out):
        cuda_rows.softmax(x, out)  # one CUDA kernel, not four passes
        return
    np.subtract(x, x.max(axis=axis, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)


def reduce_sum(ins, outs, axis, keepdims):
    np.sum(ins[0], axis=axis, keepdims=keepdims, out=outs[0])


def reduce_mean(ins, outs, axis, keepdims):
    np.mean(ins[0], axis=axis, keepdims=keepdims, out=outs[0])


def reduce_max(ins, outs, axis, keepdims):
    np.max(ins[0], axis=axis, keepdims=keepdims, out=outs[0])


def reshape(ins, outs):
    np.copyto(outs[0], ins[0].reshape(outs[0].shape))


def transpose(ins, outs, perm):
    np.copyto(outs[0], ins[0].transpose(perm))


def concat(ins, outs, axis):
    np.concatenate(ins, axis=axis, out=outs[0])


def split(ins, outs, axis):
    start = 0
    for out in outs:
        stop = start + out.shape[axis]
        np.copyto(out, _window(ins[0], start, stop, axis))
        start = stop


def _window(x, start, stop, axis):
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop)
    return x[tuple(index)]


def slice_(ins, outs, begin):
    index = tuple(slice(b, b + n) for b, n in zip(begin, outs[0].shape))
    np.copyto(outs[0], ins[0][index])


def call(ins, outs, fn, grad=None):
    """Run a user's numpy function and check that it returned what the graph promised
    (``grad`` is its gradient function, which ``call_grad`` runs in the backward pass)."""
    _assign(fn, _run(fn, ins), outs[0])


def call_grad(ins, outs, fn, wanted):
    """The gradients of a ``call``'s inputs ``wanted``, one an output: ``fn(*inputs, dout)``
    returns one per input."""
    grads = _run(fn, ins)
    if len(ins) == 2 and not isinstance(grads, (tuple, list)):
        grads = (grads,)
    if not isinstance(grads, (tuple, list)) or len(grads) != len(ins) - 1:
        raise KernelError(
            f"{_name(fn)} returned {type(grads).__name__}, but a gradient function returns "
            f"a tuple of {len(ins) - 1} gradients, one per input of the call"
        )
    for k, out in zip(wanted, outs):
        _assign(fn, grads[k], out)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _run(fn, ins):
    """``fn(*ins)``; a write into an input (a read-only view) becomes a KernelError naming it."""
    try:
        return fn(*ins)
    except ValueError as exc:
        if "read-only" not in str(exc):
            raise
        written = _written(fn, ins)
        which = f"input {written}" if written is not None else "one of its inputs"
        raise KernelError(
            f"{_name(fn)} wrote into {which}: a kernel's inputs are read-only, since other "
            f"readers (and the next run) share them; write into a copy (x = x.copy()) or return a new array",
            input=written,
        ) from exc


def _written(fn, ins) -> int | None:
    """Which input ``fn`` writes into, found by running it again on copies, or None."""
    copies = [x.copy() if isinstance(x, np.ndarray) else x for x in ins]
    try:
        fn(*copies)
    except Exception:
        return None
    changed = [
        k
        for k, (x, c) in enumerate(zip(ins, copies))
        if isinstance(x, np.ndarray) and not np.array_equal(x, c, equal_nan=True)
    ]
    return changed[0] if changed else None


def _assign(fn, result, out) -> None:
    """Write ``fn``'s result into ``out``: an array of the declared shape and dtype, or a
    plain Python value numpy casts to that dtype within its kind (a user kernel on a GPU
    returns a CuPy array)."""
    # a host array for a host output needs no namespace or asarray (a quarter of a no-op
    # call's cost)
    host = result.__class__ is np.ndarray and out.__class__ is np.ndarray
    value = result if host else namespace(out).asarray(result)
    if value.shape == out.shape and value.dtype == out.dtype:
        out[...] = value  # the common case, at half copyto's cost on small arrays
        return
    xp = namespace(out)
    declared = f"{out.dtype}{list(out.shape)}"
    if result is None:
        raise KernelError(f"{_name(fn)} returned None, but the graph declared {declared}")
    if value.shape != out.shape:
        raise KernelError(f"{_name(fn)} returned shape {value.shape}, but the graph declared {declared}")
    if isinstance(result, (np.ndarray, xp.ndarray, np.generic)) or not np.can_cast(
        value.dtype, out.dtype, "same_kind"
    ):
        raise KernelError(
            f"{_name(fn)} returned {value.dtype}, but the graph declared {declared}: "
            f"return {out.dtype} (say .astype(np.{out.dtype})) or declare dtype={str(value.dtype)!r}"
        )
    xp.copyto(out, value, casting="same_kind")


def noop(ins, outs):
    """A variable's act: publishing its buffer takes no work, only a place in stream order."""


def full(ins, outs, value):
    outs[0].fill(value)


def copy(ins, outs):
    """A device-to-device copy, a feed from the host, or the like: one array into another
    (between host and GPU too)."""
    copy_into(outs[0], ins[0])


def fetch(ins, outs):
    """Device-to-host: hand the host a copy it may keep, since the register will be reused
    (from a GPU, into pinned memory, read once the run's work is done)."""
    return to_host_soon(ins[0])


_REDUCERS = {"sum": np.add, "mean": np.add, "max": np.maximum}


def all_reduce(ins, outs, op, across=None):
    """``across``: where the participants span ranks, this rank's participants reduce
    theirs here first, then ``across(acc, op)`` reduces ``acc`` in place with the other
    ranks' (their sum or max; ``across(acc, op, x)`` reduces a lone participant's ``x``
    into ``acc``), and ``across.participants`` counts them all, for a mean."""
    acc = outs[0]
    reduce = _REDUCERS[op]
    if across is not None and len(ins) == 1 and ins[0].dtype == acc.dtype:
        across(acc, op, ins[0])
    else:
        if len(ins) == 1:
            np.copyto(acc, ins[0])
        else:
            reduce(ins[0], ins[1], out=acc, dtype=acc.dtype)
        for x in ins[2:]:
            reduce(acc, x, out=acc)
        if across is not None:
            across(acc, op)
    if op == "mean":
        acc /= len(ins) if across is None else across.participants
    for out in outs[1:]:
        np.copyto(out, acc)


def send(ins, outs, comm, peer, tag):
    """Start sending a register to rank ``peer``; returns the MPI request. A synchronous
    send completes only once the receiver has posted its receive, which it does only
    with a free buffer: so the receiver's quota bounds what is in flight (a control
    register sends an empty message, for the order alone)."""
    return comm.Issend(ins[0] if ins else _NOTHING, dest=peer, tag=tag)


def recv(ins, outs, comm, peer, tag):
    """Start receiving a register from rank ``peer`` into this act's buffer."""
    return comm.Irecv(outs[0] if outs else _NOTHING, source=peer, tag=tag)


_NOTHING = np.zeros(0, np.uint8)


def all_gather(ins, outs, axis):
    np.concatenate(ins, axis=axis, out=outs[0])
    for out in outs[1:]:
        np.copyto(out, outs[0])


def _chunk(x, k, n, axis):
    size = x.shape[axis] // n
    return _window(x, k * size, (k + 1) * size, axis)


def reduce_scatter(ins, outs, axis):
    n = len(ins)
    for k, out in enumerate(outs):
        np.copyto(out, _chunk(ins[0], k, n, axis))
        for x in ins[1:]:
            np.add(out, _chunk(x, k, n, axis), out=out)


def broadcast(ins, outs):
    for out in outs:
        np.copyto(out, ins[0])


def all_to_all(ins, outs, split_axis, concat_axis):
    n = len(ins)
    for k, out in enumerate(outs):
        pieces = [_chunk(x, k, n, split_axis) for x in ins]
        np.concatenate(pieces, axis=concat_axis, out=out)
