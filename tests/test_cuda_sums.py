"""``gradient_kernels.sum_to`` on a GPU: x summed over its leading axes (a bias's
gradient) by ``cuda_rows.column_sums``' two kernels, partial sums per chunk of rows and
then over the chunks, on float32 C-contiguous CuPy arrays; everything else by ``np.sum``.

On the CPU: which shapes are column sums (``leading_columns``) and which arrays take the
kernels (``fits_column_sums``); ``sum_to`` on numpy arrays as it was; the CUDA source
compiles (nvcc, where found) and runs on the host through ``test_cuda_rows``' simulator,
against numpy's float64 sums. On a GPU (marker ``gpu``): ``sum_to`` launching the kernels
for many shapes (one row, one column, rows not a multiple of a chunk, columns not of 32,
two leading axes, [4096, 4096]), on values exact in float32 (any order gives the same
bits), random ones, large ones and NaN or infinities; on a stream of its own; an output
inside its input; and what does not fit still computed by CuPy's ``sum``.
"""

from __future__ import annotations

import math
import re
import sys
import types

import numpy as np
import pytest

from actorflow.ops import cuda_rows
from actorflow.ops import gradient_kernels as grads
from test_cuda_rows import (
    FakeDeviceArray,
    cupy,
    gpu,
    host_simulator,
    rng_for,
    values,
)

COLUMN_SUMS = [
    ((1, 1), (1,)),
    ((1, 1000), (1000,)),  # one row
    ((9, 1), (1,)),  # one column
    ((1000, 1), ()),
    ((7, 33), (33,)),
    ((513, 100), (100,)),  # a last chunk of one row, a last group of 4 columns
    ((1001, 7), (7,)),
    ((301, 1024), (1024,)),
    ((700, 2050), (2050,)),  # 44 rows a chunk
    ((2, 3, 5, 7), (5, 7)),
    ((5, 33), (1, 33)),  # keepdims
    ((3, 1, 40), (1, 1, 40)),
    ((1, 6, 40), (1, 1, 40)),
    ((4, 6, 40), (1, 1, 40)),
]
"""x's shape and out's, out x's trailing shape (after 1s): column sums."""

BIASES = [
    ((4096, 1024), (1024,)),
    ((8, 512, 1024), (1024,)),
    ((4096, 3072), (3072,)),
    ((4096, 4096), (4096,)),
]
"""The transformer benchmark's bias gradients (on a GPU only: seconds on the host)."""

OTHER_SUMS = [
    ((64, 33), (64, 1)),  # the last axis
    ((4, 5, 6), (4, 1, 6)),  # a middle one
    ((4, 5, 6), (5, 1)),
]
"""Sums that are not over leading axes only: CuPy's reduction."""


def layout(x_shape, out_shape) -> tuple[int, int]:
    found = cuda_rows.leading_columns(x_shape, out_shape)
    assert found is not None
    return found


def kernels_for(rows: int, n: int) -> list[str]:
    """The kernels ``column_sums`` launches: one where the rows make one chunk."""
    return list(cuda_rows.COLUMN_KERNELS[: 1 if cuda_rows.column_chunks(rows, n)[1] == 1 else 2])


def integers(rng, shape) -> np.ndarray:
    """Values whose every sum of up to 4096 is exact in float32: the same in any order."""
    return rng.integers(-1000, 1001, shape).astype(np.float32)


