"""``minimize``: gradients of a loss and an optimizer update for each parameter."""

from __future__ import annotations

from collections.abc import Sequence

from ..autodiff.gradients import gradients
from ..errors import GraphError
from ..graph.ir import Tensor
from .optimizers import SGD, Adam


def minimize(loss: Tensor, optimizer: SGD | Adam, params: Sequence[Tensor] | None = None) -> list[Tensor]:
    """Add the backward pass of ``loss`` and an in-place update of every parameter it
    depends on (or of ``params``); returns the gradients, in parameter order."""
    graph = loss.graph
    if params is None:
        params = [
            graph.tensor((n.id, 0)) for n in graph.nodes if n.op == "parameter" and not n.attrs.get("state")
        ]
    grads = gradients(loss, params)
    used = [(p, g) for p, g in zip(params, grads) if g is not None]
    if not used:
        raise GraphError(f"minimize: loss {loss.name!r} depends on no parameter")
    for p, g in used:
        optimizer.update(p, g)
    return [g for _, g in used]
