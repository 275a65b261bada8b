"""Batched matmul on CuPy arrays as one cuBLAS call that reads its operands where they lie.

For operands of more than two dimensions, ``cupy.matmul`` makes both C-contiguous first
(``ascontiguousarray``) and then calls cuBLAS with neither one transposed, so an operand
that ``kernels.matmul`` reads transposed (``transpose_a``/``transpose_b``: a ``swapaxes``
view) is copied whole before every product: in the transformer's attention backward,
dS^T Q and P^T dO each copy a [batch, heads, seq, seq] array first. cuBLAS takes a
transposed matrix as it is (its ``transa``/``transb``) and a stack of matrices a fixed
stride apart as one batch, which is what PyTorch hands it, so such a product needs no copy.

``gemm`` decides, from shapes and strides alone (numpy's and CuPy's arrays describe
themselves alike), whether ``a @ b`` into ``out`` is one strided-batched GEMM, and with
which arguments; ``fits`` adds what only the arrays know (CuPy arrays of one dtype cuBLAS
multiplies, the output apart from the inputs); ``matmul`` makes the call. Everything
else, two-dimensional products included (``cupy.dot`` already passes their transposes
to cuBLAS), keeps ``cupy.matmul``.

cuBLAS is column-major. A C-contiguous M x N output is, read column-major, the N x M
matrix C^T = B^T A^T, so b's buffer is cuBLAS' first operand and a's its second, as in
CuPy. A row-major matrix whose rows lie ``ld`` elements apart is, read column-major with
leading dimension ``ld``, its own transpose: as an operand of C^T it needs no transpose
flag; a column-major one (the ``swapaxes`` view of a C-contiguous matrix) takes ``T``.

The call is CuPy's ``sgemmStridedBatched`` (``dgemmStridedBatched`` for float64): float32
arithmetic, the same as ``cupy.matmul``'s ``gemmStridedBatchedEx`` with ``CUDA_R_32F`` as
its compute type, under the handle's math mode, which CuPy leaves at the default (no
TF32). CuPy's cuBLAS wrappers point the handle at CuPy's current stream on every call, so
the product is queued on the stream the kernel runs on; alpha and beta are host scalars,
read during the call in the handle's host pointer mode (cuBLAS' default, which
``cupy.matmul`` relies on too). CuPy is imported only when a product is made on a GPU.
"""

from __future__ import annotations

import functools
import importlib
import math
import sys
from typing import Any, NamedTuple

import numpy as np

Shape = tuple[int, ...]
Layout = tuple[Shape, Shape]
"""An array's shape and its strides in bytes."""

INT32_MAX = 2**31 - 1
"""cuBLAS takes sizes, leading dimensions and the batch count as int."""

_ROUTINES = {np.dtype(np.float32): "sgemmStridedBatched", np.dtype(np.float64): "dgemmStridedBatched"}
_ONE = {dtype: np.ones((), dtype) for dtype in _ROUTINES}
_ZERO = {dtype: np.zeros((), dtype) for dtype in _ROUTINES}


class Gemm(NamedTuple):
    """One cuBLAS strided-batched GEMM, C_i = op(A_i) op(B_i) for i < batch, column-major:
    op(A_i) m x k, op(B_i) k x n, C_i m x n; A is b's buffer, B is a's and C out's
    (C^T = B^T A^T). Transposes are cuBLAS' operations (0: N, 1: T); leading dimensions
    and strides count elements."""

    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    stride_a: int
    ldb: int
    stride_b: int
    ldc: int
    stride_c: int
    batch: int


class _Matrix(NamedTuple):
    """An operand's matrices as cuBLAS reads them: transposed or not, their leading
    dimension, the stride from one matrix of the batch to the next."""

    trans: int
    ld: int
    stride: int


