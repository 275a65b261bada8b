"""Tensors on several devices: SBP, boxing, and the builders and training entry points
that accept them."""

from .build import box, gradients, minimize, output, parameter, placeholder
from .global_tensor import GlobalTensor
from .recompute import recompute
from .sbp import B, P, S
from .signatures import dispatch

__all__ = [
    "B",
    "GlobalTensor",
    "P",
    "S",
    "box",
    "dispatch",
    "gradients",
    "minimize",
    "output",
    "parameter",
    "placeholder",
    "recompute",
]
