"""A config's data: a classification task a model can learn (labels from a random linear
teacher plus noise) for the mlp, or windows of a text for the transformer (each
character predicting the next); cut into each step's micro-batches."""

from __future__ import annotations

import codecs
import io
import os
import stat
from collections.abc import Iterator
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


MAX_TEXT_BYTES = 1 << 30
"""The largest file data.path may name (1 GiB): reading holds its bytes and one id per
character at once, about twice its size for an ASCII text."""

_CHUNK = 1 << 20
"""Bytes decoded at a time: what a read holds beyond the file's bytes and its ids."""

_CODE_POINTS = 0x110000


def text_windows(config: Config) -> Data:
    """Character ids (samples, seq_len) at random offsets of the text, and the ids one
    character later as labels."""
    path = Path(config.data.path) if config.data.path is not None else TEXT
    ids, vocab = text_ids(path)
    seq = config.model.seq_len
    if len(vocab) > config.model.vocab:
        raise ConfigError(
            f"model.vocab: {path.name} has {len(vocab)} distinct characters, more than {config.model.vocab}"
        )
    if len(ids) <= seq:
        raise ConfigError(f"data.path: {path.name} has {len(ids)} characters, fewer than model.seq_len + 1")
    starts = np.random.default_rng(config.data.seed).integers(0, len(ids) - seq, config.data.samples)
    windows = ids[starts[:, None] + np.arange(seq + 1)].astype(np.int64)
    return {"x": windows[:, :-1], "labels": windows[:, 1:]}


def text_ids(path: Path) -> tuple[np.ndarray, str]:
    """The UTF-8 text at ``path`` (newlines read as ``Path.read_text`` reads them) as ids
    into its vocabulary, in the smallest unsigned integer type they fit, and the
    vocabulary: its distinct characters in code point order. The file is read once, and
    decoded twice a chunk at a time (the vocabulary, then the ids), so memory is its
    bytes, its ids and a chunk's worth. Not a regular file, or one of more than
    ``MAX_TEXT_BYTES``: a ConfigError."""
    try:
        size = _regular_size(path)
        with open(path, "rb") as file:
            raw = file.read(size)
        present = np.zeros(_CODE_POINTS, bool)
        length = 0
        for points in _code_points(raw):
            present[points] = True
            length += len(points)
        vocab = np.flatnonzero(present)
        table = np.zeros(_CODE_POINTS, np.min_scalar_type(max(len(vocab) - 1, 0)))
        table[vocab] = np.arange(len(vocab))
        ids = np.empty(length, table.dtype)
        done = 0
        for points in _code_points(raw):
            ids[done : done + len(points)] = table[points]
            done += len(points)
    except (OSError, UnicodeError) as err:
        raise ConfigError(
            f"data.path: cannot read {str(path)!r}: {getattr(err, 'strerror', None) or err}"
        ) from None
    return ids, "".join(map(chr, vocab))


def _regular_size(path: Path) -> int:
    """The size of the regular file at ``path``, if at most ``MAX_TEXT_BYTES``; asked of
    the file system, so a device or a fifo is refused without being opened."""
    mode = os.stat(path)
    if not stat.S_ISREG(mode.st_mode):
        raise ConfigError(f"data.path: {str(path)!r} is not a regular file")
    if mode.st_size > MAX_TEXT_BYTES:
        raise ConfigError(
            f"data.path: {str(path)!r} has {mode.st_size} bytes, more than the {MAX_TEXT_BYTES} a text may have"
        )
    return mode.st_size


def _code_points(raw: bytes) -> Iterator[np.ndarray]:
    """The code points of UTF-8 ``raw``, a chunk at a time, "\r\n" and "\r" read as "\n"."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    view = memoryview(raw)
    for start in range(0, len(raw), _CHUNK):
        text = decoder.decode(view[start : start + _CHUNK], final=start + _CHUNK >= len(raw))
        yield np.frombuffer(text.encode("utf-32-le"), np.uint32)


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
