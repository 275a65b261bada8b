"""Data movement: copies between devices, and the feeds and fetches at the host's edge."""

from __future__ import annotations

from ..graph.builder import add_node, check_inputs, device_of
from ..graph.dispatch import dispatchable
from ..graph.ir import Tensor
from . import kernels
from .registry import register

register("copy", "copy", kernels.copy)
register("feed", "feed", kernels.copy)
register("fetch", "fetch", kernels.fetch)
register("parameter", "parameter", None)
register("variable", "variable", kernels.noop)


@dispatchable
def to_device(x: Tensor, device: str, *, name: str | None = None) -> Tensor:
    """``x`` on ``device``: a copy actor on the destination's copy stream (``x`` itself if
    already there). A tensor on several devices moves to as many devices, part by part."""
    check_inputs("to_device", [x])
    device = device_of("to_device", device)
    if device == x.device:
        return x
    (t,) = add_node("copy", [x], [(x.shape, x.dtype, device)], name=name, label="to_device")
    return t
