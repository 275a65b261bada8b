"""A config's data: a classification task a model can learn (labels from a random linear
teacher plus noise) or the rows of two memory-mapped .npy files for the mlp, or windows
of a text for the transformer (each character predicting the next); cut into each
step's micro-batches, of which each feed reads only its part."""

from __future__ import annotations

import codecs
import io
import mmap
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ..config import Config
from ..errors import ConfigError

TEXT = Path(__file__).with_name("sonnets.txt")
"""The text a transformer trains on when data.path names none: sonnets by Shakespeare."""

Data = dict[str, np.ndarray]
"""``x`` and ``labels``, a sample per row."""


def dataset(config: Config) -> Data:
    """data.samples samples, from data.seed or from files."""
    if config.data.kind == "text":
        return text_windows(config)
    if config.data.kind == "npy":
        return npy_arrays(config)
    return synthetic_classification(config)


def synthetic_classification(config: Config) -> Data:
    """Inputs (samples, features) and integer labels (samples,)."""
    rng = np.random.default_rng(config.data.seed)
    x = rng.standard_normal((config.data.samples, config.features))
    teacher = rng.standard_normal((config.features, config.classes))
    labels = np.argmax(x @ teacher + 0.5 * rng.standard_normal((config.data.samples, config.classes)), axis=1)
    return {"x": x.astype(config.model.dtype), "labels": labels.astype(np.int64)}


def npy_arrays(config: Config) -> Data:
    """The first data.samples rows of the .npy files data.x and data.labels, checked
    against the model, memory-mapped: the feeds read only the rows they take (see
    ``Part``) and let go of them (``read_parts``), so a rank holds no more of the files
    than a micro-batch's part. The labels are read whole once, to check their range."""
    data, rows = config.data, config.data.samples
    assert data.x is not None and data.labels is not None, "parse_config requires both for npy"
    x, labels = _memmap("data.x", data.x), _memmap("data.labels", data.labels)
    if x.shape[1:] != (config.features,) or x.dtype != config.model.dtype:
        raise ConfigError(
            f"data.x: {data.x} holds {x.dtype}{list(x.shape)}, the model takes "
            f"{config.model.dtype}[rows, {config.features}] (model.dtype, model.sizes[0])"
        )
    if labels.ndim != 1 or labels.dtype != np.int64:
        raise ConfigError(
            f"data.labels: {data.labels} holds {labels.dtype}{list(labels.shape)}, expected int64[rows]"
        )
    if len(labels) != len(x):
        raise ConfigError(f"data.labels: {data.labels} has {len(labels)} rows, data.x {len(x)}")
    if len(x) < rows:
        raise ConfigError(f"data.samples: {rows} is more than the {len(x)} rows of data.x")
    outside = np.flatnonzero((labels[:rows] < 0) | (labels[:rows] >= config.classes))
    if len(outside):
        raise ConfigError(
            f"data.labels: row {outside[0]} is class {labels[outside[0]]}, "
            f"not in 0..{config.classes - 1} (model.sizes[-1] classes)"
        )
    return {"x": x[:rows], "labels": labels[:rows]}


def _memmap(key: str, path: str) -> np.ndarray:
    """The array in the .npy file at ``path``, memory-mapped read-only."""
    _regular(key, path)
    try:
        return np.lib.format.open_memmap(path, mode="r")
    except (OSError, ValueError) as err:
        problem = getattr(err, "strerror", None) or str(err).partition("\n")[0]
        raise ConfigError(f"{key}: cannot read {path!r} as a .npy array: {problem}") from None


def _regular(key: str, path: str | Path) -> os.stat_result:
    """The file system's word on ``path``, refused unless a regular file: a device or a
    fifo is never opened (reading /dev/zero would not end, opening a fifo waits)."""
    try:
        found = os.stat(path)
    except OSError as err:
        raise ConfigError(f"{key}: cannot read {str(path)!r}: {err.strerror}") from None
    if not stat.S_ISREG(found.st_mode):
        raise ConfigError(f"{key}: {str(path)!r} is not a regular file")
    return found


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
    size = _regular("data.path", path).st_size
    if size > MAX_TEXT_BYTES:
        raise ConfigError(
            f"data.path: {str(path)!r} has {size} bytes, more than the {MAX_TEXT_BYTES} a text may have"
        )
    try:
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


