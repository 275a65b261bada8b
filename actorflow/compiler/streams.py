"""assign streams: compute ops (variables and updates too) -> the device's compute stream;
copies, feeds and fetches -> the device's copy stream; sends and receives between ranks
-> their rank's communication stream (the rank's MPI thread); collectives -> collective
streams per communication group (the devices a collective spans), on each rank it
spans.

A group's collectives fill its streams in execution order (the collective order):
a stream takes ``max_ops_per_stream`` of them, then the group's next stream opens
(MindSpore's in-order assignment), so each stream keeps one fixed order, the same on
every rank. A reused communication subgraph (see ``reuse``) has a stream of its own. A
rank that would need more than ``max_streams`` streams is a CompileError.
"""

from __future__ import annotations

from ..errors import CompileError
from ..plan import Plan, Resources, Stream
from ..plan_summary import kinds_text, streams_per_rank
from ..records import evolve

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


def communication_group(plan: Plan, actors: tuple[int, ...]) -> tuple[str, ...]:
    """The devices a collective spans, in the order of its participants."""
    return tuple(plan.actors[a].device for a in actors)


def assign_streams(plan: Plan) -> Plan:
    """Each actor's stream, within the plan's resources (``max_ops_per_stream``,
    ``max_streams``)."""
    limits = plan.resources
    channel: dict[int, tuple[tuple[str, ...], int]] = {}  # collective participant -> (group, channel)
    filled: dict[tuple[str, ...], int] = {}
    subgraphs: dict[tuple[str, ...], int] = {}
    for coll in plan.collectives:
        group = communication_group(plan, coll.actors)
        if plan.actors[coll.actors[0]].calls > 1:
            # a reused subgraph: a stream of its own, after the group's in-order ones
            k = -1 - subgraphs.get(group, 0)
            subgraphs[group] = subgraphs.get(group, 0) + 1
        else:
            k = filled.get(group, 0) // limits.max_ops_per_stream
            filled[group] = filled.get(group, 0) + 1
        channel.update((a, (group, k)) for a in coll.actors)

    def key_of(actor) -> tuple:
        rank = plan.rank_of(actor.device)
        kind, device = stream_key(actor.kind, actor.device, rank)
        group, k = channel.get(actor.id, ((), 0))
        return kind, device, group, k

    first_use = {key: n for n, key in enumerate(dict.fromkeys(key_of(plan.actors[a]) for a in channel))}
    keys = sorted(
        {key_of(a) for a in plan.actors},
        key=lambda k: (k[0] in RANK_STREAMS, k[1], k[0], first_use.get(k, 0)),
    )
    streams: list[Stream] = []
    index: dict[tuple, int] = {}
    nth: dict[tuple[str, str], int] = {}
    for key in keys:
        kind, device, group, k = key
        rank = plan.rank_of(device)
        n = nth[(kind, device)] = nth.get((kind, device), 0) + 1
        name = f"{device}/{kind}" + (str(n - 1) if n > 1 else "")
        index[key] = len(streams)
        streams.append(Stream(len(streams), name, kind, device, rank, group, k))
    _check_limit(streams, filled, limits)
    actors = tuple(evolve(a, stream=index[key_of(a)]) for a in plan.actors)
    return evolve(plan, actors=actors, streams=tuple(streams))


def _check_limit(streams: list[Stream], filled: dict[tuple[str, ...], int], limits: Resources) -> None:
    for rank, kinds in sorted(streams_per_rank(streams).items()):
        if kinds.total() <= limits.max_streams:
            continue
        mine = [s for s in streams if s.rank == rank]
        groups = sorted(
            {s.group for s in mine if s.kind == "collective" and s.channel >= 0}, key=lambda g: -filled[g]
        )
        needs = "".join(
            f"; {filled[g]} collectives over {','.join(g)} at max_ops_per_stream={limits.max_ops_per_stream} "
            f"need {-(-filled[g] // limits.max_ops_per_stream)} streams"
            for g in groups[:3]
        )
        advice = (
            ". Communication subgraph reuse (comm_reuse=-1, or ACTORFLOW_COMM_REUSE=-1) runs each group of "
            "same-key collectives as one reused subgraph on one stream; or raise max_streams or max_ops_per_stream"
            if groups
            else "; raise max_streams, or place the graph on fewer devices"
        )
        raise CompileError(
            f"rank {rank} needs {len(mine)} streams ({kinds_text(kinds)}), more than max_streams={limits.max_streams}{needs}{advice}"
        )
