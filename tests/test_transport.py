"""The ranks' transport, in what can be checked in one process: its timed waits end when
asked (timer slack), SIGUSR1, hydra's notice that a rank ended, is ignored once MPI is
up, and a collective's thread waits inside MPI only while the rank is idle (see
``runtime/transport``)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import threading
from typing import Any

import pytest

from actorflow.runtime.transport import _precise_sleeps

PR_GET_TIMERSLACK = 30


def timer_slack_ns() -> int:
    return ctypes.CDLL(None).prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0)


@pytest.mark.skipif(sys.platform != "linux", reason="timer slack is Linux's")
def test_the_transport_thread_asks_for_a_timer_slack_of_one_microsecond():
    caller = timer_slack_ns()
    seen = {}

    def thread() -> None:
        _precise_sleeps()
        seen["slack"] = timer_slack_ns()

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join()
    assert seen["slack"] == 1_000
    assert timer_slack_ns() == caller  # a per-thread setting: the other threads keep theirs


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(60)
def test_a_rank_ignores_sigusr1_once_mpi_is_up():
    pytest.importorskip("mpi4py")
    code = (
        "import os, signal; from actorflow.runtime.mpi_world import mpi; mpi(); "
        "os.kill(os.getpid(), signal.SIGUSR1); print(signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


WAITS = """
import json, os, threading, time
import trio
from actorflow.errors import RankError
from actorflow.runtime import transport as module
from actorflow.runtime.transport import Transport

module.QUIET_AFTER = 1.5  # longer than the three phases before the quiet one
transport = Transport(1)
trio.run(transport.connect, [], b"")
busy = False
transport.busy = lambda: busy
transport.threads = len(os.sched_getaffinity(0))  # no core to spare
ended_blocks = [0.0]  # seconds the collective threads spent blocked in MPI, summed
blocking = {}  # thread -> when its block began
block = transport._block


def timed_block(requests, until, every):
    me = threading.get_ident()
    blocking[me] = time.monotonic()
    try:
        block(requests, until, every)
    finally:
        ended_blocks[0] += time.monotonic() - blocking.pop(me)


def inside():
    now = time.monotonic()
    return ended_blocks[0] + sum(now - start for start in list(blocking.values()))


transport._block = timed_block
transport.start()
never = [transport.MPI.COMM_SELF.Irecv(bytearray(1), source=0, tag=tag) for tag in (1, 2)]
ended = []


def collective(request):
    try:
        with transport.collective():
            transport.wait(request)
    except RankError:
        ended.append(time.monotonic())


threads = [threading.Thread(target=collective, args=(r,)) for r in never]
for thread in threads:
    thread.start()


def share(lead=0.1):
    time.sleep(lead)
    before, cpu = inside(), time.process_time()
    time.sleep(0.5)
    return (inside() - before) / 0.5 / len(threads), (time.process_time() - cpu) / 0.5


idle, _ = share()
busy = True
polling, _ = share()
busy = False
idle_again, _ = share()
quiet, cpu = share(lead=1.0)  # nothing heard for QUIET_AFTER by now
closed = time.monotonic()
transport.close()
for thread in threads:
    thread.join(10)
