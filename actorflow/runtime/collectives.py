"""Collectives whose participants span ranks: each rank runs its own participants' part,
and the ranks meet in MPI on the group's communicator: the collective stream's thread
starts the nonblocking call and waits for it (``Transport.collective``, ``Transport.wait``).

An all-reduce reduces in two levels (OneFlow's): a rank's participants reduce theirs
into one buffer first, the ranks then all-reduce those buffers, and each participant
gets the result (the kernels take an ``across``, see ``ops.kernels.all_reduce``); a
fused bucket stays one call. Every other collective gathers all participants' inputs on
every rank (one all-gather of their bytes) and runs its own kernel over them, writing
this rank's outputs: the same arithmetic as in one process, in the same order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..plan import Actor, Collective, Plan
from .transport import Transport


class Across:
    """``across`` of an all-reduce kernel: sums (or maxes) a buffer in place over ranks."""

    def __init__(self, transport: Transport, comm: Any, participants: int) -> None:
        self.transport = transport
        self.comm = comm
        self.participants = participants

    def __call__(self, acc: np.ndarray, op: str, source: np.ndarray | None = None) -> None:
        """Reduce ``acc`` in place, or ``source`` into ``acc`` (one copy less)."""
        MPI = self.transport.MPI
        reduce = MPI.MAX if op == "max" else MPI.SUM
        send = MPI.IN_PLACE if source is None else source
        with self.transport.collective():
            self.transport.wait(self.comm.Iallreduce(send, acc, op=reduce))


def ranks_of(plan: Plan, coll: Collective) -> tuple[int, ...]:
    """The ranks a collective's participants are on, in order: its group."""
    return tuple(sorted({plan.rank_of(plan.actors[a].device) for a in coll.actors}))


def channel_of(plan: Plan, coll: Collective) -> tuple[tuple[str, ...], int]:
    """The communicator a collective over ranks runs on: one per collective stream of its
    group (the group's devices, the stream's channel), the same on every rank, since
    collectives on one communicator must start in the same order everywhere."""
    stream = plan.streams[plan.actors[coll.actors[0]].stream]
    return stream.group, stream.channel


def across_ranks(
    plan: Plan, rank: int, transport: Transport, coll: Collective
) -> Callable[[list, list], Any]:
    """The kernel this rank's participants of ``coll`` run, for a collective over ranks."""
    actors = [plan.actors[a] for a in coll.actors]
    group = ranks_of(plan, coll)
    comm = transport.groups[channel_of(plan, coll)]
    first = actors[0]
    if first.op == "all_reduce":
        return functools.partial(first.kernel, **first.attrs, across=Across(transport, comm, len(actors)))
    return _Gathering(plan, actors, group, rank, transport, comm)


class _Gathering:
    """Gathers every participant's inputs, then runs the collective's kernel over all of
    them; the outputs of other ranks' participants go to scratch buffers."""

    def __init__(
        self,
        plan: Plan,
        actors: list[Actor],
        group: tuple[int, ...],
        rank: int,
        transport: Transport,
        comm: Any,
    ) -> None:
        first = actors[0]
        self.kernel = functools.partial(first.kernel, **first.attrs) if first.attrs else first.kernel
        self.transport = transport
        self.comm = comm
        self.local = [plan.rank_of(a.device) == rank for a in actors]
        # a reused subgraph's call reads one of its inputs, all of one shape and dtype
        self.inputs = [
            [
                plan.registers[i.register]
                for i in a.inputs[: 1 if a.calls > 1 else None]
                if not plan.registers[i.register].control
            ]
            for a in actors
        ]
        self.n_outputs = [len(a.outputs) for a in actors]
        owner = [plan.rank_of(a.device) for a in actors]
        counts = [sum(r.nbytes for a, regs in zip(owner, self.inputs) if a == g for r in regs) for g in group]
        self.counts = counts
        self.displacements = list(np.cumsum([0, *counts[:-1]]))
        self.sendbuf = np.empty(counts[group.index(rank)], np.uint8)
        self.recvbuf = np.empty(sum(counts), np.uint8)
        # where each participant's inputs start in the gathered bytes
        self.offsets: list[int] = []
        at = dict(zip(group, self.displacements))
        for a, regs in zip(owner, self.inputs):
            self.offsets.append(at[a])
            at[a] += sum(r.nbytes for r in regs)
        self.scratch = [
            [] if mine else [np.empty(plan.registers[o].shape, plan.registers[o].dtype) for o in a.outputs]
            for a, mine in zip(actors, self.local)
        ]

    def __call__(self, ins: list, outs: list) -> Any:
        offset = 0
        for x in ins:
            self.sendbuf[offset : offset + x.nbytes] = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
            offset += x.nbytes
        MPI = self.transport.MPI
        with self.transport.collective():
            self.transport.wait(
                self.comm.Iallgatherv(self.sendbuf, [self.recvbuf, self.counts, self.displacements, MPI.BYTE])
            )
        all_ins: list = []
        all_outs: list = []
        mine_in, mine_out = iter(ins), iter(outs)
        for k, regs in enumerate(self.inputs):
            if self.local[k]:
                all_ins.extend(next(mine_in) for _ in regs)
                all_outs.extend(next(mine_out) for _ in range(self.n_outputs[k]))
                continue
            at = self.offsets[k]
            for r in regs:
                all_ins.append(
                    np.frombuffer(self.recvbuf, r.dtype, int(np.prod(r.shape, dtype=np.int64)), at).reshape(
                        r.shape
                    )
                )
                at += r.nbytes
            all_outs.extend(self.scratch[k])
        return self.kernel(all_ins, all_outs)
