"""Collectives whose participants span ranks: each rank runs its own participants' part,
and the ranks meet in MPI on the group's communicator: the collective stream's thread
starts the nonblocking call and waits for it (``Transport.collective``, ``Transport.wait``).

An all-reduce reduces in two levels (OneFlow's): a rank's participants reduce theirs
into one buffer first, the ranks then all-reduce those buffers (``Across``: each rank
reduces one block of the elements straight into the result, and the ranks all-gather
the blocks), and each participant gets the result (the kernels take an ``across``, see
``ops.kernels.all_reduce``); a fused bucket stays one all-reduce. Every other collective
gathers all participants' inputs on every rank (one all-gather of their bytes) and runs
its own kernel over them, writing this rank's outputs: the same arithmetic as in one
process, in the same order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..plan import Actor, Collective, Plan
from .transport import Transport
from .wiring import bound, ranks_of


class Across:
    """``across`` of an all-reduce kernel: sums (or maxes) a buffer over ranks.

    Not MPI's all-reduce: out of place, as for a rank's lone participant, MPICH's copies
    the source into the result first, which made it 1.4x slower than in place on 2 ranks
    here (0.26 against 0.19 ms at 1 MiB), and every rank must take the same way (a rank
    with several participants reduces in place). So each rank reduces one block of the
    elements, its own source's then the others' (sent to it) in rank order, straight
    into the result, and the ranks then all-gather the blocks in place: in place and out
    of place alike, for any dtype, with the kernels' own arithmetic. Bare, on 2 ranks, it
    took MPI's in-place time (0.19 against 0.18-0.20 ms at 1 MiB, 2.5 against 2.5-2.6 ms
    at 16 MiB); here with the transport and nothing else, 0.26 and 3.2-3.4 ms against
    0.33 and 5.0-6.2 ms for MPI's out of place.
    """

    TAG = 0
    """Of the blocks sent (on the collective's own communicator, where nothing else sends
    point to point)."""

    def __init__(self, transport: Transport, comm: Any, participants: int) -> None:
        self.transport = transport
        self.comm = comm
        self.participants = participants
        self._received: np.ndarray | None = None

    def __call__(self, acc: np.ndarray, op: str, source: np.ndarray | None = None) -> None:
        """Reduce ``acc`` in place, or ``source`` into ``acc`` (one copy less)."""
        with self.transport.collective():
            self._reduce(acc if source is None else source, acc, np.maximum if op == "max" else np.add)

    def _reduce(self, source: np.ndarray, acc: np.ndarray, reduce: np.ufunc) -> None:
        """``acc`` = ``reduce`` of every rank's ``source`` (which may be ``acc``)."""
        comm, ranks, me = self.comm, self.comm.Get_size(), self.comm.Get_rank()
        src, out = source.reshape(-1), acc.reshape(-1)
        bounds = [src.size * k // ranks for k in range(ranks + 1)]
        peers = [k for k in range(ranks) if k != me]
        shape = (len(peers), bounds[me + 1] - bounds[me])
        if self._received is None or self._received.shape != shape or self._received.dtype != src.dtype:
            self._received = np.empty(shape, src.dtype)
        received = self._received
        requests = []
        for peer, into in zip(peers, received):
            requests.append(comm.Irecv(into.view(np.uint8), source=peer, tag=self.TAG))
            block = src[bounds[peer] : bounds[peer + 1]].view(np.uint8)
            requests.append(comm.Isend(block, dest=peer, tag=self.TAG))
        self.transport.wait(requests)
        # its own block first: in place, the result's block is the source's
        mine = out[bounds[me] : bounds[me + 1]]
        reduce(src[bounds[me] : bounds[me + 1]], received[0], out=mine)
        for block in received[1:]:
            reduce(mine, block, out=mine)
        nbytes = [(bounds[k + 1] - bounds[k]) * src.itemsize for k in range(ranks)]
        displacements = [bounds[k] * src.itemsize for k in range(ranks)]
        MPI = self.transport.MPI
        self.transport.wait(
            comm.Iallgatherv(MPI.IN_PLACE, [out.view(np.uint8), nbytes, displacements, MPI.BYTE])
        )


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
        self.kernel = bound(first)
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
