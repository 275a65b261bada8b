"""The batched matmul on a GPU (``ops.cuda_matmul``): ``kernels.matmul`` on CuPy arrays,
its operands read transposed where they lie, as one cuBLAS strided-batched GEMM.

Each product is checked against the exact one (float64 on the host for float32 arrays,
long double for float64 ones) within ``min(k, 64) eps |a| @ |b|``, and against
``cupy.matmul`` of contiguous copies within twice that: for k up to 64 the bound holds
for float32 sums in any order; past it, float32's rounding of random operands stays far
below it, while TF32's (inputs rounded to 10 bits, errors near 2^-11 sqrt(k) |a| |b|)
would cross it. That the fast path was taken is checked twice:
``cuda_matmul.fits`` accepts the layout, and ``cupy.matmul`` is not called.
"""

from __future__ import annotations

import numpy as np
import pytest

from actorflow.ops import cuda_matmul, kernels
from actorflow.runtime.cuda import SPIN, unavailable

GPU_REASON = unavailable()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPU_REASON is not None, reason=str(GPU_REASON))]


@pytest.fixture
def cp():
    import cupy

    return cupy


def stored(cp, rng, batch, rows, cols, transposed, dtype=np.float32):
    """The C-contiguous register ``kernels.matmul`` is given for a rows x cols operand
    (its transpose where the operand is read transposed)."""
    shape = (*batch, cols, rows) if transposed else (*batch, rows, cols)
    return cp.asarray(rng.standard_normal(shape).astype(dtype))


def read(x, transposed):
    return x.swapaxes(-1, -2) if transposed else x


def check_product(cp, got, a, b, err=""):
    """``got`` (after its stream is done) against ``a @ b`` (views as the kernel reads
    them) exactly and as ``cupy.matmul`` of contiguous copies computes it."""
    exact_dtype = np.float64 if got.dtype == np.float32 else np.longdouble
    ah, bh = (cp.asnumpy(x).astype(exact_dtype) for x in (a, b))
    exact = np.matmul(ah, bh)
    bound = min(a.shape[-1], 64) * np.finfo(got.dtype).eps * np.matmul(np.abs(ah), np.abs(bh))
    copies = cp.asnumpy(cp.matmul(cp.ascontiguousarray(a), cp.ascontiguousarray(b))).astype(exact_dtype)
    for name, value in [("exact", exact), ("cupy.matmul of copies", copies)]:
        off = np.abs(cp.asnumpy(got).astype(exact_dtype) - value)
        worst = np.unravel_index(np.argmax(off - bound), off.shape)
        assert np.all(off <= (1 if name == "exact" else 2) * bound), (
            f"{err}: against {name}, {off[worst]} off at {worst}, bound {bound[worst]}"
        )


def no_cupy_matmul(monkeypatch, cp):
    def refused(*args, **kwargs):
        raise AssertionError("cupy.matmul called: the fast path was not taken")

    monkeypatch.setattr(cp, "matmul", refused)


SHAPES = [
    # batch, m, k, n
    ((3,), 5, 7, 9),
    ((1,), 1, 33, 1),
    ((4,), 1, 1, 1),
    ((2, 3), 17, 31, 65),
    ((2, 5), 33, 1, 7),
    ((1, 1), 64, 100, 33),
    ((3,), 129, 257, 95),
]
TRANSPOSES = [(False, False), (True, False), (False, True), (True, True)]


