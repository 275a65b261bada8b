"""A cheap span recorder (off by default) and its export to Chrome trace JSON.

It knows nothing of Plans: the runtime hands it plain names. Chrome's format opens in
ui.perfetto.dev and chrome://tracing: one process per device, one thread per stream.
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs


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
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.spans: list[Span] = []

    def add(self, process: str, thread: str, name: str, category: str, start: float, end: float, args: dict) -> None:
        self.spans.append(Span(process, thread, name, category, start, end, args))

    def to_chrome(self) -> dict[str, Any]:
        """Chrome trace JSON: named process and thread tracks, one complete event per span (µs)."""
        origin = min((s.start for s in self.spans), default=0.0)
        pids: dict[str, int] = {}
        tids: dict[tuple[str, str], int] = {}
        for s in sorted(self.spans, key=lambda s: (s.process, s.thread)):
            pids.setdefault(s.process, len(pids))
            tids.setdefault((s.process, s.thread), len(tids))
        events: list[dict[str, Any]] = []
        for process, pid in pids.items():
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for (process, thread), tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": pids[process], "tid": tid, "args": {"name": thread}})
        for s in self.spans:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "cat": s.category,
                    "ts": round((s.start - origin) * 1e6, 3),
                    "dur": round((s.end - s.start) * 1e6, 3),
                    "pid": pids[s.process],
                    "tid": tids[(s.process, s.thread)],
                    "args": s.args,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)
