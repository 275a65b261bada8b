"""The layout decision of the batched GPU matmul (``ops.cuda_matmul.gemm``), on the CPU.

A plan is run by a reference GEMM that reads numpy arrays' buffers as cuBLAS would read
them (``as_strided`` from each operand's first element, column-major, each matrix a batch
stride after the last, every element read inside the operand's own bytes and written
inside the output's, cuBLAS' argument checks on the leading dimensions), and must give
``a @ b``: over random batch shapes, sizes from 1, broadcast and padded operands and all
four transposes. Layouts that one strided-batched GEMM can't read are refused.
"""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.array_utils import byte_bounds
from numpy.lib.stride_tricks import as_strided

from actorflow.ops import cuda_matmul, kernels
from actorflow.ops.cuda_matmul import INT32_MAX, Gemm, gemm


def layout(x: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return x.shape, x.strides


def plan_of(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> Gemm | None:
    return gemm(layout(a), layout(b), layout(out), out.itemsize)


def inside(view: np.ndarray, x: np.ndarray) -> bool:
    low, high = byte_bounds(view)
    x_low, x_high = byte_bounds(x)
    return x_low <= low and high <= x_high


def cublas_operand(x: np.ndarray, trans: int, rows: int, cols: int, ld: int, stride: int, batch: int):
    """op(X_i) (``rows`` x ``cols``) for i < batch, X read column-major from x's first
    element with leading dimension ``ld``, X_i ``stride`` elements after X_{i-1}."""
    stored = (cols, rows) if trans else (rows, cols)
    assert ld >= max(1, stored[0]), "cuBLAS refuses a leading dimension shorter than a column"
    item = x.itemsize
    view = as_strided(x, (batch, *stored), (stride * item, item, ld * item), writeable=False)
    assert inside(view, x), "cuBLAS would read outside the operand"
    return view.swapaxes(-1, -2) if trans else view


def run(plan: Gemm, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """The GEMM cuBLAS computes for ``plan``, A being b's buffer, B a's and C out's,
    in float64, written into ``out`` where cuBLAS writes."""
    assert min(plan.m, plan.n, plan.k, plan.batch) >= 1
    assert max(plan.m, plan.n, plan.k, plan.lda, plan.ldb, plan.ldc, plan.batch) <= INT32_MAX
    first = cublas_operand(b, plan.transa, plan.m, plan.k, plan.lda, plan.stride_a, plan.batch)
    second = cublas_operand(a, plan.transb, plan.k, plan.n, plan.ldb, plan.stride_b, plan.batch)
    assert plan.ldc >= max(1, plan.m)
    item = out.itemsize
    c = as_strided(out, (plan.batch, plan.m, plan.n), (plan.stride_c * item, item, plan.ldc * item))
    assert inside(c, out), "cuBLAS would write outside the output"
    c[...] = first.astype(np.float64) @ second.astype(np.float64)


def operand(rng, batch: tuple[int, ...], rows: int, cols: int, transposed: bool, pad: int, dtype):
    """A rows x cols (batch of) matrix: C-contiguous, or the swapaxes view of a
    C-contiguous one; ``pad`` unused elements after each stored row (a slice)."""
    stored = (cols, rows) if transposed else (rows, cols)
    full = rng.standard_normal((*batch, stored[0], stored[1] + pad)).astype(dtype)
    x = full[..., : stored[1]]
    return x.swapaxes(-1, -2) if transposed else x


BATCH_FORMS = ["full", "matrix", "ones"]
"""An operand's batch axes: the product's, none (a 2-D operand), all of size 1."""


def batch_of(form: str, batch: tuple[int, ...]) -> tuple[int, ...]:
    return {"full": batch, "matrix": (), "ones": (1,) * len(batch)}[form]


@settings(max_examples=300, deadline=None)
@given(
    batch=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
    sizes=st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9)),
    transposes=st.tuples(st.booleans(), st.booleans()),
    forms=st.tuples(st.sampled_from(BATCH_FORMS), st.sampled_from(BATCH_FORMS)),
    pads=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_plan_read_as_cublas_reads_it_gives_the_product(batch, sizes, transposes, forms, pads, dtype, seed):
    rng = np.random.default_rng(seed)
    (m, k, n), (ta, tb) = sizes, transposes
    a = operand(rng, batch_of(forms[0], batch), m, k, ta, pads[0], dtype)
    b = operand(rng, batch_of(forms[1], batch), k, n, tb, pads[1], dtype)
    if a.ndim < 3 and b.ndim < 3:
        a = a[None]
    expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    out = np.full(expected.shape, np.nan, dtype)
    plan = plan_of(a, b, out)
    assert plan is not None, (a.shape, a.strides, b.shape, b.strides)
    run(plan, a, b, out)
    np.testing.assert_allclose(out, expected.astype(dtype), rtol=1e-5, atol=1e-5)


@settings(max_examples=200, deadline=None)
@given(
    a_batch=st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple),
    b_batch=st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple),
    sizes=st.tuples(st.integers(1, 5), st.integers(1, 5), st.integers(1, 5)),
    transposes=st.tuples(st.booleans(), st.booleans()),
    axes=st.permutations(range(3)),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_accepted_layout_gives_the_product(a_batch, b_batch, sizes, transposes, axes, seed):
    """Partial broadcasts and permuted batch axes: where a plan is given, it is right."""
    rng = np.random.default_rng(seed)
    (m, k, n), (ta, tb) = sizes, transposes
    a = operand(rng, a_batch, m, k, ta, 0, np.float32)
    if len(a_batch) == 3:
        a = a.transpose(*axes, 3, 4)
    b = operand(rng, b_batch, k, n, tb, 0, np.float32)
    try:
        expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    except ValueError:
        return
    out = np.full(expected.shape, np.nan, np.float32)
    plan = plan_of(a, b, out)
    if plan is not None:
        run(plan, a, b, out)
        np.testing.assert_allclose(out, expected.astype(np.float32), rtol=1e-5, atol=1e-5)
    elif out.ndim >= 3 and len(a_batch) < 3:
        assert partly_broadcast(a.shape, out.shape) or partly_broadcast(b.shape, out.shape)


def partly_broadcast(shape: tuple[int, ...], out_shape: tuple[int, ...]) -> bool:
    """Whether an operand of ``shape`` repeats along some of the product's batch axes of
    more than one element, but not along all: its matrices are not one stride apart."""
    batch = out_shape[:-2]
    sizes = (1,) * (len(batch) - len(shape) + 2) + tuple(shape[:-2])
    return len({size == 1 for size, n in zip(sizes, batch, strict=True) if n > 1}) == 2


def test_the_attention_backward_products_need_no_copy():
    """dS^T Q and P^T dO (transpose_a), q k^T (transpose_b): transposed batches of
    C-contiguous [batch, heads, seq, *] registers, each one GEMM with a transpose flag."""
    scores = np.zeros((2, 3, 16, 16), np.float32)
    q = np.zeros((2, 3, 16, 8), np.float32)
    grad = plan_of(scores.swapaxes(-1, -2), q, np.empty_like(q))
    assert grad == Gemm(0, 1, 8, 16, 16, 8, 128, 16, 256, 8, 128, 6)
    logits = plan_of(q, q.swapaxes(-1, -2), np.empty_like(scores))
    assert logits == Gemm(1, 0, 16, 16, 8, 8, 128, 8, 128, 16, 256, 6)


def strided(shape, strides, itemsize=4):
    return tuple(shape), tuple(s * itemsize for s in strides)


def c_order(*shape, itemsize=4):
    return strided(shape, np.empty(shape, np.uint8).strides, itemsize)


def refused_arrays():
    """(name, a, b, out) whose product one strided-batched GEMM can't compute in place."""
    x = np.zeros((2, 3, 4, 5), np.float32)
    y = np.zeros((2, 3, 5, 6), np.float32)
    out = np.zeros((2, 3, 4, 6), np.float32)
    heads = np.zeros((2, 4, 3, 5), np.float32).transpose(0, 2, 1, 3)  # split heads: [rows, heads, seq, d]
    return [
        ("two-dimensional", x[0, 0], y[0, 0], out[0, 0]),
        ("batch axes swapped", np.zeros((3, 2, 4, 5), np.float32).swapaxes(0, 1), y, out),
        ("heads split off a row", heads, y, out),
        ("batch axis sliced unevenly", np.zeros((2, 4, 4, 5), np.float32)[:, [0, 1, 3]], y, out),
        ("every other column", np.zeros((2, 3, 4, 10), np.float32)[..., ::2], y, out),
        ("rows reversed", x[..., ::-1, :], y, out),
        ("batch reversed", x[:, ::-1], y, out),
        ("one batch axis reversed", x[0, ::-1], y[0], out[0]),
        ("out transposed", x, y, np.zeros((2, 3, 6, 4), np.float32).swapaxes(-1, -2)),
        ("out padded", x, y, np.zeros((2, 3, 4, 7), np.float32)[..., :6]),
        ("out of another shape", x, y, np.zeros((2, 3, 4, 5), np.float32)),
        ("out of fewer axes", x, y, np.zeros((6, 4, 6), np.float32)),
        ("inner sizes differ", x, np.zeros((2, 3, 4, 6), np.float32), out),
        ("partial broadcast", np.zeros((1, 3, 4, 5), np.float32), y, out),
        ("empty inner axis", np.zeros((2, 3, 4, 0), np.float32), np.zeros((2, 3, 0, 6), np.float32), out),
        ("empty batch", np.zeros((0, 3, 4, 5), np.float32), y[:0], out[:0]),
        ("empty rows", x[:, :, :0], y, out[:, :, :0]),
    ]


@pytest.mark.parametrize(("name", "a", "b", "out"), refused_arrays(), ids=[c[0] for c in refused_arrays()])
def test_layouts_one_gemm_cannot_read_are_refused(name, a, b, out):
    assert plan_of(a, b, out) is None


def test_overlapping_rows_are_refused():
    """A sliding window (rows closer than a row's length) is no matrix cuBLAS reads."""
    a = strided((2, 4, 5), (20, 2, 1))
    assert gemm(a, c_order(2, 5, 6), c_order(2, 4, 6), 4) is None
    assert gemm(strided((2, 4, 5), (20, 5, 1)), c_order(2, 5, 6), c_order(2, 4, 6), 4) is not None


def test_strides_that_are_not_whole_elements_are_refused():
    a = ((2, 4, 5), (80, 20, 4))
    odd = ((2, 4, 5), (80, 22, 4))
    assert gemm(a, c_order(2, 5, 6), c_order(2, 4, 6), 4) is not None
    assert gemm(odd, c_order(2, 5, 6), c_order(2, 4, 6), 4) is None


def test_sizes_past_int32_are_refused():
    """cuBLAS takes m, n, k, the leading dimensions and the batch count as int."""
    big = INT32_MAX + 1
    assert gemm(c_order(big, 1, 1), c_order(1, 1), c_order(big, 1, 1), 4) is None
    assert gemm(c_order(1, 1, big), c_order(big, 1), c_order(1, 1, 1), 4) is None
    assert gemm(c_order(INT32_MAX, 1, 1), c_order(1, 1), c_order(INT32_MAX, 1, 1), 4) is not None


def test_a_broadcast_operand_repeats_with_stride_zero():
    plan = gemm(c_order(3, 4, 5), c_order(5, 6), c_order(3, 4, 6), 4)
    assert plan is not None and (plan.stride_a, plan.stride_b, plan.stride_c, plan.batch) == (0, 20, 24, 3)


def test_the_host_kernel_is_numpy_matmul_on_every_transpose():
    rng = np.random.default_rng(7)
    for ta in (False, True):
        for tb in (False, True):
            a = rng.standard_normal((2, 3, 5, 4) if ta else (2, 3, 4, 5))
            b = rng.standard_normal((3, 6, 5) if tb else (3, 5, 6))
            out = np.empty((2, 3, 4, 6))
            kernels.matmul([a, b], [out], transpose_a=ta, transpose_b=tb)
            av = a.swapaxes(-1, -2) if ta else a
            bv = b.swapaxes(-1, -2) if tb else b
            np.testing.assert_array_equal(out, np.matmul(av, bv))


# -- the dispatch, with CuPy and cuBLAS stood in for on the CPU ---------------------------


class FakeDeviceArray:
    """What ``kernels.matmul`` and ``cuda_matmul`` read of a CuPy array, over a numpy one
    (its data pointer the numpy array's own)."""

    __cuda_array_interface__ = None

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.shape, self.strides, self.ndim, self.dtype, self.itemsize = (
            a.shape, a.strides, a.ndim, a.dtype, a.itemsize
        )  # fmt: skip
        self.data = types.SimpleNamespace(ptr=a.ctypes.data)

    def swapaxes(self, i: int, j: int) -> FakeDeviceArray:
        return FakeDeviceArray(self.a.swapaxes(i, j))


def at(pointer: int, dtype, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """The elements at a raw pointer as cuBLAS addresses them (element strides)."""
    item = np.dtype(dtype).itemsize
    span = item * (1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True)))
    memory = np.ctypeslib.as_array((ctypes.c_char * span).from_address(pointer)).view(dtype)
    return as_strided(memory, shape, tuple(s * item for s in strides))


