"""Seed 004's GPU kernel habits (issue #26, item 5), each an option beside its plain
version, which stays the default wherever a habit does not apply:

1. **A fused element-wise chain as one CUDA kernel.** The compiler's chains
   (``compiler.chains``) run their parts one by one (``ops.chain``): on a GPU, one kernel
   per part, each reading its inputs from and writing its output to device memory.
   ``chain_code`` writes the CUDA code of one CuPy ``ElementwiseKernel`` for a chain
   whose every part is element-wise (``SUPPORTED``, the gradient kernels and a step's
   ``accumulate`` included, so a backward chain fuses as well as a forward one): each
   element's intermediates stay in registers, and only the outputs someone reads are
   written. ``fused_chain`` is its kernel (a plain ``chain`` on numpy arrays);
   ``compiler.chains.cuda_chains``, a pass after ``fuse_chains``, gives it to each fused
   chain on a ``cuda:`` device that fits one kernel.
2. **relu's mask as bits.** relu's backward needs only ``x > 0``; keeping x (or a
   float32 mask) for it costs 4 bytes an element, a bit costs 1/8 of a byte.
   ``relu_bits`` writes relu(x) and the packed mask (one warp ballot, ``__ballot_sync``,
   per 32 elements: lane j is bit j of its warp's word), ``relu_bits_grad`` reads it back.
3. **int32 index arithmetic where a tensor fits.** 64-bit integer division and
   multiplication take many more instructions than 32-bit ones; an index-heavy kernel
   such as an embedding gather (row ``i // dim``, column ``i % dim``) does its index
   arithmetic in ``int`` where every index fits (``index_type``), in ``long long``
   otherwise (``gather_rows``). (CuPy's own element-wise kernels, the fused chain's
   included, already index in 32 bits where their arrays fit.)

What decides (the CUDA code, whether a chain fits one kernel, the mask's layout, the
index type) is plain Python, checked on the CPU; the numpy versions of the kernels are
their references. CuPy is imported only when a kernel gets CuPy arrays. The CUDA sources
are kept to standard CUDA C++ (float32 math, ``__ballot_sync`` with the full mask, every
lane of a warp reaching the ballot) so that NVRTC, which CuPy compiles with, takes them.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..arrays import raw_kernel
from . import gradient_kernels, kernels
from .chain import Part, chain
from .micro_batch import accumulate

# -- 1. a fused element-wise chain ------------------------------------------------------


def _literal(value: float) -> str | None:
    """``value`` as the float32 literal numpy would use (a Python float meets a float32
    array as float32), or None where it is not finite."""
    f32 = float(np.float32(value))
    if not math.isfinite(f32):
        return None
    text = repr(f32)
    return f"({text}f)" if f32 < 0 else f"{text}f"


_C = _literal(kernels._GELU_C)
_A = _literal(gradient_kernels._GELU_A)
_3A = _literal(3 * gradient_kernels._GELU_A)

Expression = Callable[..., str]
"""(*operands) -> the C++ expression of one element of a part's output; operands are
names of float registers, so no operand needs parentheses."""

_EXPRESSIONS: dict[Callable, tuple[int, Expression]] = {
    kernels.add: (2, lambda a, b: f"{a} + {b}"),
    kernels.sub: (2, lambda a, b: f"{a} - {b}"),
    kernels.mul: (2, lambda a, b: f"{a} * {b}"),
    kernels.div: (2, lambda a, b: f"{a} / {b}"),
    # np.maximum(x, 0): NaN stays NaN, so "x < 0 ? 0 : x" (not fmaxf, which drops it)
    kernels.relu: (1, lambda a: f"{a} < 0.0f ? 0.0f : {a}"),
    # the numpy kernel's own order of operations, so results differ by tanhf's ulps only
    kernels.gelu: (1, lambda a: f"(tanhf(({a} * {a} * {a} * {_A} + {a}) * {_C}) + 1.0f) * {a} * 0.5f"),
    kernels.tanh: (1, lambda a: f"tanhf({a})"),
    kernels.exp: (1, lambda a: f"expf({a})"),
    kernels.log: (1, lambda a: f"logf({a})"),
    gradient_kernels.relu_grad: (2, lambda dy, x: f"{dy} * ({x} > 0.0f ? 1.0f : 0.0f)"),
    gradient_kernels.tanh_grad: (2, lambda dy, y: f"(1.0f - {y} * {y}) * {dy}"),
    gradient_kernels.equal_mask: (2, lambda a, b: f"{a} == {b} ? 1.0f : 0.0f"),
    gradient_kernels.broadcast_to: (1, lambda a: a),
}


def _gelu_grad(v: str, dy: str, x: str) -> list[str]:
    """gelu_grad in the numpy kernel's order: x2 = x x, t = tanh(c x (1 + a x2)),
    ((3a x2 + 1) c x (1 - t t) + t + 1) 0.5 dy."""
    return [
        f"const float {v}_x2 = {x} * {x};",
        f"const float {v}_t = tanhf({_C} * {x} * (1.0f + {_A} * {v}_x2));",
        f"const float {v} = (({v}_x2 * {_3A} + 1.0f) * {_C} * {x} * (1.0f - {v}_t * {v}_t)"
        f" + {v}_t + 1.0f) * 0.5f * {dy};",
    ]


_OTHERS = (gradient_kernels.gelu_grad, gradient_kernels.scale, accumulate)
"""The parts ``_part`` writes code for beside ``_EXPRESSIONS``' one-line ones."""

