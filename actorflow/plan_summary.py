"""A Plan for people: its headline, each rank's streams against the resource model, and
the summary (streams, actors, quotas, events, collective order, memory)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from .plan_data import Input, PlanData, Stream


def summary(plan: PlanData) -> str:
    """The Plan for people: streams, actors, quotas, events, collective order, memory."""
    return "\n".join(_summary_lines(plan))


def headline(plan: PlanData) -> str:
    """The summary's first line: how many actors, streams, collectives and events."""
    m = plan.micro_batches
    steps = f"; {m} micro-batches a step ([step]: acts once per step)" if m > 1 else ""
    ranks = f" over {plan.world} ranks" if plan.world > 1 else ""
    return (
        f"Plan: {len(plan.actors)} actors on {len(plan.streams)} streams{ranks}, "
        f"{len(plan.collectives)} collectives, {len(plan.events)} events{steps}"
    )


def streams_per_rank(streams: Iterable[Stream]) -> dict[int, Counter[str]]:
    """Per rank, how many streams of each kind it runs."""
    kinds: dict[int, Counter[str]] = {}
    for s in streams:
        kinds.setdefault(s.rank, Counter())[s.kind] += 1
    return kinds


def kinds_text(counts: Counter[str]) -> str:
    """``2 collective, 1 comm, 2 copy``: stream counts by kind, for messages."""
    return ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))


def stream_usage(plan: PlanData) -> list[str]:
    """Per rank, the streams it runs against ``max_streams``, by kind; labels, where used."""
    limit = plan.resources.max_streams
    lines = [
        f"streams of rank {rank}: {n.total()} of max_streams {limit} ({kinds_text(n)})"
        for rank, n in sorted(streams_per_rank(plan.streams).items())
    ]
    if plan.labels:
        lines.append(f"labels: {plan.labels} of max_labels {plan.resources.max_labels}")
    return lines


def _summary_lines(plan: PlanData) -> list[str]:
    names = {a.id: a.name for a in plan.actors}
    lines = [headline(plan), *stream_usage(plan)]
    for stream in plan.streams:
        actors = sorted((a for a in plan.actors if a.stream == stream.id), key=lambda a: a.priority)
        rank = f"rank {stream.rank}, " if plan.world > 1 else ""
        group = f"group {','.join(stream.group)}, " if stream.group else ""
        lines.append(f"stream {stream.name} ({rank}{group}{len(actors)} actors)")
        for a in actors:
            ins = ", ".join(_input_text(plan, i) for i in a.inputs) or "-"
            rate = " [step]" if a.every > 1 else ""
            lines.append(f"  [{a.priority:>3}] {a.name:<24} {a.op:<14} in: {ins}{rate}")
            for r in (plan.registers[o] for o in a.outputs):
                to = ", ".join(names[c.actor] for c in r.consumers) or "-"
                lines.append(f"        out {r.name}: {r.dtype}{list(r.shape)} quota {r.quota} -> {to}")
    lines.append("events (producer -> consumer, the consumer's stream waits)")
    stream_name = {s.id: s.name for s in plan.streams}
    stream_of = {a.id: a.stream for a in plan.actors}
    for p, c in plan.events:
        lines.append(
            f"  {names[p]} ({stream_name.get(stream_of[p])}) -> {names[c]} ({stream_name.get(stream_of[c])})"
        )
    lines.append("collective order")
    if plan.link is not None:
        bandwidth, latency = plan.link
        lines.append(f"  (link emulated: {bandwidth / 1e9:g} GB/s, {latency * 1e6:g} us latency)")
    for k, coll in enumerate(plan.collectives):
        emulated = f", {coll.seconds * 1e3:.3f} ms emulated" if plan.link is not None else ""
        moved = f", {coll.nbytes} bytes an act"
        lines.append(f"  {k}. {coll.name} ({coll.op} over {len(coll.actors)} devices{moved}{emulated})")
    lines.append(f"predicted communication: {plan.communication_per_step()} bytes a step over the links")
    if plan.sbp:
        lines.append("SBP of the tensors on several devices")
        lines += [f"  {name}: {sbp}" for name, sbp in plan.sbp.items()]
    lines.append("planned memory (registers x quota + parameters)")
    for device, nbytes in sorted(plan.memory.items()):
        lines.append(f"  {device}: {nbytes / 1024:.1f} KiB")
    return lines


def _input_text(plan: PlanData, i: Input) -> str:
    r = plan.registers[i.register]
    if r.is_parameter:
        return f"{r.name} (parameter)"
    return r.name if i.sync == "stream" else f"{r.name} ({i.sync})"
