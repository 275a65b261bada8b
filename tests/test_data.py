"""A config's data read from files: the transformer's text (ids in the smallest integer
type its vocabulary fits; a file over the bound or not a regular file refused in one
line)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from actorflow.config import parse_config
from actorflow.errors import ConfigError
from actorflow.training import data as data_module
from actorflow.training.data import dataset, text_ids
from test_cli import run_cli

TRANSFORMER = {
    "model": {"kind": "transformer", "vocab": 64, "d_model": 8, "heads": 2, "layers": 1, "seq_len": 4},
    "data": {"kind": "text", "samples": 16, "seed": 0},
    "train": {"steps": 1, "batch_size": 4, "optimizer": {"lr": 0.01}},
    "parallel": {"stages": ["cpu:0"]},
}


def text_config(path, **model):
    return parse_config(
        TRANSFORMER | {"model": TRANSFORMER["model"] | model, "data": TRANSFORMER["data"] | {"path": str(path)}}
    )


# -- text -----------------------------------------------------------------------------


def test_a_tiny_text_is_ids_of_its_sorted_characters_in_one_byte(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("abracadabra\n", encoding="utf-8")
    ids, vocab = text_ids(path)
    assert vocab == "\nabcdr"
    assert ids.dtype == np.uint8
    assert "".join(vocab[i] for i in ids) == "abracadabra\n"
    data = dataset(text_config(path))
    assert data["x"].dtype == np.int64 and data["x"].shape == (16, 4)
    np.testing.assert_array_equal(data["x"][:, 1:], data["labels"][:, :-1])
    for window, last in zip(data["x"], data["labels"][:, -1]):
        assert "".join(vocab[i] for i in [*window, last]) in "abracadabra\n"


def test_a_vocabulary_past_256_characters_takes_two_bytes_and_chunks_split_characters(tmp_path, monkeypatch):
    """Characters of 1 to 4 bytes across chunk boundaries, "\\r\\n" split between chunks
    read as "\\n" (as ``Path.read_text`` reads it), and more than 256 distinct ones."""
    monkeypatch.setattr(data_module, "_CHUNK", 7)
    text = "".join(chr(c) for c in range(0x100, 0x100 + 300)) + "a\r\nb\rc😀é東\r\n" * 5
    path = tmp_path / "wide.txt"
    path.write_bytes(text.encode("utf-8"))
    ids, vocab = text_ids(path)
    expected = path.read_text(encoding="utf-8")
    assert ids.dtype == np.uint16
    assert vocab == "".join(sorted(set(expected)))
    assert "".join(vocab[i] for i in ids) == expected


def test_the_text_file_is_refused_in_one_line_when_not_a_regular_file(tmp_path, monkeypatch):
    """Refused before it is opened: /dev/zero is never read, the fifo never waited on."""

    def no_open(*args, **kwargs):
        raise AssertionError("opened")

    monkeypatch.setattr(data_module, "open", no_open, raising=False)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", tmp_path, fifo):
        with pytest.raises(ConfigError) as caught:
            dataset(text_config(path))
        assert str(caught.value) == f"data.path: {str(path)!r} is not a regular file"


def test_a_text_past_the_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "big.txt"
    path.write_text("x" * 101)
    monkeypatch.setattr(data_module, "MAX_TEXT_BYTES", 100)
    with pytest.raises(ConfigError) as caught:
        text_ids(path)
    assert str(caught.value) == f"data.path: {str(path)!r} has 101 bytes, more than the 100 a text may have"
    path.write_text("x" * 100)
    assert len(text_ids(path)[0]) == 100


def test_a_text_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("abc déjà vu".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"^data\.path: cannot read .*latin1\.txt.*'utf-8' codec") as caught:
        text_ids(path)
    assert "\n" not in str(caught.value)


def test_the_cli_refuses_dev_zero_with_exit_2(capsys, tmp_path):
    config = tmp_path / "text.yaml"
    config.write_text(
        "model: {kind: transformer, vocab: 64, d_model: 8, heads: 2, layers: 1, seq_len: 4}\n"
        "data: {kind: text, samples: 16, path: /dev/zero}\n"
        "train: {steps: 1, batch_size: 4, optimizer: {lr: 0.01}}\n"
        "parallel: {stages: [cpu:0]}\n"
    )
    code, out, err = run_cli(capsys, "run", str(config), "--quiet")
    assert (code, out) == (2, "")
    assert err == "actorflow run: error: data.path: '/dev/zero' is not a regular file\n"
