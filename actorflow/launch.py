"""``actorflow launch``: start N ranks of a command with MPICH's ``mpiexec`` (hydra).

By default every rank runs on this machine and talks over loopback only. Three things
hydra does not do well are done here instead (all measured with the mpich 5.0 wheel):

- Rank prefixes. Hydra's ``-prepend-rank`` prefixes each chunk it reads, not each line:
  ``print`` under ``PYTHONUNBUFFERED=1`` writes the text and the newline separately and
  shows as ``[1] text[1] ``, and two ranks' halves of lines run together. So hydra is
  asked to write a marker before each chunk, and whole lines are rebuilt per rank here.
- Exit status. Hydra exits with the bitwise OR of the ranks' wait statuses (exits 5, 200
  and 3 give 207; SIGINT and SIGKILL give 11, announced as a segmentation fault), so each
  rank's status is read from ``-print-all-exitcodes`` and the worst one is returned.
- Cleanup. Hydra's proxies and ranks each call ``setsid``, so killing mpiexec's process
  group misses them; when mpiexec does not stop after a signal, its whole process tree
  is killed instead.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import FrameType
from typing import Any, BinaryIO

from .world import RANK_CPUS, cpu_shares, listed_cpus

GRACE = 10.0
"""Seconds mpiexec gets after the first forwarded signal before its tree is killed: an
interrupted ``actorflow run`` ends after the steps in flight and then writes its report,
its metrics and its traces, which takes seconds after a long run."""

LOOPBACK = ("-launcher", "fork", "-iface", "lo", "-host", "localhost")
LOOPBACK_ENV = {"UCX_TLS": "self,sm", "UCX_NET_DEVICES": "lo"}

_MARK, _MARK_END = b"\x1f", b"\x1e"  # hydra writes \x1f<rank>\x1e before each chunk
_HYDRA = b"[mpiexec@"  # how hydra's own messages start
_EXIT_CODES = re.compile(rb"\[mpiexec@[^\]]*\] Exit codes: (.*)")
_HOST_CODES = re.compile(rb"\[([^\]]+)\] ([\d,]+)")
_BANNER = (b"YOUR APPLICATION TERMINATED", b"This typically refers", b"Please see the FAQ", b"=")
_FORWARDING = re.compile(rb"\[mpiexec@[^\]]*\] (Sending Ctrl-C to processes|Press Ctrl-C again)")
"""Hydra's notes on a forwarded Ctrl-C: the ranks' own lines say how they stopped."""


class MpiexecNotFound(RuntimeError):
    """No MPICH ``mpiexec`` beside this Python or on PATH (none, or Open MPI's)."""


def find_mpiexec() -> str | None:
    """The mpich wheel's ``mpiexec`` beside this Python, else the first one on PATH."""
    for folder in dict.fromkeys((os.path.dirname(sys.executable), sysconfig.get_path("scripts"))):
        path = os.path.join(folder, "mpiexec")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("mpiexec")


def open_mpi(mpiexec: str) -> str | None:
    """What ``mpiexec`` says it is where that is Open MPI's (the first line of its
    ``--version``), whose mpiexec refuses the hydra options ``mpiexec_command`` passes;
    None for MPICH's hydra, or where it can't tell (mpiexec then says what is wrong)."""
    try:
        done = subprocess.run([mpiexec, "--version"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    said = (done.stdout + done.stderr).decode(errors="replace")
    return said.strip().splitlines()[0] if re.search(r"Open ?MPI|OpenRTE|PRRTE", said) else None


def mpiexec_command(
    n: int,
    command: Sequence[str],
    *,
    mpiexec: str = "mpiexec",
    hostfile: str | None = None,
    extra: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start ``n`` ranks of ``command``.

    Without a hostfile the ranks are forked on this machine and MPICH's UCX transport is
    kept to shared memory and ``lo``, unless the environment already sets those variables.
    Each rank is given its share of the CPUs this process may run on (``world.RANK_CPUS``,
    unless set already or ``extra`` binds the ranks itself), to which an actorflow rank
    binds itself: a rank's threads that poll then take turns with its own compute
    threads only, not with another rank's (on 2 cores, 2x2 over 4 ranks made
    17,400-18,700 samples/s bound against 14,300-15,000 unbound, the default config
    over 2 ranks 44,200-48,100 against 30,900-43,500, alternating).
    ``-disable-auto-cleanup`` keeps hydra from killing the other ranks when one that
    started MPI dies (it sends them SIGUSR1 instead), so they can report which peer was
    lost themselves.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    env = dict(os.environ if environ is None else environ)
    where: Sequence[str] = LOOPBACK
    if hostfile is None:
        for name, value in LOOPBACK_ENV.items():
            env.setdefault(name, value)
        if not any(arg.startswith("-bind") for arg in extra):
            env.setdefault(RANK_CPUS, listed_cpus(cpu_shares(sorted(os.sched_getaffinity(0)), n)))
    else:
        where = ("-f", hostfile)
    argv = [
        mpiexec,
        *where,
        "-disable-auto-cleanup",
        "-print-all-exitcodes",
        "-prepend-pattern",
        "\x1f%r\x1e",
        *extra,
        "-n",
        str(n),
        *command,
    ]
    return argv, env


def launch(
    n: int,
    command: Sequence[str],
    *,
    hostfile: str | None = None,
    extra: Sequence[str] = (),
    grace: float = GRACE,
) -> int:
    """Run ``n`` ranks of ``command`` and return the worst rank's exit status.

    Each rank's lines go to this process's stdout and stderr prefixed with ``[rank] ``;
    stdin goes to rank 0, as with mpiexec. SIGINT, SIGTERM and SIGHUP are forwarded to mpiexec (which
    passes the first two on to the ranks, and dies of the third, taking them along); if
    it has not exited ``grace`` seconds after the first one, its process tree is killed.
    Signals are only caught when called from the main thread.
    """
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise MpiexecNotFound(
            "no mpiexec beside this Python or on PATH; install MPICH's with: pip install mpi4py mpich"
        )
    other = open_mpi(mpiexec)
    if other is not None:
        raise MpiexecNotFound(
            f"{mpiexec} is Open MPI's mpiexec ({other}); actorflow launch starts ranks with MPICH's "
            "hydra: pip install mpi4py mpich"
        )
    argv, env = mpiexec_command(n, command, mpiexec=mpiexec, hostfile=hostfile, extra=extra)
    forward = _Forward()
    old = forward.install()
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        forward.attach(proc)
        ends = _Ends(proc.pid, n) if hostfile is None else None  # ranks elsewhere: not seen here
        width, texts = len(str(n - 1)), (_HydraText(), _HydraText())
        pumps = [
            threading.Thread(target=_pump, args=(pipe, sink.buffer, width, text), daemon=True)
            for pipe, sink, text in zip((proc.stdout, proc.stderr), (sys.stdout, sys.stderr), texts)
        ]
        for pump in pumps:
            pump.start()
        returncode = _wait(proc, forward, grace)
        if ends is not None:
            ends.stop()
        for pump in pumps:
            pump.join(timeout=grace)
    finally:
        forward.restore(old)
    hosts = [host for text in texts for host in text.hosts]
    statuses = [status for _, codes in hosts for status in codes]
    if not statuses:  # mpiexec failed itself, or was killed before it could report
        statuses = [-returncode if returncode < 0 else returncode << 8]
    if failed := _failures(hosts, forward.first, ends.first() if ends is not None else None):
        print(f"actorflow launch: {failed}", file=sys.stderr)
    return exit_status(statuses, forward.first)


_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TEARDOWN = frozenset({*_FORWARDED, signal.SIGKILL, signal.SIGUSR1})
"""Signals that ranks (or mpiexec) die of when a run is torn down: hydra passes SIGINT or
SIGTERM on, then sends SIGKILL to ranks that linger; with -disable-auto-cleanup, SIGUSR1
to the others when one rank died."""


def exit_status(statuses: Iterable[int], interrupted: int | None = None) -> int:
    """The launcher's exit status from the ranks' wait statuses (as ``os.waitpid`` gives).

    The worst rank's, a rank killed by signal N counting as 128 + N like a shell reports
    it. Deaths by SIGUSR1 (hydra's notice that a peer died) count only when nothing else
    failed. After the launcher forwarded signal S the status is at least 128 + S, and
    deaths by the signals of a teardown count as its consequence, not as worse.
    """
    statuses = list(statuses)
    own = [_code(s) for s in statuses if not _killed_by(s, _TEARDOWN if interrupted else {signal.SIGUSR1})]
    if interrupted:
        return max([128 + interrupted, *own])
    return max(own, default=0) or max(map(_code, statuses), default=0)


def _code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _killed_by(status: int, signals: Iterable[int]) -> bool:
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) in signals


def _failures(hosts: list[tuple[str, list[int]]], interrupted: int | None, first: int | None = None) -> str:
    """The ranks that failed, but not those a teardown after a signal stopped.

    With one host hydra lists the ranks in order; across hosts it deals them out by slots,
    so only the host is named. ``first``: the rank whose process ended before the others
    (see ``_Ends``); when a signal killed it, it is named as the one that died and the
    others as stopped after it (hydra kills the survivors of a killed rank, so their
    statuses alone can't tell who died)."""
    parts = []
    for host, statuses in hosts:
        for rank, status in enumerate(statuses):
            if (
                status == 0
                or interrupted
                and (_killed_by(status, _TEARDOWN) or _code(status) == 128 + interrupted)
            ):
                continue  # a rank that ended as the signal asked
            who = f"rank {rank}" if len(hosts) == 1 else f"a rank on {host}"
            parts.append((rank, f"{who} {_status_text(status)}"))
    statuses = hosts[0][1] if len(hosts) == 1 else []
    if first is not None and first < len(statuses) and os.WIFSIGNALED(statuses[first]) and len(parts) > 1:
        others = [
            f"rank {rank} ({_status_text(statuses[rank], was='')})" for rank, _ in parts if rank != first
        ]
        return f"rank {first} {_status_text(statuses[first])} first; the others stopped after it: {', '.join(others)}"
    return "; ".join(text for _, text in parts)


def _status_text(status: int, was: str = "was ") -> str:
    if os.WIFSIGNALED(status):
        return f"{was}killed by {_signal_name(os.WTERMSIG(status))}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def _signal_name(sig: int) -> str:
    try:
        return f"{signal.Signals(sig).name} (signal {sig})"
    except ValueError:
        return f"signal {sig}"


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What ``signal.signal`` returns: the handler it replaced."""


class _Forward:
    """Forwards SIGINT, SIGTERM and SIGHUP to mpiexec, remembering the first one and when."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.at = 0.0
        self._proc: subprocess.Popen | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.first is None:
            self.first, self.at = signum, time.monotonic()
        if self._proc is not None:
            self._proc.send_signal(signum)

    def install(self) -> dict[int, _Handler]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self) for sig in _FORWARDED}

    def attach(self, proc: subprocess.Popen) -> None:
        """Start forwarding to ``proc``, passing on a signal that came while it started."""
        self._proc = proc
        if self.first is not None:
            proc.send_signal(self.first)

    def restore(self, old: dict[int, _Handler]) -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)


