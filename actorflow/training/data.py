"""Synthetic data: a classification task a model can learn (labels from a random linear
teacher plus noise), cut into each step's micro-batches."""

from __future__ import annotations

import numpy as np

from ..config import Config


def synthetic_classification(config: Config) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, integer labels) for data.samples samples, from data.seed."""
    rng = np.random.default_rng(config.data.seed)
    x = rng.standard_normal((config.data.samples, config.features))
    teacher = rng.standard_normal((config.features, config.classes))
    labels = np.argmax(x @ teacher + 0.5 * rng.standard_normal((config.data.samples, config.classes)), axis=1)
    return x.astype(config.model.dtype), labels.astype(np.int64)


def step_feeds(config: Config, data: tuple[np.ndarray, np.ndarray], step: int) -> list[dict[str, np.ndarray]]:
    """Step ``step``'s global batch (the next batch_size samples, wrapping around), as one
    feed dict per micro-batch."""
    x, labels = data
    batch, rows = config.train.batch_size, config.micro_batch_size
    index = (step * batch + np.arange(batch)) % len(x)
    return [
        {"x": x[index[k : k + rows]], "labels": labels[index[k : k + rows]]}
        for k in range(0, batch, rows)
    ]
