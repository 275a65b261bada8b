"""This machine's matrix products at sizes beyond a run's, timed for the simulator.

A run's kernels are its model's sizes. A small model's products all have about the same
flops per byte, so a cost model fitted on them alone cannot tell a product's arithmetic
rate from its memory rate: extrapolated to a model 30 times wider, the shipped
transformer calibration's products were 20 times too fast (``simulate.costs.fit``). A
trace of one process on CPUs therefore also carries how long numpy's product of two
larger square matrices took here, after the run, with one BLAS thread as a stream runs
it (``otherData.machine``); calibrating holds a product's seconds a flop at that.
"""

from __future__ import annotations

import time

import numpy as np

from ..runtime.blas import single_threaded_blas

SIZES = (1024,)
"""The products' sides: where BLAS nears its full rate (on one thread here, 75 GFLOP/s
at a 1024 side, 92 in a quieter minute, against 58 at 512 and 23 at 64)."""
REPEATS = 2


def matmul_seconds(dtype: str) -> list[list[float]]:
    """[m, k, n, seconds] per side in ``SIZES``: the fastest of ``REPEATS`` products of an
    (m, k) and a (k, n) matrix of ``dtype`` after one not timed (others' load only slows
    a product down); 0.10 s in float32 here, 0.18 s in float64."""
    rows = []
    with single_threaded_blas():
        for side in SIZES:
            a = np.full((side, side), 0.5, dtype)  # BLAS's time doesn't depend on the values
            out = np.empty((side, side), dtype)
            times = []
            for _ in range(REPEATS + 1):
                start = time.perf_counter()
                np.matmul(a, a, out=out)
                times.append(time.perf_counter() - start)
            rows.append([side, side, side, min(times[1:])])
    return rows
