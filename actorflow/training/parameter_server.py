"""Parameter-server training (seed 003): the model's computation on workers, its updates
on servers, each scaled on its own.

The workers are the stages' data-parallel replicas, as in data-parallel training; the
servers are ``parallel.parameter_server.servers`` more devices, one per server rank (the
last ranks of the run). Each parameter lives on one server (balanced by bytes, the
largest first onto the server holding the fewest), with its optimizer state and its
update. Nothing new runs: the graph reads a parameter on a server from each worker
(``pull``: a copy, which the compiler lowers to a send on the server's rank and a
receive on the worker's), and the gradient of that read flows back as the copy's
gradient (a send from the worker: the push) into a sum on the server, which the update
takes. So every transfer is a send or receive actor under the credit protocol, the
update waits for every worker's gradient of the step (sync: the average, as the
all-reduce of data-parallel training gives it), and each step's pull waits for the
update (the updated parameter's register holds one buffer).

Async (``pull_async``, ``minimize_async``): each worker pulls a snapshot of the parameter
taken on its server (a copy, with its version: the steps every worker's update is in),
and each worker's gradient has its own update, all of them sharing the parameter and its
optimizer state in place on the server's one compute stream, so each applies as its
gradient arrives. A version register holds staleness + 1 buffers and every update of a
step frees it: a worker's pull of step j waits for every worker's update of step
j - staleness - 1, so the parameters a gradient comes from lack at most ``staleness``
steps of updates. The updates count that lag (``staleness``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs
import numpy as np

from .. import ops
from ..config import Config, Stage
from ..devices import device_order, parse_device
from ..errors import ConfigError
from ..graph.builder import parameter
from ..graph.ir import Graph, Tensor
from ..optim.optimizers import snapshot, update_as_arriving
from ..parallel import B, GlobalTensor, gradients
from ..plan import Plan
from ..text import count
from ..world import blocks
from .optimizer import optimizer

STEPS_PER_RUN = 16
"""An async run's steps go this many to one ``Session.run``: a run ends once every actor
is done with it, so workers run ahead of the updates only within one."""


def server_devices(config: Config) -> tuple[str, ...]:
    """The servers' devices: the CPU devices numbered after every device of the stages."""
    ps = config.parallel.parameter_server
    if ps is None:
        return ()
    last = max(device_order(parse_device(d))[1] for d in config.parallel.devices)
    return tuple(f"cpu:{last + 1 + k}" for k in range(ps.servers))


def assign(sizes: Mapping[str, int], servers: int) -> dict[str, int]:
    """Each parameter's server, balanced by bytes: the largest first (ties: by name),
    each onto the server holding the fewest bytes so far (ties: the lowest)."""
    held = [0] * servers
    chosen = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        server = min(range(servers), key=lambda s: (held[s], s))
        chosen[name] = server
        held[server] += sizes[name]
    return chosen


