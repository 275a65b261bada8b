"""The optimizer a config names, and the minimize call every model ends with."""

from __future__ import annotations

from .. import optim
from ..config import Config, OptimizerConfig
from ..graph.ir import Tensor
from ..parallel import GlobalTensor, minimize


def optimizer(spec: OptimizerConfig) -> optim.SGD | optim.Adam:
    if spec.kind == "adam":
        return optim.Adam(lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps)
    return optim.SGD(lr=spec.lr, momentum=spec.momentum)


def minimize_loss(config: Config, loss: Tensor | GlobalTensor, params: list[Tensor] | None = None) -> None:
    """Backward pass and updates (of ``params``, default every parameter), sharded over
    the replicas if train.optimizer.shard."""
    spec = config.train.optimizer
    minimize(
        loss,
        optimizer(spec),
        params,
        shard=spec.shard,
        shard_threshold_kb=spec.shard_threshold_kb,
        gradient_accumulation_shard=spec.gradient_accumulation_shard,
    )
