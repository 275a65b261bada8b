"""Seed 004's kernel habits on a GPU, each against its plain version (issue #26, item 5,
``actorflow.ops.cuda_habits``; ``benchmarks/gpu.py`` runs this as its section (d)):

1. fused chain: chains of element-wise kernels (forward, backward, a gradient and its
   accumulate), their parts run one by one with CuPy (the plain ``ops.chain``, as a
   fused actor runs them) against one generated ElementwiseKernel; bytes: what each
   writes to device memory per act (the plain chain writes every part's register).
2. relu mask: relu forward and backward on one tensor, the backward reading x (the plain
   actorflow kernels ``relu`` and ``relu_grad``, or one element-wise kernel each way), a
   float32 mask, or the bit mask of a warp ballot; bytes: what the forward pass keeps
   for the backward one.
3. int32 index: an embedding gather, index arithmetic in ``long long`` or ``int``, ids
   int64 or int32 (and CuPy's own ``take``); bytes: the ids.

Times are milliseconds per act on the GPU, CUDA events around each act, the median of
--repeats, after warm-up runs that compile the kernels. Each habit's results are checked
against its plain version's.

Run: python benchmarks/gpu_habits.py [--rows 8192] [--width 1024] [--vocab 32768] [--repeats 30] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from actorflow.ops import cuda_habits as habits
from actorflow.ops import gradient_kernels as grads
from actorflow.ops import kernels
from actorflow.ops.chain import chain
from actorflow.ops.micro_batch import accumulate
from actorflow.runtime.cuda import import_cupy, unavailable
from actorflow.text import columns

MiB = 1 << 20


def gpu_ms(cupy: Any, act: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of ``act`` on the current stream, by CUDA events."""
    stream = cupy.cuda.get_current_stream()
    for _ in range(warmup):
        act()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record(stream)
        act()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def part(kernel, sources, target, attrs=None, phased=False):
    return (
        kernel,
        attrs or {},
        tuple(sources),
        (target,),
        phased,
        kernel.__name__,
        "benchmarks/gpu_habits.py",
    )


def chains(rows: int, width: int) -> dict[str, tuple]:
    """name: (parts, input shapes, output count, outputs read after the act, micro-batches)."""
    full, row = (rows, width), (width,)
    return {
        "bias add + gelu (h kept for backward)": (
            (part(kernels.add, (0, 1), 0), part(kernels.gelu, (~0,), 1)),
            [full, row],
            2,
            [0, 1],
            1,
        ),
        "8 ops: mul add tanh scale exp sub relu log": (
            (
                part(kernels.mul, (0, 1), 0),
                part(kernels.add, (~0, 2), 1),
                part(kernels.tanh, (~1,), 2),
                part(grads.scale, (~2,), 3, {"factor": -0.75}),
                part(kernels.exp, (~3,), 4),
                part(kernels.sub, (~4, 0), 5),
                part(kernels.relu, (~5,), 6),
                part(kernels.log, (~4,), 7),
            ),
            [full, full, row],
            8,
            [6, 7],
            1,
        ),
        "backward: gelu_grad relu_grad tanh_grad div": (
            (
                part(grads.gelu_grad, (0, 1), 0),
                part(grads.relu_grad, (~0, 2), 1),
                part(grads.tanh_grad, (~1, 3), 2),
                part(kernels.div, (~2, 4), 3),
            ),
            [full] * 5,
            4,
            [3],
            1,
        ),
        "gelu_grad + scale + accumulate (phase 1 of 4)": (
            (
                part(grads.gelu_grad, (0, 1), 0),
                part(grads.scale, (~0,), 1, {"factor": 0.5}),
                part(accumulate, (~1,), 2, {"micro_batches": 4}, phased=True),
            ),
            [full, full],
            3,
            [2],
            4,
        ),
    }