SUPPORTED: tuple[str, ...] = tuple(f.__name__ for f in (*_EXPRESSIONS, *_OTHERS))
"""The kernels a chain fused into one CUDA kernel may have as parts (float32 only)."""


class ChainCode(NamedTuple):
    """One CuPy ``ElementwiseKernel`` for a chain: ``ElementwiseKernel(in_params,
    out_params, operation, name)`` called with the fused actor's inputs ``inputs`` (then
    the act's phase, where ``phased``), then its outputs ``outputs``. Plain strings and
    ints, so a Plan carries it through bytes."""

    name: str
    in_params: str
    out_params: str
    operation: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    phased: bool


def chain_code(parts: Sequence[Part], written: Collection[int] | None = None) -> ChainCode | None:
    """The CUDA code of ``parts`` (a fused chain's, as ``ops.chain`` takes them) as one
    element-wise kernel, or None where a part is not one of ``SUPPORTED`` (or its attrs
    are not what this code knows). ``written``: the fused actor's outputs that someone
    reads (None: all), the only ones the kernel writes; an ``accumulate``'s output is
    always written, since it is kept from one act to the next. The parts' sources and
    targets are the fused actor's inputs and outputs, as in ``ops.chain``."""
    lines: list[str] = []
    ready: set[int] = set()  # outputs computed so far
    inputs: set[int] = set()
    kept: set[int] = set()  # accumulates' outputs
    phased = False
    names = []
    for kernel, attrs, sources, targets, part_phased, _name, _where in parts:
        if len(targets) != 1 or any(k < 0 and ~k not in ready for k in sources):
            return None
        out = targets[0]
        if out in ready:
            return None
        operands = [f"a{k}" if k >= 0 else f"v{~k}" for k in sources]
        inputs.update(k for k in sources if k >= 0)
        step = _part(kernel, attrs, operands, f"v{out}", out, part_phased)
        if step is None:
            return None
        if kernel is accumulate:
            phased = True
            kept.add(out)
        lines += step
        ready.add(out)
        names.append(kernel.__name__)
    outputs = sorted((ready if written is None else ready & set(written)) | kept)
    if not outputs:
        return None
    loads = [f"const float a{k} = x{k};" for k in sorted(inputs)]
    stores = [f"y{t} = v{t};" for t in outputs]
    in_params = [f"float32 x{k}" for k in sorted(inputs)] + (["int32 phase"] if phased else [])
    return ChainCode(
        name="af_chain_" + "_".join(names)[:80],
        in_params=", ".join(in_params),
        out_params=", ".join(f"float32 y{t}" for t in outputs),
        operation="\n".join(loads + lines + stores),
        inputs=tuple(sorted(inputs)),
        outputs=tuple(outputs),
        phased=phased,
    )


