"""Row kernels on a GPU, each one CUDA kernel (seed 004: fuse): softmax and its gradient,
causal softmax, layer norm and its gradient, along the last axis of float32 CuPy arrays.

Done with CuPy's array functions, a layer norm is about ten kernels (mean, subtract,
square, mean, + eps, sqrt, reciprocal, three element-wise products and sums), each a pass
over device memory and a launch the host pays tens of microseconds for; its gradient
about fifteen, a softmax four or more. Here a block of threads takes one row (whole
warps, about eight elements a thread, so any row length works) and keeps its statistics
in registers: a reduction is a warp's ``__shfl_xor_sync`` tree, then one across the
block's warps through shared memory, which every thread of the block reaches. The
arithmetic is the numpy kernels', in their order (the mean subtracted before the squares
are summed; ``1 / sqrt(var + eps)``; exp(x - max) / sum; float32 throughout, each
product and sum rounded on its own), so a result differs from the host's by summation
order only.

``column_sums`` is ``gradient_kernels.sum_to``'s where the summed axes are x's leading ones
(a bias's gradient: x [tokens, n] summed into [n]; CuPy's reduction took 2.55 ms of the
transformer benchmark's step for them, PyTorch 0.46 ms): the layer norm gradient's
two-phase column sums, of x itself (``COLUMN_SOURCE``, apart from ``SOURCE`` and its
``KERNELS``).

``fits`` says whether an array and its axis take this path (float32, C-contiguous, on a
GPU, not empty, the axis its last); the kernels in ``kernels``, ``gradient_kernels`` and
``transformer_kernels`` ask it first and keep their numpy code for everything else. Each
launcher writes into the arrays it is given and returns nothing. An output may be one of
the inputs (in place): each thread reads an element before it writes it, and no other
thread reads it; an output that only partly overlaps an input, or layer norm's dx
overlapping dy, x or gamma (read again by its second kernel, or by other rows), is
computed into a temporary first. CuPy is imported only when a kernel is launched: this
module imports without it.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from ..arrays import namespace, raw_kernel

SOURCE = r"""
// A row per block of blockDim.x threads, a multiple of 32 up to 1024; thread t takes the
// row's elements t, t + blockDim.x, ... Every thread of a block reaches every reduction
// (no early return in a row kernel), so every __syncthreads and full-mask shuffle is met
// by all its threads. Row bases are 64-bit (rows * n may pass 2**31); within a row,
// indices are int (the launcher keeps n + blockDim.x below 2**31).

__device__ __forceinline__ float af_warp_sum(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

__device__ __forceinline__ float af_warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// The block's sum of v, in every thread (each warp adds the warps' partial sums in the
// same order, so all threads get the same bits). scratch: 32 floats of shared memory;
// the first barrier keeps a previous reduction's readers ahead of this one's writers.
__device__ float af_block_sum(float v, float* scratch) {
    const unsigned int lane = threadIdx.x & 31u;
    v = af_warp_sum(v);
    __syncthreads();
    if (lane == 0u) {
        scratch[threadIdx.x >> 5] = v;
    }
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? scratch[lane] : 0.0f;
    return af_warp_sum(v);
}

// The block's maximum of v, in every thread (fmaxf: a NaN loses to a number; the caller's
// sum of exponentials carries the NaN on).
__device__ float af_block_max(float v, float* scratch) {
    const unsigned int lane = threadIdx.x & 31u;
    v = af_warp_max(v);
    __syncthreads();
    if (lane == 0u) {
        scratch[threadIdx.x >> 5] = v;
    }
    __syncthreads();
    v = lane < (blockDim.x >> 5) ? scratch[lane] : __int_as_float(0xff800000);
    return af_warp_max(v);
}

// out = exp(x - max) / sum(exp(x - max)) along each row of n, x read as x * scale (rounded
// as a multiply before it would round: 1 leaves it as it is). causal: the rows are those
// of (n, n) matrices, and row i of each (query i) sees keys j <= i only: the others are
// -inf, whose exp is 0, so they are skipped and written 0 / sum (0, or NaN where the
// sum is NaN, as the host's division gives).
extern "C" __global__ void af_softmax_rows(const float* x, float* out, const int n, const int causal,
                                           const float scale) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * (long long)n;
    const float* xr = x + base;
    float* yr = out + base;
    const int valid = causal ? (int)(blockIdx.x % (unsigned int)n) + 1 : n;
    float m = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < valid; j += blockDim.x) {
        m = fmaxf(m, __fmul_rn(xr[j], scale));
    }
    m = af_block_max(m, scratch);
    float s = 0.0f;
    for (int j = threadIdx.x; j < valid; j += blockDim.x) {
        s = __fadd_rn(s, expf(__fsub_rn(__fmul_rn(xr[j], scale), m)));
    }
    s = af_block_sum(s, scratch);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = j < valid ? expf(__fsub_rn(__fmul_rn(xr[j], scale), m)) : 0.0f;
        yr[j] = __fdiv_rn(e, s);
    }
}

