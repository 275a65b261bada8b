"""Compute ops: each becomes one actor on its inputs' device, run on that device's compute stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..graph.builder import add_node, axis_of, check_inputs, device_of, dtype_of, fail, float_dtype
from ..graph.dispatch import dispatchable
from ..graph.ir import Tensor
from . import kernels
from .registry import register


def _device(op: str, inputs: Sequence[Tensor]) -> str:
    devices = sorted({t.device for t in inputs})
    if len(devices) > 1:
        raise fail(
            op,
            f"inputs are on different devices {devices}; move them with af.ops.to_device",
        )
    return devices[0]


def _dtype(op: str, inputs: Sequence[Tensor]) -> str:
    dtypes = sorted({t.dtype for t in inputs})
    if len(dtypes) > 1:
        raise fail(op, f"inputs have different dtypes {dtypes}")
    return dtypes[0]


def _compute(
    op: str,
    inputs: Sequence[Tensor],
    shape: Sequence[int],
    dtype: str | None = None,
    attrs: dict | None = None,
    name: str | None = None,
) -> Tensor:
    (t,) = add_node(
        op,
        inputs,
        [(tuple(shape), dtype or _dtype(op, inputs), _device(op, inputs))],
        attrs,
        name,
    )
    return t


def _unary(op: str, kernel: Callable, doc: str, real: bool = False) -> Callable[..., Tensor]:
    """``real``: the result is a float even for integer inputs (exp, log, ...)."""
    register(op, "compute", kernel)

    def build(x: Tensor, *, name: str | None = None) -> Tensor:
        check_inputs(op, [x])
        return _compute(op, [x], x.shape, float_dtype(x.dtype) if real else None, name=name)

    build.__name__ = build.__qualname__ = op
    build.__doc__ = doc
    return dispatchable(build)


def _binary(op: str, kernel: Callable, doc: str, real: bool = False) -> Callable[..., Tensor]:
    register(op, "compute", kernel)

    def build(a: Tensor, b: Tensor, *, name: str | None = None) -> Tensor:
        check_inputs(op, [a, b])
        try:
            shape = np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            raise fail(op, f"shapes {a.shape} and {b.shape} do not broadcast") from None
        dtype = _dtype(op, [a, b])
        return _compute(op, [a, b], shape, float_dtype(dtype) if real else dtype, name=name)

    build.__name__ = build.__qualname__ = op
    build.__doc__ = doc
    return dispatchable(build)


relu = _unary("relu", kernels.relu, "max(x, 0), elementwise.")
gelu = _unary("gelu", kernels.gelu, "GELU, tanh approximation.", real=True)
tanh = _unary("tanh", kernels.tanh, "tanh(x), elementwise.", real=True)
exp = _unary("exp", kernels.exp, "e**x, elementwise.", real=True)
log = _unary("log", kernels.log, "Natural log, elementwise.", real=True)
add = _binary("add", kernels.add, "a + b with numpy broadcasting.")
sub = _binary("sub", kernels.sub, "a - b with numpy broadcasting.")
mul = _binary("mul", kernels.mul, "a * b with numpy broadcasting.")
div = _binary("div", kernels.div, "a / b with numpy broadcasting; integers give float64.", real=True)

register("matmul", "compute", kernels.matmul)
register("bias_add", "compute", kernels.add)
register("softmax", "compute", kernels.softmax)
register("sum", "compute", kernels.reduce_sum)
register("mean", "compute", kernels.reduce_mean)
register("max", "compute", kernels.reduce_max)
register("reshape", "compute", kernels.reshape)
register("transpose", "compute", kernels.transpose)
register("concat", "compute", kernels.concat)
register("split", "compute", kernels.split)
register("slice", "compute", kernels.slice_)
register("call", "compute", kernels.call)
register("call_grad", "compute", kernels.call_grad)
register("full", "compute", kernels.full)


@dispatchable
def matmul(
    a: Tensor, b: Tensor, *, transpose_a: bool = False, transpose_b: bool = False, name: str | None = None
) -> Tensor:
    """a @ b; leading (batch) dimensions broadcast as in numpy. ``transpose_a`` /
    ``transpose_b`` use an operand with its last two dims swapped, without a copy."""
    check_inputs("matmul", [a, b])
    if a.ndim < 2 or b.ndim < 2:
        raise fail("matmul", f"needs tensors of at least 2 dims, got {a.shape} @ {b.shape}")
    (m, k1), (k2, n) = _last_two(a.shape, transpose_a), _last_two(b.shape, transpose_b)
    if k1 != k2:
        flags = (
            f" (transpose_a={transpose_a}, transpose_b={transpose_b})" if transpose_a or transpose_b else ""
        )
        raise fail("matmul", f"inner dimensions differ: {a.shape} @ {b.shape}{flags} ({k1} != {k2})")
    try:
        batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise fail("matmul", f"batch dimensions of {a.shape} @ {b.shape} do not broadcast") from None
    attrs = {key: True for key, on in (("transpose_a", transpose_a), ("transpose_b", transpose_b)) if on}
    return _compute("matmul", [a, b], (*batch, m, n), attrs=attrs, name=name)


def _last_two(shape: tuple[int, ...], transposed: bool) -> tuple[int, int]:
    return (shape[-1], shape[-2]) if transposed else (shape[-2], shape[-1])


@dispatchable
def bias_add(x: Tensor, bias: Tensor, *, name: str | None = None) -> Tensor:
    """x + bias, where bias matches x's trailing dimensions (a 1-D bias: the last one)."""
    check_inputs("bias_add", [x, bias])
    if bias.ndim == 0 or bias.ndim > x.ndim or x.shape[-bias.ndim :] != bias.shape:
        raise fail(
            "bias_add",
            f"bias of shape {bias.shape} does not match the trailing dims of {x.shape}",
        )
    return _compute("bias_add", [x, bias], x.shape, name=name)


