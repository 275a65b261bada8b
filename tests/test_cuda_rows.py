"""The fused row kernels (``ops.cuda_rows``): softmax, causal softmax, softmax's gradient,
layer norm and its gradient, each one CUDA kernel (layer norm's gradient three) on
float32 CuPy arrays along the last axis.

On the CPU: the CUDA source compiles (nvcc, where found); the CUDA code itself runs on the
host, compiled with a C++ compiler around a shim that runs each block's threads as
fibers of one host thread (``__syncthreads`` hands over to the next, so each goes on once
all arrived; a shuffle is an exchange between two barriers), and the
launchers drive it as they drive a GPU (each launch's arguments checked against the
kernel's C signature, arrays inside guard bands that must stay untouched), against the
numpy kernels; and ``fits`` refuses what the kernels don't take. On a GPU (marker
``gpu``): each kernel, dispatched from the numpy kernel it replaces, against that numpy
kernel on the host's copy, written into the preallocated output, and what does not fit
(other dtypes, axes, strides) still computed by the numpy-namespace code.
"""

from __future__ import annotations

import ctypes
import math
import re
import shutil
import subprocess
import sys
import types
import zlib

import numpy as np
import pytest

from actorflow.ops import cuda_rows, kernels
from actorflow.ops import gradient_kernels as grads
from actorflow.ops import transformer_kernels as tk

try:
    from actorflow.runtime.cuda import unavailable
except ImportError:  # pragma: no cover - an actorflow without CUDA devices

    def unavailable() -> str | None:
        return "actorflow.runtime.cuda missing"


GPU_REASON = unavailable()


def gpu(test):
    """A GPU test: marked ``gpu`` (``pytest -m gpu``), skipped with the reason where CUDA
    is not usable."""
    return pytest.mark.gpu(pytest.mark.skipif(GPU_REASON is not None, reason=str(GPU_REASON))(test))


SOFTMAX_LENGTHS = [1, 7, 32, 33, 512, 1000]
LAYER_NORM_WIDTHS = [1, 33, 64, 1024, 4096]
EPS = [1e-5, 1e-3, 0.5]


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def values(rng, shape, scale=3.0, offset=0.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale + offset).astype(np.float32)


def probabilities(rng, shape) -> np.ndarray:
    y = np.empty(shape, np.float32)
    kernels.softmax([values(rng, shape)], [y], axis=-1)
    return y


# -- the host's answers -----------------------------------------------------------------


def host_softmax(x):
    out = np.empty_like(x)
    with np.errstate(invalid="ignore", over="ignore"):
        kernels.softmax([x], [out], axis=-1)
    return out


def host_causal(x):
    out = np.empty_like(x)
    with np.errstate(invalid="ignore", over="ignore"):
        tk.causal_softmax([x], [out])
    return out


def host_softmax_grad(dy, y):
    out = np.empty_like(dy)
    grads.softmax_grad([dy, y], [out], axis=-1)
    return out


def host_layer_norm(x, gamma, beta, eps):
    out = np.empty_like(x)
    tk.layer_norm([x, gamma, beta], [out], axis=x.ndim - 1, eps=eps)
    return out


def host_layer_norm_grad(dy, x, gamma, eps):
    outs = [np.empty_like(x), np.empty_like(gamma), np.empty_like(gamma)]
    tk.layer_norm_grad([dy, x, gamma], outs, axis=x.ndim - 1, eps=eps)
    return outs


