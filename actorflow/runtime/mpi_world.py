"""The MPI world this process is a rank of, beside the runs: starting MPI, the world's
communicator (and the survivors' after a lost rank), the ranks' meetings between runs,
and leaving without finalizing MPI. The transport (``transport``) carries the runs.

Before MPI starts, the process binds itself to its share of the CPUs (``bind_to_share``).
It ignores SIGUSR1 (when MPI starts on the main thread, where Python may set handlers).
MPICH's mpiexec sends it to every rank when one ends (even normally, with the mpich 5.0
wheel), and MPICH's own handler answers it with a PMI query for the dead ranks. Hydra
kills the other ranks when one dies of a signal; when it killed the asking rank before
the answer arrived, hydra's proxy and mpiexec aborted without reporting any rank's exit
status (strace; 1 kill in 15 under load). Ranks learn of a lost peer from the
transport's control messages instead. SIG_IGN, unlike a Python handler, stays in place
while the interpreter exits, so SIGUSR1 never kills a rank that is leaving.

After a lost rank (a parameter server's worker, ``training.survival``), ``regroup`` makes
the survivors' communicator the world (``world_comm``) that the next Transport,
``gather`` and ``Vote`` use.

A process whose run failed over ranks exits with status 1 at interpreter exit without
finalizing MPI: ``MPI_Finalize`` waits for requests its peers will never match (a
survivor of a killed rank was seen to hang there for good). One that survived a lost
rank exits so too: with status 0, or 1 after an uncaught exception, unless the program
ends with ``leave(its status)`` first (``actorflow``'s commands do).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import RankError
from ..world import RANK_CPUS, cpus_of, launched, renumber, shares_listed

JOIN_TIMEOUT = 120.0
"""Seconds the ranks wait for each other to meet where one may have been lost."""
FIRST_POLL, LAST_POLL = 20e-6, 0.01
"""A meeting's back-off between its tests of MPI (``_poll``)."""


def mpi() -> Any:
    """mpi4py's MPI module (initializing MPI), or a RankError saying how to install it.
    Before MPI starts, the process binds itself to its CPUs (``bind_to_share``)."""
    if "mpi4py.MPI" not in sys.modules:
        bind_to_share()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RankError(
            "a plan over several ranks runs on MPI: pip install 'actorflow[mpi]' (mpi4py and mpich)"
        ) from e
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    return MPI


def bind_to_share() -> None:
    """Bind every thread of this process to this rank's CPUs as ``actorflow launch``
    listed them (``world.RANK_CPUS``); threads started later inherit them. Nothing where
    the variable is unset or empty (plain ``mpiexec``, another launcher, or a user's
    choice), or lists no CPUs for this rank."""
    listed = os.environ.get(RANK_CPUS, "")
    shares = shares_listed(listed)
    rank = launched()[0]
    if rank >= len(shares):
        return
    try:
        cpus = cpus_of(shares[rank])
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), cpus)
    except (ValueError, OSError) as e:
        raise RankError(
            f"{RANK_CPUS}={listed!r}: rank {rank} cannot bind to CPUs {shares[rank]!r} ({e}); give each "
            "rank's CPUs as 0,1;2,3 (rank 0's, then rank 1's), or set it empty to leave the ranks unbound"
        ) from None


_world: Any = None  # the survivors' communicator, once ``regroup`` made one
_launched: list[int] | None = None  # per rank of ``_world``, its rank as launched


def world_comm() -> Any:
    """The communicator of every rank of the run: MPI's world, or the survivors' of a lost
    rank (``regroup``)."""
    return mpi().COMM_WORLD if _world is None else _world


def regroup(lost: set[int]) -> tuple[int, int]:
    """Make the ranks of ``world_comm`` but ``lost`` the world, renumbered in order;
    returns (this rank, how many). Called by every survivor, with the same ``lost``: it
    is collective over them only, so the lost ranks need not take part (``within``
    ``JOIN_TIMEOUT``: a survivor lost meanwhile would leave the others waiting)."""
    global _world, _launched
    comm = world_comm()
    group = comm.Get_group()
    kept = [r for r in range(comm.Get_size()) if r not in lost]
    survivors = group.Incl(kept)
    _world = within(
        JOIN_TIMEOUT, "regroup without the lost rank", lambda: comm.Create_group(survivors, tag=7)
    )
    _launched = [launched_rank(r) for r in kept]
    group.Free()
    survivors.Free()
    renumber(_world.Get_rank(), _world.Get_size())
    return _world.Get_rank(), _world.Get_size()


def launched_rank(rank: int) -> int:
    """Rank ``rank`` of ``world_comm`` as the launcher numbered it."""
    return rank if _launched is None else _launched[rank]