def _part(
    kernel: Callable, attrs: dict[str, Any], operands: list[str], v: str, out: int, phased: bool
) -> list[str] | None:
    """The lines computing one part's element into register ``v``, or None."""
    if phased != (kernel is accumulate):
        return None
    if kernel in _EXPRESSIONS:
        arity, expression = _EXPRESSIONS[kernel]
        if attrs or len(operands) != arity:
            return None
        return [f"const float {v} = {expression(*operands)};"]
    if kernel is gradient_kernels.gelu_grad and not attrs and len(operands) == 2:
        return _gelu_grad(v, *operands)
    if kernel is gradient_kernels.scale and set(attrs) == {"factor"} and len(operands) == 1:
        factor = attrs["factor"]
        literal = _literal(factor) if isinstance(factor, (int, float)) else None
        return None if literal is None else [f"const float {v} = {operands[0]} * {literal};"]
    if kernel is accumulate and set(attrs) == {"micro_batches"} and len(operands) == 1:
        m = attrs["micro_batches"]
        if not isinstance(m, int) or m < 1:
            return None
        (source,) = operands
        # the numpy kernel: copy at phase 0, add after, divide by m at the last phase
        return [
            f"float {v} = phase == 0 ? {source} : y{out} + {source};",
            f"if (phase == {m - 1}) {v} = {v} / {_literal(m)};",
        ]
    return None


def fits_one_kernel(
    code: ChainCode, ins: Sequence[tuple[tuple[int, ...], str]], outs: Sequence[tuple[tuple[int, ...], str]]
) -> bool:
    """Whether the chain's registers (``ins`` and ``outs``: the fused actor's data
    inputs and outputs as (shape, dtype)) let ``code`` run as one ElementwiseKernel: all
    float32 (the code's arithmetic is), and every written output of the one shape all
    its arrays broadcast to (CuPy's rule: a bias of shape (n,) read into outputs of
    shape (b, n) is fine; an output smaller than an input is not)."""
    if any(dtype != "float32" for _, dtype in [*ins, *outs]):
        return False
    shapes = [tuple(ins[k][0]) for k in code.inputs] + [tuple(outs[t][0]) for t in code.outputs]
    try:
        full = np.broadcast_shapes(*shapes)
    except ValueError:
        return False
    return all(tuple(outs[t][0]) == full for t in code.outputs)


_CODES: dict[int, tuple[Sequence[Part], Sequence[int], ChainCode]] = {}
"""Each fused actor's code, made on its first act, by the id of its parts."""


@functools.cache
def _elementwise(code: ChainCode) -> Any:
    """The compiled-on-first-call kernel of ``code`` (equal chains share one). With
    --fmad=false each multiply and add is rounded as numpy rounds them, not fused."""
    return importlib.import_module("cupy").ElementwiseKernel(
        code.in_params,
        code.out_params,
        code.operation,
        name=code.name,
        no_return=True,
        options=("--fmad=false",),
    )


def _code_of(parts: Sequence[Part], written: Sequence[int]) -> ChainCode:
    """``chain_code(parts, written)``, written once per fused actor: a Plan carries the
    parts (functions it resolves only from allowed modules) and which outputs to write,
    never CUDA source, so loading a plan compiles nothing it says."""
    entry = _CODES.get(id(parts))
    if entry is None or entry[0] is not parts or entry[1] != written:
        code = chain_code(parts, written)
        if code is None:
            raise ValueError(f"parts {[p[5] for p in parts]} are not a chain one kernel can run")
        entry = _CODES[id(parts)] = (parts, written, code)
    return entry[2]


def fused_chain(ins: list, outs: list, parts: Sequence[Part], written: Sequence[int]) -> None:
    """A chain's kernel as one CUDA kernel (its parts' ``chain_code``, writing only the
    outputs ``written``); on numpy arrays, the plain chain of ``parts``. The launch goes
    on CuPy's current stream, as every kernel's does."""
    if isinstance(outs[0], np.ndarray):
        chain(ins, outs, parts)
        return
    code = _code_of(parts, written)
    args = [ins[k] for k in code.inputs]
    if code.phased:
        args.append(int(ins[-1]))
    args += [outs[t] for t in code.outputs]
    _elementwise(code)(*args)


def fused_chain_kernel(parts: Sequence[Part], written: Collection[int] | None = None) -> Callable | None:
    """``parts`` as one kernel with the ``kernel(ins, outs)`` contract (writing only the
    outputs ``written``, None: all), or None where a part is not element-wise: then the
    plain ``chain`` runs them. Whether the registers' shapes and dtypes fit is
    ``fits_one_kernel``'s to say (CuPy raises where they don't)."""
    code = chain_code(parts, written)
    return None if code is None else functools.partial(fused_chain, parts=parts, written=code.outputs)


