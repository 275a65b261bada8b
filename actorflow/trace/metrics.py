"""Numbers from a trace: how busy each stream was, how much communication hid behind
compute, the pipeline bubble per stage, and the critical path.

Definitions (a *kernel* is any complete event whose category is neither ``"wait"`` nor
``"step"``; the steps' track is no stream and counts for nothing but the wall):

- **wall**: first start to last end over all complete events, waits included.
- **busy** of a stream: the length of the union of its kernels (overlapping spans count
  once), over wall. Its **wait**: the union of its wait spans, in seconds.
- **overlap**: with C the union of kernels on collective streams and P the union of
  kernels on compute streams, |C ∩ P| / |C| (None without collective time).
- **bubble** of a stage: a stage is a device, in stage order when given (``stages``),
  else read from the kernels' ``args["stage"]`` on compute streams (most frequent value per
  stream; every span of a run compiled with ``stages=`` carries one). Each iteration (step: ``args["iteration"]``) has one window for all stages:
  first start to last end over that iteration's kernels on every stage's compute stream.
  A stage's bubble is the part of the windows its compute stream was not busy (waits
  count as idle): 1 - sum of busy / sum of windows. For GPipe or 1F1B with p stages, m
  micro-batches and even stage times this is (p-1)/(m+p-1) on every stage. (Per-stage
  windows would not be: the last stage runs its m forwards and backwards back to back.)
  ``bubble`` is the mean over stages; ``window_s`` the length of the windows' union
  (over ranks, one rank may start a step before another has finished the last, and
  time two windows share counts once). The time between steps (the host's
  turn-around) is in no window. ``balanced_bubbles``: what the bubbles would be with
  the stages' measured busy times and no time between kernels.
- **critical path**: the longest chain of kernels where each step is a flow edge
  (producer -> consumer) or same-stream order (a kernel -> the stream's next kernel;
  not on a rank's communication stream, whose sends and receives are in flight
  together, in any order). A chain's length is the time it covers, first start to
  last end: each kernel adds its time after the chain so far ended, and the gap
  before it (next start - the chain's end, clamped at 0). So a kernel that overlaps
  the one before it (a receive posted ahead, spans of a foreign trace) counts once,
  and no chain is longer than the wall. Of equally long chains the one with most
  kernel time wins. Its composition is the time per span category on it, plus
  ``"gap"`` for the gaps (runtime latency, event waits, queueing); ``COMMUNICATION``
  names the categories of time spent moving data between ranks or devices' groups
  (sends, receives, collectives), waits on a peer included.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from ..collector import cyclic_gc_paused
from .parse import Trace, parse, sort_key
from .recorder import STEP

GAP = "gap"
COMMUNICATION = ("send", "recv", "collective")
Interval = tuple[int, int]


@attrs.frozen
class StreamStat:
    process: str
    thread: str
    kind: str
    kernels: int
    busy_s: float
    busy_fraction: float
    wait_s: float


@attrs.frozen
class StageBubble:
    stage: int | str
    process: str
    busy_s: float
    bubble: float


@attrs.frozen
class CriticalPath:
    length_s: float
    kernels: int
    by_kind: dict[str, float]  # seconds per span category, and GAP

    @property
    def shares(self) -> dict[str, float]:
        return {k: (v / self.length_s if self.length_s else 0.0) for k, v in self.by_kind.items()}

    @property
    def communication_share(self) -> float:
        return sum(v for k, v in self.shares.items() if k in COMMUNICATION)


@attrs.frozen
class TraceSummary:
    wall_s: float
    streams: tuple[StreamStat, ...]
    collective_s: float
    overlapped_s: float
    overlap: float | None
    window_s: float
    stages: tuple[StageBubble, ...]
    bubble: float | None  # the mean over stages
    critical_path: CriticalPath

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["critical_path"]["shares"] = self.critical_path.shares
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self) -> str:
        """A text table for people."""
        lines = [f"wall {_ms(self.wall_s)}, {len(self.streams)} streams"]
        if self.streams:
            width = max(len(s.thread) for s in self.streams)
            lines.append(
                f"  {'stream':<{width}}  {'kind':<10} {'kernels':>7} {'busy':>10} {'busy%':>6} {'wait':>10}"
            )
            for s in self.streams:
                lines.append(
                    f"  {s.thread:<{width}}  {s.kind:<10} {s.kernels:>7} {_ms(s.busy_s):>10} "
                    f"{_pct(s.busy_fraction):>6} {_ms(s.wait_s):>10}"
                )
        if self.overlap is None:
            lines.append("overlap: no collective time")
        else:
            lines.append(
                f"overlap: {_pct(self.overlap)} of {_ms(self.collective_s)} collective time ran beside compute"
            )
        if self.stages:
            lines.append(f"bubble per stage (window {_ms(self.window_s)}): mean {_pct(self.bubble or 0.0)}")
            lines.extend(f"  stage {b.stage}  {b.process:<10} {_pct(b.bubble):>6}" for b in self.stages)
        else:
            lines.append("bubble: no stages (pass stages, or record args['stage'])")
        path = self.critical_path
        shares = ", ".join(f"{k} {_pct(v)}" for k, v in sorted(path.shares.items(), key=lambda kv: -kv[1]))
        head = f"critical path: {_ms(path.length_s)} over {path.kernels} kernels"
        lines.append(f"{head}: {shares}" if shares else head)
        return "\n".join(lines)


def summarize(
    trace_json: dict[str, Any] | list[dict[str, Any]], stages: Sequence[str] | None = None
) -> TraceSummary:
    """The metrics of a Chrome trace (see the module's docstring for what each one measures).

    stages: the devices (``cpu:0``, ...) of the pipeline stages, in stage order; None: read
    stages from the kernels' ``args["stage"]``.
    """
    return summarize_parsed(parse(trace_json), stages)


@cyclic_gc_paused()
def summarize_parsed(trace: Trace, stages: Sequence[str] | None = None) -> TraceSummary:
    """``summarize`` for a trace already parsed."""
    spans = trace.spans
    wall = (max(s.end for s in spans) - spans[0].start) if spans else 0
    kernel_times: list[list[Interval]] = [[] for _ in trace.tracks]
    wait_times: list[list[Interval]] = [[] for _ in trace.tracks]
    for s in spans:
        if s.is_wait:
            wait_times[s.track].append((s.start, s.end))
        elif s.is_kernel:
            kernel_times[s.track].append((s.start, s.end))
    busy = [_union(times) for times in kernel_times]
    streams = tuple(
        StreamStat(
            t.process,
            t.thread,
            t.kind,
            kernels=len(kernel_times[i]),
            busy_s=_s(_length(busy[i])),
            busy_fraction=_fraction(_length(busy[i]), wall),
            wait_s=_s(_length(_union(wait_times[i]))),
        )
        for i, t in enumerate(trace.tracks)
        if t.kind != STEP
    )

    def union_of(kind: str) -> list[Interval]:
        return _union(iv for i, t in enumerate(trace.tracks) if t.kind == kind for iv in busy[i])

    collective = union_of("collective")
    overlapped = _length(_intersect(collective, union_of("compute")))
    window, bubbles = _bubbles(trace, busy, stages)
    return TraceSummary(
        wall_s=_s(wall),
        streams=streams,
        collective_s=_s(_length(collective)),
        overlapped_s=_s(overlapped),
        overlap=_fraction(overlapped, _length(collective)) if collective else None,
        window_s=_s(window),
        stages=bubbles,
        bubble=sum(b.bubble for b in bubbles) / len(bubbles) if bubbles else None,
        critical_path=critical_path(trace),
    )


def balanced_bubbles(busy: Sequence[float], micro_batches: int) -> list[float]:
    """The bubble of each stage of a pipeline whose stages compute for ``busy`` (any unit,
    per step) and spend no time between kernels: a step of m identical micro-batches
    through stages taking t_s each (busy / m) lasts sum t_s + (m - 1) max t_s (a flow
    shop's makespan), of which stage s computes m t_s. Even stage times give
    (p-1)/(m+p-1); uneven ones more, for all but the slowest stage. The measured bubble
    above it is what the runtime adds (hand-offs, queueing, waits)."""
    m = micro_batches
    window = makespan(busy, m)
    return [1.0 - b / window if window > 0 else 0.0 for b in busy]


def makespan(busy: Sequence[float], micro_batches: int) -> float:
    """How long a step of a pipeline whose stages compute for ``busy`` a step lasts, with
    no time between kernels: sum t_s + (m - 1) max t_s, t_s = busy / m (a flow shop's
    makespan, see ``balanced_bubbles``)."""
    times = [b / micro_batches for b in busy]
    return sum(times) + (micro_batches - 1) * max(times, default=0.0)


PASSES = ("forward", "backward", "weight")


def pass_seconds(trace: Trace, micro_batches: int = 0) -> dict[str, float]:
    """Kernel seconds per micro-batch and compute stream of each pass (the spans'
    ``phase``: forward, backward as input gradients, weight as weight gradients), over
    the compute kernels that act once per micro-batch: a pipeline stage's F, B and W.
    ``micro_batches`` 1: every kernel is its step's one micro-batch's (the spans then
    name none)."""
    totals = dict.fromkeys(PASSES, 0)
    batches, streams = set(), set()
    for s in trace.spans:
        phase = s.args.get("phase")
        if s.is_kernel and phase in totals and ("micro_batch" in s.args or micro_batches == 1):
            totals[phase] += s.end - s.start
            batches.add((s.args.get("iteration"), s.args.get("micro_batch", 0)))
            streams.add(s.track)
    per = len(batches) * len(streams)
    return {phase: _s(t) / per if per else 0.0 for phase, t in totals.items()}


def pipeline_theory(
    stages: int, micro_batches: int, f: float = 1, b: float = 1, w: float = 1, *, zero_bubble: bool = False
) -> float:
    """The bubble's share of a step of ``micro_batches`` through ``stages`` stages taking F,
    B and W per micro-batch (Qi et al., arXiv 2401.10241, section 2): GPipe and 1F1B idle
    (p-1)(F+B+W), which is (p-1)/(m+p-1) of the step; ZB-H1 (``zero_bubble``) idles
    (p-1)(F+B-W)."""
    p, m = stages, micro_batches
    idle = (p - 1) * (max(0.0, f + b - w) if zero_bubble else f + b + w)
    step = m * (f + b + w) + idle
    return idle / step if step > 0 else 0.0


def critical_path(trace: Trace) -> CriticalPath:
    """The longest chain (module docstring), by dynamic programming over kernels in start order."""
    spans = trace.spans
    order = [i for i, s in enumerate(spans) if s.is_kernel]
    rank = {i: k for k, i in enumerate(order)}
    preds: dict[int, list[int]] = {i: [] for i in order}
    last_on_track: dict[int, int] = {}
    for i in order:
        track = spans[i].track
        if trace.tracks[track].kind == "comm":
            continue
        if track in last_on_track:
            preds[i].append(last_on_track[track])
        last_on_track[track] = i
    for p, c in trace.flows:
        if rank[p] < rank[c]:
            preds[c].append(p)

    # per kernel, of the best chain ending there: (length, kernel time), the time it
    # reaches, its parent, and what the kernel adds to it (gap, own time)
    best: dict[int, tuple[int, int]] = {}
    reach: dict[int, int] = {}
    parent: dict[int, int | None] = {}
    adds: dict[int, tuple[int, int]] = {}
    for i in order:
        span = spans[i]
        dur = span.end - span.start
        best[i], reach[i], parent[i], adds[i] = (dur, dur), span.end, None, (0, dur)
        for p in preds[i]:
            gap = max(0, span.start - reach[p])
            own = max(0, span.end - max(span.start, reach[p]))
            length, kernel = best[p]
            candidate = (length + gap + own, kernel + own)
            if candidate > best[i]:
                best[i], reach[i], parent[i] = candidate, max(reach[p], span.end), p
                adds[i] = (gap, own)
    if not order:
        return CriticalPath(0.0, 0, {})
    node: int | None = max(order, key=lambda i: best[i])
    by_kind: Counter[str] = Counter()
    count = 0
    while node is not None:
        gap, own = adds[node]
        if own:
            by_kind[spans[node].category] += own
        if gap:
            by_kind[GAP] += gap
        count += 1
        node = parent[node]
    return CriticalPath(_s(sum(by_kind.values())), count, {k: _s(v) for k, v in by_kind.items()})


def _bubbles(
    trace: Trace, busy: list[list[Interval]], stages: Sequence[str] | None
) -> tuple[int, tuple[StageBubble, ...]]:
    compute = [i for i, t in enumerate(trace.tracks) if t.kind == "compute"]
    rows: list[tuple[int | str, str, int | None]] = []  # (stage, device, compute track)
    if stages is not None:
        on = {trace.tracks[i].device: i for i in compute}
        rows = [(k, device, on.get(device)) for k, device in enumerate(stages)]
    else:
        for i in compute:
            labels = Counter(
                s.args["stage"] for s in trace.spans if s.track == i and s.is_kernel and "stage" in s.args
            )
            if labels:
                rows.append((labels.most_common(1)[0][0], trace.tracks[i].device, i))
        rows.sort(key=lambda r: (sort_key(r[0]), r[1]))
    tracks = {i for _, _, i in rows if i is not None}
    steps: dict[Any, dict[int, list[Interval]]] = {}
    for s in trace.spans:
        if s.track in tracks and s.is_kernel:
            steps.setdefault(s.args.get("iteration"), {}).setdefault(s.track, []).append((s.start, s.end))
    windows = []
    used = dict.fromkeys(tracks, 0)
    for per_track in steps.values():
        spans = [iv for ivs in per_track.values() for iv in ivs]
        windows.append((min(b for b, _ in spans), max(e for _, e in spans)))
        for i, intervals in per_track.items():
            used[i] += _length(_union(intervals))
    window = _length(_union(windows))
    if not window:
        return 0, tuple(StageBubble(stage, device, 0.0, 1.0) for stage, device, _ in rows)
    bubbles = []
    for stage, device, track in rows:
        mine = used.get(track, 0) if track is not None else 0
        bubbles.append(StageBubble(stage, device, _s(mine), 1.0 - _fraction(mine, window)))
    return window, tuple(bubbles)


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two sorted, disjoint interval lists."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(intervals: list[Interval]) -> int:
    return sum(hi - lo for lo, hi in intervals)


def _fraction(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _s(ns: int) -> float:
    return ns / 1e9


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.1f}%"
