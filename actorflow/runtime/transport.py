"""The transport between ranks: a thread per process that makes its MPI calls, but for
the collectives over ranks, which their own stream's thread makes, and the sends and
receives of a rank whose compute stream rides its communication stream
(``replay._rider``), which that stream's thread makes (waiting as a collective does).

Stream threads and the trio thread hand the transport thread a function that starts a
nonblocking operation (``Issend``, ``Irecv``...) and a callback for its completion. The
thread starts what it is handed in order, polls the requests in flight and runs the
callbacks of those that completed, then sleeps a back-off that doubles while nothing
happens (``MIN_BACKOFF`` to ``MAX_BACKOFF``) and is cut short by new work. MPI moves a
large message only while someone polls it, so while a send is in flight the thread
backs off no further than ``MOVING_BACKOFF``; a posted receive alone lets it back off
to ``MAX_BACKOFF`` (polling for it every 100 µs cost data-parallel training more than
it saved a hop). While the rank has nothing else to run (``busy``, which the runtime
sets, says no) or has a core to spare, it polls every ``MIN_BACKOFF`` instead. It can't
stay inside MPI: it would not hear of the sends a stream hands it. With nothing in
flight there is nothing to poll: the thread sleeps until new work comes or the control
messages' turn (every ``CONTROL_EVERY``). It also runs the rank's communication
stream between its polls (``serve``: its driver, or its replayed program,
``replay.CommReplay``; the stream's messages come through the same inbox as the work,
and a finished send or receive reaches it by a plain call): one thread fewer than a
stream thread of its own, and two wake-ups fewer per hop
between ranks (one iteration's hop went from 143-172 to 90-103 µs, ``benchmarks/ranks.py``
(b), alternating runs).

A collective over ranks is started and waited for on its stream's own thread
(``collective``, ``wait``; MPI runs at thread level MULTIPLE), not handed to the
transport thread and back: two wake-ups fewer per collective. Each collective stream
has a communicator of its own, so every rank still starts the collectives on it in one
order. While some compute stream of the rank is busy, the waiting thread polls with
back-off (``MIN_BACKOFF`` doubling to ``MOVING_BACKOFF``: a rank that came early waits
for the others, and they need its polls to move the data). While they are idle (on a
node with a core per rank: else MPICH's spinning wait would take the core of the rank
it waits for), or the rank has a core to spare, it stays in MPI (``stays``): blocked in
``Waitsome`` on its requests and
on a receive from this process of its own, which the transport thread sends it
(``wake``) once the rank got busy (it looks every ``WATCH_EVERY`` meanwhile) or the
transport stops: a closing runtime and a lost or failed rank end the wait as they end
everything else. A rank has a core to spare when its share of the node's cores (those
its ranks may run on, every one's ``os.sched_getaffinity`` together, over the ranks on
its node, from MPI's shared-memory split) holds the threads ``busy`` speaks for
(``threads``) and one more.
Meanwhile that thread's MPI calls move every request's data, so the transport thread
looks at its own requests only every ``WATCH_EVERY``, and polls them at once when the
collective ends. A rider waiting on its own transfers meanwhile does the same, out of
MPI (``_leave_mpi``): beside it, blocked in MPI or polling, a 16 MiB all-reduce took
twice as long. Spinning on ``Test`` in Python instead would hold the GIL between the
calls: the rank's other threads then waited up to the switch interval (5 ms) for each
turn, and the transport thread was seen to start a send 85 ms late; blocked in MPI, the
thread holds no GIL. While a collective stream of the rank can start its next
collective (``collective_ready``, which the runtime sets), a rider polls with back-off
rather than wait in MPI: a collective thread just woken otherwise waited for the rank's
core while the rider spun there (``benchmarks/ranks.py`` (a) at 1 MiB: the rider
blocked in MPI 13-15 times in 40 iterations, spinning 20 ms of the rank's 80).

Measured with ``benchmarks/ranks.py --parts a c`` on this machine (2 cores, which the 2
ranks share), alternating runs, medians (each run's figures are medians of 3 repeats):
(a) a 2-rank all_reduce fed every iteration, against bare MPI's blocking in-place
``Allreduce``, at 1 / 16 / 64 MiB: 0.16x / 0.29x / 0.54x before, 0.33x / 0.28x / 0.54x
with these waits, 0.34x / 0.37x / 0.79x with ``collectives.Across``'s all-reduce too
(1.29 -> 0.62 -> 0.59 ms at 1 MiB); (c) data-parallel training on 2 ranks 1.42x ->
1.53x -> 1.57x of one device (145 -> 134 -> 130 ms a step). Short of the goals (0.9x,
1.85x). The all-reduce alone (``Across`` on two ranks, with the transport thread
running and nothing else) comes near bare MPI: 0.26 ms at 1 MiB and 3.2-3.4 ms at
16 MiB, against 0.20 and 3.0. The rest goes to what else the ranks do: with one core
per rank, every wake-up of another thread on either rank takes a core from a thread
that waits in MPI or computes (a thread waking every 100 µs beside a bare 1 MiB
exchange made it 1.5x slower, every 1 ms 1.13x). In (a) those are the iteration's other
kernels (the output's slice, its fetch and its send to the other rank, the next feed's
copy), in (c) the collective's polls while the rank computes: the compute threads were
preempted 230-290 times a step (60-85 in one process) and ran 133 ms a step for 120 ms
of CPU.

A rank that has been idle and heard of nothing (no work handed over, no request with a
callback completed) for ``QUIET_AFTER`` is quiet: a rank waiting for a slow, paused or
lost one. It stops spinning: a wait in MPI is woken, and every wait and poll backs off
to ``MAX_BACKOFF`` until work comes. Ranks waiting out a failure's deadline (seconds)
spun a core each before; the tests over ranks took 12% less CPU.

Failures reach every rank. On a control communicator of their own, ranks tell each
other when they fail (the error's text) and when they leave normally, and send a
heartbeat every ``HEARTBEAT`` s; a rank that has not left and was not heard from for
``lost_after`` s is lost, and the rank that noticed tells every other, the lost one too,
so that each names the rank that went silent first: a rank that was paused itself (its
own loop stood still for half that time: SIGSTOP, a swap) heard nothing meanwhile and
judges no one for it, but hears when the others judged it. Either way ``on_failure``
gets a ``RankError``. A stalled rank
asks another where its wait-for chain goes on there (``QUERY``, ``REPLY``: the runtime's
``on_query`` and ``on_reply`` get the bytes).

A rank may be ``losable`` (a parameter server's worker, ``training.survival``): its loss
is told as ``LOST`` (its rank), and ``on_failure`` gets a ``RankLost``, which the program
may survive (``mpi_world.regroup``).

A process whose run failed over ranks, or survived a lost one, ends without finalizing
MPI (``mpi_world.exit_unfinalized``).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, NamedTuple

import trio

from ..errors import RankError, RankLost
from ..world import LOST_AFTER
from .device import OnDone
from .mpi_world import JOIN_TIMEOUT, exit_unfinalized, mpi, world_comm

MIN_BACKOFF = 20e-6
MAX_BACKOFF = 1e-3
MOVING_BACKOFF = 100e-6
WATCH_EVERY = 5e-3
QUIET_AFTER = 0.2
"""Seconds a rank runs nothing and hears of nothing before it stops spinning."""
CONTROL_EVERY = 0.02
HEARTBEAT = 0.5
LEAVE_WAIT = 1.0
NOTICE_BYTES = 1 << 16
PR_SET_TIMERSLACK = 29  # prctl(2)
FAILED, BEAT, BYE, QUERY, REPLY, LOST = 1, 2, 3, 4, 5, 6

Done = Callable[[BaseException | None], None]


class _Work(NamedTuple):
    """What ``submit`` hands the transport thread (its other messages are a stream's)."""

    start: Callable[[], Any]
    done: Done | None
    moving: bool


class Transport:
    """``await connect(...)``, then ``start()``; ``close()`` when done (or failed).

    Set before ``start()``: ``collective_ready``, whether a collective stream of this rank
    runs a collective or can start its next one (cheap, never blocking, as ``busy``);
    ``busy``, whether some compute stream of this rank is running a kernel or has one it
    can launch (called from the transport's and the collective streams' threads and a
    rider's, often: it must be cheap and never block); ``threads``, how many threads
    ``busy`` speaks for (the rank's compute and copy streams with work, so at most this
    many cores it keeps busy). The defaults, always busy and one thread, have a rank wait
    inside MPI only where it has a core to spare. ``losable``: the ranks whose loss this
    rank may survive (``RankLost``)."""

    def __init__(
        self, world: int, lost_after: float = LOST_AFTER, losable: frozenset[int] = frozenset()
    ) -> None:
        self.MPI = mpi()
        self.lost_after = lost_after
        self.losable = losable
        self.world = world_comm()
        self.rank, size = self.world.Get_rank(), self.world.Get_size()
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
        self.busy: Callable[[], bool] = _always_busy
        self.collective_ready: Callable[[], bool] = _never
        self.threads = 1
        self.spare_core = False
        """Whether this rank may keep a core in MPI while ``busy``: set by ``start``."""
        self._cores_per_rank = 0.0
        self._quiet = False
        """Whether the rank has been idle and heard nothing for ``QUIET_AFTER``: set by the
        transport's thread."""
        self._collecting: set[int] = set()  # the threads inside ``collective`` (their idents)
        # the wake-up tags of those inside ``_block``, till ``wake``: whether in a collective
        self._blocked: dict[int, bool] = {}
        self._nudged = threading.Event()  # set by ``wake`` and a collective's end: see ``_leave_mpi``
        self._wakes: Any = None  # this process alone: where ``wake`` sends
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        """What this thread reads: work to start (``submit``), and messages for the
        stream it serves (``serve``), in the order they came."""
        self._live: list[tuple[Any, Done | None, bool]] = []  # request, callback, data moving
        self._stream: Callable[[list[Any]], None] = lambda messages: None
        self._closed = False
        self._failed = False
        self._held: list[tuple[float, Any]] = []  # MPI errors awaiting a loss's verdict: (until, error)
        self.thread = threading.Thread(target=self._loop, name=f"rank{self.rank}/transport", daemon=True)

    async def connect(self, groups: Sequence[tuple[Hashable, tuple[int, ...]]], digest: bytes) -> None:
        """Meet every other rank: communicators for the data, the control messages and each
        (key, group of ranks) that runs collectives together, and a check that all ranks
        hold the same plan. Every rank opens its Runtimes in the same order."""
        MPI = self.MPI
        joined = self.world.Ibarrier()
        deadline = time.monotonic() + JOIN_TIMEOUT
        backoff = MIN_BACKOFF
        while not joined.Test():
            if time.monotonic() > deadline:
                exit_unfinalized()
                raise RankError(
                    f"rank {self.rank} waited for the other ranks to open this Runtime, but not every rank "
                    f"came within {JOIN_TIMEOUT:.0f} s: a rank may have failed before it got there (see its "
                    "output), or the ranks open their Runtimes in different orders"
                )
            await trio.sleep(backoff)
            backoff = min(2 * backoff, 0.01)
        node = self.world.Split_type(MPI.COMM_TYPE_SHARED)
        cores = set().union(*node.allgather(os.sched_getaffinity(0)))  # ranks may be pinned apart
        self._cores_per_rank = len(cores) / node.Get_size()
        node.Free()
        self.data = self.world.Dup()
        self.control = self.world.Dup()
        self._wakes = MPI.COMM_SELF.Dup()
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
        # the node's cores hold every rank's busy threads and one more each, in MPI
        self.spare_core = self._cores_per_rank >= self.threads + 1
        self.thread.start()

    def stays(self) -> bool:
        """Whether a wait for MPI stays in MPI: the rank is not quiet, and has a core to
        spare or nothing else to run on a node with a core per rank. Where the node has
        fewer cores than ranks, MPICH's spinning wait would take the core of the rank it
        waits for: 2x2 over 4 ranks on 2 cores ran 2,027 to 8,196 samples/s staying in
        MPI while idle, 12,256 to 12,772 polling (``actorflow run configs/2x2.yaml
        --steps 40``, alternating runs)."""
        return not self._quiet and (self.spare_core or (self._cores_per_rank >= 1 and not self.busy()))

    def submit(self, start: Callable[[], Any], done: Done | None, moving: bool = False) -> None:
        """Run ``start()`` (which returns an MPI request) on the transport thread, then
        ``done(error or None)`` there once the request completed; ``moving``: it moves
        data only while polled (a send), so poll it at least every ``MOVING_BACKOFF``."""
        if threading.current_thread() is self.thread:
            self._start(start, done, moving)
        else:
            self.inbox.put(_Work(start, done, moving))

    def serve(self, stream: Callable[[list[Any]], None]) -> None:
        """Run a stream's message loop on this thread (the rank's communication stream,
        whose kernels this thread starts anyway): every turn of the loop that heard news
        or finished a request calls ``stream(the messages put in inbox since the last)``."""
        self._stream = stream

    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Around a collective over ranks, on its stream's thread, which starts its MPI
        requests and ``wait``s for them there: meanwhile the transport thread leaves the
        polling to that thread."""
        me = threading.get_ident()
        self._collecting.add(me)
        try:
            self.wake(collectives=False)  # a rider waiting inside MPI leaves it to the collective
            yield
        finally:
            self._collecting.discard(me)
            self._nudged.set()
            if self._live and not self._collecting:  # poll them now, not at the next watch
                self.submit(_no_requests, None)

    def wait(self, requests: Any, until: Callable[[], bool] = bool, every: bool = True) -> None:
        """Wait on the calling thread (a collective stream's, inside ``collective``, or a
        communication stream's rider) until ``requests`` (an MPI request or a list of
        them) completed (not ``every``: one of them), or sooner once ``until()`` (which a
        thread that makes it true follows with ``wake``): in MPI (``_block``) while the
        rank ``stays``, else polling them with back-off (``MIN_BACKOFF`` doubling to
        ``MOVING_BACKOFF``: the others' data moves only while this rank polls too). A
        RankError once the transport closed (this rank or another failed)."""
        if not isinstance(requests, list):
            requests = [requests]
        test = self.MPI.Request.Testall if every else self._test_any
        backoff = MIN_BACKOFF
        while not test(requests) and not until():
            if self._closed:
                raise RankError(
                    f"rank {self.rank} stopped while a transfer or a collective over ranks was in flight"
                )
            if self._collective_elsewhere():
                self._leave_mpi(until)
                continue
            if self.stays() and not self._collective_next():
                self._block(requests, until, every)
                backoff = MIN_BACKOFF
                continue
            _precise_sleeps_once()
            time.sleep(backoff)
            backoff = min(2 * backoff, MAX_BACKOFF if self._quiet else MOVING_BACKOFF)

    def _collective_elsewhere(self) -> bool:
        """Whether a collective over ranks is in MPI on another thread, this one (a rider)
        not in one."""
        collecting = self._collecting
        return bool(collecting) and threading.get_ident() not in collecting

    def _collective_next(self) -> bool:
        """Whether a collective stream can start its next collective (``collective_ready``),
        this thread not in a collective: it then polls rather than spin in MPI."""
        return self.collective_ready() and threading.get_ident() not in self._collecting

    def _leave_mpi(self, until: Callable[[], bool]) -> None:
        """A rider's wait while a collective is in MPI on another thread: out of MPI, as the
        transport's thread leaves it to the collective, until the collective ended, a
        ``wake`` (``until()`` may have come true) or ``WATCH_EVERY``. The collective's own
        calls move the rider's transfers meanwhile. A rider blocked in MPI beside it, or
        polling it, took turns in MPI with it on the rank's core: a 16 MiB all-reduce
        took twice as long (``benchmarks/ranks.py`` (a): 13.9-16.0 ms, against 5.5-7.3 ms
        with the transport's thread serving the transfers). A rank has one rider, so one
        thread clears the event."""
        self._nudged.clear()
        if self._collective_elsewhere() and not until() and not self._closed:
            self._nudged.wait(WATCH_EVERY)

    def _test_any(self, requests: list) -> bool:
        """Whether one of ``requests`` completed: now, or before (MPI set it to the null
        request, which ``Testany`` passes over)."""
        return not all(requests) or self.MPI.Request.Testany(requests)[1]

    def _block(self, requests: list, until: Callable[[], bool], every: bool) -> None:
        """Stay in MPI, without the GIL, until ``requests`` completed or a thread wakes
        this one (``wake``: the rank got busy, the transport stops, or ``until()``).
        A thread spinning on ``Test`` in Python would hold the GIL between its calls, and
        the rank's other threads waited up to the switch interval (5 ms) for each turn:
        the transport thread was seen to start a send 85 ms late so."""
        tag = _own_tag()
        wake = self._wakes.Irecv(_NOTHING, source=0, tag=tag)
        self._blocked[tag] = threading.get_ident() in self._collecting
        # it may have changed before the wake saw us
        woken = (
            self._closed
            or self._collective_elsewhere()
            or self._collective_next()
            or not self.stays()
            or until()
        )
        pending = [*requests, wake]
        left = sum(1 for request in requests if request)  # an earlier _block's completed ones are null
        if not every:
            left = min(left, 1)
        while left > 0 and not woken:
            for k in self.MPI.Request.Waitsome(pending) or ():
                if k == len(requests):
                    woken = True
                else:
                    left -= 1
        try:
            del self._blocked[tag]
        except KeyError:  # ``wake`` took it out: its message came, or comes
            pass
        else:
            wake.Cancel()
        wake.Wait()

    def announce(self, text: str) -> None:
        """Tell every other rank this one failed, with ``text``; at most once."""
        if self._failed:
            return
        self._failed = True
        exit_unfinalized()
        self.submit(lambda: self._notices(text), None)

    def _notices(self, text: str, tag: int = FAILED) -> list:
        """Start sending ``text`` to every other rank as a failure notice (or ``tag``); its
        requests."""
        notice = text.encode()[:NOTICE_BYTES]
        return [self.control.Isend(notice, dest=p, tag=tag) for p in self.peers]

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
        last_control = time.monotonic()
        backoff = MIN_BACKOFF
        carried: list = []
        lively = time.monotonic()
        try:
            while True:
                news = worked = False  # worked: news other than a heartbeat sent
                messages = []
                for item in _drain(self.inbox, carried):
                    if item is None:
                        self._leave(listen)
                        return
                    news = worked = True
                    if isinstance(item, _Work):
                        self._start(*item)
                    else:
                        messages.append(item)
                live = self._live
                if live:
                    try:
                        finished = MPI.Request.Testsome([x[0] for x in live]) or []
                    except MPI.Exception as exc:
                        if not self.losable:
                            raise
                        finished = self._hold_errors(live, exc)
                    if finished:
                        news = True
                        finished_set = set(finished)
                        self._live = [x for k, x in enumerate(live) if k not in finished_set]
                        for k in finished:
                            done = live[k][1]
                            if done is not None:
                                worked = True
                                done(None)
                if news:
                    self._stream(messages)
                now = time.monotonic()
                if worked or self.busy():
                    lively = now
                    self._quiet = False
                elif not self._quiet and now - lively > QUIET_AFTER:
                    self._quiet = True
                    self.wake()
                if now >= next_control:
                    next_control = now + CONTROL_EVERY
                    if now - last_control > self.lost_after / 2:  # this rank was paused
                        heard = dict.fromkeys(self.peers, now)
                    last_control = now
                    listen = self._hear(listen, notice, status, heard, left, now)
                    if now >= next_beat:
                        beats = (
                            self.control.Isend(b"", dest=p, tag=BEAT) for p in self.peers if p not in left
                        )
                        self._live.extend((beat, None, False) for beat in beats)
                        next_beat = now + HEARTBEAT
                    for peer in self.peers:
                        if peer not in left and now - heard[peer] > self.lost_after:
                            lost = (
                                f"rank {peer} was lost: rank {self.rank} had no word from it for "
                                f"{now - heard[peer]:.1f} s (its process died, hangs or was paused longer "
                                "than lost_after, or its host is unreachable)"
                            )
                            self._fail(self._loss(peer, lost), f"{peer}\n{lost}")
                            left.add(peer)
                    if self._held and now > self._held[0][0]:  # no loss explains it: a failure
                        self._fail(RankError(f"rank {self.rank}: MPI failed: {self._held[0][1]}"))
                watching = bool(self._blocked) and not self.spare_core  # until the rank gets busy
                if watching and self.busy():
                    self.wake()
                if self._collecting and self._live:
                    # a collective's thread polls MPI, which moves every request's data: only
                    # notice the ends now and then
                    backoff = wait = WATCH_EVERY
                elif self._live:
                    if self.stays():
                        most = MIN_BACKOFF
                    elif not self._quiet and any(x[2] for x in self._live):
                        most = MOVING_BACKOFF
                    else:
                        most = MAX_BACKOFF
                    backoff = wait = MIN_BACKOFF if news else min(2 * backoff, most)
                else:  # nothing to poll: sleep until new work or the control messages' turn
                    backoff, wait = MIN_BACKOFF, next_control - now
                if watching:  # a thread waits inside MPI: notice soon that the rank got busy
                    wait = min(wait, WATCH_EVERY)
                try:
                    carried.append(self.inbox.get(timeout=wait))
                except queue.Empty:
                    pass
        except MPI.Exception as exc:
            self._fail(RankError(f"rank {self.rank}: MPI failed: {exc}"))
        finally:
            self._closed = True
            self.wake()

    def _hold_errors(self, live: list, error: Exception) -> list[int]:
        """After ``Testsome`` raised ``error``, with ``losable`` peers: the indices of the
        requests that completed. MPI may see a peer's death (a failed request to it) before
        the heartbeats do, so the failure is held (``_held``) for ``lost_after``: a
        ``RankLost`` meanwhile is the verdict, else it fails this rank as any MPI error
        does. ``Testsome`` freed the requests it completed, the failed ones among them,
        without saying which succeeded, so the others are tested one by one, and none
        completed now calls back (the rank fails or regroups either way)."""
        finished = []
        for k, (request, _, _) in enumerate(live):
            try:
                if request and not request.Test():
                    continue
            except self.MPI.Exception:
                pass
            finished.append(k)
            live[k] = (request, None, False)
        self._held.append((time.monotonic() + self.lost_after, error))
        return finished

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
            elif tag == LOST:
                peer, _, text = message.decode(errors="replace").partition("\n")
                self._fail(self._loss(int(peer), text))
                left.add(int(peer))
            elif tag == BYE:
                left.add(source)
            elif tag == QUERY:
                self.on_query(source, message)
            elif tag == REPLY:
                self.on_reply(message)
            listen = self.control.Irecv(notice, source=self.MPI.ANY_SOURCE, tag=self.MPI.ANY_TAG)
        return listen

    def wake(self, collectives: bool = True) -> None:
        """Take every thread in ``_block`` out of MPI (a message to this process with its
        tag), or (not ``collectives``) those outside a collective, and a rider out of
        ``_leave_mpi``. A rider's pokes and a collective's start wake the rider alone: a
        collective thread woken by each would go back into MPI, taking turns there with
        no one."""
        self._nudged.set()
        for tag, collecting in list(self._blocked.items()):
            if collectives or not collecting:
                try:
                    del self._blocked[tag]
                except KeyError:  # it left on its own meanwhile
                    continue
                self._wakes.Send(_NOTHING, dest=0, tag=tag)

    def _loss(self, peer: int, text: str) -> RankError:
        """What losing rank ``peer`` is to this rank: a ``RankLost`` where it is ``losable``
        (and not this rank itself, judged lost by another), else a failure."""
        return RankLost(peer, text) if peer in self.losable and peer != self.rank else RankError(text)

    def _fail(self, exc: RankError, lost: str | None = None) -> None:
        """Fail this rank, once; ``lost``: tell the other ranks this ``LOST`` notice (they
        may not hear of a lost rank otherwise)."""
        if not self._failed:
            self._failed = True
            if lost is not None:
                self._live.extend((r, None, False) for r in self._notices(lost, LOST))
            exit_unfinalized(0 if isinstance(exc, RankLost) else 1)
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
        self.event = None

    def launch(self, kernel: Callable, ins: list, outs: list, ctx: Any) -> None:
        self.submitted += 1
        began = time.perf_counter()

        def done(error: BaseException | None) -> None:
            self.done += 1
            self._on_done(ctx, error, began, time.perf_counter(), error is None)

        sends = bool(ins)  # a send has its data to move; a receive waits for it
        self._transport.submit(lambda: kernel(ins, outs, self._transport.data), done, moving=sends)

    def wait(self, event: Any) -> None:
        """Ranks move host memory only (``cuda.Gpus`` refuses cuda plans over ranks)."""
        event.synchronize()

    def finish(self) -> None:
        """Every send and receive of a run has completed when its last act is reported."""

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


_NOTHING = bytearray()
_local = threading.local()  # per thread: ``precise``, whether it called _precise_sleeps; ``tag``
_tags = itertools.count()


def _precise_sleeps_once() -> None:
    """``_precise_sleeps`` on the calling thread, the first time it asks."""
    if not getattr(_local, "precise", False):
        _local.precise = True
        _precise_sleeps()


def _own_tag() -> int:
    """The calling thread's own tag, for the messages that wake it (``Transport.wake``)."""
    tag = getattr(_local, "tag", None)
    if tag is None:
        tag = _local.tag = next(_tags)
    return tag


def _no_requests() -> list:
    """Nothing to start: a ``submit`` that only has the transport thread poll."""
    return []


def _never() -> bool:
    """``Transport.collective_ready`` until the runtime sets it: no collective stream."""
    return False


def _always_busy() -> bool:
    """``Transport.busy`` until the runtime sets it: as if a compute stream always had work."""
    return True


def _drain(q: queue.SimpleQueue, carried: list) -> list:
    items, carried[:] = list(carried), []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