def placement(config: Config, values: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Each parameter's server device (none without parameter servers)."""
    devices = server_devices(config)
    if not devices:
        return {}
    return {
        name: devices[s] for name, s in assign({n: v.nbytes for n, v in values.items()}, len(devices)).items()
    }


def pull(param: Tensor, workers: str | Sequence[str]) -> Tensor | GlobalTensor:
    """A server's parameter as its workers read it: a copy on each (broadcast over several)."""
    if isinstance(workers, str):
        return ops.to_device(param, workers)
    return GlobalTensor(param.shape, B, tuple(ops.to_device(param, d) for d in workers))


@attrs.frozen
class Pull:
    """One parameter's async pulls: per worker, the snapshot it reads and its version."""

    param: Tensor
    clock: Tensor
    snapshots: tuple[Tensor, ...]
    versions: tuple[Tensor, ...]


def pull_async(param: Tensor, workers: str | Sequence[str]) -> tuple[Tensor | GlobalTensor, Pull]:
    """``pull`` for async mode: each worker reads its own snapshot, taken on the server
    beside a clock (the updates applied per worker, a state of the parameter)."""
    devices = [workers] if isinstance(workers, str) else list(workers)
    clock = parameter(f"{param.name}.clock", np.zeros(len(devices), np.int64), param.device, state=True)
    taken = [snapshot(param, clock, f"{param.name}.pull[{d}]") for d in devices]
    read = [ops.to_device(copy, d) for (copy, _), d in zip(taken, devices)]
    pulled = read[0] if isinstance(workers, str) else GlobalTensor(param.shape, B, tuple(read))
    return pulled, Pull(param, clock, tuple(c for c, _ in taken), tuple(v for _, v in taken))


def minimize_async(config: Config, loss: Tensor | GlobalTensor, pulls: Sequence[Pull]) -> None:
    """Backward pass and, per pulled parameter, one update per worker's gradient."""
    grads = iter(gradients(loss, [s for p in pulls for s in p.snapshots]))
    chosen = optimizer(config.train.optimizer)
    for p in pulls:
        update_as_arriving(chosen, p.param, [next(grads) for _ in p.snapshots], p.clock, p.versions)


def is_async(config: Config) -> bool:
    """Whether the run has parameter servers in async mode."""
    ps = config.parallel.parameter_server
    return ps is not None and ps.mode == "async"


def quotas(config: Config, graph: Graph) -> dict[str, int]:
    """Staleness + 1 buffers for each async pull's version (none in sync mode)."""
    ps = config.parallel.parameter_server
    if ps is None or not is_async(config):
        return {}
    return {n.outputs[1].name: ps.staleness + 1 for n in graph.nodes if n.op == "snapshot"}


def run_end(config: Config, step: int) -> int:
    """The step a ``Session.run`` from ``step`` goes up to: ``train.steps_per_run`` steps
    on, ``STEPS_PER_RUN`` in async mode, never past a checkpoint's step or the last."""
    steps = config.train.steps
    keep = config.output.checkpoint
    every = keep.every if keep else steps
    per_run = STEPS_PER_RUN if is_async(config) else config.train.steps_per_run
    return min(steps, step + per_run, (step // every + 1) * every)


def run_starts(config: Config) -> list[int]:
    """The first step of each ``Session.run`` of a training from step 0 (``run_end``)."""
    starts, step = [], 0
    while step < config.train.steps:
        starts.append(step)
        step = run_end(config, step)
    return starts


def staleness(values: Mapping[str, np.ndarray], dropped: int = 0) -> tuple[int, int, int]:
    """(updates, the sum of their staleness, the largest) counted by the async updates of
    the parameters in ``values`` (a rank's, ``Session.values``), since step 0 (they are
    optimizer state: a checkpoint keeps them); ``dropped``: updates whose clocks went
    with lost workers (``survival``), their staleness still in the sums."""
    counted = [v for n, v in values.items() if n.endswith(".staleness")]
    clocks = [v for n, v in values.items() if n.endswith(".clock")]
    return (
        dropped + int(sum(c.sum() for c in clocks)),
        int(sum(c[0] for c in counted)),
        int(max((c[1] for c in counted), default=0)),
    )


def summed(counts: Sequence[tuple[int, int, int]]) -> tuple[int, int, int]:
    """The ranks' ``staleness`` counts together."""
    return sum(c[0] for c in counts), sum(c[1] for c in counts), max(c[2] for c in counts)


def described(counted: tuple[int, int, int]) -> tuple[float, int] | None:
    """(mean, max) staleness of the counted updates; None if there were none."""
    updates, total, most = counted
    return (total / updates, most) if updates else None


def replicas_on(config: Config, devices: Collection[str]) -> list[int]:
    """The workers (data-parallel replicas, in order) that have a device among ``devices``."""
    tp = config.parallel.tensor_parallel
    return sorted({k // tp for stage in config.parallel.stages for k, d in enumerate(stage) if d in devices})


def without(config: Config, lost: Sequence[int]) -> Config:
    """``config`` going on without the workers ``lost`` (replica numbers): each worker left
    keeps its devices and its share of a batch, so the batch shrinks with the workers. A
    ValueError where ``lost`` are not some of its workers, leaving one."""
    parallel, tp = config.parallel, config.parallel.tensor_parallel
    kept = [r for r in range(parallel.data_parallel) if r not in lost]
    if not lost or not set(lost) <= set(range(parallel.data_parallel)) or not kept:
        raise ValueError(
            f"workers {list(lost)} are not some of the {parallel.data_parallel} workers, leaving one"
        )
    stages = tuple(
        Stage(tuple(d for r in kept for d in stage[r * tp : (r + 1) * tp])) for stage in parallel.stages
    )
    batch = config.train.batch_size // parallel.data_parallel * len(kept)
    return attrs.evolve(
        config,
        parallel=attrs.evolve(parallel, stages=stages, data_parallel=len(kept)),
        train=attrs.evolve(config.train, batch_size=batch),
    )


def rank_devices(config: Config, world: int) -> list[list[str]]:
    """The devices of each of ``world`` ranks: the workers' over the first ranks, in order
    and as even as they go, and each server's alone on one of the last ranks."""
    servers = server_devices(config)
    workers = sorted(config.parallel.devices, key=device_order)
    first = world - len(servers)
    if not 1 <= first <= len(workers):
        raise ConfigError(
            f"parallel.parameter_server.servers: {len(servers)} server ranks and {len(workers)} worker "
            f"devices need {len(servers) + 1} to {len(servers) + len(workers)} ranks, not {world}"
        )
    return blocks(workers, first) + [[d] for d in servers]


def roles(config: Config, plan: Plan) -> list[str]:
    """What each rank (and device) is, and per server the bytes it holds (parameters and
    optimizer state) and moves a step: pulled by the workers, pushed to it."""
    servers = server_devices(config)
    ps = config.parallel.parameter_server
    assert ps is not None, "roles of a parameter-server config"
    lines = [
        f"parameter servers ({ps.mode}): {count(len(servers), 'server')}, "
        f"{count(config.parallel.data_parallel, 'worker')} (the data-parallel replicas)"
    ]
    held: dict[str, int] = {}
    for p in plan.parameters:
        device = plan.registers[p.register].device
        held[device] = held.get(device, 0) + plan.registers[p.register].nbytes
    pulled, pushed = _traffic(plan)
    for rank in range(plan.world):
        devices = sorted(plan.devices_of(rank), key=device_order)
        for device in devices:
            if device in servers:
                lines.append(
                    f"  rank {rank}: server {servers.index(device)} on {device}: "
                    f"{held.get(device, 0) / 2**20:.2f} MiB of parameters and optimizer state; "
                    f"a step, {pulled.get(device, 0) / 2**20:.2f} MiB pulled, {pushed.get(device, 0) / 2**20:.2f} MiB pushed"
                )
            else:
                lines.append(f"  rank {rank}: worker on {device}")
    return lines


def _traffic(plan: Plan) -> tuple[dict[str, int], dict[str, int]]:
    """Per device, the bytes a step that leave it and that reach it, over ranks (sends and
    receives) or between devices of a rank (copies); results delivered to every rank left out."""
    out: dict[str, int] = {}
    into: dict[str, int] = {}
    fetches = {a.id for a in plan.actors if a.kind == "fetch"}
    for a in plan.actors:
        acts = plan.micro_batches // a.every
        if a.kind == "send":
            reg = plan.registers[a.inputs[0].register]
            if not any(c.actor in fetches for c in reg.consumers):
                out[a.device] = out.get(a.device, 0) + reg.nbytes * acts
        elif a.kind == "recv":
            reg = plan.registers[a.outputs[0]]
            if not any(c.actor in fetches for c in reg.consumers):
                into[a.device] = into.get(a.device, 0) + reg.nbytes * acts
        elif a.op == "copy" and a.inputs:
            reg = plan.registers[a.inputs[0].register]
            if reg.device != a.device:
                out[reg.device] = out.get(reg.device, 0) + reg.nbytes * acts
                into[a.device] = into.get(a.device, 0) + reg.nbytes * acts
    return out, into