def fake_routine(calls: list, dtype):
    """cuBLAS' {s,d}gemmStridedBatched on host pointers: C_i = alpha op(A_i) op(B_i) + beta C_i."""

    def routine(handle, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc, stride_c, batch):  # fmt: skip
        calls.append((handle, dtype))
        scalars = [at(p, dtype, (), ())[()] for p in (alpha, beta)]
        assert scalars == [1, 0], "alpha 1 and beta 0, as host scalars"

        def op(pointer, trans, rows, cols, ld, stride):
            stored = (cols, rows) if trans else (rows, cols)
            assert ld >= max(1, stored[0])
            x = at(pointer, dtype, (batch, *stored), (stride, 1, ld))
            return x.swapaxes(-1, -2) if trans else x

        first = op(a, transa, m, k, lda, stride_a)
        second = op(b, transb, k, n, ldb, stride_b)
        at(c, dtype, (batch, m, n), (stride_c, 1, ldc))[...] = first @ second

    return routine


@pytest.fixture
def fake_gpu(monkeypatch):
    """CuPy and its cuBLAS module stood in for: what they were called for, in order."""
    calls: list = []

    def host_matmul(a, b, out):
        calls.append("cupy.matmul")
        np.matmul(a.a, b.a, out=out.a)

    cupy = types.SimpleNamespace(
        ndarray=FakeDeviceArray,
        matmul=host_matmul,
        may_share_memory=lambda x, y: np.may_share_memory(x.a, y.a),
        cuda=types.SimpleNamespace(device=types.SimpleNamespace(get_cublas_handle=lambda: 4242)),
    )
    cublas = types.SimpleNamespace(
        sgemmStridedBatched=fake_routine(calls, np.float32),
        dgemmStridedBatched=fake_routine(calls, np.float64),
    )
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.cublas", cublas)
    return calls