def numpy_sums(x: np.ndarray, out_shape) -> np.ndarray:
    """``sum_to`` of x in float64 (numpy's, on the host)."""
    out = np.empty(out_shape, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        grads.sum_to([x.astype(np.float64)], [out])
    return out


def close_sums(got: np.ndarray, x: np.ndarray, err: str = "") -> None:
    """``got`` (float32) as close to the float64 sums of x over its leading axes as a
    float32 sum in another order comes: 1e-5 of the sum, plus 1e-6 sqrt(rows) of the
    column's largest magnitude; NaN and infinities where the float64 sums have them."""
    rows, n = layout(x.shape, got.shape)
    want = numpy_sums(x, got.shape).reshape(n)
    got = np.asarray(got, np.float64).reshape(n)
    assert (np.isnan(got) == np.isnan(want)).all(), f"{err}: NaN at other columns"
    terms = x.reshape(rows, n).astype(np.float64)
    largest = np.abs(terms, where=np.isfinite(terms), out=np.zeros_like(terms)).max(axis=0)
    finite = np.isfinite(want)
    assert (got[~finite & ~np.isnan(want)] == want[~finite & ~np.isnan(want)]).all(), f"{err}: infinities"
    with np.errstate(invalid="ignore"):
        bad = finite & ~(np.abs(got - want) <= 1e-5 * np.abs(want) + 1e-6 * math.sqrt(rows) * largest)
    assert not bad.any(), f"{err}: {got[bad][:5]} != {want[bad][:5]} (of {bad.sum()})"


def special_columns(rng, rows: int, n: int) -> np.ndarray:
    """Random values with a NaN in column 5, +inf in column 40, +inf and -inf in 41."""
    x = values(rng, (rows, n))
    x[rows // 2, 5] = np.nan
    x[rows - 1, 40] = np.inf
    x[0, 41], x[rows - 1, 41] = np.inf, -np.inf
    return x


def test_leading_columns():
    assert [layout(x, out) for x, out in COLUMN_SUMS] == [
        (1, 1), (1, 1000), (9, 1), (1000, 1), (7, 33), (513, 100), (1001, 7), (301, 1024), (700, 2050), (6, 35),
        (5, 33), (3, 40), (6, 40), (24, 40),
    ]  # fmt: skip
    assert [layout(x, out) for x, out in BIASES] == [(4096, 1024), (4096, 1024), (4096, 3072), (4096, 4096)]
    for x, out in OTHER_SUMS + [((5, 6), (5, 6)), ((3, 4), (5, 3, 4)), ((3, 4), (2,)), ((3, 4), (3, 2))]:
        assert cuda_rows.leading_columns(x, out) is None, (x, out)


def test_fits_column_sums(monkeypatch):
    x = np.zeros((6, 40), np.float32)
    out = np.zeros(40, np.float32)
    assert not cuda_rows.fits_column_sums(x, out)  # numpy
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=FakeDeviceArray))
    device = FakeDeviceArray
    assert cuda_rows.fits_column_sums(device(x), device(out))
    assert cuda_rows.fits_column_sums(device(x), device(out.reshape(1, 40)))
    narrow = device(np.zeros((6, 31), np.float32)), device(np.zeros(31, np.float32))
    assert not cuda_rows.fits_column_sums(*narrow)  # under a warp's columns: CuPy's reduction
    assert not cuda_rows.fits_column_sums(device(x), out)  # an output on the host
    assert not cuda_rows.fits_column_sums(device(x), device(np.zeros((6, 1), np.float32)))
    assert not cuda_rows.fits_column_sums(device(x), device(x))  # nothing summed
    assert not cuda_rows.fits_column_sums(device(x.astype(np.float64)), device(out.astype(np.float64)))
    assert not cuda_rows.fits_column_sums(device(x), device(out.astype(np.float64)))
    assert not cuda_rows.fits_column_sums(device(np.zeros((40, 6), np.float32).T), device(out))  # strided
    assert not cuda_rows.fits_column_sums(device(np.zeros((0, 40), np.float32)), device(out))  # empty


@pytest.mark.parametrize(("x_shape", "out_shape"), COLUMN_SUMS[:8] + OTHER_SUMS)
def test_sum_to_on_numpy_arrays_is_numpys(monkeypatch, x_shape, out_shape):
    monkeypatch.setattr(cuda_rows, "_launch", None)  # never called
    x = values(rng_for("numpy", x_shape), x_shape)
    out = np.full(out_shape, np.nan, np.float32)
    grads.sum_to([x], [out])
    axes = tuple(k for k, (a, b) in enumerate(zip(x.shape, (1,) * (x.ndim - out.ndim) + out.shape)) if a != b)
    np.testing.assert_array_equal(out, np.sum(x, axis=axes).reshape(out_shape))


def test_the_column_kernels_are_the_column_sources():
    found = re.findall(r'extern "C" __global__ void (\w+)\(', cuda_rows.COLUMN_SOURCE)
    assert tuple(found) == cuda_rows.COLUMN_KERNELS
    assert not set(found) & set(cuda_rows.KERNELS)


# -- the CUDA code, on the host ---------------------------------------------------------


@pytest.fixture(scope="module")
def simulator(tmp_path_factory):
    """``COLUMN_SOURCE`` compiled for the host (``test_cuda_rows``' shim): a stand-in for
    ``cuda_rows._launch``."""
    return host_simulator(tmp_path_factory.mktemp("sums"), cuda_rows.COLUMN_SOURCE, cuda_rows.COLUMN_KERNELS)


@pytest.fixture
def on_host(simulator, monkeypatch):
    simulator.launched.clear()
    monkeypatch.setattr(cuda_rows, "_launch", simulator)
    return simulator


