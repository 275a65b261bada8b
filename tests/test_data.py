"""A config's data read from files: the transformer's text (ids in the smallest integer
type its vocabulary fits; a file over the bound or not a regular file refused in one
line), and the mlp's memory-mapped .npy files, each rank reading only the parts its
devices are fed (rows, or an image's height or width), equal to the whole-array run."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
import yaml

import actorflow as af
import rank_slices
import ranks
from actorflow.config import parse_config
from actorflow.errors import ConfigError
from actorflow.runtime.logical import assemble
from actorflow.training import compile_config, train
from actorflow.training import data as data_module
from actorflow.training.data import dataset, npy_arrays, step_feeds, text_ids
from actorflow.training.runner import local_feeds
from rank_slices import Recording
from test_cli import run_cli

TRANSFORMER = {
    "model": {"kind": "transformer", "vocab": 64, "d_model": 8, "heads": 2, "layers": 1, "seq_len": 4},
    "data": {"kind": "text", "samples": 16, "seed": 0},
    "train": {"steps": 1, "batch_size": 4, "optimizer": {"lr": 0.01}},
    "parallel": {"stages": ["cpu:0"]},
}


def text_config(path, **model):
    return parse_config(
        TRANSFORMER
        | {"model": TRANSFORMER["model"] | model, "data": TRANSFORMER["data"] | {"path": str(path)}}
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


# -- npy ------------------------------------------------------------------------------

MLP = {
    "model": {"kind": "mlp", "sizes": [6, 8, 3], "dtype": "float64"},
    "data": {"kind": "synthetic_classification", "samples": 40, "seed": 3},
    "train": {"steps": 6, "batch_size": 8, "optimizer": {"kind": "sgd", "lr": 0.1}},
    "parallel": {"stages": [["cpu:0", "cpu:1"]], "data_parallel": 2, "micro_batches": 2},
}
PIPELINE = {"stages": ["cpu:0", "cpu:1"], "micro_batches": 2}


def npy_config(folder, parallel=None, **data):
    """MLP's synthetic data saved as x.npy and labels.npy in ``folder``; its config on them."""
    arrays = dataset(parse_config(MLP))
    for name, array in arrays.items():
        np.save(folder / f"{name}.npy", array)
    files = {"kind": "npy", "x": str(folder / "x.npy"), "labels": str(folder / "labels.npy")}
    return parse_config(
        MLP | {"data": {"samples": 40, "seed": 3} | files | data, "parallel": parallel or MLP["parallel"]}
    )


def elements_read(shape, steps, rows, axis, k, n):
    """Per element of an array of ``shape``: whether the k-th of n parts along ``axis`` of
    the micro-batches of ``rows`` rows of the first ``steps`` steps hold it (one
    micro-batch a step, the next rows each step)."""
    ids = np.arange(np.prod(shape)).reshape(shape)
    read = np.zeros(shape, bool)
    for step in range(steps):
        micro = ids[(step * rows + np.arange(rows)) % shape[0]]
        read.flat[np.split(micro, n, axis=axis)[k].ravel()] = True
    return read


def test_npy_data_trains_as_the_same_arrays_in_memory(tmp_path):
    from_files = train(npy_config(tmp_path))
    in_memory = train(parse_config(MLP))
    assert from_files.losses == in_memory.losses
    for name, value in in_memory.parameters.items():
        np.testing.assert_array_equal(from_files.parameters[name], value, err_msg=name)


