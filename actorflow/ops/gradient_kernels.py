"""Kernels of the ops that backward passes use (same contract as ``kernels``)."""

import functools

import numpy as np

from . import cuda_rows
from .kernels import _GELU_C

_GELU_A = 0.044715


def sum_to(ins, outs):
    """Sum ``x`` down to the output's shape: the inverse of numpy broadcasting."""
    x, out = ins[0], outs[0]
    if not isinstance(x, np.ndarray) and cuda_rows.fits_column_sums(x, out):
        cuda_rows.column_sums(x, out)  # a bias's gradient: two CUDA kernels, not CuPy's reduction
        return
    axes, kept = _summed(x.shape, out.shape)
    x.sum(axis=axes, keepdims=True, out=out.reshape(kept))


@functools.cache
def _summed(x: tuple[int, ...], out: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The axes ``sum_to`` sums a tensor of shape ``x`` over, and ``out`` with the summed
    leading axes kept as 1s: worked out once per pair of shapes (4 of a bias gradient's
    5 µs on small arrays)."""
    lead = len(x) - len(out)
    axes = tuple(range(lead)) + tuple(lead + k for k, n in enumerate(out) if n == 1 and x[lead + k] != 1)
    return axes, (1,) * lead + out


def broadcast_to(ins, outs):
    np.copyto(outs[0], ins[0])


def scale(ins, outs, factor):
    np.multiply(ins[0], factor, out=outs[0])


def pad(ins, outs, begin):
    x, out = ins[0], outs[0]
    out.fill(0)
    out[tuple(slice(b, b + n) for b, n in zip(begin, x.shape))] = x


def relu_grad(ins, outs):
    dy, x = ins
    np.multiply(dy, np.greater(x, 0), out=outs[0])


def gelu_grad(ins, outs):
    """dy * d/dx [0.5 x (1 + t)], t = tanh(c (x + a x^3)):
    0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)."""
    dy, x = ins
    out = outs[0]
    x2 = x * x
    t = np.tanh(_GELU_C * x * (1 + _GELU_A * x2))
    np.multiply(x2, 3 * _GELU_A, out=out)
    out += 1
    out *= _GELU_C
    out *= x
    t2 = np.multiply(t, t, out=x2)
    np.subtract(1, t2, out=t2)
    out *= t2
    out += t
    out += 1
    out *= 0.5
    out *= dy


def tanh_grad(ins, outs):
    dy, y = ins
    out = outs[0]
    np.multiply(y, y, out=out)
    np.subtract(1, out, out=out)
    out *= dy


def softmax_grad(ins, outs, axis):
    dy, y = ins
    out = outs[0]
    if not isinstance(dy, np.ndarray) and cuda_rows.fits(dy, axis, y, out):
        cuda_rows.softmax_grad(dy, y, out)
        return
    np.multiply(dy, y, out=out)
    total = out.sum(axis=axis, keepdims=True)
    np.subtract(dy, total, out=out)
    out *= y


def max_grad(ins, outs, axis, keepdims):
    """Ties split evenly: each maximal element gets dy / (number of maximal elements)."""
    dy, x, y = ins
    out = outs[0]
    if not keepdims:
        dy, y = np.expand_dims(dy, axis), np.expand_dims(y, axis)
    np.equal(x, y, out=out)
    count = out.sum(axis=axis, keepdims=True)
    out *= dy / count


def equal_mask(ins, outs):
    np.equal(ins[0], ins[1], out=outs[0])
