"""A pool of ranks for tests (see ``ranks.Pool``), so that a test pays mpiexec's start
once, not per case: rank 0 reads cases from stdin, one base64 pickle a line, and hands
each to the other ranks; every rank runs it; rank 0 prints ``RESULT`` and the outcome
(what the case returned on rank 0, or the error's text).

A case is (kind, *args):
- ("graph", recipe, ranks, quota, iterations, feed seed, order): the recipe's graph
  compiled with ``ranks`` as the list of devices per rank, run in that ``order``
  (replayed or dynamic); the outputs;
- ("train", config path, overrides): ``train`` of that config; the losses and every
  parameter, as ``test_ranks`` compares them.
"""

import base64
import pickle
import sys
import time
import traceback

from mpi4py import MPI

import actorflow as af
import graph_strategies as gs
from rank_train import trained

CASE = 7


def next_case(comm):
    if comm.Get_rank() == 0:
        line = sys.stdin.readline().strip() or None
        for peer in range(1, comm.Get_size()):
            comm.send(line, dest=peer, tag=CASE)
        return line
    backoff = 1e-4
    while not comm.Iprobe(source=0, tag=CASE):
        time.sleep(backoff)
        backoff = min(2 * backoff, 0.01)
    return comm.recv(source=0, tag=CASE)


def run_graph(recipe, ranks, quota, iterations, seed, order):
    graph, _ = gs.build(recipe)
    plan = af.compile(graph, quota=quota, ranks=ranks)
    return af.run(plan, gs.make_feeds(recipe, iterations, seed), stall_timeout=20, order=order)


def run_training(config, overrides):
    return trained(config, *overrides)


CASES = {"graph": run_graph, "train": run_training}


def main() -> None:
    comm = MPI.COMM_WORLD.Dup()
    while (line := next_case(comm)) is not None:
        kind, *args = pickle.loads(base64.b64decode(line))
        try:
            outcome = ("ok", CASES[kind](*args))
        except Exception:  # noqa: BLE001 - the test shows it
            outcome = ("error", traceback.format_exc())
        if comm.Get_rank() == 0:
            print("RESULT " + base64.b64encode(pickle.dumps(outcome)).decode(), flush=True)


if __name__ == "__main__":
    main()
