"""Collectives over one tensor per device: one actor per participating device, run together
on their communication group's collective stream."""

from __future__ import annotations

from collections.abc import Sequence

from ..graph.builder import add_node, axis_of, check_inputs, device_of, fail, float_dtype
from ..graph.ir import Tensor
from . import kernels
from .registry import register

for _name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
    register(_name, "collective", getattr(kernels, _name))


def _group(op: str, tensors: Sequence[Tensor]) -> list[Tensor]:
    tensors = list(tensors)
    check_inputs(op, tensors)
    if not tensors:
        raise fail(op, "needs one tensor per device, got none")
    devices = [t.device for t in tensors]
    if len(set(devices)) != len(devices):
        raise fail(op, f"needs one tensor per device, got devices {devices}")
    first = tensors[0]
    for t in tensors[1:]:
        if (t.shape, t.dtype) != (first.shape, first.dtype):
            raise fail(
                op,
                f"tensors differ: {first.dtype}{list(first.shape)} on {first.device} vs "
                f"{t.dtype}{list(t.shape)} on {t.device}",
            )
    return tensors


def _collective(op, tensors, shape, attrs, name, dtype=None) -> list[Tensor]:
    outputs = [(shape, dtype or t.dtype, t.device) for t in tensors]
    return add_node(op, tensors, outputs, attrs, name)


def all_reduce(tensors: Sequence[Tensor], op: str = "sum", *, name: str | None = None) -> list[Tensor]:
    """Reduce (sum, mean or max) elementwise over devices; every device gets the result.
    A mean of integers is float64."""
    tensors = _group("all_reduce", tensors)
    if op not in ("sum", "mean", "max"):
        raise fail("all_reduce", f"op {op!r} is not one of 'sum', 'mean', 'max'")
    dtype = float_dtype(tensors[0].dtype) if op == "mean" else None
    return _collective("all_reduce", tensors, tensors[0].shape, {"op": op}, name, dtype)


def all_gather(tensors: Sequence[Tensor], axis: int = 0, *, name: str | None = None) -> list[Tensor]:
    """Concatenate the tensors along ``axis``, in list order; every device gets the result."""
    tensors = _group("all_gather", tensors)
    axis = axis_of("all_gather", axis, tensors[0].ndim)
    shape = list(tensors[0].shape)
    shape[axis] *= len(tensors)
    return _collective("all_gather", tensors, tuple(shape), {"axis": axis}, name)


def reduce_scatter(tensors: Sequence[Tensor], axis: int = 0, *, name: str | None = None) -> list[Tensor]:
    """Sum over devices; the k-th tensor's device keeps the k-th of n equal chunks along ``axis``."""
    tensors = _group("reduce_scatter", tensors)
    axis = axis_of("reduce_scatter", axis, tensors[0].ndim)
    shape = list(tensors[0].shape)
    if shape[axis] % len(tensors):
        raise fail(
            "reduce_scatter",
            f"dim {axis} of {tuple(shape)} does not split into {len(tensors)} equal chunks",
        )
    shape[axis] //= len(tensors)
    return _collective("reduce_scatter", tensors, tuple(shape), {"axis": axis}, name)


def all_to_all(
    tensors: Sequence[Tensor],
    split_axis: int = 0,
    concat_axis: int = 0,
    *,
    name: str | None = None,
) -> list[Tensor]:
    """The i-th tensor's device sends the k-th chunk (along ``split_axis``) of its tensor to
    the k-th tensor's device, which concatenates what it receives along ``concat_axis``, in
    list order."""
    tensors = _group("all_to_all", tensors)
    ndim, n = tensors[0].ndim, len(tensors)
    split_axis = axis_of("all_to_all", split_axis, ndim)
    concat_axis = axis_of("all_to_all", concat_axis, ndim)
    shape = list(tensors[0].shape)
    if shape[split_axis] % n:
        raise fail(
            "all_to_all",
            f"dim {split_axis} of {tuple(shape)} does not split into {n} equal chunks",
        )
    shape[split_axis] //= n
    shape[concat_axis] *= n
    attrs = {"split_axis": split_axis, "concat_axis": concat_axis}
    return _collective("all_to_all", tensors, tuple(shape), attrs, name)


def broadcast(tensor: Tensor, devices: Sequence[str], *, name: str | None = None) -> list[Tensor]:
    """``tensor`` on each of ``devices`` (one result per device, in that order)."""
    check_inputs("broadcast", [tensor])
    targets = [device_of("broadcast", d) for d in devices]
    if not targets or len(set(targets)) != len(targets):
        raise fail("broadcast", f"needs distinct target devices, got {list(devices)}")
    outputs = [(tensor.shape, tensor.dtype, d) for d in targets]
    return add_node("broadcast", [tensor], outputs, {}, name)


_RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def ring_bytes(op: str, nbytes: float, devices: int) -> float:
    """What one participant of a ring implementation of ``op`` sends, ``nbytes`` being
    its input (all-reduce: 2(n-1)/n x bytes). One device moves nothing."""
    return _RING_FACTOR[op](devices) * nbytes if devices > 1 else 0.0


def ring_total_bytes(op: str, nbytes: int, devices: int) -> float:
    """What all the participants of a ring ``op`` send together (all-reduce of s bytes
    each: 2(n-1) s; OneFlow's boxing table)."""
    return devices * ring_bytes(op, nbytes, devices)


def ring_seconds(op: str, nbytes: int, devices: int, bandwidth: float, latency: float) -> float:
    """Time a ring implementation of ``op`` takes over a link of ``bandwidth`` bytes/s and
    ``latency`` seconds, ``nbytes`` being one participant's input (all-reduce:
    2(n-1)/n x bytes / bandwidth + latency). One device moves nothing."""
    if devices < 2:
        return 0.0
    return ring_bytes(op, nbytes, devices) / bandwidth + latency
