"""One trace out of the traces the ranks of a run wrote, one file per rank.

A rank's trace (``Recorder(rank=r)``) counts its times from its own first span and says in
``otherData`` which rank it is and the unix time of its ts 0; its kernels keep their
``inputs``. The merge shifts every rank's spans onto one timeline by those unix times,
makes a process per rank with its streams as threads, and draws flows with the recorder's
own logic: a receive lists the matching send of another rank among its inputs, so the
arrow crosses ranks. Where a rank dropped its oldest iterations (``otherData.kept_from``,
see ``Recorder``), the merge keeps only the iterations every rank holds whole.

Ranks on one host share the monotonic clock, so they line up as well as each Recorder took
its offset to unix time (microseconds, unless the wall clock was stepped in between);
ranks on several hosts, as well as the hosts' wall clocks agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .parse import parse
from .recorder import Span, chrome_trace

_NS = 1e-9


def merge(
    traces: Sequence[dict[str, Any] | list[dict[str, Any]]], names: Sequence[str] | None = None
) -> dict[str, Any]:
    """The Chrome trace of all ranks: processes ``rank 0``, ``rank 1``, ... in rank order.

    names: what errors call each trace (its file, say); default ``trace 0``, ``trace 1``...
    ValueError for no traces, a trace without rank metadata, or two of one rank.
    """
    if not traces:
        raise ValueError("no traces to merge")
    names = list(names) if names is not None else [f"trace {i}" for i in range(len(traces))]
    ranks = [_rank_and_origin(trace, name) for name, trace in zip(names, traces, strict=True)]
    seen: dict[int, str] = {}
    for name, (rank, _) in zip(names, ranks):
        if rank in seen:
            raise ValueError(f"{seen[rank]} and {name} are both rank {rank}")
        seen[rank] = name
    start = min(origin for _, origin in ranks)
    kept_from = max((k for k in map(_kept_from, traces) if k is not None), default=None)
    spans: list[Span] = []
    for trace, (rank, origin) in zip(traces, ranks):
        parsed, shift = parse(trace), origin - start
        kept = parsed.spans if kept_from is None else [s for s in parsed.spans if _since(s.args, kept_from)]
        spans.extend(
            Span(
                f"rank {rank}",
                parsed.tracks[s.track].thread,
                s.name,
                s.category,
                shift + s.start * _NS,
                shift + s.end * _NS,
                s.args,
            )
            for s in kept
        )
    merged = chrome_trace(spans)
    if kept_from is not None:
        note = f"iterations from {kept_from} on: some rank dropped its earlier ones to stay within its trace limit"
        merged["otherData"] = {"kept_from": kept_from, "note": note}
    return merged


def _kept_from(trace: Any) -> int | None:
    kept = trace.get("otherData", {}).get("kept_from") if isinstance(trace, dict) else None
    return kept if type(kept) is int else None


def _since(args: dict[str, Any], iteration: int) -> bool:
    """Whether a span is of ``iteration`` or later (or of no iteration)."""
    own = args.get("iteration")
    return type(own) is not int or own >= iteration


def _rank_and_origin(trace: Any, name: str) -> tuple[int, float]:
    other = trace.get("otherData") if isinstance(trace, dict) else None
    rank = other.get("rank") if isinstance(other, dict) else None
    origin = other.get("origin_unix") if isinstance(other, dict) else None
    if type(rank) is not int or rank < 0 or isinstance(origin, bool) or not isinstance(origin, (int, float)):
        raise ValueError(
            f"{name} is not a rank's trace: no otherData.rank and otherData.origin_unix "
            "(written by each rank of a multi-rank run)"
        )
    return rank, float(origin)
