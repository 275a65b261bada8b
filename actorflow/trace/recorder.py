"""A cheap span recorder (off by default) and its export to Chrome trace JSON.

It knows nothing of Plans: the runtime hands it plain names. Chrome's format opens in
ui.perfetto.dev and chrome://tracing: one process track per device (and per rank's
collective stream), one thread track per stream, one complete event per span.

Span args are exported as they are (numpy scalars as plain numbers); the runtime's kernel
spans carry ``actor``, ``op``, ``iteration``, and where they apply ``micro_batch``,
``register`` (the index of the output buffer written) and ``stage``. The exporter and the
metrics read these (all optional):

- ``iteration`` (int): the iteration a span belongs to; the recorder's iteration filter
  keeps only selected ones (spans without it are always kept).
- ``stage``: the pipeline stage of a kernel on a compute stream, for the bubble metric.
- ``actor`` (str, default: the span's name) and ``act`` (int, that actor's act counter):
  identify the span as a producer.
- ``inputs``: ``[[producer_actor, producer_act], ...]`` the acts whose registers this span
  read. Each one recorded on another track becomes a flow arrow producer -> consumer;
  ``inputs`` itself is left out of the exported args, except in a rank's trace.

A rank's trace (``Recorder(rank=r)``, one per process of a multi-rank run) also carries
``"otherData": {"rank": r, "origin_unix": ...}``, the unix time of its ts 0, and keeps
``inputs``, so that ``merge`` can put the ranks on one timeline and draw flows between them.

A span of category ``"wait"`` is time a stream spent waiting on an event: it is exported
like any other span, on the waiting stream's track, and metrics treat it as idle time.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Collection, Iterable
from typing import Any

import attrs

WAIT = "wait"
STREAM_KINDS = ("compute", "copy", "collective", "comm")  # a stream's name ends in /KIND
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
    """

    def __init__(
        self, enabled: bool = False, iterations: Collection[int] | None = None, rank: int | None = None
    ) -> None:
        self.enabled = enabled
        self.iterations = None if iterations is None else frozenset(iterations)
        self.rank = rank
        self.spans: list[Span] = []
        self._unix_offset = time.time() - time.perf_counter()

    def add(
        self, process: str, thread: str, name: str, category: str, start: float, end: float, args: dict
    ) -> None:
        if self.iterations is not None:
            iteration = args.get("iteration")
            if iteration is not None and iteration not in self.iterations:
                return
        self.spans.append(Span(process, thread, name, category, start, end, args))

    def kernels(self) -> list[Span]:
        """The kernels' spans, without the waits."""
        return [s for s in self.spans if s.category != WAIT]

    def to_chrome(self) -> dict[str, Any]:
        """``chrome_trace`` of the spans; a rank's trace adds its rank and origin and keeps inputs."""
        if self.rank is None:
            return chrome_trace(self.spans)
        trace = chrome_trace(self.spans, keep_inputs=True)
        trace["otherData"] = {"rank": self.rank, "origin_unix": _origin(self.spans) + self._unix_offset}
        return trace

    def write(self, path: str | os.PathLike) -> None:
        write_chrome(self.to_chrome(), path)


def chrome_trace(spans: Iterable[Span], keep_inputs: bool = False) -> dict[str, Any]:
    """Chrome trace JSON: named and ordered process and thread tracks, one complete event
    per span (µs from the first span), and flow events for cross-track inputs."""
    spans = sorted(spans, key=lambda s: (s.start, s.end))
    origin = _origin(spans)
    pids, tids = _tracks(spans)
    events = _metadata(pids, tids)
    outgoing, incoming = _flows(spans)
    for i, s in enumerate(spans):
        ts = _us(s.start - origin)
        dur = round(_us(s.end - origin) - ts, 3)
        at = {"ts": ts, "pid": pids[s.process], "tid": tids[(s.process, s.thread)]}
        args = s.args if keep_inputs else {k: v for k, v in s.args.items() if k != "inputs"}
        events.append({"ph": "X", "name": s.name, "cat": s.category, "dur": dur, **at, "args": args})
        # flow events sit at the start of their slice, so each one binds to it
        events.extend({"ph": "s", "id": flow, **at, **_FLOW} for flow in outgoing.get(i, ()))
        events.extend({"ph": "f", "bp": "e", "id": flow, **at, **_FLOW} for flow in incoming.get(i, ()))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome(trace: dict[str, Any], path: str | os.PathLike) -> None:
    """Compact JSON, numpy scalars in args as plain numbers."""
    with open(path, "w") as f:
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


def _origin(spans: Iterable[Span]) -> float:
    """The time of ts 0: the first span's start."""
    return min((s.start for s in spans), default=0.0)


def _tracks(spans: list[Span]) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
    """pid per process (devices first, then ranks' streams), tid per (process, thread)
    (compute, copy, collective, comm streams in that order): the display order."""
    pids: dict[str, int] = {}
    for process in sorted({s.process for s in spans}, key=_process_order):
        pids[process] = len(pids)
    tids: dict[tuple[str, str], int] = {}
    for track in sorted({(s.process, s.thread) for s in spans}, key=lambda t: (pids[t[0]], _thread_order(t[1]))):
        tids[track] = len(tids)
    return pids, tids


def _metadata(pids: dict[str, int], tids: dict[tuple[str, str], int]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for process, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
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
    return (process.startswith("rank"), _natural(process))


def _thread_order(thread: str) -> tuple:
    kind = thread.rsplit("/", 1)[-1]
    return (STREAM_KINDS.index(kind) if kind in STREAM_KINDS else len(STREAM_KINDS), _natural(thread))


def _flows(spans: list[Span]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Flow ids leaving and entering each kernel span (by index): one per input whose
    producer span was recorded on another track. Unrecorded producers give no flow at all;
    waits never take part, even when they carry their kernel's actor and act."""
    kernels = [(i, s) for i, s in enumerate(spans) if s.category != WAIT]
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