def _code_points(raw: bytes) -> Iterator[np.ndarray]:
    r"""The code points of UTF-8 ``raw``, a chunk at a time, "\r\n" and "\r" read as "\n"."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    view = memoryview(raw)
    for start in range(0, len(raw), _CHUNK):
        text = decoder.decode(view[start : start + _CHUNK], final=start + _CHUNK >= len(raw))
        yield np.frombuffer(text.encode("utf-32-le"), np.uint32)


@attrs.frozen
class Part:
    """What one feed takes of each micro-batch of the data's ``source`` array (``x`` or
    ``labels``): the ``k``-th of ``n`` equal slices along ``axis``, the part a
    placeholder split S(axis) over n devices gives its k-th device (0: rows, 1 and 2: an
    image's height and width); by default the whole."""

    source: str
    k: int = 0
    n: int = 1
    axis: int = 0

    def read(self, array: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """This part of ``array``'s ``rows`` (a micro-batch), with one indexing of
        ``array``, which touches nothing else of it: of a memory-mapped array, only this
        part's pages are read."""
        size = len(rows) if self.axis == 0 else array.shape[self.axis]
        cut = slice(self.k * size // self.n, (self.k + 1) * size // self.n)
        index: list[Any] = [rows, *[slice(None)] * (array.ndim - 1)]
        index[self.axis] = rows[cut] if self.axis == 0 else cut
        return array[tuple(index)]


WHOLE = {"x": Part("x"), "labels": Part("labels")}
"""The feeds of a run whose rank holds every device: each array whole."""


def position(config: Config, data: Data, step: int, origin: tuple[int, int] = (0, 0)) -> int:
    """The data position of step ``step``: the sample its batch starts at. ``origin``: (a
    step, the sample its batch starts at), where the batch size changed (a run that lost
    parameter servers' workers); the steps after it go on from there."""
    first, sample = origin
    return (sample + (step - first) * config.train.batch_size) % len(data["x"])


def step_feeds(
    config: Config,
    data: Data,
    step: int,
    parts: dict[str, Part] | None = None,
    origin: tuple[int, int] = (0, 0),
) -> list[Data]:
    """Step ``step``'s global batch (the next batch_size samples, wrapping around), as one
    feed dict per micro-batch. ``parts``: only these feeds, each named by its placeholder
    (``x[cpu:2]``) and read as its ``Part`` says (a rank reads only what its devices are
    fed; see ``runner.local_feeds``); ``origin`` as in ``position``."""
    batch, rows = config.train.batch_size, config.micro_batch_size
    index = (position(config, data, step, origin) + np.arange(batch)) % len(data["x"])
    return [read_parts(data, index[k : k + rows], parts or WHOLE) for k in range(0, batch, rows)]


def read_parts(data: Data, rows: np.ndarray, parts: dict[str, Part]) -> Data:
    """The feeds ``parts`` of one micro-batch, the samples ``rows`` of ``data``. Once they
    are copied out, the pages of memory-mapped files this read mapped are let go, so a
    process holds at most a micro-batch's part of the files: the kernel maps whole large
    folios around what is read (on 6.x, a rank fed half of each batch held 1.45 times
    its half at the epoch's end), and it keeps the pages in its cache either way."""
    feeds = {name: part.read(data[part.source], rows) for name, part in parts.items()}
    for array in data.values():
        _let_go(array)
    return feeds


def _let_go(array: np.ndarray) -> None:
    """Unmap from this process the pages of the file ``array`` maps, if it maps one
    (MADV_DONTNEED: a read-only file mapping reads them back from the page cache)."""
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, mmap.mmap):
        base.madvise(mmap.MADV_DONTNEED)