@pytest.mark.parametrize(("x_shape", "out_shape"), COLUMN_SUMS)
def test_column_sums_on_the_host(on_host, x_shape, out_shape):
    rows, n = layout(x_shape, out_shape)
    rng = rng_for("host sums", x_shape, out_shape)
    x = integers(rng, x_shape)
    out = np.full(out_shape, np.nan, np.float32)
    assert cuda_rows.column_sums(x, out) is None
    np.testing.assert_array_equal(out, numpy_sums(x, out_shape))
    launched = [name for name, _, _ in on_host.launched]
    assert launched == kernels_for(rows, n)
    assert on_host.launched[0][1:] == ((-(-n // 32), cuda_rows.column_chunks(rows, n)[1]), (256,))
    x = values(rng, x_shape, 3.0, -1.0)
    cuda_rows.column_sums(x, out)
    close_sums(out, x, f"{x_shape} -> {out_shape}")


def test_special_values_on_the_host(on_host):
    x = special_columns(rng_for("host special"), 300, 70)
    out = np.full(70, 0.0, np.float32)
    cuda_rows.column_sums(x, out)
    assert np.isnan(out).nonzero()[0].tolist() == [5, 41] and out[40] == np.inf
    close_sums(out, x, "special")
    x = (values(rng_for("host large"), (333, 50)) * 1e30).astype(np.float32)
    cuda_rows.column_sums(x, out := np.empty(50, np.float32))
    close_sums(out, x, "large")


def test_an_output_inside_its_input_on_the_host(on_host):
    x = integers(rng_for("host inside"), (5, 33))
    want = numpy_sums(x, (33,))
    cuda_rows.column_sums(x, x[2])  # one chunk, yet through the partial sums: x is read as out is written
    assert [name for name, _, _ in on_host.launched] == list(cuda_rows.COLUMN_KERNELS)
    np.testing.assert_array_equal(x[2], want)


def test_column_sums_refuses_other_sums():
    with pytest.raises(ValueError, match="trailing shape"):
        cuda_rows.column_sums(np.zeros((4, 5), np.float32), np.zeros((4, 1), np.float32))


# -- on a GPU ---------------------------------------------------------------------------


def sum_on_gpu(x: np.ndarray, out_shape, dtype=np.float32):
    """``sum_to`` of x's copy on the GPU into a preallocated output, back on the host."""
    out = cupy().full(out_shape, np.nan, dtype)
    assert grads.sum_to([cupy().asarray(x)], [out]) is None
    return out.get()


@gpu
@pytest.mark.parametrize(("x_shape", "out_shape"), COLUMN_SUMS + BIASES)
def test_column_sums_on_the_gpu(launches, x_shape, out_shape):
    rows, n = layout(x_shape, out_shape)
    rng = rng_for("gpu sums", x_shape, out_shape)
    x = integers(rng, x_shape)
    np.testing.assert_array_equal(sum_on_gpu(x, out_shape), numpy_sums(x, out_shape))
    path = kernels_for(rows, n) if n >= 32 else []  # narrower: CuPy's reduction
    assert launches == path
    for scale, offset in [(1.0, 0.0), (3.0, -2.0), (1e30, 0.0), (1.0, 1e4)]:
        x = (values(rng, x_shape) * np.float32(scale) + np.float32(offset)).astype(np.float32)
        close_sums(sum_on_gpu(x, out_shape), x, f"{x_shape} -> {out_shape} scale {scale} offset {offset}")
    assert launches == path * 5


@gpu
@pytest.mark.parametrize("rows", [2, 9, 300, 4096])
def test_special_values_on_the_gpu(launches, rows):
    x = special_columns(rng_for("gpu special", rows), rows, 70)
    got = sum_on_gpu(x, (70,))
    assert np.isnan(got).nonzero()[0].tolist() == [5, 41] and got[40] == np.inf
    close_sums(got, x, f"special {rows}")
    assert launches == kernels_for(rows, 70)


@gpu
def test_column_sums_on_a_stream_of_their_own(launches):
    rng = rng_for("gpu stream")
    cases = [(integers(rng, shape), shape[1:]) for shape in [(4096, 1024), (5, 33), (999, 77)]]
    stream = cupy().cuda.Stream(non_blocking=True)
    with stream:
        inputs = [cupy().asarray(x) * 2 for x, _ in cases]  # queued on the stream, as sum_to's input
        outs = [cupy().full(shape, np.nan, np.float32) for _, shape in cases]
        for dx, out in zip(inputs, outs):
            grads.sum_to([dx], [out])
            dx.fill(np.nan)  # after the sums, on the same stream
    stream.synchronize()
    for (x, shape), out in zip(cases, outs):
        np.testing.assert_array_equal(out.get(), numpy_sums(x * 2, shape))
    assert launches == [name for x, _ in cases for name in kernels_for(*x.shape)]


@gpu
@pytest.mark.parametrize("shape", [(5, 33), (300, 64)])
def test_an_output_inside_its_input_on_the_gpu(launches, shape):
    x = integers(rng_for("gpu inside", shape), shape)
    want = numpy_sums(x, shape[1:])
    device = cupy().asarray(x)
    grads.sum_to([device], [device[2]])
    np.testing.assert_array_equal(device[2].get(), want)
    assert launches == list(cuda_rows.COLUMN_KERNELS)


@gpu
@pytest.mark.parametrize(("x_shape", "out_shape"), OTHER_SUMS)
def test_other_sums_on_the_gpu(launches, x_shape, out_shape):
    rng = rng_for("gpu other", x_shape, out_shape)
    x = integers(rng, x_shape)
    np.testing.assert_array_equal(sum_on_gpu(x, out_shape), numpy_sums(x, out_shape))
    assert launches == []


@gpu
def test_other_dtypes_and_strides_on_the_gpu(launches):
    rng = rng_for("gpu dtypes")
    x = values(rng, (300, 40))
    np.testing.assert_allclose(
        sum_on_gpu(x.astype(np.float64), (40,), np.float64), numpy_sums(x, (40,)), rtol=1e-12, atol=1e-12
    )
    got = cupy().full(40, np.nan, np.float32)
    grads.sum_to([cupy().asarray(x.T.copy()).T], [got])  # (300, 40), strided
    close_sums(got.get(), x, "strided")
    assert launches == []
