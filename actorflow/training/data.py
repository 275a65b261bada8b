"""A config's data: a classification task a model can learn (labels from a random linear
teacher plus noise) for the mlp, or windows of a text for the transformer (each
character predicting the next); cut into each step's micro-batches."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import Config
from ..errors import ConfigError

TEXT = Path(__file__).with_name("sonnets.txt")
"""The text a transformer trains on when data.path names none: sonnets by Shakespeare."""

Data = dict[str, np.ndarray]
"""``x`` and ``labels``, a sample per row."""


def dataset(config: Config) -> Data:
    """data.samples samples, from data.seed."""
    if config.data.kind == "text":
        return text_windows(config)
    return synthetic_classification(config)


def synthetic_classification(config: Config) -> Data:
    """Inputs (samples, features) and integer labels (samples,)."""
    rng = np.random.default_rng(config.data.seed)
    x = rng.standard_normal((config.data.samples, config.features))
    teacher = rng.standard_normal((config.features, config.classes))
    labels = np.argmax(x @ teacher + 0.5 * rng.standard_normal((config.data.samples, config.classes)), axis=1)
    return {"x": x.astype(config.model.dtype), "labels": labels.astype(np.int64)}


def characters(text: str) -> str:
    """The vocabulary: the text's distinct characters, in code point order."""
    return "".join(sorted(set(text)))


def text_windows(config: Config) -> Data:
    """Character ids (samples, seq_len) at random offsets of the text, and the ids one
    character later as labels."""
    path = Path(config.data.path) if config.data.path is not None else TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as err:
        raise ConfigError(
            f"data.path: cannot read {str(path)!r}: {getattr(err, 'strerror', None) or err}"
        ) from None
    vocab, seq = characters(text), config.model.seq_len
    if len(vocab) > config.model.vocab:
        raise ConfigError(
            f"model.vocab: {path.name} has {len(vocab)} distinct characters, more than {config.model.vocab}"
        )
    if len(text) <= seq:
        raise ConfigError(f"data.path: {path.name} has {len(text)} characters, fewer than model.seq_len + 1")
    ids = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.searchsorted(np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32), ids).astype(np.int64)
    starts = np.random.default_rng(config.data.seed).integers(0, len(ids) - seq, config.data.samples)
    windows = ids[starts[:, None] + np.arange(seq + 1)]
    return {"x": windows[:, :-1], "labels": windows[:, 1:]}


Part = tuple[str, int, int]


def step_feeds(config: Config, data: Data, step: int, parts: dict[str, Part] | None = None) -> list[Data]:
    """Step ``step``'s global batch (the next batch_size samples, wrapping around), as one
    feed dict per micro-batch. ``parts``: only these feeds, each named by its placeholder
    (``x[cpu:2]``) and given as (source, k, n): the k-th of n slices of the micro-batch's
    ``x`` or ``labels`` (a rank reads only what its devices are fed)."""
    batch, rows = config.train.batch_size, config.micro_batch_size
    index = (step * batch + np.arange(batch)) % len(data["x"])
    if parts is None:
        parts = {"x": ("x", 0, 1), "labels": ("labels", 0, 1)}
    feeds = []
    for k in range(0, batch, rows):
        micro = index[k : k + rows]
        feeds.append(
            {
                name: data[what][micro[j * rows // n : (j + 1) * rows // n]]
                for name, (what, j, n) in parts.items()
            }
        )
    return feeds
