"""The transport between ranks: one thread per process makes every MPI call of that process.

Stream threads and the trio thread never call MPI. They hand the transport thread a
function that starts a nonblocking operation (``Issend``, ``Irecv``, ``Iallreduce``...)
and a callback for its completion. The thread starts what it is handed in order, polls
the requests in flight and runs the callbacks of those that completed, then sleeps a
back-off that doubles while nothing happens (``MIN_BACKOFF`` to ``MAX_BACKOFF``) and is
cut short by new work. MPICH busy-polls inside blocking calls: a thread blocked in one
would take one of the cores the streams need, even while it only waits for a peer.
But MPI moves a large message only while someone polls it, so while a collective or a
send is in flight the thread backs off no further than ``MOVING_BACKOFF`` (a rank that
came early waits for the others, and they need its polls to move the data). It does not
spin: polling without sleeping for as long as a collective's data could take to move
made its bandwidth up to twice the back-off's, alone, but took the GIL from the rank's
compute thread so often that data-parallel training on 2 ranks ran 1.56x of one device
instead of 1.73x (``benchmarks/ranks.py`` (a) and (c)). A posted receive alone lets it
back off to ``MAX_BACKOFF``: polling for it every 100 µs cost that training more than
it saved a hop. With nothing in flight there is nothing to poll: the thread sleeps
until new work comes or the control messages' turn (every ``CONTROL_EVERY``).

Two users: the rank's communication stream (``CommExecutor``: sends and receives),
whose driver this thread runs between its polls (``serve``: the stream's messages come
through the same inbox as the work, and a finished send or receive reaches the driver
by a plain call), and collectives over ranks (``call``: a collective stream's thread
waits, off MPI, until its collective completed). One thread fewer than a stream
thread of its own, and two wake-ups fewer per hop between ranks: one iteration's hop
went from 143-172 to 90-103 µs (``benchmarks/ranks.py`` (b), alternating runs).

Failures reach every rank. On a control communicator of their own, ranks tell each
other when they fail (the error's text) and when they leave normally, and send a
heartbeat every ``HEARTBEAT`` s; a rank that has not left and was not heard from for
``LOST_AFTER`` s is lost. Either way ``on_failure`` gets a ``RankError``. A stalled rank
asks another where its wait-for chain goes on there (``QUERY``, ``REPLY``: the runtime's
``on_query`` and ``on_reply`` get the bytes).

It ignores SIGUSR1 (when MPI starts on the main thread, where Python may set handlers).
MPICH's mpiexec sends it to every rank when one ends (even normally, with the mpich 5.0
wheel), and MPICH's own handler answers it with a PMI query for the dead ranks. Hydra
kills the other ranks when one dies of a signal; when it killed the asking rank before
the answer arrived, hydra's proxy and mpiexec aborted without reporting any rank's exit
status (strace; 1 kill in 15 under load). Ranks learn of a lost peer from the control
messages above instead. SIG_IGN, unlike a Python handler, stays in place while the
interpreter exits, so SIGUSR1 never kills a rank that is leaving.

A process whose run failed over ranks exits with status 1 at interpreter exit without
finalizing MPI: ``MPI_Finalize`` waits for requests its peers will never match (a
survivor of a killed rank was seen to hang there for good).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import trio

from ..errors import RankError
from .device import OnDone

MIN_BACKOFF = 20e-6
MAX_BACKOFF = 1e-3
MOVING_BACKOFF = 100e-6
CONTROL_EVERY = 0.02
HEARTBEAT = 0.5
LOST_AFTER = 3.0
LEAVE_WAIT = 1.0
NOTICE_BYTES = 1 << 16
PR_SET_TIMERSLACK = 29  # prctl(2)
JOIN_TIMEOUT = 120.0
FAILED, BEAT, BYE, QUERY, REPLY = 1, 2, 3, 4, 5

Done = Callable[[BaseException | None], None]


class _Work(NamedTuple):
    """What ``submit`` hands the transport thread (its other messages are a stream's)."""

    start: Callable[[], Any]
    done: Done | None
    moving: bool


def mpi() -> Any:
    """mpi4py's MPI module (initializing MPI), or a RankError saying how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise RankError(
            "a plan over several ranks runs on MPI: pip install 'actorflow[mpi]' (mpi4py and mpich)"
        ) from e
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    return MPI


class Transport:
    """``await connect(...)``, then ``start()``; ``close()`` when done (or failed)."""

    def __init__(self, world: int) -> None:
        self.MPI = mpi()
        comm = self.MPI.COMM_WORLD
        self.rank, size = comm.Get_rank(), comm.Get_size()
        if size != world:
            raise RankError(
                f"this plan runs on {world} ranks, but this process is one of {size}: start it with "
                f"`actorflow launch -n {world} -- COMMAND` (or mpiexec -n {world}), or compile it for {size}"
            )
        self.peers = [r for r in range(world) if r != self.rank]
        self.data: Any = None
        self.control: Any = None
        self.groups: dict[Hashable, Any] = {}
        self.on_failure: Callable[[RankError], None] = lambda exc: None
        self.on_query: Callable[[int, bytes], None] = lambda rank, payload: None
        self.on_reply: Callable[[bytes], None] = lambda payload: None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        """What this thread reads: work to start (``submit``), and messages for the
        stream it serves (``serve``), in the order they came."""
        self._live: list[tuple[Any, Done | None, bool]] = []  # request, callback, data moving
        self._stream: Callable[[list[Any]], None] = lambda messages: None
        self._closed = False
        self._failed = False
        self.thread = threading.Thread(target=self._loop, name=f"rank{self.rank}/transport", daemon=True)

    async def connect(self, groups: Sequence[tuple[Hashable, tuple[int, ...]]], digest: bytes) -> None:
        """Meet every other rank: communicators for the data, the control messages and each
        (key, group of ranks) that runs collectives together, and a check that all ranks
        hold the same plan. Every rank opens its Runtimes in the same order."""
        MPI = self.MPI
        joined = MPI.COMM_WORLD.Ibarrier()
        deadline = time.monotonic() + JOIN_TIMEOUT
        backoff = MIN_BACKOFF
        while not joined.Test():
            if time.monotonic() > deadline:
                _exit_unfinalized()
                raise RankError(
                    f"rank {self.rank} waited for the other ranks to open this Runtime, but not every rank "
                    f"came within {JOIN_TIMEOUT:.0f} s: a rank may have failed before it got there (see its "
                    "output), or the ranks open their Runtimes in different orders"
                )
            await trio.sleep(backoff)
            backoff = min(2 * backoff, 0.01)
        self.data = MPI.COMM_WORLD.Dup()
        self.control = MPI.COMM_WORLD.Dup()
        for key, group in groups:
            comm = self.data.Split(0 if self.rank in group else MPI.UNDEFINED, self.rank)
            if self.rank in group:
                self.groups[key] = comm
        digests = self.control.allgather(digest)
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        if odd:
            raise RankError(
                f"ranks {odd} hold another plan than rank 0: every rank must build the same graph "
                "(same parameter values too) and compile it with the same options"
            )

    def start(self) -> None:
        self.thread.start()

    def submit(self, start: Callable[[], Any], done: Done | None, moving: bool = False) -> None:
        """Run ``start()`` (which returns an MPI request) on the transport thread, then
        ``done(error or None)`` there once the request completed; ``moving``: it moves
        data only while polled (a collective, a send), so poll it at least every
        ``MOVING_BACKOFF``."""
        if threading.current_thread() is self.thread:
            self._start(start, done, moving)
        else:
            self.inbox.put(_Work(start, done, moving))

    def serve(self, stream: Callable[[list[Any]], None]) -> None:
        """Run a stream's message loop on this thread (the rank's communication stream,
        whose kernels this thread starts anyway): every turn of the loop that heard news
        or finished a request calls ``stream(the messages put in inbox since the last)``."""
        self._stream = stream

    def call(self, start: Callable[[], Any]) -> None:
        """Run a collective and wait for it, off MPI, on the calling (stream) thread."""
        finished = threading.Event()
        errors: list[BaseException | None] = []

        def done(error: BaseException | None) -> None:
            errors.append(error)
            finished.set()

        self.submit(start, done, moving=True)
        while not finished.wait(0.2):
            if self._closed:
                raise RankError(f"rank {self.rank} stopped while a collective over ranks was in flight")
        if errors[0] is not None:
            raise errors[0]

    def announce(self, text: str) -> None:
        """Tell every other rank this one failed, with ``text``; at most once."""
        if self._failed:
            return
        self._failed = True
        _exit_unfinalized()
        notice = text.encode()[:NOTICE_BYTES]
        self.submit(lambda: [self.control.Isend(notice, dest=p, tag=FAILED) for p in self.peers], None)

    def tell(self, peer: int, tag: int, payload: bytes) -> None:
        """Send a control message (``QUERY`` or ``REPLY``) to rank ``peer``."""
        payload = payload[:NOTICE_BYTES]
        self.submit(lambda: self.control.Isend(payload, dest=peer, tag=tag), None)

    def close(self) -> None:
        """Stop after what was handed over so far (a failure notice included); says goodbye
        to the other ranks unless this one failed."""
        if not self._closed:
            self._closed = True
            self.inbox.put(None)

    # -- the thread ------------------------------------------------------------------

    def _loop(self) -> None:
        _precise_sleeps()
        MPI = self.MPI
        notice = bytearray(NOTICE_BYTES)
        status = MPI.Status()
        listen = self.control.Irecv(notice, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        heard = dict.fromkeys(self.peers, time.monotonic())
        left: set[int] = set()
        next_beat = next_control = 0.0
        backoff = MIN_BACKOFF
        carried: list = []
        try:
            while True:
                busy = False
                messages = []
                for item in _drain(self.inbox, carried):
                    if item is None:
                        self._leave(listen)
                        return
                    busy = True
                    if isinstance(item, _Work):
                        self._start(*item)
                    else:
                        messages.append(item)
                live = self._live
                if live:
                    finished = MPI.Request.Testsome([x[0] for x in live]) or []
                    if finished:
                        busy = True
                        finished_set = set(finished)
                        self._live = [x for k, x in enumerate(live) if k not in finished_set]
                        for k in finished:
                            done = live[k][1]
                            if done is not None:
                                done(None)
                if busy:
                    self._stream(messages)
                now = time.monotonic()
                if now >= next_control:
                    next_control = now + CONTROL_EVERY
                    listen = self._hear(listen, notice, status, heard, left, now)
                    if now >= next_beat:
                        beats = (
                            self.control.Isend(b"", dest=p, tag=BEAT) for p in self.peers if p not in left
                        )
                        self._live.extend((beat, None, False) for beat in beats)
                        next_beat = now + HEARTBEAT
                    for peer in self.peers:
                        if peer not in left and now - heard[peer] > LOST_AFTER:
                            self._fail(
                                RankError(
                                    f"rank {peer} was lost: no word from it for {now - heard[peer]:.1f} s "
                                    "(its process died or hangs, or its host is unreachable)"
                                )
                            )
                            left.add(peer)
                if self._live:
                    moving = any(x[2] for x in self._live)
                    most = MOVING_BACKOFF if moving else MAX_BACKOFF
                    backoff = wait = MIN_BACKOFF if busy else min(2 * backoff, most)
                else:  # nothing to poll: sleep until new work or the control messages' turn
                    backoff, wait = MIN_BACKOFF, next_control - now
                try:
                    carried.append(self.inbox.get(timeout=wait))
                except queue.Empty:
                    pass
        except MPI.Exception as exc:
            self._fail(RankError(f"rank {self.rank}: MPI failed: {exc}"))

    def _start(self, start: Callable[[], Any], done: Done | None, moving: bool) -> None:
        """On the transport thread: start what was handed over, and poll its requests."""
        try:
            started = start()
        except Exception as exc:  # noqa: BLE001 - the caller hears of it
            if done is None:
                raise
            done(exc)
            return
        requests = started if isinstance(started, list) else [started]
        self._live.extend((request, done, moving) for request in requests)

    def _hear(self, listen: Any, notice: bytearray, status: Any, heard: dict, left: set, now: float) -> Any:
        """Handle the control messages that came; returns the receive posted for the next."""
        while listen.Test(status):
            source, tag = status.Get_source(), status.Get_tag()
            heard[source] = now
            message = bytes(notice[: status.Get_count()])
            if tag == FAILED:
                self._fail(RankError(message.decode(errors="replace")))
            elif tag == BYE:
                left.add(source)
            elif tag == QUERY:
                self.on_query(source, message)
            elif tag == REPLY:
                self.on_reply(message)
            listen = self.control.Irecv(notice, source=self.MPI.ANY_SOURCE, tag=self.MPI.ANY_TAG)
        return listen

    def _fail(self, exc: RankError) -> None:
        if not self._failed:
            self._failed = True
            _exit_unfinalized()
            self.on_failure(exc)

    def _leave(self, listen: Any) -> None:
        """Say goodbye (unless failed), give what is in flight a moment, and stop listening."""
        if not self._failed:
            self._live.extend((self.control.Isend(b"", dest=p, tag=BYE), None, False) for p in self.peers)
        deadline = time.monotonic() + LEAVE_WAIT
        pending = [x[0] for x in self._live]
        while pending and time.monotonic() < deadline and not self.MPI.Request.Testall(pending):
            time.sleep(MAX_BACKOFF)
        listen.Cancel()


class CommExecutor:
    """The communication stream of a rank: sends and receives started on the transport
    thread, completing in any order. It is a ``device.Stream`` to the driver
    (``launch``, ``close``, ``submitted``, ``done``, ``running``), but its launches return
    at once and report their completion (``on_done``) from the transport's thread; its
    kernels are ``kernel(ins, outs, comm)`` returning the MPI request."""

    def __init__(self, name: str, transport: Transport, on_done: OnDone) -> None:
        self.name = name
        self._transport = transport
        self._on_done = on_done
        self.submitted = 0
        self.done = 0
        self.running = None

    def launch(self, kernel: Callable, ins: list, outs: list, ctx: Any) -> None:
        self.submitted += 1
        began = time.perf_counter()

        def done(error: BaseException | None) -> None:
            self.done += 1
            self._on_done(ctx, error, began, time.perf_counter(), error is None)

        sends = bool(ins)  # a send has its data to move; a receive waits for it
        self._transport.submit(lambda: kernel(ins, outs, self._transport.data), done, moving=sends)

    def close(self) -> None:
        self._transport.close()


def _precise_sleeps() -> None:
    """Make this thread's timed waits end when asked. Linux rounds each one up by the
    thread's timer slack, 50 µs by default: the back-offs of 20 and 100 µs took 108 and
    181 µs here (``time.sleep`` measured), so every poll of a transfer came late; with a
    slack of 1 µs they take 42 and 126 µs. Elsewhere nothing changes."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


_exiting = False


def _exit_unfinalized() -> None:
    """At interpreter exit, leave with status 1 before MPI is finalized (see the module)."""
    global _exiting
    if not _exiting:
        _exiting = True
        atexit.register(_leave_now)


def _leave_now() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _drain(q: queue.SimpleQueue, carried: list) -> list:
    items, carried[:] = list(carried), []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


def gather(obj: Any) -> list | None:
    """Every rank's ``obj`` on rank 0 (None on the others), for a run's final report.

    Called by every rank, outside a Runtime. The ranks first meet at a barrier polled with
    back-off, so no rank spins in MPI while waiting for a slower one."""
    MPI = mpi()
    request = MPI.COMM_WORLD.Ibarrier()
    backoff = MIN_BACKOFF
    while not request.Test():
        time.sleep(backoff)
        backoff = min(2 * backoff, 0.01)
    return MPI.COMM_WORLD.gather(obj, root=0)
