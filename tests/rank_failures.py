"""A two-rank pipeline for the failure tests (run under a launcher by ``test_rank_failures``):
step k feeds k; ``kernel``: a kernel on rank 1 raises at step 5; ``steady``: every step
sleeps 20 ms on rank 1, for 2000 steps, so a test can kill or interrupt it midway;
``kernel-collective``, ``steady-collective``: the same, then an all_reduce over the two
ranks, which rank 0, with nothing else to run, waits for inside MPI;
``stall``: rank 1's kernel blocks until someone writes to the named pipe given after the
mode, and sends its result back to rank 0, which gives up after 1 s (the acts in the
``order`` given after the pipe); ``pause``: as ``steady`` for 150 steps, with the
``lost_after`` given after the mode (seconds), so a test can pause a rank. Each rank
prints its pid first."""

import os
import sys
import threading

import numpy as np

import actorflow as af
import userfns
from actorflow.world import this_rank

KERNELS = {
    "kernel": userfns.fail_on_five,
    "steady": userfns.sleep_20ms,
    "pause": userfns.sleep_20ms,
    "stall": userfns.blocked,
}


def release_on_write(fifo: str) -> None:
    with open(fifo) as f:
        f.read()
    userfns.release()


def main(mode: str, *args: str) -> None:
    kernel, collective = mode.removesuffix("-collective"), mode.endswith("-collective")
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 4), dtype="float64", device="cpu:0")
        h = af.ops.to_device(af.ops.relu(x), "cpu:1")
        y = af.ops.call(KERNELS[kernel], h, shape=(4, 4), dtype="float64", name="work")
        if collective:
            y = af.ops.all_reduce([af.ops.relu(x), y])[1]
        af.output("y", af.ops.to_device(y, "cpu:0") if mode == "stall" else y)
    plan = af.compile(g, ranks=2)
    if mode == "stall" and this_rank() == 1:
        threading.Thread(target=release_on_write, args=args[:1], daemon=True).start()
    print("pid", os.getpid(), flush=True)
    patience = 1.0 if mode == "stall" and this_rank() == 0 else 60.0
    lost_after = float(args[0]) if mode == "pause" else 6.0
    order = args[1] if mode == "stall" else "replay"
    with af.Session(plan, stall_timeout=patience, lost_after=lost_after, order=order) as session:
        for step in range(150 if mode == "pause" else 2000):
            session.run({"x": np.full((4, 4), float(step))})
            if step == 2:
                print("running", flush=True)
    print("finished", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
