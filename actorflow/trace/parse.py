"""Reading a Chrome trace back into tracks, spans and flow edges, for metrics and plots.

It reads what ``Recorder.to_chrome`` writes, and is lenient with other Chrome traces:
missing names fall back to the numeric ids, unknown phases are ignored. Times become
integer nanoseconds so that sums and comparisons are exact.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Hashable, Iterable
from typing import Any

import attrs

from ..collector import cyclic_gc_paused
from . import recorder
from .recorder import STEP, WAIT, stream_kind

COPY_CATEGORIES = frozenset({"copy", "feed", "fetch"})


@attrs.frozen
class Track:
    """One stream, or the steps' track. kind: compute, copy, collective, comm, step or
    other (see ``_kind``)."""

    process: str
    thread: str
    kind: str

    @property
    def device(self) -> str:
        """The device of a stream named ``device/kind`` (``cpu:0/compute``), else the process:
        the same in a one-process trace, where a merged trace's process is its rank."""
        return self.thread.rpartition("/")[0] if stream_kind(self.thread) else self.process


@attrs.frozen
class Span:
    track: int
    name: str
    category: str
    start: int
    end: int
    args: dict[str, Any]

    @property
    def is_wait(self) -> bool:
        return self.category == WAIT

    @property
    def is_kernel(self) -> bool:
        """Neither a wait nor a step span."""
        return self.category not in (WAIT, STEP)


@attrs.frozen
class Trace:
    """tracks in (pid, tid) order; spans sorted by (start, end), times in ns on the file's
    clock; flows: (producer, consumer) indices into ``spans``, both kernels (never waits
    or steps)."""

    tracks: tuple[Track, ...]
    spans: tuple[Span, ...]
    flows: tuple[tuple[int, int], ...]


FlowEnd = tuple[Hashable, bool, "int | None", int, bool]
"""One end of a flow arrow: its flow, whether it is its start, the track and the time (ns)
it sits at, and whether it binds to the span enclosing that time (else the next one)."""


def load(path: str | os.PathLike) -> dict[str, Any] | list[dict[str, Any]]:
    """The JSON of a trace file; ValueError when it is not a Chrome trace."""
    with open(path) as f:
        data = json.load(f)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if isinstance(events, list):
        return data
    raise ValueError("not a Chrome trace: expected a list of events or an object with 'traceEvents'")


@cyclic_gc_paused()
def parse(trace_json: dict[str, Any] | list[dict[str, Any]]) -> Trace:
    events = trace_json.get("traceEvents", []) if isinstance(trace_json, dict) else trace_json
    processes: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    complete: list[dict[str, Any]] = []
    flow_events: list[dict[str, Any]] = []
    for e in events:
        ph = e.get("ph")
        if ph == "M" and e.get("name") == "process_name":
            processes[e.get("pid")] = str(e.get("args", {}).get("name", e.get("pid")))
        elif ph == "M" and e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", e.get("tid")))
        elif ph == "X":
            complete.append(e)
        elif ph in ("s", "f"):
            flow_events.append(e)

    keys = sorted({(e.get("pid"), e.get("tid")) for e in complete}, key=lambda k: tuple(map(sort_key, k)))
    index = {key: i for i, key in enumerate(keys)}
    spans = sorted(
        (
            Span(
                index[(e.get("pid"), e.get("tid"))],
                str(e.get("name", "")),
                str(e.get("cat", "")),
                _ns(e["ts"]),
                _ns(e["ts"]) + _ns(e.get("dur", 0)),
                e.get("args") or {},
            )
            for e in complete
        ),
        key=lambda s: (s.start, s.end),
    )
    ends = [
        (
            (e.get("cat"), e.get("id")),
            e["ph"] == "s",
            index.get((e.get("pid"), e.get("tid"))),
            _ns(e.get("ts", 0)),
            e["ph"] == "s" or e.get("bp") == "e",
        )
        for e in flow_events
    ]
    names = [(processes.get(pid, str(pid)), threads.get((pid, tid), str(tid))) for pid, tid in keys]
    return _trace(names, spans, ends)