class _Ends:
    """Which rank's process ended first, watched from here: hydra starts the ranks (so
    their exit statuses come from its report), and when one is killed its proxy kills the
    rest within milliseconds, all by SIGKILL. A thread finds the ranks among mpiexec's
    descendants (the topmost process with a ``PMI_RANK`` in its environment) and waits on
    a pidfd of each (readable once the process ended, without polling) in an epoll, which
    hands over the ready ones in the order they became ready: the order the ranks ended,
    even where several ended before the thread woke (a busy machine may not run it in
    the milliseconds between). Where that can't be done (no /proc, no pidfd, no epoll) it
    names no one."""

    def __init__(self, root: int, n: int) -> None:
        self._root, self._n = root, n
        self._ended: list[int] = []  # the ranks that ended, in order
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="actorflow-launch-ends", daemon=True)
        self._thread.start()

    def first(self) -> int | None:
        """The rank that ended before any other, or None."""
        return self._ended[0] if self._ended else None

    def stop(self) -> None:
        os.write(self._wake_write, b"x")
        self._thread.join()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _watch(self) -> None:
        ranks: dict[int, int] = {}  # pidfd -> rank
        found: set[int] = set()
        try:
            with select.epoll() as poller:
                poller.register(self._wake_read, select.EPOLLIN)
                while len(found) < self._n or ranks:
                    for pid, rank in self._find(found).items() if len(found) < self._n else ():
                        found.add(rank)
                        try:
                            fd = os.pidfd_open(pid)
                        except ProcessLookupError:
                            self._ended.append(rank)
                            continue
                        ranks[fd] = rank
                        poller.register(fd, select.EPOLLIN)
                    ready = [fd for fd, _ in poller.poll(0.05 if len(found) < self._n else -1)]
                    for fd in ready:
                        if fd in ranks:
                            self._ended.append(ranks.pop(fd))
                            poller.unregister(fd)
                            os.close(fd)
                    if self._wake_read in ready:
                        return
        except (OSError, AttributeError):  # no pidfd_open or epoll here: name no one
            self._ended = []
        finally:
            for fd in ranks:
                os.close(fd)

    def _find(self, found: set[int]) -> dict[int, int]:
        """pid -> rank of the ranks not ``found`` yet that have started."""
        parents = _parents()
        below = {self._root}
        for _ in range(8):  # mpiexec -> hydra_pmi_proxy -> rank: a few levels at most
            below |= {pid for pid, ppid in parents.items() if ppid in below}
        ranks: dict[int, int] = {}
        for pid in below - {self._root}:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environ = dict(e.partition(b"=")[::2] for e in f.read().split(b"\0"))
            except OSError:
                continue
            rank = environ.get(b"PMI_RANK", b"")
            if rank.isdigit() and int(rank) not in found:
                ranks[pid] = int(rank)
        # a rank's command may start processes of its own: the topmost one is the rank
        return {pid: rank for pid, rank in ranks.items() if ranks.get(parents.get(pid, 0)) != rank}


