"""priorities: when several actors of one stream can act, the driver launches the lowest
number first, so it decides their order in the stream's queue.

Deeper first: an actor later in the topological order goes ahead of an earlier one, so
earlier iterations drain before later ones start (the way pipelines run backward before
forward): the work another device waits for enters the queue first, and fewer buffers
are held.

Unless ``compute_first=False``, communication decides before depth (PaddlePaddle
#47471's compute-first dispatch, and what makes gradient all-reduces overlap backward):
an actor whose result a collective or a copy to another device reads goes first, so
communication can start as soon as possible (a bias gradient must not wait behind the
rest of the backward pass; a pipeline stage computes the input gradient the previous
stage waits for before its own weight gradients); an actor launched early to wait on a
collective's result goes last, so its wait can't hold up compute that could run
meanwhile: a replayed stream (and a GPU stream) waits in its place for what it reads,
so an update placed between backward ops held the backward pass for its gradient's
all-reduce.

With ``defer_weight_grads`` (the zero-bubble schedules), a weight-gradient actor
(``Actor.weight_grad``) goes behind every other actor of its stream but those waiting on
a collective: it runs only when no forward or input-gradient work can, filling the time
the stage would otherwise wait.
"""

from __future__ import annotations

from ..plan import Plan
from ..records import evolve
from .topology import unit_of, unit_positions


def assign_priorities(plan: Plan, compute_first: bool = True, defer_weight_grads: bool = False) -> Plan:
    unit = unit_of(plan)
    position = unit_positions(plan)
    collective_streams = {s.id for s in plan.streams if s.kind == "collective"}
    stream_of = {a.id: a.stream for a in plan.actors}

    def waits_on_collective(actor) -> bool:
        producers = (plan.registers[i.register].producer for i in actor.inputs)
        return any(p >= 0 and stream_of[p] in collective_streams for p in producers)

    def another_device_waits(actor) -> bool:
        consumers = (plan.actors[c.actor] for o in actor.outputs for c in plan.registers[o].consumers)
        return any(
            c.stream in collective_streams
            or c.kind == "send"
            or (c.kind == "copy" and c.device != actor.device)
            for c in consumers
        )

    def key(actor):
        compute = actor.stream not in collective_streams
        late = compute_first and compute and waits_on_collective(actor)
        early = compute_first and compute and another_device_waits(actor)
        deferred = defer_weight_grads and actor.weight_grad
        return (late, deferred, not early, -position[unit[actor.id]], actor.id)

    rank = {a.id: k for k, a in enumerate(sorted(plan.actors, key=key))}
    actors = tuple(evolve(a, priority=rank[a.id]) for a in plan.actors)
    return evolve(plan, actors=actors)
