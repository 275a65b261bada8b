"""assign streams: compute ops (variables and updates too) -> the device's compute stream;
copies, feeds and fetches -> the device's copy stream; collectives -> the rank's one
collective stream."""

from __future__ import annotations

import attrs

from ..plan import Plan, Stream

COLLECTIVE_STREAM = "rank0/collective"


def stream_key(kind: str, device: str) -> tuple[str, str]:
    """(stream kind, stream device) for an actor of ``kind`` placed on ``device``."""
    if kind in ("compute", "variable", "update"):
        return "compute", device
    if kind == "collective":
        return "collective", "rank0"
    return "copy", device


def assign_streams(plan: Plan) -> Plan:
    keys = sorted(
        {stream_key(a.kind, a.device) for a in plan.actors},
        key=lambda k: (k[0] == "collective", k[1], k[0]),
    )
    streams = tuple(
        Stream(i, COLLECTIVE_STREAM if kind == "collective" else f"{device}/{kind}", kind, device)
        for i, (kind, device) in enumerate(keys)
    )
    index = {key: i for i, key in enumerate(keys)}
    actors = tuple(
        attrs.evolve(a, stream=index[stream_key(a.kind, a.device)]) for a in plan.actors
    )
    return attrs.evolve(plan, actors=actors, streams=streams)
