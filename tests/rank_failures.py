"""A two-rank pipeline for the failure tests (run under a launcher by ``test_rank_failures``):
step k feeds k; ``kernel``: a kernel on rank 1 raises at step 5; ``steady``: every step
naps 10 ms on rank 1, for 2000 steps, so a test can kill or interrupt it midway. Each
rank prints its pid first."""

import os
import sys

import numpy as np

import actorflow as af
import userfns


def main(mode: str) -> None:
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 4), dtype="float64", device="cpu:0")
        h = af.ops.to_device(af.ops.relu(x), "cpu:1")
        kernel = userfns.fail_on_five if mode == "kernel" else userfns.nap
        af.output("y", af.ops.call(kernel, h, shape=(4, 4), dtype="float64"))
    plan = af.compile(g, ranks=2)
    print("pid", os.getpid(), flush=True)
    with af.Session(plan) as session:
        for step in range(2000):
            session.run({"x": np.full((4, 4), float(step))})
            if step == 2:
                print("running", flush=True)
    print("finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