def product(cp, monkeypatch, batch, m, k, n, ta, tb, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    a = stored(cp, rng, batch, m, k, ta, dtype)
    b = stored(cp, rng, batch, k, n, tb, dtype)
    out = cp.full((*batch, m, n), np.nan, dtype)
    assert cuda_matmul.fits(read(a, ta), read(b, tb), out) is not None
    with monkeypatch.context() as patch:
        no_cupy_matmul(patch, cp)
        kernels.matmul([a, b], [out], transpose_a=ta, transpose_b=tb)
    cp.cuda.get_current_stream().synchronize()
    check_product(cp, out, read(a, ta), read(b, tb), f"{batch} {m}x{k} @ {k}x{n}, ta {ta} tb {tb}")


@pytest.mark.parametrize(("ta", "tb"), TRANSPOSES)
@pytest.mark.parametrize(("batch", "m", "k", "n"), SHAPES)
def test_float32_products_on_every_transpose(cp, monkeypatch, batch, m, k, n, ta, tb):
    product(cp, monkeypatch, batch, m, k, n, ta, tb)


@pytest.mark.parametrize(("ta", "tb"), TRANSPOSES)
@pytest.mark.parametrize(("batch", "m", "k", "n"), [((3,), 5, 7, 9), ((2, 3), 17, 31, 65)])
def test_float64_products_on_every_transpose(cp, monkeypatch, batch, m, k, n, ta, tb):
    product(cp, monkeypatch, batch, m, k, n, ta, tb, np.float64)


@pytest.mark.parametrize(
    ("m", "k", "n", "ta", "tb"),
    [(512, 64, 512, False, True), (512, 512, 64, True, False)],
    ids=["q k^T", "dS^T Q"],
)
def test_the_attention_products_of_the_benchmark(cp, monkeypatch, m, k, n, ta, tb):
    """[8, 16, 512, *] float32, as the transformer of benchmark (c) multiplies them."""
    product(cp, monkeypatch, (8, 16), m, k, n, ta, tb)


@pytest.mark.parametrize(("ta", "tb"), TRANSPOSES)
@pytest.mark.parametrize(
    ("a_batch", "b_batch"), [((3,), ()), ((), (2, 3)), ((1,), (4,)), ((4,), (1,))], ids=str
)
def test_a_broadcast_operand_repeats_with_batch_stride_zero(cp, monkeypatch, a_batch, b_batch, ta, tb):
    rng = np.random.default_rng(1)
    m, k, n = 9, 13, 6
    a = stored(cp, rng, a_batch, m, k, ta)
    b = stored(cp, rng, b_batch, k, n, tb)
    out = cp.full((*np.broadcast_shapes(a_batch, b_batch), m, n), np.nan, np.float32)
    plan = cuda_matmul.fits(read(a, ta), read(b, tb), out)
    assert plan is not None and 0 in (plan.stride_a, plan.stride_b)
    with monkeypatch.context() as patch:
        no_cupy_matmul(patch, cp)
        kernels.matmul([a, b], [out], transpose_a=ta, transpose_b=tb)
    cp.cuda.get_current_stream().synchronize()
    check_product(cp, out, read(a, ta), read(b, tb), f"{a_batch} @ {b_batch}")


def test_the_product_is_queued_on_the_current_stream(cp):
    """On a stream that first spins for 200 ms and then writes the operands: the call
    returns at once, cuBLAS' handle is on that stream, and the product reads the
    operands written there (on any other stream it would read the zeros before)."""
    from cupy_backends.cuda.libs import cublas

    rng = np.random.default_rng(2)
    batch, m, k, n = (4,), 65, 96, 80
    sources = [stored(cp, rng, batch, m, k, True), stored(cp, rng, batch, k, n, True)]
    a, b = (cp.empty_like(x) for x in sources)
    out = cp.empty((*batch, m, n), np.float32)
    spin = cp.RawKernel(SPIN, "actorflow_spin")
    spin((1,), (1,), (np.int64(1000),))  # each kernel compiled, cuBLAS' handle made, before the clock runs
    cp.copyto(a, sources[0])
    cp.copyto(b, sources[1])
    kernels.matmul([a, b], [out], transpose_a=True, transpose_b=True)
    a.fill(0)
    b.fill(0)
    out.fill(np.nan)
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        spin((1,), (1,), (np.int64(200_000_000),))
        cp.copyto(a, sources[0])
        cp.copyto(b, sources[1])
        kernels.matmul([a, b], [out], transpose_a=True, transpose_b=True)
        assert cublas.getStream(cp.cuda.device.get_cublas_handle()) == stream.ptr
        assert not stream.done, "the host waited for the GPU"
    stream.synchronize()
    check_product(cp, out, read(a, True), read(b, True), "on a non-default stream")


def test_what_one_gemm_cannot_do_is_still_right(cp):
    """Layouts ``fits`` refuses go through ``cupy.matmul``, and still give a @ b."""
    rng = np.random.default_rng(3)
    x, y = stored(cp, rng, (2, 3), 6, 6, False), stored(cp, rng, (2, 3), 6, 6, False)
    heads = cp.asarray(rng.standard_normal((2, 5, 3, 4)).astype(np.float32)).transpose(0, 2, 1, 3)
    half = cp.asarray(rng.standard_normal((2, 6, 6)).astype(np.float16))
    cases = [
        ("out is an input", x, y, x),
        (
            "heads split off a row",
            heads,
            stored(cp, rng, (2, 3), 4, 7, False),
            cp.empty((2, 3, 5, 7), np.float32),
        ),
        ("partial broadcast", stored(cp, rng, (1, 3), 6, 6, False), y, cp.empty((2, 3, 6, 6), np.float32)),
        ("float16", half, half.copy(), cp.empty((2, 6, 6), np.float16)),
        ("two dimensions", x[0, 0], y[1, 1].swapaxes(0, 1), cp.empty((6, 6), np.float32)),
    ]
    for name, a, b, out in cases:
        assert cuda_matmul.fits(a, b, out) is None, name
        expected = cp.asnumpy(cp.matmul(cp.ascontiguousarray(a), cp.ascontiguousarray(b)))
        kernels.matmul([a, b], [out])
        cp.cuda.get_current_stream().synchronize()
        np.testing.assert_allclose(cp.asnumpy(out), expected, rtol=1e-5, atol=1e-5, err_msg=name)