def _wait(proc: subprocess.Popen, forward: _Forward, grace: float) -> int:
    """Wait for mpiexec; kill its tree if it outlives the grace after a signal."""
    while True:
        try:
            return proc.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            if forward.first is not None and time.monotonic() - forward.at > grace:
                _kill_tree(proc.pid)
                return proc.wait()


def _kill_tree(root: int) -> None:
    """SIGKILL ``root`` and all its descendants, found through /proc.

    Each is stopped as soon as it is found, so none forks or gets reparented (when its
    parent dies) while the tree is still being collected. Without /proc only root's
    process group is killed."""
    found: set[int] = set()
    new = {root}
    while new:
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        found |= new
        parents = _parents()
        new = {pid for pid, ppid in parents.items() if ppid in found} - found
    for pid in found:
        _signal(pid, signal.SIGKILL)
    try:
        os.killpg(root, signal.SIGKILL)
    except OSError:
        pass


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process /proc shows."""
    parents = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(b")", 1)[1].split()[1])
    return parents


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


class _Demux:
    """Rebuilds whole lines per rank from one of mpiexec's output streams.

    Hydra writes the marker before each chunk it reads from a rank and after each newline
    inside one; other bytes are its own messages. It may write one right after a rank's
    unfinished line, so ``[mpiexec@`` ends a rank's bytes too (unless it starts a chunk).
    A line ends at ``\\n`` or at ``\\r``, so progress bars redraw in place.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._rank: int | None = None  # whose bytes come next; None: hydra's own
        self._fresh = False  # right after a marker
        self._lines: dict[int | None, bytes] = {}  # the unfinished line of each

    def feed(self, data: bytes) -> list[tuple[int | None, bytes]]:
        """Take the next bytes of the stream; return the (rank, line) pairs completed."""
        self._buf += data
        done = []
        while self._buf:
            buf = self._buf
            if buf.startswith(_MARK):
                end = buf.find(_MARK_END)
                if end < 0:
                    break
                self._rank, self._fresh, self._buf = int(buf[1:end]), True, buf[end + 1 :]
                continue
            if self._rank is not None and not self._fresh and buf.startswith(_HYDRA):
                self._rank = None
            cut = self._cut(buf)
            if cut == 0:
                break
            piece, self._buf = buf[:cut], buf[cut:]
            line = self._lines.pop(self._rank, b"") + piece
            if line.endswith((b"\n", b"\r")):
                done.append((self._rank, line))
                if line.endswith(b"\n"):  # hydra marks what follows a \n, not a \r
                    self._rank = None
            else:
                self._lines[self._rank] = line
            self._fresh = False
        return done

    def close(self) -> list[tuple[int | None, bytes]]:
        """The unfinished lines left at the end of the stream, each given a newline."""
        if self._buf and not self._buf.startswith(_MARK):
            self._lines[self._rank] = self._lines.get(self._rank, b"") + self._buf
        self._buf = b""
        done = [(rank, line + b"\n") for rank, line in self._lines.items()]
        self._lines.clear()
        return done

    def _cut(self, buf: bytes) -> int:
        """Where the piece at the start of ``buf`` ends; 0 when more bytes are needed."""
        ends = [buf.find(b"\n") + 1, buf.find(_MARK)]
        cr = buf.find(b"\r")
        if cr >= 0 and buf[cr + 1 : cr + 2] != b"\n":  # \r\n ends a line once, at the \n
            ends.append(cr + 1)
        if self._rank is not None:
            ends.append(buf.find(_HYDRA, 1))
        ends = [i for i in ends if i > 0]
        if ends or self._rank is None:  # hydra's own text: whole lines only
            return min(ends, default=0)
        held = next((k for k in range(len(_HYDRA) - 1, 0, -1) if buf.endswith(_HYDRA[:k])), 0)
        return len(buf) - held


class _HydraText:
    """Hydra's own lines on one stream: takes the exit codes out and drops the banner,
    which names the OR of the ranks' statuses as if it were one, and its notes on a
    forwarded Ctrl-C."""

    def __init__(self) -> None:
        self.hosts: list[tuple[str, list[int]]] = []  # (host, wait status of each rank)
        self._codes = False  # inside the exit codes, one line per host

    def line(self, line: bytes) -> bytes | None:
        """The line to show, or None."""
        first = _EXIT_CODES.match(line)
        if (first or self._codes) and (m := _HOST_CODES.fullmatch((first[1] if first else line).strip())):
            self._codes = True
            self.hosts.append((m[1].decode(errors="replace"), [int(c) for c in m[2].split(b",")]))
            return None
        self._codes = False
        return None if line.startswith(_BANNER) or _FORWARDING.match(line) else line


def _pump(pipe: BinaryIO, sink: BinaryIO, width: int, hydra: _HydraText) -> None:
    """Copy one of mpiexec's streams to ``sink``, each rank's lines prefixed by its rank;
    after the sink breaks (``| head``) keep reading, so mpiexec never blocks on a write."""
    demux = _Demux()
    out: BinaryIO | None = sink

    def show(lines: list[tuple[int | None, bytes]]) -> None:
        nonlocal out
        for rank, line in lines:
            text = hydra.line(line) if rank is None else b"[%*d] " % (width, rank) + line
            if text is not None and out is not None:
                try:
                    out.write(text)
                    out.flush()
                except OSError:
                    out = None

    while chunk := os.read(pipe.fileno(), 65536):
        show(demux.feed(chunk))
    show(demux.close())