// out = y * (dy - sum(dy * y)) * scale along each row of n (a multiply after, as a scale
// op after it would round: 1 leaves it as it is).
extern "C" __global__ void af_softmax_grad_rows(const float* dy, const float* y, float* out, const int n,
                                                const float scale) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * (long long)n;
    const float* dyr = dy + base;
    const float* yr = y + base;
    float* outr = out + base;
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        s = __fadd_rn(s, __fmul_rn(dyr[j], yr[j]));
    }
    s = af_block_sum(s, scratch);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        outr[j] = __fmul_rn(__fmul_rn(__fsub_rn(dyr[j], s), yr[j]), scale);
    }
}

// The row's mean and 1 / sqrt(var + eps), var the mean of (x - mean)**2 (the mean
// subtracted first): two reductions, every thread of the block calling this.
__device__ void af_row_stats(const float* xr, const int n, const float eps, float* scratch, float* mean,
                             float* rstd) {
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        s = __fadd_rn(s, xr[j]);
    }
    const float mu = __fdiv_rn(af_block_sum(s, scratch), (float)n);
    float q = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float d = __fsub_rn(xr[j], mu);
        q = __fadd_rn(q, __fmul_rn(d, d));
    }
    const float var = __fdiv_rn(af_block_sum(q, scratch), (float)n);
    *mean = mu;
    *rstd = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
}

// out = (x - mean) * rstd * gamma + beta along each row of n.
extern "C" __global__ void af_layer_norm_rows(const float* x, const float* gamma, const float* beta, float* out,
                                              const int n, const float eps) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * (long long)n;
    const float* xr = x + base;
    float* outr = out + base;
    float mean, rstd;
    af_row_stats(xr, n, eps, scratch, &mean, &rstd);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        outr[j] = __fadd_rn(__fmul_rn(__fmul_rn(__fsub_rn(xr[j], mean), rstd), gamma[j]), beta[j]);
    }
}

// Layer norm's dx along each row of n, with xhat = (x - mean) * rstd and g = dy * gamma:
// dx = (g - mean(g) - xhat * mean(dy * xhat * gamma)) * rstd; and the row's mean and rstd
// into stats[2 row], stats[2 row + 1] for af_layer_norm_grad_columns. dx must not
// overlap dy or x (that kernel reads them after this one).
extern "C" __global__ void af_layer_norm_grad_rows(const float* dy, const float* x, const float* gamma, float* dx,
                                                   float* stats, const int n, const float eps) {
    __shared__ float scratch[32];
    const long long base = (long long)blockIdx.x * (long long)n;
    const float* dyr = dy + base;
    const float* xr = x + base;
    float* dxr = dx + base;
    float mean, rstd;
    af_row_stats(xr, n, eps, scratch, &mean, &rstd);
    float sg = 0.0f;
    float sgx = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float d = dyr[j];
        const float gj = gamma[j];
        const float xh = __fmul_rn(__fsub_rn(xr[j], mean), rstd);
        sg = __fadd_rn(sg, __fmul_rn(d, gj));
        sgx = __fadd_rn(sgx, __fmul_rn(__fmul_rn(d, xh), gj));
    }
    const float mean_g = __fdiv_rn(af_block_sum(sg, scratch), (float)n);
    const float mean_gx = __fdiv_rn(af_block_sum(sgx, scratch), (float)n);
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float xh = __fmul_rn(__fsub_rn(xr[j], mean), rstd);
        const float g = __fmul_rn(dyr[j], gamma[j]);
        dxr[j] = __fmul_rn(__fsub_rn(__fsub_rn(g, mean_g), __fmul_rn(xh, mean_gx)), rstd);
    }
    if (threadIdx.x == 0u) {
        stats[2 * (long long)blockIdx.x] = mean;
        stats[2 * (long long)blockIdx.x + 1] = rstd;
    }
}