def fused_rows(cupy: Any, rows: int, width: int, repeats: int) -> list[list[str]]:
    table = [["fused chain", "plain ms", "fused ms", "speedup", "plain MiB", "fused MiB", "agree"]]
    rng = np.random.default_rng(0)
    size = rows * width * 4
    for name, (parts, shapes, n_out, written, micro_batches) in chains(rows, width).items():
        ins: list = [cupy.asarray(rng.uniform(0.5, 1.5, s).astype(np.float32)) for s in shapes]
        if micro_batches > 1:
            ins.append(1)  # the act's phase: a middle micro-batch, reading and adding
        plain_outs = [cupy.zeros((rows, width), cupy.float32) for _ in range(n_out)]
        fused_outs = [cupy.zeros((rows, width), cupy.float32) for _ in range(n_out)]
        fused, code = habits.fused_chain_kernel(parts, written), habits.chain_code(parts, written)
        if fused is None or code is None:
            table.append([name, "", "", "refused", "", "", ""])
            continue
        plain_ms = gpu_ms(cupy, partial(chain, ins, plain_outs, parts), repeats)
        fused_ms = gpu_ms(cupy, partial(fused, ins, fused_outs), repeats)
        for o in plain_outs + fused_outs:  # the same state, for one more act each
            o.fill(0)
        chain(ins, plain_outs, parts)
        fused(ins, fused_outs)
        agree = all(
            bool(cupy.allclose(fused_outs[t], plain_outs[t], rtol=1e-5, atol=1e-5)) for t in code.outputs
        )
        table.append(
            [
                name,
                f"{plain_ms:.3f}",
                f"{fused_ms:.3f}",
                f"{plain_ms / fused_ms:.2f}x",
                f"{n_out * size / MiB:.1f}",
                f"{len(code.outputs) * size / MiB:.1f}",
                "yes" if agree else "DIFFERS",
            ]
        )
    return table


def relu_rows(cupy: Any, n: int, repeats: int) -> list[list[str]]:
    rng = np.random.default_rng(1)
    x = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    dy = cupy.asarray(rng.standard_normal(n).astype(np.float32))
    y, dx, mask = cupy.empty_like(x), cupy.empty_like(x), cupy.empty_like(x)
    bits = cupy.empty(habits.mask_words(n), cupy.uint32)
    ek = cupy.ElementwiseKernel
    relu_fwd = ek("float32 x", "float32 y", "y = x < 0.0f ? 0.0f : x;", name="bench_relu", no_return=True)
    relu_recompute = ek(
        "float32 dy, float32 x", "float32 dx", "dx = dy * (x > 0.0f ? 1.0f : 0.0f);", name="bench_relu_grad_x"
    )
    relu_fwd_mask = ek(
        "float32 x",
        "float32 y, float32 m",
        "const float v = x; y = v < 0.0f ? 0.0f : v; m = v > 0.0f ? 1.0f : 0.0f;",
        name="bench_relu_fmask",
        no_return=True,
    )
    relu_bwd_mask = ek("float32 dy, float32 m", "float32 dx", "dx = dy * m;", name="bench_relu_grad_fmask")
    want = (dy * (x > 0)).astype(cupy.float32)
    variants = [
        (
            "plain kernels relu, relu_grad(dy, x)",
            lambda: kernels.relu([x], [y]),
            lambda: grads.relu_grad([dy, x], [dx]),
            4 * n,
        ),
        (
            "one kernel each, backward reads x",
            lambda: relu_fwd(x, y),
            lambda: relu_recompute(dy, x, dx),
            4 * n,
        ),
        ("float32 mask", lambda: relu_fwd_mask(x, y, mask), lambda: relu_bwd_mask(dy, mask, dx), 4 * n),
        (
            "bit mask (warp ballot)",
            lambda: habits.relu_bits([x], [y, bits]),
            lambda: habits.relu_bits_grad([dy, bits], [dx]),
            bits.nbytes,
        ),
    ]
    table = [["relu mask", "forward ms", "backward ms", "total ms", "vs plain", "MiB kept", "agree"]]
    base = 0.0
    for name, forward, backward, kept in variants:
        fwd_ms = gpu_ms(cupy, forward, repeats)
        bwd_ms = gpu_ms(cupy, backward, repeats)
        dx.fill(np.nan)
        forward()
        backward()
        agree = bool(cupy.array_equal(dx, want)) and bool(cupy.array_equal(y, cupy.maximum(x, 0)))
        total = fwd_ms + bwd_ms
        base = base or total
        table.append(
            [
                name,
                f"{fwd_ms:.3f}",
                f"{bwd_ms:.3f}",
                f"{total:.3f}",
                f"{base / total:.2f}x",
                f"{kept / MiB:.2f}",
                "yes" if agree else "DIFFERS",
            ]
        )
    return table