@dispatchable
def softmax(x: Tensor, axis: int = -1, *, name: str | None = None) -> Tensor:
    check_inputs("softmax", [x])
    axis = axis_of("softmax", axis, x.ndim)
    return _compute("softmax", [x], x.shape, float_dtype(x.dtype), {"axis": axis}, name)


def _reduce(op: str, x: Tensor, axis, keepdims: bool, name: str | None, dtype: str | None = None) -> Tensor:
    check_inputs(op, [x])
    if axis is None:
        axes = tuple(range(x.ndim))
    else:
        raw = axis if isinstance(axis, (tuple, list)) else (axis,)
        axes = tuple(sorted({axis_of(op, a, x.ndim) for a in raw}))
    shape = tuple(1 if d in axes else n for d, n in enumerate(x.shape) if keepdims or d not in axes)
    attrs = {"axis": axes, "keepdims": bool(keepdims)}
    return _compute(op, [x], shape, dtype=dtype, attrs=attrs, name=name)


@dispatchable
def reduce_sum(x: Tensor, axis=None, keepdims: bool = False, *, name: str | None = None) -> Tensor:
    """Sum over ``axis`` (an int, a tuple, or None for all)."""
    return _reduce("sum", x, axis, keepdims, name)


@dispatchable
def reduce_mean(x: Tensor, axis=None, keepdims: bool = False, *, name: str | None = None) -> Tensor:
    """Mean over ``axis``; integer inputs give float64."""
    return _reduce("mean", x, axis, keepdims, name, float_dtype(x.dtype))


@dispatchable
def reduce_max(x: Tensor, axis=None, keepdims: bool = False, *, name: str | None = None) -> Tensor:
    """Maximum over ``axis``."""
    return _reduce("max", x, axis, keepdims, name)


@dispatchable
def reshape(x: Tensor, shape: Sequence[int], *, name: str | None = None) -> Tensor:
    """A new shape of the same size; one dimension may be -1."""
    check_inputs("reshape", [x])
    try:
        new = np.empty(x.shape, dtype=np.bool_).reshape(tuple(shape)).shape
    except (ValueError, TypeError) as e:
        raise fail("reshape", f"cannot reshape {x.shape} to {tuple(shape)}: {e}") from None
    return _compute("reshape", [x], new, name=name)


@dispatchable
def transpose(x: Tensor, perm: Sequence[int] | None = None, *, name: str | None = None) -> Tensor:
    """Permute dimensions (reverse them when ``perm`` is None)."""
    check_inputs("transpose", [x])
    perm = tuple(reversed(range(x.ndim))) if perm is None else tuple(int(p) for p in perm)
    if sorted(perm) != list(range(x.ndim)):
        raise fail("transpose", f"{perm} is not a permutation of the {x.ndim} dims of {x.shape}")
    shape = tuple(x.shape[p] for p in perm)
    return _compute("transpose", [x], shape, attrs={"perm": perm}, name=name)


@dispatchable
def concat(tensors: Sequence[Tensor], axis: int = 0, *, name: str | None = None) -> Tensor:
    """Join tensors along ``axis``; the other dims must agree."""
    tensors = list(tensors)
    check_inputs("concat", tensors)
    if not tensors:
        raise fail("concat", "needs at least one tensor")
    first = tensors[0]
    axis = axis_of("concat", axis, first.ndim)
    for t in tensors[1:]:
        if t.ndim != first.ndim or any(
            a != b for d, (a, b) in enumerate(zip(t.shape, first.shape)) if d != axis
        ):
            raise fail("concat", f"shapes {first.shape} and {t.shape} differ off axis {axis}")
    shape = list(first.shape)
    shape[axis] = sum(t.shape[axis] for t in tensors)
    return _compute("concat", tensors, shape, attrs={"axis": axis}, name=name)


