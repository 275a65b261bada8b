"""The user-facing builders, for tensors on one device or on several.

``placeholder``, ``parameter`` and ``output`` take ``device=[...]`` and ``sbp=`` to make a
global tensor: one part per device, recorded in the graph as a logical tensor so a run
takes and gives whole arrays. ``gradients`` and ``minimize`` accept global tensors: the
gradient of a broadcast parameter is partial on each device and is all-reduced before
every replica takes the same update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import numpy as np

from .. import graph as g
from .. import ops, optim
from ..autodiff import gradients as local_gradients
from ..errors import GraphError
from ..graph.builder import device_of, dtype_of, graph_for
from ..graph.ir import Graph, OptimizerShard, Tensor
from ..plan import LogicalTensor
from . import boxing
from .boxing import box as _box
from .global_tensor import GlobalTensor, local_shape
from .program import Pending, is_pending, pending_leaf, record_call, record_leaf
from .sbp import SBP, B, Broadcast, P, Partial, Split, sbp_code


def _placement(op: str, device: Any, sbp: SBP | None) -> list[str] | None:
    """The devices of a global tensor, or None for a tensor on one device."""
    if not isinstance(device, (list, tuple)):
        if sbp is not None:
            raise GraphError(f"{op}: sbp= needs a list of devices, got {device!r}")
        return None
    devices = [device_of(op, d) for d in device]
    if not devices or len(set(devices)) != len(devices):
        raise GraphError(f"{op}: needs distinct devices, got {list(device)}")
    if isinstance(sbp, Partial):
        raise GraphError(f"{op}: a tensor on several devices takes sbp=af.S(axis), af.B or None, not P")
    return devices


def _record(kind: str, name: str, sbp: SBP, parts: Sequence[str]) -> None:
    graph = graph_for(kind)
    graph.unique_name(name, kind)
    graph.logical.append(LogicalTensor(kind, name, *sbp_code(sbp), tuple(parts)))


@overload
def placeholder(
    name: str, shape: Sequence[int], dtype: Any = "float32", device: str = "cpu:0", sbp: None = None
) -> Tensor: ...


@overload
def placeholder(
    name: str, shape: Sequence[int], dtype: Any = "float32", *, device: Sequence[str], sbp: SBP
) -> GlobalTensor: ...


@overload
def placeholder(
    name: str, shape: Sequence[int], dtype: Any, device: Sequence[str], sbp: SBP
) -> GlobalTensor: ...


@overload
def placeholder(
    name: str, shape: Sequence[int], dtype: Any = "float32", device: Any = "cpu:0", sbp: SBP | None = None
) -> Tensor | GlobalTensor: ...


def placeholder(
    name: str, shape: Sequence[int], dtype: Any = "float32", device: Any = "cpu:0", sbp: SBP | None = None
) -> Tensor | GlobalTensor:
    """A tensor fed at each iteration; on several devices with ``sbp`` (fed whole)."""
    devices = _placement("placeholder", device, sbp)
    if devices is None:
        return g.placeholder(name, shape, dtype, device)
    shape = tuple(shape)
    if sbp is None:
        return pending_leaf("placeholder", name, shape, dtype_of("placeholder", dtype), devices)
    part = local_shape("placeholder", shape, sbp, len(devices))
    parts = [g.placeholder(f"{name}[{d}]", part, dtype, d) for d in devices]
    _record("feed", name, sbp, [p.name for p in parts])
    tensor = GlobalTensor(shape, sbp, tuple(parts))
    record_leaf("placeholder", name, devices, sbp, tensor)
    return tensor


@overload
def parameter(name: str, value: Any, device: str = "cpu:0", sbp: None = None) -> Tensor: ...


@overload
def parameter(name: str, value: Any, device: Sequence[str], sbp: SBP) -> GlobalTensor: ...


@overload
def parameter(
    name: str, value: Any, device: Any = "cpu:0", sbp: SBP | None = None
) -> Tensor | GlobalTensor: ...


def parameter(name: str, value: Any, device: Any = "cpu:0", sbp: SBP | None = None) -> Tensor | GlobalTensor:
    """A tensor kept across iterations; on several devices with ``sbp`` (a replica per
    device for B, a shard per device for S)."""
    devices = _placement("parameter", device, sbp)
    if devices is None:
        return g.parameter(name, value, device)
    value = np.asarray(value)
    if sbp is None:
        dtype = dtype_of("parameter", value.dtype)
        return pending_leaf("parameter", name, value.shape, dtype, devices, value)
    local_shape("parameter", value.shape, sbp, len(devices))
    values = (
        np.split(value, len(devices), axis=sbp.axis) if isinstance(sbp, Split) else [value] * len(devices)
    )
    parts = [g.parameter(f"{name}[{d}]", v, d) for d, v in zip(devices, values)]
    _record("parameter", name, sbp, [p.name for p in parts])
    tensor = GlobalTensor(value.shape, sbp, tuple(parts))
    record_leaf("parameter", name, devices, sbp, tensor, value)
    return tensor


def output(name: str, tensor: Tensor | GlobalTensor) -> None:
    """Return ``tensor`` from each iteration under ``name`` (a global one as one array)."""
    if isinstance(tensor, Pending):
        record_call(output, (name, tensor), {}, op=False)
        return
    if not isinstance(tensor, GlobalTensor):
        return g.output(name, tensor)
    parts = [f"{name}[{d}]" for d in tensor.devices]
    for part, t in zip(parts, tensor.locals):
        g.output(part, t)
    _record("output", name, tensor.sbp, parts)
    record_call(output, (name, tensor), {}, op=False)


def box(x: GlobalTensor, to: SBP) -> GlobalTensor:
    """``x`` with SBP ``to`` (see ``boxing``)."""
    if isinstance(x, Pending):
        raise GraphError("box: the compiler chooses this tensor's SBP; box only tensors with one")
    return record_call(box, (x, to), {}, boxing.box(x, to), op=False)


def gradients(y: Tensor | GlobalTensor, xs: Sequence[Any], dy: Tensor | None = None) -> list[Any]:
    """Like ``af.gradients``; for a global ``y`` (partial or broadcast), the gradient of a
    broadcast x is partial (P), that of a split x is split the same way."""
    if is_pending((y, xs)):
        raise GraphError("gradients: the compiler chooses these tensors' SBP; use minimize, which it replays")
    if not isinstance(y, GlobalTensor):
        return local_gradients(y, xs, dy)
    if dy is not None:
        raise GraphError("gradients: dy is not supported for a tensor on several devices")
    if isinstance(y.sbp, Split):
        raise GraphError(f"gradients: y must be partial or broadcast, not {y.sbp!r}; reduce it first")
    with y.locals[0].graph:
        roots = _box(y, P).locals if isinstance(y.sbp, Broadcast) else y.locals
        flat = [t for x in xs for t in (x.locals if isinstance(x, GlobalTensor) else [x])]
        grads = iter(local_gradients(list(roots), flat))
        out: list[Tensor | GlobalTensor | None] = []
        for x in xs:
            if not isinstance(x, GlobalTensor):
                out.append(next(grads))
                continue
            parts = [next(grads) for _ in x.locals]
            if all(p is None for p in parts):
                out.append(None)
                continue
            filled = tuple(
                p if p is not None else ops.full(t.shape, 0.0, t.dtype, t.device)
                for p, t in zip(parts, x.locals)
            )
            out.append(GlobalTensor(x.shape, P if isinstance(x.sbp, Broadcast) else x.sbp, filled))
    return out


def minimize(
    loss: Tensor | GlobalTensor,
    optimizer: optim.SGD | optim.Adam,
    params: Sequence[Any] | None = None,
    *,
    shard: bool = False,
    shard_threshold_kb: float = 64,
    gradient_accumulation_shard: bool = True,
) -> list[Any]:
    """Like ``af.minimize``; with a global loss, every global parameter (or ``params``)
    gets its gradient all-reduced (broadcast ones) and each part the same update.

    ``shard``: optimizer parallel (ZeRO-1/2, MindSpore's parallel optimizer) for every
    broadcast parameter of at least ``shard_threshold_kb`` KiB per replica with a dim
    its replicas divide: the compiler keeps one shard of it and of its optimizer state
    per replica, reduce-scatters its gradient, updates each shard where it lives and
    all-gathers the parameter for the next step (see ``compiler.optimizer_shards``).
    ``gradient_accumulation_shard``: with micro-batches, the gradient is
    reduce-scattered at each micro-batch and accumulated as a shard (else accumulated
    whole and reduce-scattered once per step: less communication, more memory).
    """
    if (
        not isinstance(shard_threshold_kb, (int, float))
        or isinstance(shard_threshold_kb, bool)
        or shard_threshold_kb < 0
    ):
        raise GraphError(f"minimize: shard_threshold_kb is a number >= 0, got {shard_threshold_kb!r}")
    options = {
        "shard": shard,
        "shard_threshold_kb": shard_threshold_kb,
        "gradient_accumulation_shard": gradient_accumulation_shard,
    }
    if is_pending((loss, params)):
        record_call(minimize, (loss, optimizer, params), options, op=False)
        return []
    if not isinstance(loss, GlobalTensor):
        return optim.minimize(loss, optimizer, params)
    graph = loss.locals[0].graph
    if params is None:
        params = _global_parameters(graph)
    grads = gradients(loss, params)
    used = [(p, gr) for p, gr in zip(params, grads) if gr is not None]
    if not used:
        raise GraphError(f"minimize: loss {loss.name!r} depends on no parameter")
    with graph:
        for param, grad in used:
            if isinstance(param, GlobalTensor):
                grad = _box(grad, param.sbp)
                for part, part_grad in zip(param.locals, grad.locals):
                    optimizer.update(part, part_grad)
            else:
                optimizer.update(param, grad)
    record_call(minimize, (loss, optimizer, params), options, op=False)
    if shard:
        graph.optimizer_shards.extend(
            OptimizerShard(name, axis, gradient_accumulation_shard)
            for name, axis in _shardable(graph, [p for p, _ in used], shard_threshold_kb * 1024)
        )
    return [gr for _, gr in used]


def _shardable(graph: Graph, params: Sequence[Any], threshold: float) -> list[tuple[str, int]]:
    """(logical name, axis) of each broadcast parameter over several devices whose part
    holds at least ``threshold`` bytes, cut along its first dim the replicas divide."""
    names = {lt.parts: lt.name for lt in graph.logical if lt.kind == "parameter"}
    chosen = []
    for param in params:
        if not isinstance(param, GlobalTensor) or not isinstance(param.sbp, Broadcast):
            continue
        n, part = len(param.locals), param.locals[0]
        if n < 2 or part.meta.nbytes < threshold:
            continue
        axis = next((a for a, size in enumerate(part.shape) if size and size % n == 0), None)
        if axis is not None:
            chosen.append((names[tuple(t.name for t in param.locals)], axis))
    return chosen


def _global_parameters(graph: Graph) -> list[GlobalTensor]:
    by_name = {n.name: n for n in graph.nodes}
    params = []
    for lt in graph.logical:
        if lt.kind != "parameter":
            continue
        parts = tuple(graph.tensor((by_name[p].id, 0)) for p in lt.parts)
        sbp = Split(lt.axis) if lt.sbp == "S" else B
        shape = list(parts[0].shape)
        if lt.sbp == "S":
            shape[lt.axis] *= len(parts)
        params.append(GlobalTensor(tuple(shape), sbp, parts))
    return params
