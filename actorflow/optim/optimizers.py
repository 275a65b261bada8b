"""Optimizers: each adds, per parameter, one update op that rewrites it in place once per
iteration (after every read of it in that iteration; see compiler/updates.py)."""

from __future__ import annotations

import attrs
import numpy as np

from ..graph.builder import add_node, check_inputs, fail, is_shape_only, parameter, shape_only
from ..graph.ir import Tensor
from ..ops.registry import register
from . import kernels

register("sgd_update", "update", kernels.sgd_update)
register("adam_update", "update", kernels.adam_update)


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


@attrs.frozen
class SGD:
    """p -= lr * g, or with momentum: v = momentum * v + g; p -= lr * v."""

    lr: float
    momentum: float = 0.0

    def update(self, param: Tensor, grad: Tensor) -> None:
        _check("sgd_update", param, grad)
        states = [_state(param, "momentum", _zeros(param))] if self.momentum else []
        attrs_ = {"lr": float(self.lr), "momentum": float(self.momentum)}
        add_node("sgd_update", [param, grad, *states], [], attrs_, f"{param.name}.sgd_update")


@attrs.frozen
class Adam:
    """Adam with bias correction (Kingma & Ba), as torch.optim.Adam without weight decay."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def update(self, param: Tensor, grad: Tensor) -> None:
        _check("adam_update", param, grad)
        zeros = _zeros(param)
        states = [
            _state(param, "adam_m", zeros),
            _state(param, "adam_v", zeros),
            _state(param, "adam_t", np.zeros((), np.float64)),
        ]
        attrs_ = {
            "lr": float(self.lr),
            "beta1": float(self.betas[0]),
            "beta2": float(self.betas[1]),
            "eps": float(self.eps),
        }
        add_node("adam_update", [param, grad, *states], [], attrs_, f"{param.name}.adam_update")
