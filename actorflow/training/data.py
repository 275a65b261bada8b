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


Part = tuple[str, int, int]


def step_feeds(
    config: Config, data: tuple[np.ndarray, np.ndarray], step: int, parts: dict[str, Part] | None = None
) -> list[dict[str, np.ndarray]]:
    """Step ``step``'s global batch (the next batch_size samples, wrapping around), as one
    feed dict per micro-batch. ``parts``: only these feeds, each named by its placeholder
    (``x[cpu:2]``) and given as (source, k, n): the k-th of n slices of the micro-batch's
    ``x`` or ``labels`` (a rank reads only what its devices are fed)."""
    x, labels = data
    source = {"x": x, "labels": labels}
    batch, rows = config.train.batch_size, config.micro_batch_size
    index = (step * batch + np.arange(batch)) % len(x)
    if parts is None:
        parts = {"x": ("x", 0, 1), "labels": ("labels", 0, 1)}
    feeds = []
    for k in range(0, batch, rows):
        micro = index[k : k + rows]
        feeds.append(
            {
                name: source[what][micro[j * rows // n : (j + 1) * rows // n]]
                for name, (what, j, n) in parts.items()
            }
        )
    return feeds