def within(seconds: float, what: str, call: Callable[[], Any]) -> Any:
    """``call()``, a blocking MPI call over the ranks, given ``seconds``: where a rank it
    waits for was lost meanwhile it would wait for good, so this process then says so
    and ends (``leave``, status 1)."""
    outcome: list[tuple[bool, Any]] = []

    def called() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - raised on the calling thread
            outcome.append((False, exc))

    caller = threading.Thread(target=called, name="actorflow-within", daemon=True)
    caller.start()
    caller.join(seconds)
    if caller.is_alive():
        sys.stderr.write(
            f"actorflow: rank {launched_rank(world_comm().Get_rank())} could not {what} within {seconds:.0f} s "
            "(another rank was lost meanwhile, or failed)\n"
        )
        leave(1)
    returned, value = outcome[0]
    if not returned:
        raise value
    return value


_exiting: int | None = None  # the status to exit with, once asked


def exit_unfinalized(status: int = 1) -> None:
    """At interpreter exit, leave with ``status`` (the worst asked for; 1 after an uncaught
    exception) before MPI is finalized (see the module)."""
    global _exiting
    if _exiting is None:
        atexit.register(_leave_now)
        hook = sys.excepthook

        def failed(*info: Any) -> None:
            exit_unfinalized(1)
            hook(*info)

        sys.excepthook = failed
    _exiting = max(status, _exiting or 0)


def _leave_now() -> None:
    leave(_exiting or 0)


def unfinalized() -> int | None:
    """Where this process must end without finalizing MPI (a rank failed or was lost),
    the least status it exits with (else None): a program that knows its own status then
    ends with ``leave``, at exit it would end with this one."""
    return _exiting


def leave(status: int) -> None:
    """Exit now with ``status``, without finalizing MPI: what a program that survived a
    lost rank ends with (``MPI_Finalize`` would wait for the lost one)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def gather(obj: Any, check: Callable[[], None] = lambda: None) -> list | None:
    """Every rank's ``obj`` on rank 0 (None on the others), for a run's final report or
    a checkpoint's manifest.

    Called by every rank. Nonblocking gathers (of the pickles' sizes, then of the pickles)
    polled with back-off (``_poll``), so no rank spins in MPI while waiting for a slower
    one, and none waits for good on one that died meanwhile: ``check`` is called at each
    poll and may raise to give up (inside a Runtime: the error that stopped it, a lost
    rank's)."""
    MPI, comm = mpi(), world_comm()
    root = comm.Get_rank() == 0
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.zeros(comm.Get_size() if root else 0, np.int64)
    size = np.array([data.size], np.int64)
    _poll(comm.Igather(size, sizes, root=0), check, size, sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    joined = np.empty(int(offsets[-1]), np.uint8)
    _poll(
        comm.Igatherv(data, [joined, sizes, offsets[:-1], MPI.BYTE], root=0),
        check,
        data,
        joined,
        sizes,
        offsets,
    )
    if not root:
        return None
    return [pickle.loads(joined[a:b].tobytes()) for a, b in itertools.pairwise(offsets)]


def _poll(request: Any, check: Callable[[], None], *buffers: Any) -> None:
    """Wait for ``request``, testing it with back-off (20 µs doubling to 10 ms) and calling
    ``check`` between the tests. Where ``check`` gives up, the request and its
    ``buffers`` are kept (``_abandoned``): MPI may still write them."""
    backoff = FIRST_POLL
    while not request.Test():
        try:
            check()
        except BaseException:
            _abandoned.append((request, buffers))
            raise
        time.sleep(backoff)
        backoff = min(2 * backoff, LAST_POLL)


_abandoned: list[tuple[Any, Any]] = []
"""Requests left in flight when their ranks lost one, with their buffers: freed, MPI
could write into memory reused meanwhile (the process ends without finalizing)."""


class Vote:
    """Whether any rank says yes, asked once a step and answered the next: an allreduce
    (max) of one flag that ``ask`` starts and ``answer`` completes, so that no rank waits
    on the others for it (a Ctrl-C heard by some ranks, ``training.stopping``)."""

    def __init__(self) -> None:
        self._request: Any = None
        self._flags = np.zeros(2, np.uint8)  # this rank's ask, and every rank's

    def ask(self, yes: bool) -> None:
        MPI = mpi()
        self._flags[:] = (yes, False)
        self._request = world_comm().Iallreduce(self._flags[:1], self._flags[1:], op=MPI.MAX)

    def answer(self, check: Callable[[], None] = lambda: None) -> bool | None:
        """The last ask's answer, once every rank asked it; None if none is out. ``check``
        as in ``gather``, at each poll while waiting."""
        if self._request is None:
            return None
        _poll(self._request, check)
        self._request = None
        return bool(self._flags[1])

    def forget(self) -> None:
        """Leave the ask out unanswered (its world lost a rank), with its flags: MPI may
        still write them."""
        if self._request is not None:
            _abandoned.append((self._request, self._flags))
        self._request, self._flags = None, np.zeros(2, np.uint8)
