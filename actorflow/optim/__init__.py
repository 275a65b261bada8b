"""Training: optimizers and ``minimize``."""

from .minimize import minimize
from .optimizers import SGD, Adam

__all__ = ["SGD", "Adam", "minimize"]
