"""The MLP a config describes, as one micro-batch's graph: layers split over the
pipeline's stages, each stage replicated over its data-parallel devices (batch S(0),
parameters B), activations copied from stage to stage, a cross-entropy loss and the
optimizer's updates."""

from __future__ import annotations

import contextlib

import numpy as np

from .. import ops
from ..config import Config
from ..graph.builder import shape_only
from ..graph.ir import Graph, Tensor
from ..parallel import B, GlobalTensor, S, output, parameter, placeholder, recompute
from . import parameter_server, transformer
from .optimizer import minimize_loss

ACTIVATIONS = {"relu": ops.relu, "tanh": ops.tanh, "gelu": ops.gelu}


def initial_parameters(config: Config, values: bool = True) -> dict[str, np.ndarray]:
    """w{k} ~ N(0, 1/fan_in) and b{k} = 0 for each layer k, from data.seed (the
    transformer's: see ``transformer.initial_parameters``); ``values`` False: the weights
    of shape only (``shape_only``)."""
    if config.model.kind == "transformer":
        return transformer.initial_parameters(config, values)
    rng = np.random.default_rng(config.data.seed + 1)
    sizes, dtype = config.model.sizes, config.model.dtype
    initial = {}
    for k, (a, b) in enumerate(zip(sizes, sizes[1:])):
        initial[f"w{k}"] = (
            (rng.standard_normal((a, b)) / np.sqrt(a)).astype(dtype) if values else shape_only((a, b), dtype)
        )
        initial[f"b{k}"] = np.zeros(b, dtype)
    return initial


def build_graph(config: Config, values: bool = True) -> Graph:
    """Feeds ``x`` (micro-batch, features) and ``labels`` (micro-batch,); outputs ``loss``
    (the transformer's: see ``transformer.build_graph``); ``values``: see
    ``initial_parameters``."""
    if config.model.kind == "transformer":
        return transformer.build_graph(config, values=values)
    stages = [_placement(config, stage) for stage in config.parallel.stages]
    sbp = S(0) if config.parallel.data_parallel > 1 else None
    params = initial_parameters(config, values)
    served = parameter_server.placement(config, params)
    pulls: list[parameter_server.Pull] | None = [] if parameter_server.is_async(config) else None
    activation = ACTIVATIONS[config.model.activation]
    rows, dtype = config.micro_batch_size, config.model.dtype
    # With data parallelism the tensors are GlobalTensors, which ops take through
    # @dispatchable; the ops' annotations show one device only, hence the ignores below.
    with Graph() as graph:
        h = placeholder("x", (rows, config.features), dtype, stages[0], sbp)
        labels = placeholder("labels", (rows,), "int64", stages[-1], sbp)
        layer = 0
        for stage, count, again in zip(stages, config.stage_layers, config.parallel.recomputed):
            h = ops.to_device(h, stage)  # type: ignore[arg-type]
            with recompute() if again else contextlib.nullcontext():
                for _ in range(count):
                    w, b = (_parameter(f"{n}{layer}", params, stage, served, pulls) for n in "wb")
                    h = ops.bias_add(ops.matmul(h, w), b)  # type: ignore[arg-type]
                    if layer < config.layers - 1:
                        h = activation(h)
                    layer += 1
        loss = ops.softmax_cross_entropy(h, labels)  # type: ignore[arg-type]
        if pulls is not None:
            parameter_server.minimize_async(config, loss, pulls)
        else:
            on_servers = [n for n in graph.nodes if n.op == "parameter" and n.name in served]
            minimize_loss(config, loss, [graph.tensor((n.id, 0)) for n in on_servers] or None)
        output("loss", loss)
    return graph


def _parameter(
    name: str,
    values: dict[str, np.ndarray],
    stage: str | list[str],
    served: dict[str, str],
    pulls: list[parameter_server.Pull] | None,
) -> Tensor | GlobalTensor:
    """Parameter ``name`` as ``stage`` reads it: its own (a replica per device, B), or
    pulled from its parameter server (async: its pulls added to ``pulls``)."""
    if name in served and pulls is not None:
        pulled, pull = parameter_server.pull_async(parameter(name, values[name], served[name]), stage)
        pulls.append(pull)
        return pulled
    if name in served:
        return parameter_server.pull(parameter(name, values[name], served[name]), stage)
    return parameter(name, values[name], stage, B if isinstance(stage, list) else None)


def _placement(config: Config, stage: tuple[str, ...]) -> str | list[str]:
    return list(stage) if config.parallel.data_parallel > 1 else stage[0]
