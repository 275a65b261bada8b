"""Streams run BLAS with one thread each, so devices don't oversubscribe the cores."""

import numpy as np
from threadpoolctl import threadpool_info

import actorflow as af
import userfns


def test_kernels_see_one_blas_thread_and_the_limit_is_lifted_after():
    before = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    with af.Graph() as g:
        x = af.placeholder("x", (4, 4))
        y = af.ops.call(userfns.record_blas_threads, af.ops.to_device(x, "cpu:1"), shape=(4, 4))
        af.output("y", y)
    userfns.blas_threads.clear()
    af.run(af.compile(g), [{"x": np.eye(4, dtype=np.float32)}] * 3)
    assert userfns.blas_threads and set(userfns.blas_threads) == {1}
    after = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    assert after == before
