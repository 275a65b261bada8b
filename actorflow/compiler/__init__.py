"""The compiler: a fixed, visible list of passes from a logical graph to a Plan."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from ..collector import cyclic_gc_paused
from ..devices import parse_device
from ..errors import CompileError
from ..graph.ir import Graph, Tensor
from ..ops.registry import lookup
from ..parallel.program import undecided
from ..plan import DEFAULT_RESOURCES, Plan
from ..records import evolve
from .chains import fuse_chains
from .check import check
from .collective_order import order_collectives
from .events import insert_events
from .expand import expand
from .fusion import fuse_collectives
from .link import emulate_links, predict_communication
from .micro_batches import split_micro_batches
from .optimizer_shards import shard_optimizer
from .priorities import assign_priorities
from .ranks import Ranks, place_ranks, plan_devices, split_ranks
from .recompute import recompute, recompute_quotas
from .registers import plan_registers
from .resources import checked_resources, memory_limit
from .reuse import reuse_communication, reuse_limit
from .sbp_search import choose_sbp
from .schedules import ZERO_BUBBLE, schedule_quotas
from .streams import assign_streams
from .updates import order_updates


@cyclic_gc_paused()
def compile(
    graph: Graph,
    *,
    quota: int = 2,
    quotas: Mapping[str | Tensor, int] | None = None,
    priority: bool = True,
    link_bandwidth: float | None = None,
    link_latency: float = 0.0,
    fusion: bool = True,
    fuse_kernels: bool = True,
    bucket_first: int = 1 << 20,
    bucket_cap: int = 25 << 20,
    overlap: bool = True,
    micro_batches: int = 1,
    stages: Sequence[str | Sequence[str]] | None = None,
    schedule: str | None = None,
    ranks: Ranks = None,
    max_streams: int = DEFAULT_RESOURCES.max_streams,
    max_ops_per_stream: int = DEFAULT_RESOURCES.max_ops_per_stream,
    max_labels: int = DEFAULT_RESOURCES.max_labels,
    max_memory: int | None = None,
    comm_reuse: int | None = None,
) -> Plan:
    """Lower ``graph`` into a Plan.

    quota: buffers per register (default for all); quotas: per-tensor overrides, keyed by
    tensor or tensor name; priority: compute-first launch order (False: off, for
    comparison); link_bandwidth (bytes/s) and link_latency (s): emulate a link between
    devices, so collectives take the time a ring collective would take on it (off by
    default); fusion: bucket the sum and mean all-reduces (gradients) in gradient-ready
    order into one fused all-reduce per bucket, with one flat register per bucket and
    device (False: off); bucket_first and bucket_cap (bytes of one device's tensors): the
    first bucket closes once it holds bucket_first, and no bucket grows past bucket_cap
    (a larger tensor goes alone); PyTorch DDP's defaults, 1 MiB and 25 MiB;
    fuse_kernels: a compute actor whose only data input (besides parameters and
    variables) is another's output on its device, in the same pass and at the same
    rate, runs inside that producer's act, one kernel after the other, where the
    producer's other readers are on its stream; a producer takes one follower and a
    chain is cut every 8 members (see ``chains``; False: every op its own actor); overlap:
    False makes collectives act as if they shared their devices' compute streams (the
    schedule with no overlap, for comparison).

    micro_batches: feeds per step: the graph is built for one micro-batch, and each
    update happens once per step, with gradients averaged over the step's micro-batches
    (see ``micro_batches``); stages and schedule ("gpipe", "1f1b", or "zb1", alias
    "zbh1": ZB-H1, 1F1B with the weight gradients deferred): the pipeline's stages in
    order (a device or a list of devices each), so that the registers each
    stage keeps for backward get the schedule's quota (see ``schedules``; ``quotas``
    still override them); the plan keeps the stages (``Plan.stages``) for its traces.

    ranks: the processes the plan runs on, each holding some devices (see
    ``ranks.place_ranks``): by default as many as the launcher started (one without a
    launcher), the devices spread over them in order; an int; or a list of the devices
    of each rank. Every rank compiles the same plan and runs its own devices' actors.

    The device resource model (see ``resources``): max_streams per rank (compute and
    copy per device, collective streams, the communication stream); max_ops_per_stream:
    collectives one collective stream carries, in execution order, before its group's
    next stream opens; max_labels: labels the calls of reused communication subgraphs
    may take; max_memory: bytes of planned memory per device (default: what this
    machine has available). Going past one is a CompileError that gives the numbers.

    comm_reuse: communication subgraph reuse (see ``reuse``), as ACTORFLOW_COMM_REUSE,
    which wins when set: -1 on with the default limit of 1000 reused collectives, a
    positive int on with that limit, None (the default) off.
    """
    if undecided(graph):
        graph = choose_sbp(graph, link_bandwidth)
    _warn_if_nothing_to_see(graph)
    limits = checked_resources(max_streams, max_ops_per_stream, max_labels, max_memory)
    reuse = reuse_limit(comm_reuse)
    overrides = {(k.name if isinstance(k, Tensor) else k): v for k, v in (quotas or {}).items()}
    plan = expand(graph)
    plan = recompute(plan)
    plan = split_micro_batches(plan, micro_batches)
    plan, gathered = shard_optimizer(plan, graph.optimizer_shards)
    overrides = dict.fromkeys(gathered, 1) | overrides
    plan = order_updates(plan)
    if fuse_kernels:
        plan, internal = fuse_chains(plan)
        overrides = dict.fromkeys(internal, 1) | overrides
    if fusion:
        plan = fuse_collectives(plan, bucket_first, bucket_cap)
    plan = split_ranks(plan, *place_ranks(plan_devices(plan), ranks))
    plan = order_collectives(plan)
    plan, floors = reuse_communication(plan, reuse, limits.max_ops_per_stream, limits.max_labels)
    plan = assign_streams(plan, limits)
    plan = predict_communication(plan)
    if link_bandwidth is not None:
        plan = emulate_links(plan, link_bandwidth, link_latency)
    plan = insert_events(plan)
    if stages is not None or schedule is not None:
        devices = _stage_devices(stages)
        plan = evolve(plan, stages=tuple(map(tuple, devices)))
    if schedule is not None:
        overrides = schedule_quotas(plan, devices, schedule, quota) | overrides
    overrides = recompute_quotas(plan) | overrides
    overrides |= {name: max(least, overrides.get(name, quota)) for name, least in floors.items()}
    plan = plan_registers(plan, quota, overrides, memory_limit(limits))
    plan = assign_priorities(plan, compute_first=priority, defer_weight_grads=schedule in ZERO_BUBBLE)
    return check(evolve(plan, overlap=overlap, resources=limits))


def _stage_devices(stages: Sequence[str | Sequence[str]] | None) -> list[list[str]]:
    if not stages or isinstance(stages, str):
        raise CompileError(
            f"a schedule needs stages: a list with a device, or a list of devices, per stage; got {stages!r}"
        )
    try:
        devices = [[parse_device(d) for d in ([s] if isinstance(s, str) else s)] for s in stages]
    except (TypeError, ValueError) as e:
        raise CompileError(f"stages: {e}") from None
    seen = [d for stage in devices for d in stage]
    twice = sorted({d for d in seen if seen.count(d) > 1})
    if twice:
        raise CompileError(f"stages: {twice} appear in more than one place; a device belongs to one stage")
    return devices


__all__ = ["compile", "check", "expand"]


def _warn_if_nothing_to_see(graph: Graph) -> None:
    """A graph whose runs can show nothing is almost always a mistake; it still compiles."""
    kinds = {lookup(n.op).kind for n in graph.nodes}
    if not kinds:
        problem = "the graph is empty (were its ops built inside `with af.Graph() as g:`?)"
    elif not kinds & {"fetch", "update"}:
        problem = (
            "the graph has no outputs and updates no parameter, so its runs return {} and "
            "compute nothing: only what an af.output or an update depends on runs"
        )
    else:
        return
    warnings.warn(problem, stacklevel=4)  # past compile and its gc pause