@pytest.mark.parametrize("layout", ["data-parallel", "pipeline"])
def test_each_rank_reads_only_the_rows_its_devices_are_fed(tmp_path, layout):
    """Over two ranks (compiled for two, read here one rank after the other): with data
    parallelism each reads its half of each micro-batch of x and labels, in a pipeline
    rank 0 reads x and rank 1 the labels; together, what one process reads."""
    config = npy_config(tmp_path, None if layout == "data-parallel" else PIPELINE)
    plan = compile_config(config, ranks=2)
    whole = npy_arrays(config)
    feeds = {r: [] for r in range(2)}
    reads = {}
    for rank in range(2):
        data = {name: Recording(array) for name, array in whole.items()}
        parts = local_feeds(plan, rank)
        for step in range(3):
            feeds[rank] += step_feeds(config, data, step, parts)
        reads[rank] = {name: array.read for name, array in data.items()}
    rows = config.micro_batch_size
    for name, array in whole.items():
        if layout == "data-parallel":
            for rank in range(2):
                np.testing.assert_array_equal(
                    reads[rank][name], elements_read(array.shape, 6, rows, 0, rank, 2)
                )
        else:
            owner = 0 if name == "x" else 1
            assert reads[owner][name].sum() == 6 * rows * array[0].size and not reads[1 - owner][name].any()
    one_process = [f for step in range(3) for f in step_feeds(config, whole, step)]
    for k, expected in enumerate(one_process):
        got = assemble(plan.logical, "feed", feeds[0][k] | feeds[1][k])
        assert got.keys() == expected.keys()
        for name in expected:
            np.testing.assert_array_equal(got[name], expected[name])


@pytest.mark.xdist_group("mpi")  # one mpiexec at a time
@pytest.mark.timeout(200)
def test_npy_training_on_two_ranks_equals_one_process(tmp_path):
    config = npy_config(tmp_path)
    path = tmp_path / "npy.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    status, text = ranks.launch(
        2,
        sys.executable,
        str(ranks.TESTS / "rank_train.py"),
        str(path),
        str(tmp_path / "rank0.npz"),
        timeout=150,
    )
    assert status == 0, text
    expected = train(config)
    with np.load(tmp_path / "rank0.npz") as got:
        np.testing.assert_allclose(got["losses"], expected.losses, rtol=1e-12)
        for name, value in expected.parameters.items():
            np.testing.assert_allclose(got[f"p_{name}"], value, rtol=1e-12, err_msg=name)


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(200)
def test_images_split_along_batch_height_and_width_are_read_per_rank(tmp_path):
    """A feed (rows, height, width) split S(0), S(1), S(2) over two ranks, read from a
    memory-mapped file: each rank reads only its part of each micro-batch, and the
    output is the one-process run's on the whole array."""
    images = np.random.default_rng(0).standard_normal((10, 6, 8))
    np.save(tmp_path / "images.npy", images)
    status, text = ranks.launch(
        2,
        sys.executable,
        str(ranks.TESTS / "rank_slices.py"),
        str(tmp_path / "images.npy"),
        str(tmp_path),
        timeout=150,
    )
    assert status == 0, text
    for axis in range(3):
        whole = af.run(
            rank_slices.image_plan(images.shape, axis, ranks=1),
            [{"x": images[rank_slices.step_rows(step, len(images))]} for step in range(rank_slices.STEPS)],
        )
        saved = [dict(np.load(tmp_path / f"rank{rank}_axis{axis}.npz")) for rank in range(2)]
        for rank in range(2):
            expected = elements_read(images.shape, rank_slices.STEPS, rank_slices.ROWS, axis, rank, 2)
            np.testing.assert_array_equal(saved[rank]["read"], expected, err_msg=f"axis {axis} rank {rank}")
        for step, outputs in enumerate(whole):
            for rank in range(2):  # a run over ranks gives every rank the whole output
                np.testing.assert_array_equal(saved[rank][f"y@{step}"], outputs["y"])


def replaced(folder, name, array):
    path = folder / f"bad_{name}.npy"
    np.save(path, array)
    return {name: str(path)}