// Sums over a chunk of rows, per column: dy * xhat (dgamma's) into partial[chunk][c] and
// dy (dbeta's) into partial[chunks + chunk][c], chunk = blockIdx.y of gridDim.y. A block
// of 256 threads takes 32 columns (blockIdx.x): lane l column 32 blockIdx.x + l, its 8
// warps every 8th row of the chunk, then warp 0 adds the warps' sums (shared memory).
extern "C" __global__ void af_layer_norm_grad_columns(const float* dy, const float* x, const float* stats,
                                                      float* partial, const long long rows, const int n,
                                                      const long long rows_per_chunk) {
    __shared__ float sums_g[8][32];
    __shared__ float sums_b[8][32];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const int c = (int)(blockIdx.x * 32u + lane);
    const long long start = (long long)blockIdx.y * rows_per_chunk;
    const long long end = start + rows_per_chunk < rows ? start + rows_per_chunk : rows;
    float g = 0.0f;
    float b = 0.0f;
    if (c < n) {
        for (long long r = start + warp; r < end; r += 8) {
            const long long i = r * (long long)n + c;
            const float d = dy[i];
            const float xh = __fmul_rn(__fsub_rn(x[i], stats[2 * r]), stats[2 * r + 1]);
            g = __fadd_rn(g, __fmul_rn(d, xh));
            b = __fadd_rn(b, d);
        }
    }
    sums_g[warp][lane] = g;
    sums_b[warp][lane] = b;
    __syncthreads();
    if (warp == 0u && c < n) {
        for (int k = 1; k < 8; ++k) {
            g = __fadd_rn(g, sums_g[k][lane]);
            b = __fadd_rn(b, sums_b[k][lane]);
        }
        partial[(long long)blockIdx.y * n + c] = g;
        partial[((long long)gridDim.y + blockIdx.y) * n + c] = b;
    }
}

// dgamma[c], dbeta[c]: the chunks' partial sums of column c, in chunk order.
extern "C" __global__ void af_layer_norm_grad_params(const float* partial, float* dgamma, float* dbeta,
                                                     const int n, const int chunks) {
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) {
        return;
    }
    float g = 0.0f;
    float b = 0.0f;
    for (int k = 0; k < chunks; ++k) {
        g = __fadd_rn(g, partial[(long long)k * n + c]);
        b = __fadd_rn(b, partial[((long long)chunks + k) * n + c]);
    }
    dgamma[c] = g;
    dbeta[c] = b;
}
"""

COLUMN_SOURCE = r"""
// Sums of x, rows by n, over a chunk of rows per column, into partial[chunk][c], chunk =
// blockIdx.y of gridDim.y: af_layer_norm_grad_columns' layout (a block of 256 threads
// takes 32 columns, lane l column 32 blockIdx.x + l, so a warp reads 32 neighbouring floats
// of a row; its 8 warps every 8th row of the chunk, then warp 0 adds the warps' sums).
extern "C" __global__ void af_column_sums(const float* x, float* partial, const long long rows, const int n,
                                          const long long rows_per_chunk) {
    __shared__ float sums[8][32];
    const unsigned int lane = threadIdx.x & 31u;
    const unsigned int warp = threadIdx.x >> 5;
    const int c = (int)(blockIdx.x * 32u + lane);
    const long long start = (long long)blockIdx.y * rows_per_chunk;
    const long long end = start + rows_per_chunk < rows ? start + rows_per_chunk : rows;
    float s = 0.0f;
    if (c < n) {
        for (long long r = start + warp; r < end; r += 8) {
            s = __fadd_rn(s, x[r * (long long)n + c]);
        }
    }
    sums[warp][lane] = s;
    __syncthreads();
    if (warp == 0u && c < n) {
        for (int k = 1; k < 8; ++k) {
            s = __fadd_rn(s, sums[k][lane]);
        }
        partial[(long long)blockIdx.y * n + c] = s;
    }
}

