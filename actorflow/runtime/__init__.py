"""The runtime: sans-IO actor state, and one thread per stream running its driver and kernels."""

from .runtime import Runtime
from .session import Session, run

__all__ = ["Runtime", "Session", "run"]