def device_product(a, b, out, ta=False, tb=False):
    kernels.matmul(
        [FakeDeviceArray(a), FakeDeviceArray(b)], [FakeDeviceArray(out)], transpose_a=ta, transpose_b=tb
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("ta", "tb"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize(("a_batch", "b_batch"), [((2, 3), (2, 3)), ((1,), (1,)), ((3,), ()), ((), (1, 2))])
def test_kernels_matmul_makes_one_cublas_call_with_its_arguments_in_order(
    fake_gpu, dtype, ta, tb, a_batch, b_batch
):
    rng = np.random.default_rng(3)
    m, k, n = 5, 7, 3
    a = rng.standard_normal((*a_batch, *((k, m) if ta else (m, k)))).astype(dtype)
    b = rng.standard_normal((*b_batch, *((n, k) if tb else (k, n)))).astype(dtype)
    av, bv = (a.swapaxes(-1, -2) if ta else a), (b.swapaxes(-1, -2) if tb else b)
    expected = np.matmul(av.astype(np.float64), bv.astype(np.float64))
    out = np.full(expected.shape, np.nan, dtype)
    device_product(a, b, out, ta, tb)
    assert fake_gpu == [(4242, dtype)]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_what_one_call_cannot_do_keeps_cupy_matmul(fake_gpu):
    x = np.ones((2, 4, 4), np.float32)
    buffer = np.arange(48, dtype=np.float32)
    cases = [
        ("out is an input", x, x.copy(), x),
        ("out overlaps an input", buffer[:32].reshape(2, 4, 4), x, buffer[16:].reshape(2, 4, 4)),
        ("float16", x.astype(np.float16), x.astype(np.float16), x.astype(np.float16)),
        ("dtypes differ", x, x.astype(np.float64), x.astype(np.float64)),
        ("two dimensions", x[0], x[1], x[0].copy()),
        (
            "batch axes swapped",
            np.ones((3, 2, 4, 4), np.float32).swapaxes(0, 1),
            np.ones((2, 3, 4, 4), np.float32),
            np.empty((2, 3, 4, 4), np.float32),
        ),
    ]
    for name, a, b, out in cases:
        fake_gpu.clear()
        expected = np.matmul(a, b)
        device_product(a, b, out)
        assert fake_gpu == ["cupy.matmul"], name
        np.testing.assert_array_equal(out, expected, err_msg=name)


def test_host_arrays_never_ask_for_cupy(fake_gpu):
    a, b, out = np.ones((2, 3, 4)), np.ones((2, 4, 5)), np.empty((2, 3, 5))
    kernels.matmul([a, b], [out])
    assert fake_gpu == []
    assert cuda_matmul.fits(a, b, out) is None
