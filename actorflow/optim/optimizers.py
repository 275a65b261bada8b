"""Optimizers: each adds, per parameter, one update op that rewrites it in place once per
iteration (after every read of it in that iteration; see compiler/updates.py), or, for
async parameter servers, one per worker (``update_as_arriving``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import attrs
import numpy as np

from ..graph.builder import add_node, check_inputs, fail, is_shape_only, parameter, shape_only
from ..graph.ir import Tensor
from ..ops.registry import register
from . import kernels

register("sgd_update", "update", kernels.sgd_update)
register("adam_update", "update", kernels.adam_update)
register("async_sgd_update", "update", kernels.async_sgd_update)
register("async_adam_update", "update", kernels.async_adam_update)
register("snapshot", "compute", kernels.snapshot)


def _check(op: str, param: Tensor, grad: Tensor) -> None:
    check_inputs(op, [param, grad])
    node = param.graph.node_of(param)
    if node.op != "parameter" or node.attrs.get("state"):
        raise fail(op, f"{param.name!r} is not a model parameter (af.parameter)")
    if (grad.shape, grad.dtype, grad.device) != (param.shape, param.dtype, param.device):
        raise fail(
            op,
            f"gradient {grad.dtype}{list(grad.shape)} on {grad.device} does not match "
            f"parameter {param.name!r} {param.dtype}{list(param.shape)} on {param.device}",
        )


def _state(param: Tensor, suffix: str, value) -> Tensor:
    return parameter(f"{param.name}.{suffix}", value, param.device, state=True)


def _zeros(param: Tensor) -> np.ndarray:
    """The initial value of ``param``'s state: zeros, or of shape only as ``param``'s."""
    if is_shape_only(param.graph.nodes[param.node].attrs.get("value")):
        return shape_only(param.shape, param.dtype)
    return np.zeros(param.shape, param.dtype)


def _add_update(optimizer: SGD | Adam, param: Tensor, grad: Tensor) -> None:
    """The update op of ``optimizer`` for ``param``, with its state."""
    op = optimizer.op
    _check(op, param, grad)
    add_node(op, [param, grad, *optimizer.states(param)], [], optimizer.settings(), f"{param.name}.{op}")


@attrs.frozen
class SGD:
    """p -= lr * g, or with momentum: v = momentum * v + g; p -= lr * v."""

    lr: float
    momentum: float = 0.0
    op: ClassVar[str] = "sgd_update"

    def update(self, param: Tensor, grad: Tensor) -> None:
        _add_update(self, param, grad)

    def states(self, param: Tensor) -> list[Tensor]:
        return [_state(param, "momentum", _zeros(param))] if self.momentum else []

    def settings(self) -> dict[str, float]:
        return {"lr": float(self.lr), "momentum": float(self.momentum)}


@attrs.frozen
class Adam:
    """Adam with bias correction (Kingma & Ba), as torch.optim.Adam without weight decay."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    op: ClassVar[str] = "adam_update"

    def update(self, param: Tensor, grad: Tensor) -> None:
        _add_update(self, param, grad)

    def states(self, param: Tensor) -> list[Tensor]:
        zeros = _zeros(param)
        return [
            _state(param, "adam_m", zeros),
            _state(param, "adam_v", zeros),
            _state(param, "adam_t", np.zeros((), np.float64)),
        ]

    def settings(self) -> dict[str, float]:
        return {
            "lr": float(self.lr),
            "beta1": float(self.betas[0]),
            "beta2": float(self.betas[1]),
            "eps": float(self.eps),
        }


def snapshot(param: Tensor, clock: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """A copy of ``param`` and its version (int64, 0-d) taken on its device: what one
    worker of an async parameter server pulls (see ``kernels.snapshot``)."""
    copy, version = add_node(
        "snapshot",
        [param, clock],
        [(param.shape, param.dtype, param.device), ((), "int64", param.device)],
        {},
        name,
    )
    return copy, version


def update_as_arriving(
    optimizer: SGD | Adam, param: Tensor, grads: Sequence[Tensor], clock: Tensor, versions: Sequence[Tensor]
) -> Tensor:
    """One update of ``param`` per worker, ``grads[w]`` being the gradient of worker w's
    pull ``versions[w]`` (``snapshot``), all sharing one optimizer state: async
    parameter-server training, each worker's gradient applied as it arrives. Each
    update reads every worker's version of its step, so a worker pulls a step's
    parameters only once every worker's update of that many steps before (the versions'
    quota) is in. Returns the staleness counted so far (int64 sum and max, a state)."""
    states = optimizer.states(param)
    staleness = _state(param, "staleness", np.zeros(2, np.int64))
    for w, grad in enumerate(grads):
        _check(optimizer.op, param, grad)
        add_node(
            f"async_{optimizer.op}",
            [param, grad, *states, clock, staleness, *versions],
            [],
            optimizer.settings() | {"worker": w},
            f"{param.name}.{optimizer.op}[{w}]",
        )
    return staleness