def gather_rows(cupy: Any, positions: int, width: int, vocab: int, repeats: int) -> list[list[str]]:
    rng = np.random.default_rng(2)
    table = cupy.asarray(rng.standard_normal((vocab, width)).astype(np.float32))
    ids64 = cupy.asarray(rng.integers(0, vocab, positions).astype(np.int64))
    ids32 = ids64.astype(cupy.int32)
    out = cupy.empty((positions, width), cupy.float32)
    want = cupy.take(table, ids64, axis=0)
    variants = [
        (
            "long long index, int64 ids",
            lambda: habits.gather_rows([ids64, table], [out], index="long long"),
            ids64,
        ),
        ("int index, int64 ids", lambda: habits.gather_rows([ids64, table], [out], index="int"), ids64),
        ("int index, int32 ids", lambda: habits.gather_rows([ids32, table], [out], index="int"), ids32),
        ("cupy.take (CuPy's own)", lambda: cupy.take(table, ids64, axis=0, out=out), ids64),
    ]
    result = [["int32 index (gather)", "ms", "vs plain", "MiB of ids", "agree"]]
    base = 0.0
    for name, act, ids in variants:
        ms = gpu_ms(cupy, act, repeats)
        out.fill(np.nan)
        act()
        agree = bool(cupy.array_equal(out, want))
        base = base or ms
        result.append(
            [name, f"{ms:.3f}", f"{base / ms:.2f}x", f"{ids.nbytes / MiB:.3f}", "yes" if agree else "DIFFERS"]
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8192, help="rows of each tensor (and gather positions)")
    parser.add_argument("--width", type=int, default=1024, help="its last dimension (and the table's)")
    parser.add_argument("--vocab", type=int, default=32768, help="rows of the gather's table")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="small tensors and few repeats: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.width, args.vocab, args.repeats = 256, 256, 1024, 3
    reason = unavailable()
    if reason is not None:
        print(f"gpu_habits: not run: {reason}")
        return 1
    cupy = import_cupy()
    device = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(device.id)["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    n = args.rows * args.width
    print(f"GPU: {name} (device {device.id}), CuPy {cupy.__version__}")
    print(
        f"tensors {args.rows}x{args.width} float32 ({n / MiB:.1f}M elements, {4 * n / MiB:.0f} MiB), "
        f"gather table {args.vocab}x{args.width}, median of {args.repeats} acts by CUDA events"
    )
    habits_run = [
        (
            "fused chain",
            partial(fused_rows, cupy, args.rows, args.width, args.repeats),
            "MiB: written to device memory per act (the plain chain writes every part's register)",
        ),
        (
            "relu mask",
            partial(relu_rows, cupy, n, args.repeats),
            "MiB kept: what the forward pass keeps for the backward one (x, a float32 mask, or bits)",
        ),
        (
            "int32 index",
            partial(gather_rows, cupy, args.rows, args.width, args.vocab, args.repeats),
            "plain: long long index arithmetic; the table's rows are gathered, ids clipped into it",
        ),
    ]
    failed = False
    for title, measure, note in habits_run:
        print()
        try:  # one habit failing still leaves the others' tables (GPU time is scarce)
            table = measure()
        except Exception as exc:
            print(f"{title}: failed: {type(exc).__name__}: {exc}")
            failed = True
            continue
        print("\n".join(columns(table)))
        print(note)
        if any(row[-1] == "DIFFERS" for row in table):
            print(f"{title}: a result differs from its plain version's (DIFFERS above)")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
