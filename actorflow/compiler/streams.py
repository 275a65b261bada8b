"""assign streams: compute ops (variables and updates too) -> the device's compute stream;
copies, feeds and fetches -> the device's copy stream; collectives -> their rank's one
collective stream; sends and receives between ranks -> their rank's communication
stream (the rank's MPI thread)."""

from __future__ import annotations

import attrs

from ..plan import Plan, Stream

RANK_STREAMS = ("collective", "comm")


def stream_key(kind: str, device: str, rank: int) -> tuple[str, str]:
    """(stream kind, stream device) for an actor of ``kind`` placed on ``device`` of ``rank``."""
    if kind in ("compute", "variable", "update"):
        return "compute", device
    if kind == "collective":
        return "collective", f"rank{rank}"
    if kind in ("send", "recv"):
        return "comm", f"rank{rank}"
    return "copy", device


def assign_streams(plan: Plan) -> Plan:
    def key_of(actor) -> tuple[str, str]:
        return stream_key(actor.kind, actor.device, plan.rank_of(actor.device))

    keys = sorted({key_of(a) for a in plan.actors}, key=lambda k: (k[0] in RANK_STREAMS, k[1], k[0]))
    streams = tuple(
        Stream(i, f"{device}/{kind}", kind, device, plan.rank_of(device)) for i, (kind, device) in enumerate(keys)
    )
    index = {key: i for i, key in enumerate(keys)}
    actors = tuple(attrs.evolve(a, stream=index[key_of(a)]) for a in plan.actors)
    return attrs.evolve(plan, actors=actors, streams=streams)
