"""Reading a Chrome trace back into tracks, spans and flow edges, for metrics and plots.

It reads what ``Recorder.to_chrome`` writes, and is lenient with other Chrome traces:
missing names fall back to the numeric ids, unknown phases are ignored. Times become
integer nanoseconds so that sums and comparisons are exact.
"""

from __future__ import annotations

import bisect
import json
import os
from typing import Any

import attrs

from ..collector import cyclic_gc_paused
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
    categories: list[set[str]] = [set() for _ in keys]
    for s in spans:
        if not s.is_wait:
            categories[s.track].add(s.category)  # steps too: a track of steps is kind "step"
    tracks = []
    for (pid, tid), ran in zip(keys, categories):
        thread = threads.get((pid, tid), str(tid))
        tracks.append(Track(processes.get(pid, str(pid)), thread, _kind(thread, ran)))
    return Trace(tuple(tracks), tuple(spans), _bind_flows(flow_events, index, spans))


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


def _bind_flows(
    flow_events: list[dict[str, Any]], index: dict[tuple[Any, Any], int], spans: list[Span]
) -> tuple[tuple[int, int], ...]:
    """Pair flow starts with finishes by (cat, id) and bind each to its kernel span: a start
    and a ``bp: "e"`` finish to the span enclosing their time, other finishes to the next
    span that starts at or after it (Chrome's rules)."""
    kernels: dict[int, list[int]] = {}
    for i, s in enumerate(spans):
        if s.is_kernel:
            kernels.setdefault(s.track, []).append(i)
    starts = {t: [spans[i].start for i in ids] for t, ids in kernels.items()}

    def bind(e: dict[str, Any], enclosing: bool) -> int | None:
        track = index.get((e.get("pid"), e.get("tid")))
        if track not in kernels:
            return None
        ts = _ns(e.get("ts", 0))
        ids = kernels[track]
        if enclosing:
            k = bisect.bisect_right(starts[track], ts) - 1
            return ids[k] if k >= 0 and spans[ids[k]].end >= ts else None
        k = bisect.bisect_left(starts[track], ts)
        return ids[k] if k < len(ids) else None

    begun: dict[tuple[Any, Any], int] = {}
    ended: dict[tuple[Any, Any], int] = {}
    for e in flow_events:
        key = (e.get("cat"), e.get("id"))
        if e["ph"] == "s":
            span = bind(e, enclosing=True)
            if span is not None:
                begun[key] = span
        else:
            span = bind(e, enclosing=e.get("bp") == "e")
            if span is not None:
                ended[key] = span
    return tuple((begun[k], ended[k]) for k in begun if k in ended)