ONE_PASS: tuple[Callable, ...] = (
    kernels.add,
    kernels.sub,
    kernels.mul,
    kernels.div,
    kernels.relu,
    kernels.tanh,
    kernels.exp,
    kernels.log,
    gradient_kernels.equal_mask,
    gradient_kernels.broadcast_to,
    gradient_kernels.scale,
)
"""Element-wise kernels that CuPy already runs as one kernel, one pass over memory: one
alone gains nothing from a generated kernel, whose launch costs the host more."""


def worth_one_kernel(parts: Sequence[Part]) -> bool:
    """Whether ``parts`` (element-wise) save passes as one generated kernel: several
    parts, or one that CuPy runs as several kernels (gelu's eight, a gradient's two or
    three, an accumulate's)."""
    return len(parts) > 1 or parts[0][0] not in ONE_PASS


def element_wise(kernel: Callable) -> bool:
    """Whether ``kernel`` is one ``chain_code`` writes code for (by identity: another
    function of the same name is not)."""
    return kernel in _EXPRESSIONS or kernel in _OTHERS


# -- 2. relu's mask as bits -------------------------------------------------------------

BLOCK = 256
"""Threads per block of the raw kernels here: a multiple of 32, so that each warp's lanes
are 32 consecutive elements, lane j at element 32 w + j."""


def mask_words(n: int) -> int:
    """uint32 words of the bit mask of ``n`` elements: one bit each, 1/32 of a float32
    mask's memory."""
    return (n + 31) // 32


def pack_mask(positive: np.ndarray) -> np.ndarray:
    """The bit mask of a boolean array, as ``relu_bits`` writes it: element i is bit
    i % 32 of word i // 32 (little-endian, as a warp ballot puts lane j at bit j)."""
    flat = np.ascontiguousarray(positive).reshape(-1)
    words = np.zeros(mask_words(flat.size), np.uint32)
    packed = np.packbits(flat, bitorder="little")
    words.view(np.uint8)[: packed.size] = packed
    return words