def close_grads(got, dy, x, gamma, eps, err=""):
    """layer_norm_grad's three outputs as close to the exact answer (the numpy kernel in
    float64) as the float32 numpy kernel's, give or take: twice its error, plus 1e-5 of
    the largest dx, or 2e-6 of the sum of a column sum's terms' magnitudes (a float32
    sum's rounding, whatever its order: the host adds the rows one by one, the GPU in
    chunks; and a row of nearly equal values loses digits in x - mean on either)."""
    dy64, x64, gamma64 = (a.astype(np.float64) for a in (dy, x, gamma))
    want = host_layer_norm_grad(dy64, x64, gamma64, eps)
    host = host_layer_norm_grad(dy, x, gamma, eps)
    xhat = np.empty_like(x64)
    tk._normalize(x64, x.ndim - 1, eps, xhat)
    rows = tuple(range(x.ndim - 1))
    magnitudes = [None, np.abs(dy64 * xhat).sum(axis=rows), np.abs(dy64).sum(axis=rows)]
    for name, g, w, h, m in zip(["dx", "dgamma", "dbeta"], got, want, host, magnitudes):
        atol = 1e-5 * float(np.abs(w).max(initial=1.0)) if m is None else 2e-6 * m + 1e-7
        bad = np.abs(g - w) > 1e-5 * np.abs(w) + atol + 2 * np.abs(h - w)
        assert not bad.any(), f"{name} {err}: {g[bad][:5]} != {w[bad][:5]} (of {bad.sum()})"


# -- the CUDA code, on the host ---------------------------------------------------------

SHIM = r"""
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <functional>
#include <ucontext.h>
#include <vector>

struct af_dim3 { unsigned int x, y, z; };
static af_dim3 threadIdx, blockIdx, blockDim, gridDim;
static float af_lanes[1024];
static std::vector<ucontext_t> af_fibers;
static std::vector<unsigned> af_next;  // the fiber each one hands over to at a barrier
static ucontext_t af_host;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

// a barrier: hand over to the next thread of the block; the last to arrive hands over to
// the first, which goes on past it once every other thread has arrived
static void __syncthreads() {
    const unsigned me = threadIdx.x;
    swapcontext(&af_fibers[me], &af_fibers[af_next[me]]);
    threadIdx = {me, 0, 0};
}
// the kernels shuffle only where every thread of the block does: an exchange between barriers
static float __shfl_xor_sync(unsigned int mask, float v, int offset) {
    if (mask != 0xffffffffu) { abort(); }
    af_lanes[threadIdx.x] = v;
    __syncthreads();
    const float r = af_lanes[threadIdx.x ^ (unsigned int)offset];
    __syncthreads();
    return r;
}
static float __int_as_float(int i) { float f; memcpy(&f, &i, sizeof f); return f; }
static float __fadd_rn(float a, float b) { return a + b; }
static float __fsub_rn(float a, float b) { return a - b; }
static float __fmul_rn(float a, float b) { return a * b; }
static float __fdiv_rn(float a, float b) { return a / b; }
static float __fsqrt_rn(float a) { return sqrtf(a); }

static std::function<void()> af_body;
static void af_thread(unsigned t) {
    threadIdx = {t, 0, 0};
    for (unsigned y = 0; y < gridDim.y; ++y) {
        for (unsigned x = 0; x < gridDim.x; ++x) {
            blockIdx = {x, y, 0};
            af_body();
            __syncthreads();  // the block ends when all its threads have
        }
    }
}  // the first to return (every block done) goes back to the host: uc_link

// the grid's blocks one after another, each by blockDim.x threads (fibers of one host
// thread, switched at each barrier, in turn forwards or backwards from launch to launch)
template <class F> static void af_run(unsigned gx, unsigned gy, unsigned bx, F body) {
    af_body = body;
    static unsigned launches = 0;
    const bool backwards = launches++ % 2;
    blockDim = {bx, 1, 1};
    gridDim = {gx, gy, 1};
    const size_t stack = 1 << 16;
    static std::vector<char> stacks;
    if (stacks.size() < stack * bx) { stacks.resize(stack * bx); }
    af_fibers.assign(bx, ucontext_t{});
    af_next.assign(bx, 0);
    for (unsigned t = 0; t < bx; ++t) {
        af_next[t] = backwards ? (t + bx - 1) % bx : (t + 1) % bx;
        getcontext(&af_fibers[t]);
        af_fibers[t].uc_stack.ss_sp = stacks.data() + stack * t;
        af_fibers[t].uc_stack.ss_size = stack;
        af_fibers[t].uc_link = &af_host;
        makecontext(&af_fibers[t], (void (*)())af_thread, 1, t);
    }
    const unsigned first = backwards ? bx - 1 : 0;
    swapcontext(&af_host, &af_fibers[first]);
}
"""


