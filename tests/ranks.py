"""Real ranks for tests: ``actorflow launch`` (mpiexec on loopback) with a time bound.

``launch`` runs a command on n ranks and returns its exit status and output; ``Pool``
keeps n ranks of ``rank_pool.py`` alive across the examples of a property test. Either
way every process ends with the call: a time-out kills the launcher's whole process
group and fails the test.
"""

from __future__ import annotations

import base64
import os
import pickle
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mpi4py", reason="multi-process tests need mpi4py and mpich: pip install '.[test]'")

TESTS = Path(__file__).parent
REPO = TESTS.parent


def environment(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]), **extra)
    for name in (
        "PMI_RANK",
        "PMI_SIZE",
        "RANK",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
    ):
        env.pop(name, None)
    return env


def launcher(n: int, *argv: str) -> list[str]:
    return [sys.executable, "-m", "actorflow.cli", "launch", "-n", str(n), "--", *argv]


def start(n: int, *argv: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        launcher(n, *argv),
        cwd=REPO,
        env=environment(),
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def launch(n: int, *argv: str, timeout: float = 60) -> tuple[int, str]:
    """(exit status, output of every rank) of ``argv`` run on ``n`` ranks."""
    proc = start(n, *argv)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{argv} on {n} ranks did not end within {timeout} s:\n{out}")
    return proc.returncode, out


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process below it: mpiexec, hydra's proxies and the
    ranks each start a session of their own, out of the launcher's process group."""
    from actorflow.launch import _kill_tree

    _kill_tree(proc.pid)


def python(n: int, code: str, timeout: float = 60) -> tuple[int, str]:
    return launch(n, sys.executable, "-c", code, timeout=timeout)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of rank ``rank``'s Python among the launcher's descendants: the one that
    runs the rank, below its guard where it has one (``survival.guard``)."""
    parents, environs = {}, {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            environs[int(entry)] = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
    family = {launcher}
    for _ in range(5):  # the launcher, mpiexec, hydra's proxy, the guards, the ranks
        family |= {pid for pid, parent in parents.items() if parent in family}
    marked = f"PMI_RANK={rank}".encode()
    found = {pid for pid in family if marked in environs.get(pid, ())}
    guarded = [pid for pid in found if parents[pid] in found]
    return min(guarded or found, default=None)


def wait_for_checkpoint(proc: subprocess.Popen, folder: Path, n: int, within: float = 60) -> list[int]:
    """Wait until the run on ``n`` ranks that ``proc`` launched has written a checkpoint
    into ``folder`` (every rank is past its start); then its ranks' pids (``rank_pid``)."""
    deadline = time.monotonic() + within
    while not any(p.name.startswith("step-") for p in folder.glob("*")):
        assert proc.poll() is None and time.monotonic() < deadline, f"no checkpoint in {within} s"
        time.sleep(0.02)
    found = [rank_pid(proc.pid, r) for r in range(n)]
    pids = [pid for pid in found if pid is not None]
    assert len(pids) == n, f"ranks {found} (None: not found)"
    return pids


def wait_gone(pids: list[int], within: float) -> list[int]:
    """The pids still alive after ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


class Pool:
    """n ranks of ``rank_pool.py``: ``run(case)`` hands rank 0 a case on stdin and returns
    what rank 0 printed for it."""

    def __init__(self, n: int, timeout: float = 60) -> None:
        self.timeout = timeout
        self.proc = start(n, sys.executable, str(TESTS / "rank_pool.py"), stdin=subprocess.PIPE, bufsize=1)

    def run(self, case: object) -> object:
        self.proc.stdin.write(base64.b64encode(pickle.dumps(case)).decode() + "\n")
        self.proc.stdin.flush()
        seen = []
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], deadline - time.monotonic())
            if not ready:
                break
            line = self.proc.stdout.readline()
            if not line:
                pytest.fail("the rank pool ended:\n" + "".join(seen))
            if "RESULT " in line:
                return pickle.loads(base64.b64decode(line.split("RESULT ", 1)[1]))
            seen.append(line)
        self.close()
        pytest.fail(f"the rank pool gave no result within {self.timeout} s:\n" + "".join(seen))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                kill(self.proc)
                self.proc.wait()