def unpack_mask(words: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` bits of ``words`` as 0/1 (uint8)."""
    return np.unpackbits(np.ascontiguousarray(words).view(np.uint8), count=n, bitorder="little")


RELU_BITS_SOURCE = r"""
extern "C" __global__ void af_relu_bits(const float* __restrict__ x, float* __restrict__ y,
                                        unsigned int* __restrict__ bits, const long long n) {
    // no early return: every lane of the warp must reach the ballot, those past the end
    // voting 0 (their bits of the last word stay 0)
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool inside = i < n;
    const float v = inside ? x[i] : 0.0f;
    const unsigned int word = __ballot_sync(0xffffffffu, inside && v > 0.0f);
    if (inside) {
        y[i] = v < 0.0f ? 0.0f : v;
        if ((threadIdx.x & 31u) == 0u) {
            bits[i >> 5] = word;
        }
    }
}

extern "C" __global__ void af_relu_bits_grad(const float* __restrict__ dy,
                                             const unsigned int* __restrict__ bits,
                                             float* __restrict__ dx, const long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const unsigned int bit = (bits[i >> 5] >> (unsigned int)(i & 31)) & 1u;
    dx[i] = dy[i] * (bit ? 1.0f : 0.0f);
}
"""


def _raw_arrays(kernel: str, *arrays: tuple[Any, str, int]) -> None:
    """Raw kernels read and write through bare pointers, with no bounds: each of
    ``arrays`` must be (array, dtype, at least this many elements) and C-contiguous (a
    view with strides would be read wrong)."""
    for k, (a, dtype, size) in enumerate(arrays):
        if str(a.dtype) != dtype or a.size < size or not a.flags.c_contiguous:
            raise ValueError(
                f"{kernel}: argument {k} must be C-contiguous {dtype} of at least {size} elements, "
                f"got {a.dtype}{list(a.shape)} with strides {a.strides}"
            )


def _blocks(n: int) -> tuple[int]:
    return ((n + BLOCK - 1) // BLOCK,)


def relu_bits(ins: list, outs: list) -> None:
    """relu(x) into ``outs[0]`` and the mask ``x > 0`` as bits into ``outs[1]`` (uint32,
    ``mask_words(x.size)`` words): what ``relu_bits_grad`` needs instead of x. The
    forward output ``relu(x)`` is as ``kernels.relu`` writes it (NaN stays NaN); a NaN's
    bit is 0, as ``relu_grad``'s ``x > 0`` is false for it."""
    (x,) = ins
    y, bits = outs
    if isinstance(x, np.ndarray):
        np.maximum(x, 0, out=y)
        bits[...] = pack_mask(x > 0)
        return
    n = x.size
    _raw_arrays("relu_bits", (x, "float32", n), (y, "float32", n), (bits, "uint32", mask_words(n)))
    if n:
        raw_kernel(RELU_BITS_SOURCE, "af_relu_bits")(
            _blocks(x.size), (BLOCK,), (x, y, bits, np.int64(x.size))
        )


def relu_bits_grad(ins: list, outs: list) -> None:
    """dy where the mask's bit is set, else 0: ``relu_grad(dy, x)`` from the bits."""
    dy, bits = ins
    (dx,) = outs
    if isinstance(dy, np.ndarray):
        np.multiply(dy, unpack_mask(bits, dy.size).reshape(dy.shape), out=dx)
        return
    n = dy.size
    _raw_arrays("relu_bits_grad", (dy, "float32", n), (bits, "uint32", mask_words(n)), (dx, "float32", n))
    if n:
        grad = raw_kernel(RELU_BITS_SOURCE, "af_relu_bits_grad")
        grad(_blocks(dy.size), (BLOCK,), (dy, bits, dx, np.int64(dy.size)))


# -- 3. int32 index arithmetic ----------------------------------------------------------

INT32_MAX = 2**31 - 1


def index_type(*sizes: int) -> str:
    """``int`` where every index a one-thread-per-element kernel over arrays of these
    sizes computes fits 32 bits (its last block's threads run up to BLOCK - 1 past the
    end), else ``long long``."""
    return "int" if max(sizes, default=0) + BLOCK - 1 <= INT32_MAX else "long long"


_ID_TYPES = {"int32": "int", "int64": "long long"}


def gather_source(index: str, ids: str) -> str:
    """The CUDA source of ``af_gather``: out[p, c] = table[clip(ids[p]), c], its index
    arithmetic in ``index`` (``int`` or ``long long``), ids of C type ``ids``."""
    return f"""
typedef {index} af_index_t;
typedef {ids} af_id_t;
extern "C" __global__ void af_gather(const float* __restrict__ table, const af_id_t* __restrict__ ids,
                                     float* __restrict__ out, const af_index_t count,
                                     const af_index_t dim, const af_index_t vocab) {{
    const af_index_t i = (af_index_t)blockIdx.x * (af_index_t)blockDim.x + (af_index_t)threadIdx.x;
    if (i >= count) {{
        return;
    }}
    const af_index_t p = i / dim;
    const af_index_t c = i - p * dim;
    af_index_t row = (af_index_t)ids[p];
    row = row < 0 ? 0 : (row >= vocab ? vocab - 1 : row);
    out[i] = table[row * dim + c];
}}
"""


def gather_rows(ins: list, outs: list, index: str | None = None) -> None:
    """``embedding``'s gather: row ``ids[...]`` of the table at each position, ids
    clipped into the table (numpy's ``mode="clip"``; checking them would need the host
    to wait for the GPU). ``index``: the index arithmetic's C type, by default
    ``index_type`` of the arrays (``int`` where they fit)."""
    ids, table = ins
    (out,) = outs
    if isinstance(ids, np.ndarray):
        np.take(table, ids, axis=0, out=out, mode="clip")
        return
    id_type = _ID_TYPES.get(str(ids.dtype))
    if id_type is None or table.ndim != 2 or tuple(out.shape) != (*ids.shape, table.shape[1]):
        raise ValueError(
            f"gather_rows takes int32 or int64 ids, a 2-D table and an output of the ids' shape "
            f"and a row's, got {ids.dtype}{list(ids.shape)}, {list(table.shape)} and {list(out.shape)}"
        )
    _raw_arrays(
        "gather_rows",
        (ids, str(ids.dtype), ids.size),
        (table, "float32", table.size),
        (out, "float32", out.size),
    )
    fits = index_type(out.size, table.size)
    index = index or fits
    if index == "int" and fits != "int":
        raise ValueError(f"{out.size} or {table.size} elements do not fit int32 indexes")
    if out.size == 0:
        return
    scalar = np.int32 if index == "int" else np.int64
    vocab, dim = table.shape
    kernel = raw_kernel(gather_source(index, id_type), "af_gather")
    kernel(_blocks(out.size), (BLOCK,), (table, ids, out, scalar(out.size), scalar(dim), scalar(vocab)))