def kernel_signatures(source: str) -> dict[str, list[str]]:
    """Each ``extern "C" __global__`` kernel of ``source``: its parameters' C types."""
    found = {}
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', source):
        found[name] = [" ".join(p.split()[:-1]).replace("const ", "") for p in params.split(",")]
    return found


SCALARS = {
    "int": (np.int32, ctypes.c_int),
    "long long": (np.int64, ctypes.c_longlong),
    "float": (np.float32, ctypes.c_float),
}


def host_program(source: str, signatures) -> str:
    runners = []
    for name, types_ in signatures.items():
        params = ", ".join(f"{t} a{k}" for k, t in enumerate(types_))
        args = ", ".join(f"a{k}" for k in range(len(types_)))
        runners.append(
            f'extern "C" void run_{name}(unsigned gx, unsigned gy, unsigned bx, {params}) {{\n'
            f"    af_run(gx, gy, bx, [=] {{ {name}({args}); }});\n}}\n"
        )
    return SHIM + source + "\n".join(runners)


def host_compiler() -> str | None:
    return shutil.which("g++") or shutil.which("clang++")


def host_simulator(where, source: str, kernels: tuple[str, ...]) -> Simulator:
    """CUDA ``source`` compiled for the host in folder ``where``: a ``launch`` standing in
    for ``cuda_rows._launch`` (skips the test where no C++20 compiler is found)."""
    if host_compiler() is None:
        pytest.skip("no C++ compiler found")
    signatures = kernel_signatures(source)
    assert sorted(signatures) == sorted(kernels)
    (where / "kernels.cpp").write_text(host_program(source, signatures))
    done = subprocess.run(
        [host_compiler(), "-std=c++20", "-O1", "-ffp-contract=off", "-pthread", "-shared", "-fPIC"]
        + ["-o", str(where / "kernels.so"), str(where / "kernels.cpp")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return Simulator(ctypes.CDLL(str(where / "kernels.so")), signatures)


@pytest.fixture(scope="module")
def simulator(tmp_path_factory):
    """The CUDA source compiled for the host: a ``launch`` standing in for ``cuda_rows._launch``."""
    return host_simulator(tmp_path_factory.mktemp("rows"), cuda_rows.SOURCE, cuda_rows.KERNELS)


GUARD = 2048


class Simulator:
    """Runs ``cuda_rows``' launches on the host: every argument of the kernel's C type
    (arrays float32 and C-contiguous, scalars the numpy type of their C type), the grid
    and block as a GPU takes them, each array copied between guard bands of NaN (a read
    past an end makes a NaN, a write past an end is caught) and back."""

    def __init__(self, library, signatures) -> None:
        self.library = library
        self.signatures = signatures
        self.launched: list[tuple[str, tuple, tuple]] = []

    def __call__(self, name, grid, block, args) -> None:
        types_ = self.signatures[name]
        assert len(args) == len(types_), (name, args)
        assert len(block) == 1 and 32 <= block[0] <= 1024 and block[0] % 32 == 0, (name, block)
        assert 1 <= len(grid) <= 2 and all(1 <= g < 2**31 for g in grid), (name, grid)
        assert len(grid) == 1 or grid[1] < 65536, (name, grid)
        if name == "af_layer_norm_grad_columns":
            assert block == (cuda_rows.COLUMN_THREADS,) == (256,)
        guarded: dict[tuple[int, int], np.ndarray] = {}
        c_args = []
        for k, (a, t) in enumerate(zip(args, types_)):
            if t == "float*":
                assert isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous, (name, k)
                key = (a.ctypes.data, a.nbytes)
                if key not in guarded:
                    band = np.full(a.size + 2 * GUARD, np.nan, np.float32)
                    band[GUARD : GUARD + a.size] = a.reshape(-1)
                    guarded[key] = band
                c_args.append(ctypes.c_void_p(guarded[key][GUARD:].ctypes.data))
            else:
                numpy_type, c_type = SCALARS[t]
                assert type(a) is numpy_type, (name, k, t, type(a))
                c_args.append(c_type(a.item()))
        run = getattr(self.library, f"run_{name}")
        run.restype = None
        run(
            ctypes.c_uint(grid[0]),
            ctypes.c_uint(grid[1] if len(grid) > 1 else 1),
            ctypes.c_uint(block[0]),
            *c_args,
        )
        for a, t in zip(args, types_):
            if t == "float*":
                band = guarded[a.ctypes.data, a.nbytes]
                assert np.isnan(band[:GUARD]).all() and np.isnan(band[GUARD + a.size :]).all(), (
                    name,
                    "wrote past",
                )
                a.reshape(-1)[...] = band[GUARD : GUARD + a.size]
        self.launched.append((name, tuple(grid), tuple(block)))


@pytest.fixture
def on_host(simulator, monkeypatch):
    simulator.launched.clear()
    monkeypatch.setattr(cuda_rows, "_launch", simulator)
    return simulator


@pytest.mark.parametrize("n", SOFTMAX_LENGTHS)
@pytest.mark.parametrize("lead", [(3,), (2, 2)])
def test_softmax_on_the_host(on_host, n, lead):
    rng = rng_for("softmax", n, lead)
    x = values(rng, (*lead, n))
    out = np.full_like(x, np.nan)
    assert cuda_rows.softmax(x, out) is None
    assert [name for name, _, _ in on_host.launched] == ["af_softmax_rows"]
    np.testing.assert_allclose(out, host_softmax(x), rtol=1e-5, atol=1e-6)
    dy = values(rng, x.shape, 1.0)
    y = probabilities(rng, x.shape)
    got = np.full_like(x, np.nan)
    cuda_rows.softmax_grad(dy, y, got)
    np.testing.assert_allclose(got, host_softmax_grad(dy, y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("s", [1, 7, 33, 64])
@pytest.mark.parametrize("lead", [(), (2, 3)])
def test_causal_softmax_on_the_host(on_host, s, lead):
    x = values(rng_for("causal", s, lead), (*lead, s, s))
    out = np.full_like(x, np.nan)
    cuda_rows.causal_softmax(x, out)
    want = host_causal(x)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert (out[..., np.triu_indices(s, 1)[0], np.triu_indices(s, 1)[1]] == 0).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s", [1, 7, 64])
def test_a_scale_inside_the_softmax_kernels_rounds_as_a_scale_kernel_on_the_host(on_host, causal, s):
    """``scale`` multiplies each element as the softmax reads it, and each gradient as
    softmax_grad writes it: the same bits as the float32 multiply before (after) them."""
    rng = rng_for("scaled", s, causal)
    x = values(rng, (2, s, s))
    factor = np.float32(1 / math.sqrt(s + 2))
    run = cuda_rows.causal_softmax if causal else cuda_rows.softmax
    fused, plain = np.full_like(x, np.nan), np.full_like(x, np.nan)
    run(x, fused, float(factor))
    run(x * factor, plain)
    np.testing.assert_array_equal(fused, plain)
    dy, y = values(rng, x.shape, 1.0), probabilities(rng, x.shape)
    cuda_rows.softmax_grad(dy, y, fused, float(factor))
    cuda_rows.softmax_grad(dy, y, plain)
    np.testing.assert_array_equal(fused, plain * factor)


def special_rows(n: int) -> np.ndarray:
    """Rows of -inf (some, all), +inf, NaN, huge and tiny values."""
    rows = np.zeros((7, n), np.float32)
    rows[0, ::2] = -np.inf
    rows[0, -1] = 1.0
    rows[1, :] = -np.inf
    rows[2, n // 2] = np.inf
    rows[3, n - 1] = np.nan
    rows[4, :] = 3e38
    rows[4, 0] = -3e38
    rows[5, :] = np.linspace(-100, 100, n)
    rows[6, :] = 1e-30
    return rows


@pytest.mark.parametrize("n", [1, 2, 33])
def test_special_values_on_the_host(on_host, n):
    x = special_rows(n)
    out = np.empty_like(x)
    cuda_rows.softmax(x, out)
    np.testing.assert_allclose(out, host_softmax(x), rtol=1e-5, atol=1e-6)
    square = np.resize(x, (n, n)).astype(np.float32)
    cuda_rows.causal_softmax(square, out := np.empty_like(square))
    np.testing.assert_allclose(out, host_causal(square), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 33, 64, 1024, 4096])
@pytest.mark.parametrize("eps", EPS)
def test_layer_norm_on_the_host(on_host, n, eps):
    lead = (3,) if n >= 1024 else (2, 5)
    rng = rng_for("layer_norm", n, eps)
    x = values(rng, (*lead, n), 2.0, 3.0)
    gamma, beta = values(rng, (n,), 1.0, 1.0), values(rng, (n,), 1.0)
    out = np.full_like(x, np.nan)
    cuda_rows.layer_norm(x, gamma, beta, out, eps)
    np.testing.assert_allclose(out, host_layer_norm(x, gamma, beta, eps), rtol=1e-5, atol=1e-5)
    dy = values(rng, x.shape, 1.0)
    got = [np.full_like(x, np.nan), np.full_like(gamma, np.nan), np.full_like(gamma, np.nan)]
    cuda_rows.layer_norm_grad(dy, x, gamma, *got, eps)
    names = [name for name, _, _ in on_host.launched]
    assert names == ["af_layer_norm_rows", *cuda_rows.KERNELS[3:]]
    close_grads(got, dy, x, gamma, eps, f"n {n} eps {eps}")


@pytest.mark.parametrize(("rows", "n"), [(1, 1), (9, 1), (200, 3), (77, 40), (1000, 7)])
def test_layer_norm_grad_column_sums_over_chunks_on_the_host(on_host, rows, n):
    """Many rows: the column sums in several chunks (``column_chunks``), the last one short."""
    rng = rng_for("chunks", rows, n)
    x, dy = values(rng, (rows, n), 1.5, -2.0), values(rng, (rows, n), 1.0)
    gamma = values(rng, (n,), 1.0, 1.0)
    got = [np.full_like(x, np.nan), np.full_like(gamma, np.nan), np.full_like(gamma, np.nan)]
    cuda_rows.layer_norm_grad(dy, x, gamma, *got, 1e-5)
    close_grads(got, dy, x, gamma, 1e-5, f"rows {rows} n {n}")


def test_in_place_and_overlapping_outputs_on_the_host(on_host):
    rng = rng_for("in place")
    x = values(rng, (5, 40))
    want = host_softmax(x)
    cuda_rows.softmax(x, x)  # in place: each thread reads its elements before writing them
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-6)
    dy, xx, gamma = values(rng, (6, 40), 1.0), values(rng, (6, 40)), values(rng, (40,), 1.0, 1.0)
    want_grads = host_layer_norm_grad(dy, xx, gamma, 1e-5)
    dgamma, dbeta = np.empty_like(gamma), np.empty_like(gamma)
    cuda_rows.layer_norm_grad(dy, xx, gamma, dy, dgamma, dbeta, 1e-5)  # dx over dy: through a temporary
    for got, want_one in zip([dy, dgamma, dbeta], want_grads):
        np.testing.assert_allclose(got, want_one, rtol=1e-4, atol=1e-5)


def test_launch_sizes():
    assert [cuda_rows.row_threads(n) for n in [1, 32, 33, 256, 257, 512, 1000, 1024, 4096, 8192, 10**6]] == [
        32, 32, 32, 32, 64, 64, 128, 128, 512, 1024, 1024
    ]  # fmt: skip
    for rows in [1, 7, 8, 9, 100, 4096, 10**6, 2**31 - 1]:
        for n in [1, 31, 33, 1024, 4096, 10**5]:
            per_chunk, chunks = cuda_rows.column_chunks(rows, n)
            assert per_chunk >= 8 and 1 <= chunks < 65536
            assert (chunks - 1) * per_chunk < rows <= chunks * per_chunk


# -- fits, on the CPU -------------------------------------------------------------------


class FakeDeviceArray:
    """What ``fits`` reads of a CuPy array, over a numpy one."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.dtype, self.shape, self.ndim, self.size, self.flags = a.dtype, a.shape, a.ndim, a.size, a.flags


def test_fits_refuses_numpy_other_dtypes_axes_and_strides(monkeypatch):
    x = np.zeros((4, 8), np.float32)
    assert not cuda_rows.fits(x, -1, x)  # a numpy array, CuPy absent or not
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(ndarray=FakeDeviceArray))
    device = FakeDeviceArray
    assert not cuda_rows.fits(x, 1)  # numpy, beside CuPy
    assert cuda_rows.fits(device(x), -1, device(x))
    assert cuda_rows.fits(device(x), 1)
    assert not cuda_rows.fits(device(x), 0)
    assert not cuda_rows.fits(device(x), -2)
    assert not cuda_rows.fits(device(x), -1, x)  # an output on the host
    assert not cuda_rows.fits(device(x.astype(np.float64)), -1)
    assert not cuda_rows.fits(device(x.astype(np.float16)), -1)
    assert not cuda_rows.fits(device(x), -1, device(x.astype(np.float64)))
    assert not cuda_rows.fits(device(np.zeros((8, 4), np.float32).T), -1)  # strided
    assert not cuda_rows.fits(device(x), -1, device(np.zeros((8, 4), np.float32).T))
    assert not cuda_rows.fits(device(np.zeros((0, 8), np.float32)), -1)  # empty
    assert not cuda_rows.fits(device(np.zeros((), np.float32)), -1)
    assert cuda_rows.fits(device(np.zeros(5, np.float32)), 0)


@pytest.mark.parametrize("module", ["actorflow.ops.cuda_rows", "actorflow.ops.cuda_matmul"])
def test_the_module_imports_without_cupy(module):
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.modules['cupy'] = None; import {module}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize(
    "source, kernels, instructions",
    [
        ("SOURCE", "KERNELS", ["shfl.sync.bfly.b32", "bar.sync"]),  # warp shuffles, block barriers
        ("COLUMN_SOURCE", "COLUMN_KERNELS", ["bar.sync"]),
    ],
)
def test_the_cuda_source_compiles_with_nvcc(tmp_path, source, kernels, instructions):
    """What a GPU would compile (CuPy compiles it with NVRTC, which takes the same CUDA C++)."""
    (tmp_path / "rows.cu").write_text(getattr(cuda_rows, source))
    done = subprocess.run(
        ["nvcc", "-ptx", "-arch=sm_90", "-o", str(tmp_path / "rows.ptx"), str(tmp_path / "rows.cu")],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr
    ptx = (tmp_path / "rows.ptx").read_text()
    for name in getattr(cuda_rows, kernels):
        assert f".entry {name}(" in ptx
    assert all(instruction in ptx for instruction in instructions)


# -- on a GPU ---------------------------------------------------------------------------


def cupy():
    import cupy

    return cupy


def on_gpu(a):
    return cupy().asarray(a)


def blank(shape, dtype=np.float32):
    return cupy().full(shape, np.nan, dtype=dtype)


LEADS = [(), (3,), (2, 3), (2, 2, 3)]


@gpu
@pytest.mark.parametrize("n", SOFTMAX_LENGTHS)
@pytest.mark.parametrize("lead", LEADS)
def test_softmax_on_the_gpu(launches, n, lead):
    rng = rng_for("gpu softmax", n, lead)
    x = values(rng, (*lead, n))
    out = blank(x.shape)
    for axis in (-1, x.ndim - 1):
        launches.clear()
        out.fill(np.nan)
        assert kernels.softmax([on_gpu(x)], [out], axis=axis) is None
        assert launches == ["af_softmax_rows"]
        np.testing.assert_allclose(out.get(), host_softmax(x), rtol=1e-5, atol=1e-6)
    dy, y = values(rng, x.shape, 1.0), probabilities(rng, x.shape)
    got = blank(x.shape)
    launches.clear()
    assert grads.softmax_grad([on_gpu(dy), on_gpu(y)], [got], axis=-1) is None
    assert launches == ["af_softmax_grad_rows"]
    np.testing.assert_allclose(got.get(), host_softmax_grad(dy, y), rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.parametrize("s", SOFTMAX_LENGTHS)
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)])
def test_causal_softmax_on_the_gpu(launches, s, lead):
    if s >= 512 and len(lead) > 1:
        lead = lead[:1]
    x = values(rng_for("gpu causal", s, lead), (*lead, s, s))
    out = blank(x.shape)
    assert tk.causal_softmax([on_gpu(x)], [out]) is None
    assert launches == ["af_softmax_rows"]
    got = out.get()
    np.testing.assert_allclose(got, host_causal(x), rtol=1e-5, atol=1e-6)
    upper = np.triu_indices(s, 1)
    assert (got[..., upper[0], upper[1]] == 0).all()


@gpu
@pytest.mark.parametrize("n", [1, 2, 33, 512])
def test_special_values_on_the_gpu(launches, n):
    x = special_rows(n)
    out = blank(x.shape)
    kernels.softmax([on_gpu(x)], [out], axis=-1)
    np.testing.assert_allclose(out.get(), host_softmax(x), rtol=1e-5, atol=1e-6)
    square = np.resize(x, (n, n)).astype(np.float32)
    square[np.triu_indices(n, 1)] = np.nan  # masked: never read
    out = blank(square.shape)
    tk.causal_softmax([on_gpu(square)], [out])
    np.testing.assert_allclose(out.get(), host_causal(square), rtol=1e-5, atol=1e-6)
    assert launches == ["af_softmax_rows"] * 2


@gpu
@pytest.mark.parametrize("n", LAYER_NORM_WIDTHS)
@pytest.mark.parametrize("lead", [(), (5,), (2, 3), (2, 2, 3)])
@pytest.mark.parametrize("eps", EPS)
def test_layer_norm_on_the_gpu(launches, n, lead, eps):
    rng = rng_for("gpu layer norm", n, lead, eps)
    x = values(rng, (*lead, n), 2.0, 3.0)
    gamma, beta = values(rng, (n,), 1.0, 1.0), values(rng, (n,), 1.0)
    out = blank(x.shape)
    assert tk.layer_norm([on_gpu(x), on_gpu(gamma), on_gpu(beta)], [out], axis=x.ndim - 1, eps=eps) is None
    assert launches == ["af_layer_norm_rows"]
    np.testing.assert_allclose(out.get(), host_layer_norm(x, gamma, beta, eps), rtol=1e-5, atol=1e-5)
    dy = values(rng, x.shape, 1.0)
    got = [blank(x.shape), blank(gamma.shape), blank(gamma.shape)]
    launches.clear()
    assert tk.layer_norm_grad([on_gpu(dy), on_gpu(x), on_gpu(gamma)], got, axis=x.ndim - 1, eps=eps) is None
    assert launches == list(cuda_rows.KERNELS[3:])
    close_grads([g.get() for g in got], dy, x, gamma, eps, f"n {n} lead {lead} eps {eps}")


@gpu
@pytest.mark.parametrize(("lead", "n"), [((4096,), 1024), ((8, 512), 64), ((999,), 33), ((3, 333), 4096)])
def test_layer_norm_grad_many_rows_on_the_gpu(launches, lead, n):
    rng = rng_for("gpu many rows", lead, n)
    x, dy = values(rng, (*lead, n), 1.5, -2.0), values(rng, (*lead, n), 1.0)
    gamma = values(rng, (n,), 1.0, 1.0)
    got = [blank(x.shape), blank(gamma.shape), blank(gamma.shape)]
    tk.layer_norm_grad([on_gpu(dy), on_gpu(x), on_gpu(gamma)], got, axis=-1 % x.ndim, eps=1e-5)
    assert launches == list(cuda_rows.KERNELS[3:])
    close_grads([g.get() for g in got], dy, x, gamma, 1e-5, f"{lead} {n}")


@gpu
def test_outputs_in_place_on_the_gpu(launches):
    rng = rng_for("gpu in place")
    x = values(rng, (6, 40))
    xd = on_gpu(x)
    kernels.softmax([xd], [xd], axis=-1)
    np.testing.assert_allclose(xd.get(), host_softmax(x), rtol=1e-5, atol=1e-6)
    dy, gamma = values(rng, (6, 40), 1.0), values(rng, (40,), 1.0, 1.0)
    want = host_layer_norm_grad(dy, x, gamma, 1e-5)
    dyd = on_gpu(dy)
    got = [dyd, blank(gamma.shape), blank(gamma.shape)]
    tk.layer_norm_grad([dyd, on_gpu(x), on_gpu(gamma)], got, axis=1, eps=1e-5)  # dx over dy
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.get(), w, rtol=1e-4, atol=1e-5)
    assert launches == ["af_softmax_rows", *cuda_rows.KERNELS[3:]]


@gpu
def test_what_does_not_fit_takes_the_numpy_namespace_code_on_the_gpu(launches):
    rng = rng_for("gpu falls back")
    x = values(rng, (4, 6, 5))
    for axis in (0, 1):
        out = blank(x.shape)
        want = np.empty_like(x)
        kernels.softmax([x], [want], axis=axis)
        kernels.softmax([on_gpu(x)], [out], axis=axis)
        np.testing.assert_allclose(out.get(), want, rtol=1e-5, atol=1e-6)
    x64 = x.astype(np.float64)
    out64 = blank(x.shape, np.float64)
    kernels.softmax([on_gpu(x64)], [out64], axis=-1)
    np.testing.assert_allclose(out64.get(), host_softmax(x64), rtol=1e-12)
    strided = on_gpu(np.ascontiguousarray(x.transpose(0, 2, 1))).transpose(0, 2, 1)  # x, but not C-contiguous
    out = blank(x.shape)
    kernels.softmax([strided], [out], axis=-1)
    np.testing.assert_allclose(out.get(), host_softmax(x), rtol=1e-5, atol=1e-6)
    gamma, beta = values(rng, (4,), 1.0, 1.0), values(rng, (4,), 1.0)
    out = blank(x.shape)
    tk.layer_norm([on_gpu(x), on_gpu(gamma), on_gpu(beta)], [out], axis=0, eps=1e-5)
    want = np.empty_like(x)
    tk.layer_norm([x, gamma, beta], [want], axis=0, eps=1e-5)
    np.testing.assert_allclose(out.get(), want, rtol=1e-5, atol=1e-5)
    assert launches == []