@functools.lru_cache(maxsize=4096)
def gemm(a: Layout, b: Layout, out: Layout, itemsize: int) -> Gemm | None:
    """``a @ b`` into ``out`` (numpy's matmul, batch axes broadcast) as one strided-batched
    GEMM, or None where it is not one: fewer than three dimensions, an empty product, a
    stride that is not a whole number of elements, an operand whose last two axes are
    neither row- nor column-major (unit stride along one, the other at least as long as
    that one's rows) or whose matrices are not one stride apart across the batch (a
    broadcast operand is, with stride 0, where it repeats over the whole batch), an
    output that is not C-contiguous or not of the product's shape, or a size past int32.
    Cached: a plan's registers keep their layouts from step to step."""
    (a_shape, a_bytes), (b_shape, b_bytes), (out_shape, out_bytes) = a, b, out
    if any(s % itemsize for s in (*a_bytes, *b_bytes, *out_bytes)):
        return None
    a_strides, b_strides, out_strides = (
        tuple(s // itemsize for s in x) for x in (a_bytes, b_bytes, out_bytes)
    )
    if min(len(a_shape), len(b_shape)) < 2 or len(out_shape) != max(len(a_shape), len(b_shape), 3):
        return None
    (rows, inner), (inner_b, cols) = a_shape[-2:], b_shape[-2:]
    batch_shape = tuple(out_shape[:-2])
    if inner != inner_b or tuple(out_shape[-2:]) != (rows, cols) or 0 in (*out_shape, inner):
        return None
    if _broadcast(a_shape[:-2], b_shape[:-2]) != batch_shape or not _c_contiguous(out_shape, out_strides):
        return None
    first = _matrix(b_shape, b_strides, batch_shape)
    second = _matrix(a_shape, a_strides, batch_shape)
    if first is None or second is None:
        return None
    plan = Gemm(
        transa=first.trans,
        transb=second.trans,
        m=cols,
        n=rows,
        k=inner,
        lda=first.ld,
        stride_a=first.stride,
        ldb=second.ld,
        stride_b=second.stride,
        ldc=cols,
        stride_c=rows * cols,
        batch=math.prod(batch_shape),
    )
    int_args = (plan.m, plan.n, plan.k, plan.lda, plan.ldb, plan.ldc, plan.batch)
    return plan if max(int_args) <= INT32_MAX else None


def _broadcast(x: Shape, y: Shape) -> Shape | None:
    """numpy's broadcast of two batch shapes, or None where they don't broadcast."""
    width = max(len(x), len(y))
    x, y = (1,) * (width - len(x)) + tuple(x), (1,) * (width - len(y)) + tuple(y)
    if any(p != q and p != 1 and q != 1 for p, q in zip(x, y, strict=True)):
        return None
    return tuple(p if q == 1 else q for p, q in zip(x, y, strict=True))


def _c_contiguous(shape: Shape, strides: Shape) -> bool:
    """Whether elements ``strides`` lay ``shape`` out in C order (a stride along an axis
    of size 1 is never used, as numpy's flag has it)."""
    step = 1
    for n, s in zip(reversed(shape), reversed(strides), strict=True):
        if n > 1 and s != step:
            return False
        step *= n
    return True


def _matrix(shape: Shape, strides: Shape, batch_shape: Shape) -> _Matrix | None:
    """How cuBLAS reads an operand of ``shape`` and element ``strides``, broadcast over
    ``batch_shape``: row-major is no transpose, column-major is ``T`` (row-major where a
    matrix is both, a row or a column)."""
    rows, cols = shape[-2:]
    row_stride, col_stride = strides[-2:]
    if (cols == 1 or col_stride == 1) and (rows == 1 or row_stride >= cols):
        trans, ld, vectors = 0, row_stride if rows > 1 else cols, rows
    elif (rows == 1 or row_stride == 1) and (cols == 1 or col_stride >= rows):
        trans, ld, vectors = 1, col_stride if cols > 1 else rows, cols
    else:
        return None
    stride = _batch_stride(shape[:-2], strides[:-2], batch_shape, alone=ld * vectors)
    return None if stride is None else _Matrix(trans, ld, stride)


def _batch_stride(shape: Shape, strides: Shape, batch_shape: Shape, alone: int) -> int | None:
    """The one stride, in elements, from each matrix of an operand of batch ``shape`` to
    the next over ``batch_shape`` (the broadcast batch, in numpy's order): 0 where one
    matrix serves them all, ``alone`` where the batch is one matrix, None where the
    matrices are not evenly spaced (or lie backwards)."""
    pad = len(batch_shape) - len(shape)
    sizes, steps = (1,) * pad + tuple(shape), (0,) * pad + tuple(strides)
    stride: int | None = None
    span = 1
    for size, step, n in zip(reversed(sizes), reversed(steps), reversed(batch_shape), strict=True):
        if n == 1:
            continue
        step = 0 if size == 1 else step
        if stride is None:
            stride = step
        if step < 0 or step != stride * span:
            return None
        span *= n
    return alone if stride is None else stride


def _layout(x: Any) -> Layout:
    return tuple(x.shape), tuple(x.strides)


def fits(a: Any, b: Any, out: Any) -> Gemm | None:
    """The GEMM that computes ``a @ b`` into ``out`` where all three are CuPy arrays of
    one dtype that cuBLAS multiplies here (float32, float64), of three or more dimensions,
    laid out as ``gemm`` takes them, ``out`` apart from both inputs; else None."""
    cupy = sys.modules.get("cupy")
    if cupy is None or max(a.ndim, b.ndim) < 3:
        return None
    if not all(isinstance(x, cupy.ndarray) for x in (a, b, out)):
        return None
    if out.dtype not in _ROUTINES or a.dtype != out.dtype or b.dtype != out.dtype:
        return None
    plan = gemm(_layout(a), _layout(b), _layout(out), out.itemsize)
    if plan is None or cupy.may_share_memory(out, a) or cupy.may_share_memory(out, b):
        return None
    return plan


def matmul(a: Any, b: Any, out: Any, plan: Gemm) -> None:
    """``a @ b`` into ``out`` as ``plan`` (from ``fits``) says: one cuBLAS call, queued on
    CuPy's current stream."""
    cupy = sys.modules["cupy"]
    cublas = importlib.import_module("cupy_backends.cuda.libs.cublas")
    routine = getattr(cublas, _ROUTINES[out.dtype])
    routine(
        cupy.cuda.device.get_cublas_handle(),
        plan.transa,
        plan.transb,
        plan.m,
        plan.n,
        plan.k,
        _ONE[out.dtype].ctypes.data,
        b.data.ptr,
        plan.lda,
        plan.stride_a,
        a.data.ptr,
        plan.ldb,
        plan.stride_b,
        _ZERO[out.dtype].ctypes.data,
        out.data.ptr,
        plan.ldc,
        plan.stride_c,
        plan.batch,
    )