// out[c]: the chunks' partial sums of column c, in chunk order.
extern "C" __global__ void af_column_sums_chunks(const float* partial, float* out, const int n, const int chunks) {
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) {
        return;
    }
    float s = 0.0f;
    for (int k = 0; k < chunks; ++k) {
        s = __fadd_rn(s, partial[(long long)k * n + c]);
    }
    out[c] = s;
}
"""

KERNELS = (
    "af_softmax_rows",
    "af_softmax_grad_rows",
    "af_layer_norm_rows",
    "af_layer_norm_grad_rows",
    "af_layer_norm_grad_columns",
    "af_layer_norm_grad_params",
)

COLUMN_KERNELS = ("af_column_sums", "af_column_sums_chunks")

MAX_THREADS = 1024
"""A row block's most threads (the block reductions' 32 floats of shared memory hold
the sums of up to 32 warps)."""

COLUMN_THREADS = 256
"""``af_layer_norm_grad_columns``' and ``af_column_sums``' block: 32 columns by 8 warps
(their shared arrays)."""

COLUMN_BLOCKS = 1024
"""About how many blocks the column sums are spread over (chunks of rows by groups of 32
columns), enough to keep every SM of a GPU busy."""

INT32_MAX = 2**31 - 1


def row_threads(n: int) -> int:
    """The threads of a row's block: whole warps, about 8 elements a thread, 32 to 1024."""
    return min(MAX_THREADS, max(32, -(-n // 256) * 32))


def fits(x: Any, axis: int, *arrays: Any) -> bool:
    """Whether ``x`` along ``axis``, with the other ``arrays`` of the kernel (its outputs,
    its other inputs), takes the fused kernels: each a float32, C-contiguous CuPy array,
    ``x`` not empty, ``axis`` its last, its rows' count and length within the kernels'
    int32 indices and grid. Anything else (numpy arrays, other dtypes, axes, views with
    strides) keeps the numpy-namespace code."""
    cupy = sys.modules.get("cupy")
    if cupy is None or not isinstance(x, cupy.ndarray) or x.ndim == 0 or x.size == 0:
        return False
    if axis not in (-1, x.ndim - 1):
        return False
    n = x.shape[-1]
    if n + MAX_THREADS > INT32_MAX or x.size // n > INT32_MAX:
        return False
    return all(
        isinstance(a, cupy.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous for a in (x, *arrays)
    )


def leading_columns(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple[int, int] | None:
    """x of ``shape`` summed down to ``out_shape`` as ``sum_to`` sums it (the inverse of
    numpy's broadcasting) when that is a column sum: (rows, n), x read as rows of n summed
    over its rows, where the summed axes are leading ones (``out_shape`` is x's trailing
    shape, after any 1s); None where an axis after a kept one is summed, or none is."""
    if len(out_shape) > len(shape):
        return None
    lead = len(shape) - len(out_shape)
    full = (1,) * lead + tuple(out_shape)
    k = max([lead] + [i + 1 for i, (a, b) in enumerate(zip(shape, full)) if a != b])
    if k == 0 or any(b != 1 for b in full[:k]):
        return None
    return math.prod(shape[:k]), math.prod(shape[k:])


def fits_column_sums(x: Any, out: Any) -> bool:
    """Whether ``sum_to`` of ``x`` into ``out`` takes ``column_sums``: both float32,
    C-contiguous CuPy arrays (``fits``), x not empty, the summed axes its leading ones
    (``leading_columns``), a row's n columns at least a warp's 32 (fewer leave most of
    each block's threads idle on long rows: CuPy's reduction does better) and within the
    kernels' int32 indices."""
    if not fits(x, -1, out):
        return False
    layout = leading_columns(x.shape, out.shape)
    return layout is not None and 32 <= layout[1] <= INT32_MAX - MAX_THREADS


def _launch(name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple) -> None:
    """Launch kernel ``name`` of ``SOURCE`` or ``COLUMN_SOURCE`` on the current CUDA stream
    (each source compiled once per GPU by CuPy, and cached)."""
    raw_kernel(_SOURCES[name], name)(grid, block, args)


_SOURCES = dict.fromkeys(KERNELS, SOURCE) | dict.fromkeys(COLUMN_KERNELS, COLUMN_SOURCE)


def _pointer(a: Any) -> int:
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)


def _target(out: Any, ins: tuple, in_place: bool = True) -> Any:
    """Where a kernel may write ``out``'s values: ``out`` itself where it is apart from
    each of ``ins`` or (``in_place``) the very same memory; else a temporary."""
    xp = namespace(out)
    for a in ins:
        if xp.may_share_memory(out, a) and not (
            in_place and _pointer(out) == _pointer(a) and out.nbytes == a.nbytes
        ):
            return xp.empty_like(out)
    return out


def _finish(out: Any, target: Any) -> None:
    if target is not out:
        namespace(out).copyto(out, target)


def _check(kernel: str, shape: tuple, *arrays: tuple[Any, tuple]) -> None:
    """The launchers read and write through bare pointers: each of ``arrays`` must have
    the shape it is paired with (the ops' checks make it so)."""
    for k, (a, want) in enumerate(arrays):
        if tuple(a.shape) != tuple(want):
            raise ValueError(f"{kernel}: argument {k} must be of shape {want} for x {shape}, got {a.shape}")


def _rows(x: Any) -> tuple[int, int]:
    n = x.shape[-1]
    return x.size // n, n


def softmax(x: Any, out: Any, scale: float = 1.0) -> None:
    """Softmax along the last axis of ``x * scale`` into ``out`` (``kernels.softmax``; a
    scale before it, see ``scaled_softmax``)."""
    _softmax_rows("softmax", x, out, False, scale)


def causal_softmax(x: Any, out: Any, scale: float = 1.0) -> None:
    """Softmax along the last axis of scores [..., s, s] times ``scale``, query i (axis -2)
    seeing keys j <= i only (``transformer_kernels.causal_softmax``)."""
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"causal_softmax: needs scores [..., s, s], got shape {x.shape}")
    _softmax_rows("causal_softmax", x, out, True, scale)


def _softmax_rows(kernel: str, x: Any, out: Any, causal: bool, scale: float) -> None:
    _check(kernel, x.shape, (out, x.shape))
    rows, n = _rows(x)
    target = _target(out, (x,))
    args = (x, target, np.int32(n), np.int32(causal), np.float32(scale))
    _launch("af_softmax_rows", (rows,), (row_threads(n),), args)
    _finish(out, target)


def softmax_grad(dy: Any, y: Any, out: Any, scale: float = 1.0) -> None:
    """y * (dy - sum(dy * y)) * scale along the last axis into ``out``
    (``gradient_kernels.softmax_grad``; a scale after it, see ``scaled_softmax_grad``)."""
    _check("softmax_grad", dy.shape, (y, dy.shape), (out, dy.shape))
    rows, n = _rows(dy)
    target = _target(out, (dy, y))
    _launch(
        "af_softmax_grad_rows", (rows,), (row_threads(n),), (dy, y, target, np.int32(n), np.float32(scale))
    )
    _finish(out, target)


def layer_norm(x: Any, gamma: Any, beta: Any, out: Any, eps: float) -> None:
    """(x - mean) / sqrt(var + eps) * gamma + beta along the last axis into ``out``
    (``transformer_kernels.layer_norm``)."""
    rows, n = _rows(x)
    _check("layer_norm", x.shape, (gamma, (n,)), (beta, (n,)), (out, x.shape))
    target = _target(out, (x, gamma, beta))
    args = (x, gamma, beta, target, np.int32(n), np.float32(eps))
    _launch("af_layer_norm_rows", (rows,), (row_threads(n),), args)
    _finish(out, target)


def column_chunks(rows: int, n: int) -> tuple[int, int]:
    """The column sums' chunks of rows: (rows a chunk, chunks), about ``COLUMN_BLOCKS``
    blocks in all (at least 8 rows a chunk, one per warp of the block)."""
    wanted = max(1, -(-COLUMN_BLOCKS // -(-n // 32)))
    per_chunk = max(8, -(-rows // wanted))
    return per_chunk, -(-rows // per_chunk)


def layer_norm_grad(dy: Any, x: Any, gamma: Any, dx: Any, dgamma: Any, dbeta: Any, eps: float) -> None:
    """``transformer_kernels.layer_norm_grad`` along the last axis: dx a row a block (and
    each row's mean and rstd), then dgamma = sum(dy xhat) and dbeta = sum(dy) over the rows,
    in chunks of rows (``column_chunks``) and then over the chunks: three kernels."""
    rows, n = _rows(x)
    _check(
        "layer_norm_grad", x.shape, (dy, x.shape), (gamma, (n,)), (dx, x.shape), (dgamma, (n,)), (dbeta, (n,))
    )
    xp = namespace(x)
    target = _target(dx, (dy, x, gamma), in_place=False)
    stats = xp.empty(2 * rows, np.float32)
    _launch(
        "af_layer_norm_grad_rows",
        (rows,),
        (row_threads(n),),
        (dy, x, gamma, target, stats, np.int32(n), np.float32(eps)),
    )
    per_chunk, chunks = column_chunks(rows, n)
    partial = xp.empty(2 * chunks * n, np.float32)
    _launch(
        "af_layer_norm_grad_columns",
        (-(-n // 32), chunks),
        (COLUMN_THREADS,),
        (dy, x, stats, partial, np.int64(rows), np.int32(n), np.int64(per_chunk)),
    )
    params = _target(dgamma, (dbeta,), in_place=False), _target(dbeta, (dgamma,), in_place=False)
    _launch(
        "af_layer_norm_grad_params",
        (-(-n // 256),),
        (256,),
        (partial, params[0], params[1], np.int32(n), np.int32(chunks)),
    )
    _finish(dx, target)
    _finish(dgamma, params[0])
    _finish(dbeta, params[1])


def column_sums(x: Any, out: Any) -> None:
    """x summed over its leading axes into ``out`` (``gradient_kernels.sum_to`` where
    ``leading_columns`` says so): each chunk of rows (``column_chunks``) summed per column,
    then the chunks; a single chunk is written straight into ``out``, unless out overlaps
    x (the first kernel reads x while it writes; the second reads its chunks only)."""
    layout = leading_columns(x.shape, out.shape)
    if layout is None:
        raise ValueError(f"column_sums: {out.shape} is not x's trailing shape {x.shape}")
    rows, n = layout
    per_chunk, chunks = column_chunks(rows, n)
    xp = namespace(x)
    direct = chunks == 1 and not xp.may_share_memory(out, x)
    partial = out if direct else xp.empty(chunks * n, np.float32)
    _launch(
        "af_column_sums",
        (-(-n // 32), chunks),
        (COLUMN_THREADS,),
        (x, partial, np.int64(rows), np.int32(n), np.int64(per_chunk)),
    )
    if not direct:
        _launch(
            "af_column_sums_chunks", (-(-n // 256),), (256,), (partial, out, np.int32(n), np.int32(chunks))
        )
