"""The ranks' transport thread, in what can be checked without MPI: its timed waits end
when asked (timer slack), and SIGUSR1, hydra's notice that a rank ended, is ignored once
MPI is up (see ``runtime/transport``)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading

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
        "import os, signal; from actorflow.runtime.transport import mpi; mpi(); "
        "os.kill(os.getpid(), signal.SIGUSR1); print(signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
