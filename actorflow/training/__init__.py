"""Config-driven training runs (``actorflow run CONFIG``): the model and data a config
describes, built as a pipelined graph, compiled, run and measured."""

from .model import build_graph, initial_parameters
from .runner import RunResult, compile_config, train

__all__ = ["RunResult", "build_graph", "compile_config", "initial_parameters", "train"]
