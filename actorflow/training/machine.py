"""This machine's matrix products at sizes beyond a run's, timed for the simulator.

A run's kernels are its model's sizes. A small model's products all have about the same
flops per byte, so a cost model fitted on them alone cannot tell a product's arithmetic
rate from its memory rate: extrapolated to a model 30 times wider, the shipped
transformer calibration's products were 20 times too fast (``simulate.costs.fit``). A
trace of one process on CPUs therefore also carries how long numpy's product of two
larger square matrices took here, after the run, with one BLAS thread as a stream runs
it (``otherData.machine``); calibrating holds a product's seconds a flop at theirs.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from ..runtime.blas import single_threaded_blas

SIZES = (512, 1024)
"""The products' sides: where BLAS nears its full rate (on one thread here, 58 and 75
GFLOP/s, 92 at 1024 in a quieter minute, against 23 at a 64 side; a 1024-side product
took 28 ms, most of the probe's 0.13 s in float32)."""
REPEATS = 3


def matmul_seconds(dtype: str) -> list[list[float]]:
    """[m, k, n, seconds] per side in ``SIZES``: the median over ``REPEATS`` products of
    an (m, k) and a (k, n) matrix of ``dtype``, after one not timed."""
    rows = []
    rng = np.random.default_rng(0)
    with single_threaded_blas():
        for side in SIZES:
            a, b = (rng.standard_normal((side, side)).astype(dtype) for _ in range(2))
            out = np.empty((side, side), dtype)
            times = []
            for _ in range(REPEATS + 1):
                start = time.perf_counter()
                np.matmul(a, b, out=out)
                times.append(time.perf_counter() - start)
            rows.append([side, side, side, statistics.median(times[1:])])
    return rows
