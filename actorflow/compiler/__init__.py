"""The compiler: a fixed, visible list of passes from a logical graph to a Plan."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

from ..collector import cyclic_gc_paused
from ..debug_flags import debug_flags
from ..errors import CompileError
from ..graph.ir import Graph
from ..ops.registry import lookup
from ..parallel.program import undecided
from ..plan import Plan
from ..plan_check import lint as plan_lint
from ..records import evolve
from .chains import cuda_chains, fuse_chains
from .check import check
from .collective_order import order_collectives
from .events import insert_events
from .expand import expand
from .fusion import fuse_collectives
from .link import emulate_links, predict_communication
from .micro_batches import split_micro_batches
from .optimizer_shards import shard_optimizer
from .options import CompileOptions, compile_options
from .priorities import assign_priorities
from .ranks import place_ranks, plan_devices, split_ranks
from .recompute import recompute, recompute_quotas
from .registers import plan_registers
from .resources import memory_limit
from .reuse import reuse_communication
from .sbp_search import choose_sbp
from .schedules import ZERO_BUBBLE, schedule_quotas
from .streams import assign_streams
from .updates import order_updates


@cyclic_gc_paused()
def compile(graph: Graph, **options: Any) -> Plan:
    """Lower ``graph`` into a Plan by the passes of ``passes``, the options checked
    first (``options.CompileOptions``: a bad one is a CompileError naming it). With
    ``ACTORFLOW_DEBUG=passes`` the plan is checked after each pass (``lint``).

    Options (keywords):

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
    chain is cut every 8 members (see ``chains``; False: every op its own actor);
    cuda_chains: on a cuda device, an element-wise op, a chain of them, or a run of them
    inside a chain runs as one generated CUDA kernel, its intermediates kept in registers
    (``chains.cuda_chains``; False: each op its own kernels, for comparison); overlap:
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
    checked = compile_options(**options)
    if undecided(graph):
        graph = choose_sbp(graph, checked.link_bandwidth)
    _warn_if_nothing_to_see(graph)
    plan = expand(graph)
    linting = "passes" in debug_flags()
    for name, run in passes(checked, graph):
        plan = run(plan)
        if linting and name != "check":  # the last pass is the whole plan check
            lint(plan, name)
    return plan


Pass = Callable[[Plan], Plan]


def passes(options: CompileOptions, graph: Graph) -> list[tuple[str, Pass]]:
    """The passes after ``expand``, in order, as (name, Plan -> Plan) for these options."""
    o, limits = options, options.resources
    steps: list[tuple[str, Pass]] = [
        ("record_options", partial(evolve, overlap=o.overlap, resources=limits, stages=o.stages or ())),
        ("recompute", recompute),
        ("split_micro_batches", partial(split_micro_batches, micro_batches=o.micro_batches)),
        ("shard_optimizer", partial(shard_optimizer, shards=graph.optimizer_shards)),
        ("order_updates", order_updates),
    ]
    if o.fuse_kernels:
        steps.append(("fuse_chains", fuse_chains))
    if o.cuda_chains:
        steps.append(("cuda_chains", cuda_chains))
    if o.fusion:
        steps.append(
            (
                "fuse_collectives",
                partial(fuse_collectives, first_bucket_bytes=o.bucket_first, bucket_cap_bytes=o.bucket_cap),
            )
        )
    steps += [
        ("split_ranks", lambda plan: split_ranks(plan, *place_ranks(plan_devices(plan), o.ranks))),
        ("order_collectives", order_collectives),
        (
            "reuse_communication",
            partial(reuse_communication, limit=o.reuse),
        ),
        ("assign_streams", assign_streams),
        ("predict_communication", predict_communication),
    ]
    if o.link_bandwidth is not None:
        steps.append(
            ("emulate_links", partial(emulate_links, bandwidth=o.link_bandwidth, latency=o.link_latency))
        )
    steps.append(("insert_events", insert_events))
    if o.schedule is not None:
        assert o.stages is not None, "CompileOptions: a schedule comes with its stages"
        steps.append(
            (
                "schedule_quotas",
                partial(schedule_quotas, stages=o.stages, schedule=o.schedule, default=o.quota),
            )
        )
    steps += [
        ("recompute_quotas", recompute_quotas),
        (
            "plan_registers",
            partial(plan_registers, quota=o.quota, quotas=o.quotas, max_memory=memory_limit(limits)),
        ),
        (
            "assign_priorities",
            partial(
                assign_priorities, compute_first=o.priority, defer_weight_grads=o.schedule in ZERO_BUBBLE
            ),
        ),
        ("check", check),
    ]
    return steps


def lint(plan: Plan, after: str) -> None:
    """The plan check that holds between passes (``plan_check.lint``), its error naming
    the pass ``after`` which it fails."""
    try:
        plan_lint(plan)
    except CompileError as e:
        raise CompileError(f"after pass {after}: {e}") from e


__all__ = ["compile", "check", "expand", "passes"]


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
