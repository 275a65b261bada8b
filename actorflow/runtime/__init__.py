"""The runtime: sans-IO actor state, one driver task and one executor thread per stream."""

from .runtime import Runtime
from .session import Session, run

__all__ = ["Runtime", "Session", "run"]