X = np.zeros((40, 6))
LABELS = np.zeros(40, np.int64)
BAD_FILES = {
    "missing": (
        lambda f: {"x": str(f / "none.npy")},
        r"data\.x: cannot read '.*none\.npy': No such file or directory",
    ),
    "not-npy": (
        lambda f: {"x": str(f / "config.yaml")},
        r"data\.x: cannot read '.*config\.yaml' as a \.npy array: the magic string is not correct.*",
    ),
    "dtype": (
        lambda f: replaced(f, "x", X.astype(np.float32)),
        r"data\.x: .* holds float32\[40, 6\], the model takes float64\[rows, 6\] \(model\.dtype, model\.sizes\[0\]\)",
    ),
    "features": (
        lambda f: replaced(f, "x", np.zeros((40, 5))),
        r"data\.x: .* holds float64\[40, 5\], the model takes float64\[rows, 6\] .*",
    ),
    "labels-dtype": (
        lambda f: replaced(f, "labels", LABELS.astype(np.int32)),
        r"data\.labels: .* holds int32\[40\], expected int64\[rows\]",
    ),
    "labels-shape": (
        lambda f: replaced(f, "labels", np.zeros((40, 1), np.int64)),
        r"data\.labels: .* holds int64\[40, 1\], expected int64\[rows\]",
    ),
    "rows": (lambda f: replaced(f, "labels", LABELS[:39]), r"data\.labels: .* has 39 rows, data\.x 40"),
    "samples": (lambda f: {"samples": 41}, r"data\.samples: 41 is more than the 40 rows of data\.x"),
    "label-negative": (
        lambda f: replaced(f, "labels", np.r_[LABELS[:7], -1, LABELS[8:]]),
        r"data\.labels: row 7 is class -1, not in 0\.\.2 \(model\.sizes\[-1\] classes\)",
    ),
    "label-too-large": (
        lambda f: replaced(f, "labels", np.r_[LABELS[:39], 3]),
        r"data\.labels: row 39 is class 3, not in 0\.\.2 .*",
    ),
}


@pytest.mark.parametrize("case", BAD_FILES, ids=list(BAD_FILES))
def test_bad_npy_files_are_one_line(tmp_path, case):
    change, message = BAD_FILES[case]
    (tmp_path / "config.yaml").write_text("not an array\n")
    with pytest.raises(ConfigError, match=f"^{message}$"):
        dataset(npy_config(tmp_path, **change(tmp_path)))


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        ({}, {"kind": "npy", "x": "x.npy"}, "data.labels: required for npy data"),
        ({}, {"labels": "labels.npy"}, "data.labels: only npy data reads it"),
        (
            {},
            {"kind": "text"},
            "data.kind: model.kind mlp trains on synthetic_classification or npy, got text",
        ),
        ({}, {"path": "a.txt"}, "data.path: only text data reads data.path"),
        (TRANSFORMER["model"], {"kind": "npy"}, "data.kind: model.kind transformer trains on text, got npy"),
    ],
)
def test_npy_keys_are_checked_with_the_config(model, data, message):
    with pytest.raises(ConfigError) as caught:
        parse_config(MLP | {"model": model or MLP["model"], "data": MLP["data"] | data})
    assert str(caught.value) == message


def test_the_cli_refuses_a_missing_npy_file_with_exit_2(capsys, tmp_path):
    config = tmp_path / "npy.yaml"
    config.write_text(yaml.safe_dump(npy_config(tmp_path, x=str(tmp_path / "none.npy")).to_dict()))
    code, out, err = run_cli(capsys, "run", str(config), "--quiet")
    assert (code, out) == (2, "")
    assert err == (
        f"actorflow run: error: data.x: cannot read {str(tmp_path / 'none.npy')!r}: No such file or directory\n"
    )


def resident_kib(path) -> int:
    """KiB of this process's mappings of ``path`` in memory (their Rss in /proc/self/smaps)."""
    smaps = open("/proc/self/smaps").read()
    return sum(map(int, re.findall(rf"{re.escape(str(path))}\n(?:\w+:.*\n)*?Rss:\s+(\d+)", smaps)))


def test_a_step_lets_go_of_the_pages_it_read(tmp_path):
    """The feeds are copies; the file's pages leave the process once they are made."""
    config = npy_config(tmp_path)
    data = npy_arrays(config)
    whole = np.array(data["x"])  # maps every page of x.npy
    assert resident_kib(tmp_path / "x.npy") > 0
    feeds = step_feeds(config, data, 0)
    assert resident_kib(tmp_path / "x.npy") == 0
    np.testing.assert_array_equal(feeds[0]["x"], whole[:4])