print(json.dumps([idle, polling, idle_again, quiet, cpu, [t - closed for t in ended]]))
"""


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(60)
def test_a_collective_waits_inside_mpi_while_the_rank_is_idle_and_polls_while_it_is_busy_or_quiet():
    """Two collective threads wait for requests that never complete: they stay blocked in
    MPI while ``busy`` says no (a share of the time that counts the time blocked, not the
    CPU it got, so a loaded machine doesn't change it), poll with sleeps between while it
    says yes, and again once the rank heard nothing for ``QUIET_AFTER``, then taking
    0.02-0.11 of a core between them (MPICH's wait spins a core each); both end with a
    RankError soon after the transport closes."""
    pytest.importorskip("mpi4py")
    done = subprocess.run([sys.executable, "-c", WAITS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    idle, polling, idle_again, quiet, cpu, ended = json.loads(done.stdout)
    assert idle > 0.9 and idle_again > 0.9 and polling < 0.1 and quiet < 0.1, done.stdout
    assert cpu < 0.3, done.stdout
    assert len(ended) == 2 and max(ended) < 1.0, done.stdout


IDLE_RANK = """
import json, threading, time
import trio
from actorflow.runtime.transport import Transport
transport = Transport(1)
trio.run(transport.connect, [], b"")
transport.busy = lambda: False  # idle, a core per rank: a wait stays in MPI
transport.start()
comm = transport.MPI.COMM_SELF
"""
"""A script's start: a transport of one rank, started, whose waits stay in MPI."""


def printed(script: str) -> Any:
    """What ``script`` printed (JSON), run in a process of its own, where MPI starts."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


ONE_OF = (
    # a rank that never turns quiet: the transport's wake on turning quiet would end the wait
    "import actorflow.runtime.transport\nactorflow.runtime.transport.QUIET_AFTER = 3600\n"
    + IDLE_RANK
    + """
received = [bytearray(1) for _ in range(3)]
requests = [comm.Irecv(buffer, source=0, tag=tag) for tag, buffer in enumerate(received)]
comm.Send(b"a", dest=0, tag=0)
comm.Send(b"b", dest=0, tag=1)  # two of the three have ended in MPI, neither tested yet
transport._block(requests, bool, False)
ended = [not request for request in requests]
transport.close()
print(json.dumps(ended))
"""
)


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(60)
def test_a_wait_for_one_of_several_requests_ends_when_more_than_one_ended():
    """A rider's wait for any one of its requests (``every=False``) inside MPI: when
    ``Waitsome`` ends two at once, the wait ends; it must not wait on for the third,
    which only this rank's next send would end (a parameter server over 2 ranks hung
    so, and a rank that turns quiet only wakes it ``QUIET_AFTER`` later)."""
    pytest.importorskip("mpi4py")
    assert printed(ONE_OF) == [True, True, False]


SPIED_RANK = (
    IDLE_RANK
    + """
blocked = []  # the threads that blocked in MPI
block = transport._block


def spy(requests, until, every):
    blocked.append(threading.current_thread().name)
    block(requests, until, every)


transport._block = spy
"""
)
"""``IDLE_RANK``, and ``blocked`` names each thread that waits in MPI (``_block``)."""


BESIDE_A_COLLECTIVE = (
    SPIED_RANK
    + """
inside = threading.Event()


def collective():
    with transport.collective():
        inside.set()
        transport.wait(comm.Irecv(bytearray(1), source=0, tag=1))


thread = threading.Thread(target=collective, name="collective")
thread.start()
inside.wait()
time.sleep(0.05)
threading.Timer(0.2, lambda: comm.Send(b"r", dest=0, tag=2)).start()
start = time.monotonic()
transport.wait(comm.Irecv(bytearray(1), source=0, tag=2), every=False)  # the rider's
rider = time.monotonic() - start
comm.Send(b"c", dest=0, tag=1)
thread.join(10)
transport.close()
print(json.dumps([blocked, rider]))
"""
)


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(60)
def test_a_rider_leaves_mpi_to_a_collective_in_flight_and_still_sees_its_transfer_end():
    """A thread waiting on its own transfer (a rider) while a collective over ranks is in
    MPI on another thread waits out of MPI (two threads in MPI on a rank's core took turns
    there, and the collective took twice as long); the collective's calls move the
    transfer, and the rider sees it end within a watch."""
    pytest.importorskip("mpi4py")
    blocked, rider = printed(BESIDE_A_COLLECTIVE)
    assert blocked == ["collective"], (blocked, rider)
    assert 0.19 < rider < 1.0, (blocked, rider)


COLLECTIVE_NEXT = (
    SPIED_RANK
    + """
transport.collective_ready = lambda: True  # a collective stream has its next collective to start
threading.Timer(0.2, lambda: comm.Send(b"r", dest=0, tag=2)).start()
start = time.monotonic()
transport.wait(comm.Irecv(bytearray(1), source=0, tag=2), every=False)  # the rider's
rider = time.monotonic() - start
transport.close()
print(json.dumps([blocked, rider]))
"""
)


@pytest.mark.xdist_group("mpi")
@pytest.mark.timeout(60)
def test_a_rider_stays_out_of_mpi_while_a_collective_of_its_rank_can_start():
    """Nor does a rider wait in MPI while a collective stream of its rank can start its
    next collective (woken, that stream's thread had yet to get the rank's core from the
    rider spinning in MPI): it polls, and sees its transfer end."""
    pytest.importorskip("mpi4py")
    blocked, rider = printed(COLLECTIVE_NEXT)
    assert blocked == [], (blocked, rider)
    assert 0.19 < rider < 1.0, (blocked, rider)


@pytest.mark.parametrize(
    ("cores_per_rank", "busy", "quiet", "stays"),
    [
        (2.0, True, False, True),
        (1.0, False, False, True),
        (1.0, True, False, False),
        (0.5, False, False, False),
        (0.5, True, False, False),
        (2.0, True, True, False),
        (1.0, False, True, False),
    ],
)
def test_a_wait_stays_in_mpi_with_a_core_to_spare_or_idle_with_a_core_per_rank_unless_quiet(
    cores_per_rank, busy, quiet, stays
):
    """Never where the node has fewer cores than ranks: MPICH's wait spins, on the core
    the rank it waits for needs; nor once the rank is quiet (waiting for a slow, paused
    or lost rank)."""
    from actorflow.runtime.transport import Transport

    transport = Transport.__new__(Transport)  # no MPI: only what ``stays`` reads
    transport._cores_per_rank = cores_per_rank
    transport.spare_core = cores_per_rank >= 2  # one busy thread and one more
    transport.busy = lambda: busy
    transport._quiet = quiet
    assert transport.stays() is stays


class _Request:
    """A stand-in for an MPI request: null once completed, else testing as ``outcome``."""

    def __init__(self, outcome: object) -> None:
        self.outcome = outcome

    def __bool__(self) -> bool:
        return self.outcome is not None

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return bool(self.outcome)


def test_after_a_failed_testsome_every_request_it_freed_or_that_fails_is_held_without_its_callback():
    """MPI frees what ``Testsome`` completed, the failed request among them, without
    saying which: none of them may call back as if done."""
    from types import SimpleNamespace

    from actorflow.runtime.transport import Transport

    transport = Transport.__new__(Transport)
    transport.MPI = SimpleNamespace(Exception=RuntimeError)
    transport.lost_after, transport._held = 5.0, []
    called = []
    live = [
        (_Request(outcome), called.append, False)
        for outcome in (None, False, RuntimeError("peer gone"), True)  # freed, active, failing, done
    ]
    error = RuntimeError("ERR_IN_STATUS")
    assert transport._hold_errors(live, error) == [0, 2, 3]
    assert [callback for _, callback, _ in live] == [None, called.append, None, None]
    assert len(transport._held) == 1 and transport._held[0][1] is error
