"""fuse collectives: many small all-reduces (a backward pass makes one per gradient) become
a few large ones, the way PyTorch DDP buckets gradients.

Candidates are the sum and mean all-reduces whose participants each read one tensor and
write one. They are grouped by (op, the ordered participant devices, input and output
dtype, rate: see ``Actor.every``) and, within a group, taken in gradient-ready order (their place in the topological
order) and bucketed greedily, counting one participant's input bytes: the first bucket of
a group closes once it holds ``first_bucket_bytes``; any bucket closes before the next
tensor would take it past ``bucket_cap_bytes``, so a tensor larger than the cap gets a
bucket of its own. Two all-reduces of which one reaches the other through data never
share a bucket (the fused kernel would wait on itself): such a tensor closes the open
bucket and starts the next (a first bucket closed early this way still counts as the
first). Buckets already formed count as one unit when later ones are checked, so fusing
several buckets can't close a cycle through them either.

A bucket of one stays as it is. A larger one becomes one collective, ``fused_all_reduce_<k>``
(numbered in gradient-ready order), with one participant per device that reads the
members' inputs on its device in bucket order and writes the members' output registers
(the same registers: their consumers don't change) plus one new flat register of all the
members' elements, which its kernel (``ops.fusion_kernels.fused_all_reduce``) packs,
reduces in place across devices and splits back. The member actors go; actor and
collective ids are renumbered so that each stays equal to its index.
"""

from __future__ import annotations

import numpy as np

from ..ops.fusion_kernels import fused_all_reduce
from ..plan import Actor, Collective, Consumer, Plan, Register
from ..records import evolve
from .topology import Contracted, data_edges, ready_order, unit_of

FUSIBLE_OPS = ("sum", "mean")


def fuse_collectives(plan: Plan, first_bucket_bytes: int = 1 << 20, bucket_cap_bytes: int = 25 << 20) -> Plan:
    buckets = _buckets(plan, first_bucket_bytes, bucket_cap_bytes)
    if not buckets:
        return plan
    return _fuse(plan, buckets)


# -- choosing the buckets --------------------------------------------------------------


def _key(plan: Plan, coll: Collective) -> tuple | None:
    """The group a collective may be fused within, or None if it can't be fused."""
    if coll.op != "all_reduce" or not coll.actors:
        return None
    participants = [plan.actors[a] for a in coll.actors]
    op = participants[0].attrs.get("op")
    if op not in FUSIBLE_OPS:
        return None
    if any(len(p.inputs) != 1 or len(p.outputs) != 1 for p in participants):
        return None
    first = participants[0]
    source, result = plan.registers[first.inputs[0].register], plan.registers[first.outputs[0]]
    if result.control:
        return None
    return (op, tuple(p.device for p in participants), source.dtype, result.dtype, first.every)


def _nbytes(plan: Plan, coll: Collective) -> int:
    return plan.registers[plan.actors[coll.actors[0]].inputs[0].register].nbytes


def _buckets(plan: Plan, first_bytes: int, cap_bytes: int) -> list[list[Collective]]:
    """The buckets of two or more collectives, each in gradient-ready order."""
    groups: dict[tuple, list[Collective]] = {}
    for coll in plan.collectives:
        key = _key(plan, coll)
        if key is not None:
            groups.setdefault(key, []).append(coll)
    if not any(len(members) > 1 for members in groups.values()):
        return []
    order = ready_order(plan)
    unit = unit_of(plan)

    def ready(coll: Collective) -> tuple[int, int, int]:
        return order[unit[coll.actors[0]]]

    graph = Contracted(data_edges(plan), [unit[c.actors[0]] for members in groups.values() for c in members])
    buckets: list[list[Collective]] = []
    ordered = sorted(groups.values(), key=lambda members: min(map(ready, members)))
    for members in ordered:
        if len(members) < 2:
            continue
        members.sort(key=ready)
        chosen = graph.independent()  # the bucket's units
        bucket: list[Collective] = []
        size, index = 0, 0

        def close() -> None:
            nonlocal bucket, size, index, chosen
            if len(bucket) > 1:
                buckets.append(bucket)
                graph.contract([unit[c.actors[0]] for c in bucket])
                chosen = graph.independent()
            else:
                chosen.clear()
            bucket, size, index = [], 0, index + 1

        for coll in members:
            u = graph.find(unit[coll.actors[0]])
            nbytes = _nbytes(plan, coll)
            if bucket and (not chosen.admits(u) or size + nbytes > cap_bytes):
                close()
            bucket.append(coll)
            size += nbytes
            chosen.add(u)
            if index == 0 and size >= first_bytes:
                close()
        close()
    buckets.sort(key=lambda b: ready(b[0]))
    return buckets