@dispatchable
def split(
    x: Tensor, sections: int | Sequence[int], axis: int = 0, *, name: str | None = None
) -> list[Tensor]:
    """Split along ``axis`` into ``sections`` equal parts, or parts of the given sizes."""
    check_inputs("split", [x])
    axis = axis_of("split", axis, x.ndim)
    size = x.shape[axis]
    if isinstance(sections, (int, np.integer)):
        if sections <= 0 or size % sections:
            raise fail("split", f"{sections} equal parts do not divide dim {axis} of {x.shape}")
        sizes = [size // int(sections)] * int(sections)
    else:
        sizes = [int(s) for s in sections]
        if sum(sizes) != size or any(s < 0 for s in sizes):
            raise fail("split", f"sizes {sizes} do not add up to dim {axis} of {x.shape}")
    shapes = [tuple(s if d == axis else n for d, n in enumerate(x.shape)) for s in sizes]
    device = _device("split", [x])
    return add_node("split", [x], [(s, x.dtype, device) for s in shapes], {"axis": axis}, name)


@dispatchable
def slice_(x: Tensor, begin: Sequence[int], end: Sequence[int], *, name: str | None = None) -> Tensor:
    """x[begin[0]:end[0], begin[1]:end[1], ...]; missing trailing dims are taken whole."""
    check_inputs("slice", [x])
    if len(begin) != len(end) or len(begin) > x.ndim:
        raise fail("slice", f"begin {tuple(begin)} and end {tuple(end)} do not fit {x.shape}")
    begin = [int(b) for b in begin] + [0] * (x.ndim - len(begin))
    end = [int(e) for e in end] + list(x.shape[len(end) :])
    if any(not 0 <= b <= e <= n for b, e, n in zip(begin, end, x.shape)):
        raise fail("slice", f"[{begin}, {end}) is out of range for {x.shape}")
    shape = tuple(e - b for b, e in zip(begin, end))
    return _compute("slice", [x], shape, attrs={"begin": tuple(begin)}, name=name)


def call(
    fn: Callable,
    *inputs: Tensor,
    shape: Sequence[int],
    dtype="float32",
    device: str | None = None,
    name: str | None = None,
    grad: Callable | None = None,
) -> Tensor:
    """Run ``fn(*arrays) -> array`` as a compute actor on the inputs' device.

    ``shape`` and ``dtype`` declare what ``fn`` returns (another shape or dtype is a
    ``KernelError``). ``fn`` gets its inputs read-only: it returns a new array. It may be
    any callable, a lambda included; a Plan names a module-level function by its import
    path and carries others by value (which only a trusted load reads back).

    ``grad(*arrays, dout) -> (one gradient per input)`` makes the call differentiable:
    ``af.gradients`` runs it in the backward pass, once for each float input.
    """
    check_inputs("call", inputs)
    for what, f in (("", fn), ("grad=", grad)):
        if f is not None and not callable(f):
            raise fail("call", f"{what}{f!r} is not callable")
    if inputs:
        where = _device("call", inputs)
        if device is not None and device_of("call", device) != where:
            raise fail("call", f"device {device} differs from its inputs' device {where}")
    elif device is None:
        raise fail("call", "with no inputs, say where it runs with device=")
    else:
        where = device_of("call", device)
    (t,) = add_node(
        "call",
        inputs,
        [(tuple(shape), dtype_of("call", dtype), where)],
        {"fn": fn} if grad is None else {"fn": fn, "grad": grad},
        name,
    )
    return t


def call_grad(fn: Callable, inputs: Sequence[Tensor], dout: Tensor, wanted: Sequence[int]) -> list[Tensor]:
    """The gradients of a ``call``'s inputs ``wanted``: entries of ``fn(*inputs, dout)``,
    which one act computes once for all of them."""
    outputs = [(inputs[k].shape, inputs[k].dtype, inputs[k].device) for k in wanted]
    return add_node("call_grad", [*inputs, dout], outputs, {"fn": fn, "wanted": tuple(wanted)})


def full(
    shape: Sequence[int], value: float, dtype="float32", device: str = "cpu:0", *, name: str | None = None
) -> Tensor:
    """A tensor of ``shape`` holding ``value`` everywhere, rewritten each iteration."""
    (t,) = add_node(
        "full",
        [],
        [(tuple(int(d) for d in shape), dtype_of("full", dtype), device_of("full", device))],
        {"value": float(value)},
        name,
    )
    return t
