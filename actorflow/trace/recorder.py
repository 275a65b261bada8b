"""A cheap span recorder (off by default) and its export to Chrome trace JSON.

It knows nothing of Plans: the runtime hands it plain names. Chrome's format opens in
ui.perfetto.dev and chrome://tracing: one process track per device (and per rank's
collective stream), one thread track per stream, one complete event per span, and a
``host`` process whose ``steps`` track has one span per step (``step N``, like the
PyTorch profiler's ``ProfilerStep#N``).

Span args are exported as they are (numpy scalars as plain numbers). The runtime's spans
carry (README, "Traces", names the same):

- ``actor`` (str, default: the span's name) and ``op``;
- ``iteration`` (int): the step the span belongs to; the recorder's iteration filter
  keeps only selected ones, and its limit drops the oldest whole ones;
- ``micro_batch`` (int): the micro-batch within the step, for actors that act once per
  micro-batch of a step of several;
- ``register`` (int): the index of the output buffer the kernel wrote;
- ``act`` (int): that actor's act counter, identifying the span as a producer;
- ``stage`` (int): the pipeline stage of the actor's device (plans compiled with
  ``stages=``), which the bubble metric reads;
- ``rank`` (int): the process that ran it (0 in a one-process run);
- ``phase``: ``forward``, ``backward`` (input gradients), ``weight`` (weight gradients,
  what zero-bubble schedules defer), ``update`` or ``communication``, the plot's colours;
- ``inputs``: ``[[producer_actor, producer_act], ...]`` the acts whose registers this span
  read. Each one recorded on another track becomes a flow arrow producer -> consumer;
  ``inputs`` itself is left out of the exported args, except in a rank's trace.

A rank's trace (``Recorder(rank=r)``, one per process of a multi-rank run) also carries
``"otherData": {"rank": r, "origin_unix": ...}``, the unix time of its ts 0, and keeps
``inputs``, so that ``merge`` can put the ranks on one timeline and draw flows between them.

A span of category ``"wait"`` is time a stream spent waiting on an event: it is exported
like any other span, on the waiting stream's track, and metrics treat it as idle time.
Step spans (category ``"step"``) are made at export from the kernels of each iteration:
a step runs from its first kernel's start (or the previous step's end, if later, so that
pipelined steps do not overlap on their track) to its last kernel's end.

Memory is bounded: a recorder holds at most ``limit`` spans, the latest whole iterations
(a long run keeps its last steps); ``kept_from`` says from which iteration on, and the
exported trace says so in ``otherData``.

Recording is on the hot path (every kernel of a traced run), so a runtime ``record``s
only what it knows at the kernel's end and a function that makes the Span from it; the
recorder calls it the first time spans are read, so building a span's args costs the
streams nothing while they run.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import attrs

from ..collector import cyclic_gc_paused
from ..files import replaced

WAIT = "wait"
STEP = "step"
HOST, STEPS = "host", "steps"  # the process and thread of the step spans
TRACE_LIMIT = 200_000  # spans: about 150 MB held, a 40 MB file that Perfetto still opens
STREAM_KINDS = ("compute", "copy", "collective", "comm")


def stream_kind(thread: str) -> str | None:
    """The kind a stream's name ends in (``cpu:0/compute``; a group's further collective
    streams are numbered, ``rank0/collective1``), or None for another thread."""
    kind = thread.rsplit("/", 1)[-1].rstrip("0123456789")
    return kind if "/" in thread and kind in STREAM_KINDS else None


_FLOW = {"name": "dataflow", "cat": "flow"}


@attrs.frozen
class Span:
    process: str
    thread: str
    name: str
    category: str
    start: float
    end: float
    args: dict[str, Any]


class Recorder:
    """Collects spans (times in seconds, any common clock) while ``enabled``.

    iterations: record only spans whose ``args["iteration"]`` is in it (None: all), so that
    long runs give traces that stay small enough to open.
    rank: the rank whose spans these are, in a multi-rank run (None: a one-process run).
    A rank's span times must be ``time.perf_counter()`` seconds, whose offset to unix time
    is taken here, once, to export the trace's origin in unix time.
    limit: the most spans held (None: no bound). Past it the oldest iteration's spans are
    dropped, whole, and later spans of a dropped iteration are refused; spans without an
    iteration count as older than any.
    """

    def __init__(
        self,
        enabled: bool = False,
        iterations: Collection[int] | None = None,
        rank: int | None = None,
        limit: int | None = TRACE_LIMIT,
    ) -> None:
        if limit is not None and (type(limit) is not int or limit < 1):
            raise ValueError(f"a trace's limit is a number of spans >= 1 or None, not {limit!r}")
        self.enabled = enabled
        self.iterations = None if iterations is None else frozenset(iterations)
        self.rank = rank
        self.limit = limit
        self.kept_from: int | None = None  # spans of iterations before it were dropped
        self.dropped = 0  # iterations whose spans were dropped
        self._groups: dict[int, list[Any]] = {}  # per iteration (-1: none): Spans, or (make, args)
        self._described = True  # every group holds Spans only
        self._oldest: list[int] = []
        self._held = 0
        self._lock = threading.Lock()  # stream threads add their spans themselves
        self._unix_offset = time.time() - time.perf_counter()

    def add(
        self, process: str, thread: str, name: str, category: str, start: float, end: float, args: dict
    ) -> None:
        """A span known whole now (a test's, a merged trace's)."""
        iteration = args.get("iteration")
        if iteration is not None and self.iterations is not None and iteration not in self.iterations:
            return
        span = Span(process, thread, name, category, start, end, args)
        self._keep(-1 if iteration is None else iteration, span, described=True)

    def record(self, iteration: int, make: Callable[..., Span], *args: Any) -> None:
        """The span ``make(*args)`` returns, made when spans are first read (the module's
        docstring); ``iteration``: its ``args["iteration"]``."""
        if self.iterations is not None and iteration not in self.iterations:
            return
        self._keep(iteration, (make, args), described=False)

    def _keep(self, key: int, span: Any, described: bool) -> None:
        with self._lock:
            if self.kept_from is not None and 0 <= key < self.kept_from:
                return
            self._described = self._described and described
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = []
                heapq.heappush(self._oldest, key)
            group.append(span)
            self._held += 1
            while self.limit is not None and self._held > self.limit:
                self._drop_oldest()

    def drop_before(self, iteration: int) -> None:
        """Drop the spans of the iterations before ``iteration`` (and those of none), as
        the limit drops the oldest."""
        with self._lock:
            while self._oldest and self._oldest[0] < iteration:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        key = heapq.heappop(self._oldest)
        self._held -= len(self._groups.pop(key))
        if key >= 0:
            self.dropped += 1
            self.kept_from = max(self.kept_from or 0, key + 1)

    @property
    def spans(self) -> list[Span]:
        """The spans held, in start order."""
        return sorted((s for group in self._described_groups().values() for s in group), key=start_end)

    def _described_groups(self) -> dict[int, list[Span]]:
        """A copy of the groups, each recorded span made (once), safe to read while
        streams go on recording. Spans are made outside the lock (a GPU span waits for
        its kernel's event: the streams must not wait on the lock meanwhile), then put in
        place of what they were made from where the group still holds it; a span
        recorded meanwhile is left for the next read."""
        with self._lock:
            if self._described:
                return {key: list(group) for key, group in self._groups.items()}
            held = {key: list(group) for key, group in self._groups.items()}
        made = {key: [s if type(s) is Span else s[0](*s[1]) for s in group] for key, group in held.items()}
        with self._lock:
            for key, group in made.items():
                current = self._groups.get(key)
                if current is not None and len(current) >= len(group):
                    if all(a is b for a, b in zip(current, held[key])):
                        current[: len(group)] = group
            self._described = all(type(s) is Span for g in self._groups.values() for s in g)
            return {key: [s for s in group if type(s) is Span] for key, group in self._groups.items()}

    def clear(self) -> None:
        """Forget every span held and every one dropped, as if new (a benchmark's warm-up)."""
        with self._lock:
            self._groups.clear()
            self._oldest.clear()
            self._held = 0
            self.kept_from = None
            self.dropped = 0
            self._described = True

    def kernels(self) -> list[Span]:
        """The kernels' spans, without the waits."""
        return [s for s in self.spans if s.category != WAIT]

    def steps(self) -> list[Span]:
        """One span per iteration held, on the ``host`` process's ``steps`` track (module
        docstring): what ``to_chrome`` adds to the kernels' spans."""
        spans = []
        previous_end = float("-inf")
        groups = self._described_groups()
        for iteration in sorted(k for k in groups if k >= 0):
            kernels = [s for s in groups[iteration] if s.category != WAIT]
            if not kernels:
                continue
            end = max(s.end for s in kernels)
            start = min(max(min(s.start for s in kernels), previous_end), end)
            args = {"iteration": iteration, "rank": self.rank or 0}
            spans.append(Span(HOST, STEPS, f"step {iteration}", STEP, start, end, args))
            previous_end = max(previous_end, end)
        return spans

    def with_steps(self) -> list[Span]:
        """The spans held and their steps' (``steps``): what a trace of them shows."""
        return self.spans + self.steps()

    def to_chrome(self) -> dict[str, Any]:
        """``chrome_trace`` of the spans and steps; a rank's trace adds its rank and origin
        and keeps inputs; a trace that dropped iterations says from which one it is whole."""
        spans = self.with_steps()
        trace = chrome_trace(spans, keep_inputs=self.rank is not None)
        other: dict[str, Any] = {}
        if self.rank is not None:
            other = {"rank": self.rank, "origin_unix": trace_origin(spans) + self._unix_offset}
        if self.kept_from is not None:
            other |= {"kept_from": self.kept_from, "note": self.note()}
        if other:
            trace["otherData"] = other
        return trace

    def note(self) -> str:
        """What was dropped, for people ("" when nothing was)."""
        if self.kept_from is None:
            return ""
        return (
            f"the spans of {self.dropped} iterations before {self.kept_from} were dropped "
            f"to hold at most {self.limit:,} spans; iterations {self.kept_from} on are whole"
        )

    def write(self, path: str | os.PathLike) -> None:
        write_chrome(self.to_chrome(), path)


@cyclic_gc_paused()
def chrome_trace(spans: Iterable[Span], keep_inputs: bool = False) -> dict[str, Any]:
    """Chrome trace JSON: named and ordered process and thread tracks, one complete event
    per span (µs from the first span), and flow events for cross-track inputs."""
    spans = sorted(spans, key=start_end)
    origin = trace_origin(spans)
    pids, tids = tracks(spans)
    events = _metadata(pids, tids)
    outgoing, incoming = flows(spans)
    for i, s in enumerate(spans):
        ts, dur = event_times(s, origin)
        at = {"ts": ts, "pid": pids[s.process], "tid": tids[(s.process, s.thread)]}
        args = s.args if keep_inputs else exported_args(s)
        events.append({"ph": "X", "name": s.name, "cat": s.category, "dur": dur, **at, "args": args})
        # flow events sit at the start of their slice, so each one binds to it
        events.extend({"ph": "s", "id": flow, **at, **_FLOW} for flow in outgoing.get(i, ()))
        events.extend({"ph": "f", "bp": "e", "id": flow, **at, **_FLOW} for flow in incoming.get(i, ()))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome(trace: dict[str, Any], path: str | os.PathLike) -> None:
    """Compact JSON, numpy scalars in args as plain numbers, in place of ``path`` (see
    ``files.replaced``)."""
    with replaced(path) as f:
        json.dump(trace, f, separators=(",", ":"), default=_plain)


def parse_iterations(text: str) -> frozenset[int]:
    """``"0,3,5-7"`` -> {0, 3, 5, 6, 7}: the iteration selection of a command-line option."""
    selected: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise ValueError(f"iterations are like '0,3,5-7' (ranges low-high, inclusive), not {text!r}")
        selected.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    return frozenset(selected)


def start_end(span: Span) -> tuple[float, float]:
    return span.start, span.end


def trace_origin(spans: Iterable[Span]) -> float:
    """The time of ts 0: the first span's start."""
    return min((s.start for s in spans), default=0.0)


def event_times(span: Span, origin: float) -> tuple[float, float]:
    """A span's ``ts`` and ``dur`` in its complete event: µs from ``origin``, to the ns."""
    ts = _us(span.start - origin)
    return ts, round(_us(span.end - origin) - ts, 3)


def exported_args(span: Span) -> dict[str, Any]:
    """A span's args as a trace exports them: without ``inputs`` (flows)."""
    return {k: v for k, v in span.args.items() if k != "inputs"} if "inputs" in span.args else span.args


def tracks(spans: list[Span]) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """pid per process (devices first, then ranks' streams), tid per (process, thread)
    (compute, copy, collective, comm streams in that order): the display order."""
    pids: dict[str, int] = {}
    for process in sorted({s.process for s in spans}, key=_process_order):
        pids[process] = len(pids)
    tids: dict[tuple[str, str], int] = {}
    for track in sorted(
        {(s.process, s.thread) for s in spans}, key=lambda t: (pids[t[0]], _thread_order(t[1]))
    ):
        tids[track] = len(tids)
    return pids, tids


def _metadata(pids: dict[str, int], tids: dict[tuple[str, str], int]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for process, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}
        )
    for (process, thread), tid in tids.items():
        at = {"pid": pids[process], "tid": tid}
        events.append({"ph": "M", "name": "thread_name", **at, "args": {"name": thread}})
        events.append({"ph": "M", "name": "thread_sort_index", **at, "args": {"sort_index": tid}})
    return events


def _plain(value: Any) -> Any:
    """numpy scalars in args (a micro-batch index, say) as Python numbers, anything else as text."""
    return value.item() if hasattr(value, "item") else str(value)


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _natural(text: str) -> tuple:
    """Sort key that puts cpu:2 before cpu:10."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


def _process_order(process: str) -> tuple:
    return (process != HOST, process.startswith("rank"), _natural(process))


def _thread_order(thread: str) -> tuple:
    kind = stream_kind(thread)
    rank = -1 if thread == STEPS else STREAM_KINDS.index(kind) if kind is not None else len(STREAM_KINDS)
    return (rank, _natural(thread))


def flows(spans: list[Span]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Flow ids leaving and entering each kernel span (by index): one per input whose
    producer span was recorded on another track. Unrecorded producers give no flow at all;
    waits never take part, even when they carry their kernel's actor and act."""
    kernels = [(i, s) for i, s in enumerate(spans) if s.category not in (WAIT, STEP)]
    producers: dict[tuple[str, int], int] = {}
    for i, s in kernels:
        act = s.args.get("act")
        if act is not None:
            producers[(s.args.get("actor", s.name), act)] = i
    outgoing: dict[int, list[int]] = {}
    incoming: dict[int, list[int]] = {}
    flow = 0
    for i, s in kernels:
        for name, act in dict.fromkeys(tuple(pair) for pair in s.args.get("inputs", ())):
            p = producers.get((name, act))
            if p is None or (spans[p].process, spans[p].thread) == (s.process, s.thread):
                continue
            flow += 1
            outgoing.setdefault(p, []).append(flow)
            incoming.setdefault(i, []).append(flow)
    return outgoing, incoming
