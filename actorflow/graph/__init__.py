"""The logical graph: its IR and the builder API."""

from .builder import output, parameter, placeholder
from .ir import Graph, Node, Tensor, TensorMeta, current_graph

__all__ = [
    "Graph",
    "Node",
    "Tensor",
    "TensorMeta",
    "current_graph",
    "output",
    "parameter",
    "placeholder",
]
