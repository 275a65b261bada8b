"""A tensor placed on several devices: its logical shape and SBP, and one local tensor
per device. Ops given one expand into per-device ops (``signatures`` registers the
dispatch)."""

from __future__ import annotations

import attrs

from ..errors import GraphError
from ..graph.ir import Tensor
from .sbp import SBP, Split


@attrs.frozen(eq=False)
class GlobalTensor:
    shape: tuple[int, ...]
    sbp: SBP
    locals: tuple[Tensor, ...]

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(t.device for t in self.locals)

    @property
    def dtype(self) -> str:
        return self.locals[0].dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def name(self) -> str:
        return self.locals[0].name.split("[")[0]

    def __repr__(self) -> str:
        return f"GlobalTensor({self.dtype}{list(self.shape)}, {self.sbp!r} over {list(self.devices)})"

    def __attrs_post_init__(self) -> None:
        self.locals[0].graph.sbp[self.name] = repr(self.sbp)


def local_shape(op: str, shape: tuple[int, ...], sbp: SBP, devices: int) -> tuple[int, ...]:
    """One device's part of a tensor of logical ``shape``."""
    if not isinstance(sbp, Split):
        return shape
    axis = sbp.axis
    if not 0 <= axis < len(shape) or shape[axis] % devices:
        raise GraphError(f"{op}: S({axis}) does not split shape {shape} into {devices} equal parts")
    return tuple(d // devices if k == axis else d for k, d in enumerate(shape))
