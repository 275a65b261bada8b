"""Kernels of the transformer ops and their backward ops (same contract as ``kernels``)."""

import functools
from collections.abc import Callable

import numpy as np

from ..arrays import namespace
from . import cuda_habits, cuda_rows, gradient_kernels
from .chain import Part, chain
from .kernels import softmax


def _check_ids(ids, vocab):
    """On the host only: on a GPU the check would make the host wait for the ids."""
    if ids.size and isinstance(ids, np.ndarray) and (ids.min() < 0 or ids.max() >= vocab):
        bad = ids[(ids < 0) | (ids >= vocab)]
        raise ValueError(f"embedding: ids must be rows of the table, in [0, {vocab}), got {bad[:5].tolist()}")


def embedding(ins, outs):
    """Row ``ids[...]`` of the table at each position (ids checked first, so the gather
    itself need not check, nor buffer its output)."""
    ids, table = ins
    _check_ids(ids, table.shape[0])
    if isinstance(table, np.ndarray):
        np.take(table, ids, axis=0, out=outs[0], mode="clip")
    elif table.dtype == np.float32 and table.ndim == 2:  # ids clipped, int32 indexes where they fit
        cuda_habits.gather_rows(ins, outs)
    else:  # CuPy's take has no mode: ids out of range wrap
        namespace(table).take(table, ids, axis=0, out=outs[0])


def embedding_grad(ins, outs):
    """The table's gradient: each position's dy added into its id's row (ids repeat)."""
    dy, ids = ins
    out = outs[0]
    _check_ids(ids, out.shape[0])
    out.fill(0)
    namespace(out).add.at(out, ids.reshape(-1), dy.reshape(-1, out.shape[1]))


def _along(v, axis, ndim):
    """A 1-D ``v`` shaped to broadcast along ``axis`` of an ``ndim``-dim tensor."""
    return v.reshape([-1 if k == axis else 1 for k in range(ndim)])


def _normalize(x, axis, eps, out):
    """(x - mean) / sqrt(var + eps) along ``axis`` into ``out``; returns 1 / sqrt(var + eps)."""
    np.subtract(x, x.mean(axis=axis, keepdims=True), out=out)
    rstd = np.mean(np.square(out), axis=axis, keepdims=True)
    rstd += eps
    np.sqrt(rstd, out=rstd)
    np.reciprocal(rstd, out=rstd)
    out *= rstd
    return rstd


def layer_norm(ins, outs, axis, eps):
    x, gamma, beta = ins
    out = outs[0]
    if not isinstance(x, np.ndarray) and cuda_rows.fits(x, axis, gamma, beta, out):
        cuda_rows.layer_norm(x, gamma, beta, out, eps)  # one CUDA kernel, not ten passes
        return
    _normalize(x, axis, eps, out)
    out *= _along(gamma, axis, x.ndim)
    out += _along(beta, axis, x.ndim)


def layer_norm_grad(ins, outs, axis, eps):
    """With xhat the normalized x and g = dy * gamma (the statistics recomputed from x):
    dx = rstd (g - mean(g) - xhat mean(g xhat)), dgamma = sum(dy xhat), dbeta = sum(dy),
    means along ``axis``, sums over the other axes."""
    dy, x, gamma = ins
    dx, dgamma, dbeta = outs
    if not isinstance(x, np.ndarray) and cuda_rows.fits(x, axis, dy, gamma, dx, dgamma, dbeta):
        cuda_rows.layer_norm_grad(dy, x, gamma, dx, dgamma, dbeta, eps)  # three CUDA kernels
        return
    others = tuple(k for k in range(x.ndim) if k != axis)
    gamma = _along(gamma, axis, x.ndim)
    xhat = np.empty_like(x)
    rstd = _normalize(x, axis, eps, xhat)
    t = np.multiply(dy, xhat)
    np.sum(t, axis=others, out=dgamma)
    np.sum(dy, axis=others, out=dbeta)
    t *= gamma
    mean_g_xhat = t.mean(axis=axis, keepdims=True)
    np.multiply(dy, gamma, out=dx)
    dx -= dx.mean(axis=axis, keepdims=True)
    xhat *= mean_g_xhat
    dx -= xhat
    dx *= rstd


@functools.cache
def _future(xp, s, device=None):
    """True where key j comes after query i (j > i): what row i may not see (made once
    per array module, size and GPU; on a GPU, done before other streams read it)."""
    mask = xp.triu(xp.ones((s, s), dtype=np.bool_), k=1)
    if xp is np:
        mask.flags.writeable = False
    else:
        xp.cuda.get_current_stream().synchronize()
    return mask


def causal_softmax(ins, outs):
    """Softmax along the last axis with the future masked to -inf: exp gives exact zeros
    there, and the diagonal keeps every row's maximum finite."""
    out = outs[0]
    if not isinstance(out, np.ndarray) and cuda_rows.fits(ins[0], -1, out):
        cuda_rows.causal_softmax(ins[0], out)  # one CUDA kernel: the mask is the row's length
        return
    np.copyto(out, ins[0])
    xp = namespace(out)
    np.copyto(out, -np.inf, where=_future(xp, out.shape[-1], None if xp is np else out.device.id))
    softmax([out], [out], axis=-1)


def scaled_softmax(ins, outs, parts):
    """``parts``, a scale and then a softmax along the last axis (or ``causal_softmax``)
    of its output, as one part of a chain (``compiler.chains.cuda_chains``): on a GPU, one
    kernel that scales each element as it reads it, so the scaled scores (``outs[0]``,
    which nothing else reads) are neither written nor read back; else the two parts."""
    x, out = ins[0], outs[1]
    factor, causal = parts[0][1]["factor"], parts[1][0] is causal_softmax
    if not isinstance(x, np.ndarray) and cuda_rows.fits(x, -1, out):
        (cuda_rows.causal_softmax if causal else cuda_rows.softmax)(x, out, factor)
        return
    chain(ins, outs, parts)


def scaled_softmax_grad(ins, outs, parts):
    """``parts``, a ``softmax_grad`` along the last axis and then a scale of its output,
    as one part of a chain: on a GPU, one kernel that scales each result as it writes
    it, so the unscaled gradient (``outs[0]``, which nothing else reads) is never
    written; else the two parts."""
    dy, y = ins
    axis, factor = parts[0][1]["axis"], parts[1][1]["factor"]
    if not isinstance(dy, np.ndarray) and cuda_rows.fits(dy, axis, y, outs[1]):
        cuda_rows.softmax_grad(dy, y, outs[1], factor)
        return
    chain(ins, outs, parts)


def scaled_kernel(first: Part, second: Part, ndim: int) -> Callable | None:
    """The one part's kernel for chain parts ``first`` then ``second`` where they are a
    scale and a softmax along the last axis of an ``ndim``-dimensional array
    (``scaled_softmax``), or a softmax gradient along it and a scale
    (``scaled_softmax_grad``); else None."""
    last = (-1, ndim - 1)
    if first[0] is gradient_kernels.scale and (
        second[0] is causal_softmax or (second[0] is softmax and second[1]["axis"] in last)
    ):
        return scaled_softmax
    if (
        first[0] is gradient_kernels.softmax_grad
        and first[1]["axis"] in last
        and second[0] is gradient_kernels.scale
    ):
        return scaled_softmax_grad
    return None