@cyclic_gc_paused()
def from_spans(recorded: Iterable[recorder.Span]) -> Trace:
    """``parse(chrome_trace(recorded))`` without the JSON between: a report of spans in
    memory (a simulated run's)."""
    recorded = sorted(recorded, key=recorder.start_end)
    origin = recorder.trace_origin(recorded)
    _, tids = recorder.tracks(recorded)  # numbered in the display order, parse's
    spans = []
    for r in recorded:
        ts, dur = recorder.event_times(r, origin)
        start = _ns(ts)
        track = tids[(r.process, r.thread)]
        spans.append(Span(track, r.name, r.category, start, start + _ns(dur), recorder.exported_args(r)))
    outgoing, incoming = recorder.flows(recorded)
    ends: list[FlowEnd] = []
    for i, span in enumerate(spans):
        ends.extend((flow, True, span.track, span.start, True) for flow in outgoing.get(i, ()))
        ends.extend((flow, False, span.track, span.start, True) for flow in incoming.get(i, ()))
    spans.sort(key=lambda s: (s.start, s.end))
    return _trace(list(tids), spans, ends)


def _trace(names: list[tuple[str, str]], spans: list[Span], ends: Iterable[FlowEnd]) -> Trace:
    """The trace of ``spans`` (sorted) on the tracks of ``names`` (process, thread), with
    the flows whose ``ends`` bind to kernels."""
    categories: list[set[str]] = [set() for _ in names]
    for s in spans:
        if not s.is_wait:
            categories[s.track].add(s.category)  # steps too: a track of steps is kind "step"
    tracks = [Track(process, thread, _kind(thread, ran)) for (process, thread), ran in zip(names, categories)]
    return Trace(tuple(tracks), tuple(spans), _bind_flows(ends, spans))


def _ns(microseconds: float) -> int:
    return round(float(microseconds) * 1000)


def sort_key(value: Any) -> tuple:
    """Numeric ids in numeric order, anything else after them by text."""
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def _kind(thread: str, categories: set[str]) -> str:
    """The stream kind from the thread name's last part (``cpu:0/compute``) or, failing
    that, from what ran on it: only steps, only collectives, only copies, else compute."""
    kind = stream_kind(thread)
    if kind is not None:
        return kind
    if not categories:
        return "other"
    if categories == {STEP}:
        return STEP
    if categories == {"collective"}:
        return "collective"
    if categories <= COPY_CATEGORIES:
        return "copy"
    return "compute"


def _bind_flows(ends: Iterable[FlowEnd], spans: list[Span]) -> tuple[tuple[int, int], ...]:
    """Pair flow starts with finishes and bind each to its kernel span: one that binds to
    the enclosing span to the span enclosing its time, others to the next span that
    starts at or after it (Chrome's rules)."""
    kernels: dict[int, list[int]] = {}
    for i, s in enumerate(spans):
        if s.is_kernel:
            kernels.setdefault(s.track, []).append(i)
    starts = {t: [spans[i].start for i in ids] for t, ids in kernels.items()}

    def bind(track: int | None, ts: int, enclosing: bool) -> int | None:
        if track not in kernels:
            return None
        ids = kernels[track]
        if enclosing:
            k = bisect.bisect_right(starts[track], ts) - 1
            return ids[k] if k >= 0 and spans[ids[k]].end >= ts else None
        k = bisect.bisect_left(starts[track], ts)
        return ids[k] if k < len(ids) else None

    begun: dict[Hashable, int] = {}
    ended: dict[Hashable, int] = {}
    for key, is_start, track, ts, enclosing in ends:
        span = bind(track, ts, enclosing)
        if span is not None:
            (begun if is_start else ended)[key] = span
    return tuple((begun[k], ended[k]) for k in begun if k in ended)