# -- rewriting the plan -----------------------------------------------------------------


def _fuse(plan: Plan, buckets: list[list[Collective]]) -> Plan:
    """Replace each bucket by one fused collective; renumber actors and collectives."""
    member_of: dict[int, tuple[int, int, int]] = {}  # old actor -> (bucket, device index, member)
    anchor: dict[int, tuple[int, int]] = {}  # old actor -> (bucket, device index) emitted there
    for b, bucket in enumerate(buckets):
        for m, coll in enumerate(bucket):
            for d, a in enumerate(coll.actors):
                member_of[a] = (b, d, m)
        for d, a in enumerate(bucket[-1].actors):
            anchor[a] = (b, d)

    # the new actor list, as ("old", id) or ("fused", bucket, device index)
    slots: list[tuple] = []
    for actor in plan.actors:
        if actor.id in anchor:
            slots.append(("fused", *anchor[actor.id]))
        elif actor.id not in member_of:
            slots.append(("old", actor.id))
    new_id = {slot: k for k, slot in enumerate(slots)}

    def actor_id(old: int) -> int:
        if old < 0:
            return old
        if old in member_of:
            b, d, _ = member_of[old]
            return new_id[("fused", b, d)]
        return new_id[("old", old)]

    def consumer(c: Consumer) -> Consumer:
        if c.actor in member_of:
            return Consumer(actor_id(c.actor), member_of[c.actor][2])
        return Consumer(actor_id(c.actor), c.slot)

    # the collectives, each fused one where its bucket's last member was
    last = {bucket[-1].id: b for b, bucket in enumerate(buckets)}
    fused_ids = {c.id for bucket in buckets for c in bucket}
    collectives: list[Collective] = []
    for coll in plan.collectives:
        if coll.id in last:
            b = last[coll.id]
            devices = range(len(coll.actors))
            collectives.append(
                Collective(
                    len(collectives),
                    _name(b),
                    "all_reduce",
                    tuple(new_id[("fused", b, d)] for d in devices),
                )
            )
        elif coll.id not in fused_ids:
            participants = tuple(map(actor_id, coll.actors))
            collectives.append(evolve(coll, id=len(collectives), actors=participants))
    group_of = {a: c.id for c in collectives for a in c.actors}

    # the fused participants and their flat registers, after the remapped old ones
    registers = [
        evolve(r, producer=actor_id(r.producer), consumers=tuple(map(consumer, r.consumers)))
        for r in plan.registers
    ]
    fused: dict[tuple[int, int], Actor] = {}
    for b, bucket in enumerate(buckets):
        for d in range(len(bucket[0].actors)):
            members = [plan.actors[c.actors[d]] for c in bucket]
            head = members[0]
            aid = new_id[("fused", b, d)]
            outs = [m.outputs[0] for m in members]
            size = sum(int(np.prod(plan.registers[o].shape, dtype=np.int64)) for o in outs)
            flat = Register(
                id=len(registers),
                name=f"{_name(b)}[{head.device}]/flat",
                producer=aid,
                device=head.device,
                shape=(size,),
                dtype=plan.registers[outs[0]].dtype,
            )
            registers.append(flat)
            fused[(b, d)] = Actor(
                id=aid,
                name=f"{_name(b)}[{head.device}]",
                kind=head.kind,
                op="all_reduce",
                kernel=fused_all_reduce,
                attrs={"op": head.attrs["op"], "members": len(bucket)},
                device=head.device,
                inputs=tuple(m.inputs[0] for m in members),
                outputs=(*outs, flat.id),
                group=group_of[aid],
                where=head.where,
                every=head.every,
                backward=head.backward,
                weight_grad=head.weight_grad,
            )

    actors: list[Actor] = []
    for k, slot in enumerate(slots):
        if slot[0] == "fused":
            actors.append(fused[slot[1:]])
        else:
            actor = plan.actors[slot[1]]
            actors.append(evolve(actor, id=k, group=group_of.get(k, -1)))
    return evolve(
        plan,
        actors=tuple(actors),
        registers=tuple(registers),
        collectives=tuple(collectives),
        feeds=tuple(evolve(f, actor=actor_id(f.actor)) for f in plan.feeds),
        outputs=tuple(evolve(o, actor=actor_id(o.actor)) for o in plan.outputs),
    )


def _name(bucket: int) -> str:
    return f"fused_all_reduce_{bucket}"
