"""Parameter-server training that goes on without a lost worker (seed 003's "node
disaster tolerance").

Under parameter servers the workers hold no state: every parameter and its optimizer
state live on the servers. So a rank that holds only workers' devices is ``losable``
(while some worker would be left): when it goes silent, its transport reports a
``RankLost`` to every other rank instead of failing them (``runtime.transport``). Each
survivor then ``regroup``s:

1. the survivors make a communicator of their own, the world from then on (MPI's
   ``Comm.Create_group``, collective over them alone);
2. they agree on the step to go on from: the latest step that every survivor holds the
   values of (``Snapshots``: each rank keeps its values after its latest runs; a rank
   that ran ahead, such as a server that finished an update the lost worker's gradient
   had already reached, takes its earlier ones);
3. each compiles the plan of the config without the lost rank's workers
   (``parameter_server.without``: the batch shrinks with them, and sync training averages
   over the workers left) for the survivors, and opens it with its values from that step;
   the data goes on from the sample it had reached (``data.position``'s ``origin``).

What is lost: the steps the survivors ran past that one (they run again, with the
workers left), and the lost workers' share of every later batch.

MPICH's hydra kills every rank of the job when one of them dies of a signal, even with
``-disable-auto-cleanup`` (which keeps the others alive only when a rank exits), so
``guard`` runs each rank under a parent process that turns its child's death into an
exit. The survivors end without finalizing MPI (``mpi_world.leave``): ``MPI_Finalize``
waits for the lost rank.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

import attrs
import numpy as np

from ..config import Config
from ..errors import ConfigError, RankError, RankLost
from ..plan import Plan
from ..runtime import Session
from ..runtime.mpi_world import JOIN_TIMEOUT, launched_rank, within, world_comm
from ..runtime.mpi_world import regroup as regroup_ranks
from ..text import count
from ..world import this_rank
from . import parameter_server

PR_SET_PDEATHSIG = 1  # prctl(2)
KEPT = 3
"""Snapshots a rank keeps: ranks are at most one run apart when a worker is lost (a
worker's next pull waits for every server's update of its last step)."""


def possible(config: Config, plan: Plan) -> bool:
    """Whether the run may lose workers: parameter servers, over ranks."""
    return config.parallel.parameter_server is not None and plan.world > 1


def losable(config: Config, plan: Plan) -> frozenset[int]:
    """The ranks the run can go on without: those holding workers' devices only, whose
    workers' loss leaves some worker and a layout over the ranks left (a lost worker's
    devices on other ranks go with it: those ranks must still hold a device)."""
    if not possible(config, plan):
        return frozenset()
    servers = set(parameter_server.server_devices(config))
    chosen = set()
    for rank in set(plan.ranks.values()):
        devices = set(plan.devices_of(rank))
        workers = parameter_server.replicas_on(config, devices)
        if servers & devices or not workers or len(workers) == config.parallel.data_parallel:
            continue
        try:
            parameter_server.rank_devices(parameter_server.without(config, workers), plan.world - 1)
        except ConfigError:
            continue
        chosen.add(rank)
    return frozenset(chosen)


class Snapshots:
    """A rank's values (``Session.values``) after its latest runs, by step."""

    def __init__(self) -> None:
        self.held: dict[int, dict[str, np.ndarray]] = {}

    def take(self, step: int, session: Session) -> None:
        self.held[step] = session.values()
        for old in sorted(self.held)[:-KEPT]:
            del self.held[old]


@attrs.frozen
class Regrouped:
    """What the survivors go on with: the config, its plan, the step and this rank's values."""

    config: Config
    plan: Plan
    step: int
    values: dict[str, np.ndarray]
    told: str
    """What happened, in a line: which worker was lost, at which step, and how many are left."""
    dropped: int
    """The async updates the lost workers' clocks had counted (``parameter_server.staleness``)."""
    workers: tuple[int, ...]
    """The workers lost (their replica numbers in the config before)."""


def regroup(
    config: Config, plan: Plan, lost: RankLost, snapshots: Snapshots, compile: Callable[[Config, int], Plan]
) -> Regrouped:
    """Go on without ``lost``'s rank (see the module); every survivor calls it with the
    same lost rank. ``compile(config, ranks)`` makes a plan. ``snapshots`` then holds the
    values the run goes on from alone."""
    devices = sorted(plan.devices_of(lost.rank))
    workers = parameter_server.replicas_on(config, devices)
    launched = launched_rank(lost.rank)  # as the user knows it, before this or an earlier regroup
    rank, size = regroup_ranks({lost.rank})
    held = within(JOIN_TIMEOUT, "agree on a step", lambda: world_comm().allgather(set(snapshots.held)))
    common = set.intersection(*held)
    if not common:
        raise RankError(
            f"the ranks left without rank {lost.rank} hold the values of no step in common: "
            f"{', '.join(f'rank {r}: steps {sorted(h)}' for r, h in enumerate(held))}"
        )
    step = max(common)
    values, dropped = _without_clocks(snapshots.held[step], workers)
    snapshots.held = {step: values}
    left = parameter_server.without(config, workers)
    told = (
        f"lost the {'worker' if len(workers) == 1 else 'workers'} on {', '.join(devices)} (rank {launched}): "
        f"going on from step {step} with {count(left.parallel.data_parallel, 'worker')} on {size} ranks"
    )
    return Regrouped(left, compile(left, size), step, values, told, dropped, tuple(workers))


def _without_clocks(values: dict[str, np.ndarray], workers: list[int]) -> tuple[dict[str, np.ndarray], int]:
    """``values`` without the lost workers' entries in the async updates' clocks (indexed
    by worker), and the updates those entries counted."""
    kept = {n: np.delete(v, workers) if n.endswith(".clock") else v for n, v in values.items()}
    dropped = sum(int(v[workers].sum()) for n, v in values.items() if n.endswith(".clock"))
    return kept, dropped


def guard() -> None:
    """Run the rest of this process as a child that a signal can kill without hydra taking
    the other ranks down (see the module): fork; the child returns, the parent waits for
    it and exits with its status (128 + N where signal N killed it), passing SIGINT,
    SIGTERM and SIGHUP on to it. The child dies with the parent. Linux only (elsewhere
    nothing changes); call it before any thread starts. The parent says which signal
    killed the child, since hydra sees only the status."""
    if sys.platform != "linux":
        return
    if "mpi4py.MPI" in sys.modules:
        raise RuntimeError("survival.guard() runs before MPI starts (before mpi4py.MPI is imported)")
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    passed = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, passed)  # till the parent passes them on
    child = os.fork()
    if child == 0:
        os.setpgid(0, 0)  # a signal to the parent's group reaches the child once, passed on
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # it died before the line above
            os._exit(1)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return
    for sig in passed:
        signal.signal(sig, lambda signum, frame: os.kill(child, signum))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # hydra will only see the status 128 + N: say which signal it was
        sys.stderr.write(f"actorflow: rank {this_rank()} was killed by {signal.Signals(-code).name}\n")
        sys.stderr.flush()
    os._exit(128 - code if code < 0 else code)
