"""Which rank this process is and how many there are, as the launcher says, and how a
machine's devices or CPUs are shared out among ranks.

A leaf module: the compiler reads it for its default number of ranks, the training run
to let rank 0 alone report; the runtime checks it against MPI itself. Launchers name
the rank in different variables: MPICH's hydra ``PMI_RANK``/``PMI_SIZE``, Open MPI
``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``, Slurm ``SLURM_PROCID``/``SLURM_NTASKS``,
torchrun ``RANK``/``WORLD_SIZE``. Without a launcher: rank 0 of 1. Once the ranks that
survived a lost one regrouped (``runtime.mpi_world.regroup``), their new numbers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

RANK_CPUS = "ACTORFLOW_RANK_CPUS"
"""Where ``actorflow launch`` lists each local rank's CPUs (``cpu_shares``), as
``0,1;2,3``: rank 0's, then rank 1's...; a rank binds itself to its own when it starts
MPI (``runtime.mpi_world.mpi``). Empty: the ranks stay unbound."""

LOST_AFTER = 6.0
"""The default silence (seconds) after which another rank counts as lost (the runtime's
``lost_after``): a paused process has seconds to come back, and a dead job still stops
within 10 s."""

_VARIABLES = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("RANK", "WORLD_SIZE"),
)


_renumbered: tuple[int, int] | None = None


def renumber(rank: int, size: int) -> None:
    """From now on this process is ``rank`` of ``size`` (the survivors of a lost rank)."""
    global _renumbered
    _renumbered = (rank, size)


def launched() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment, or as ``renumber`` said; (0, 1)
    without a launcher."""
    if _renumbered is not None:
        return _renumbered
    for rank, size in _VARIABLES:
        if rank in os.environ and size in os.environ:
            try:
                return int(os.environ[rank]), int(os.environ[size])
            except ValueError:
                raise ValueError(
                    f"the launcher's {rank}={os.environ[rank]!r} and {size}={os.environ[size]!r} are not integers"
                ) from None
    return 0, 1


def world_size() -> int:
    return launched()[1]


def this_rank() -> int:
    return launched()[0]


def blocks(items: Sequence[T], n: int) -> list[list[T]]:
    """``items``, in their order, in ``n`` contiguous blocks as even as they go (item k in
    block ``k * n // len(items)``)."""
    placed: list[list[T]] = [[] for _ in range(n)]
    for k, item in enumerate(items):
        placed[k * n // len(items)].append(item)
    return placed


def listed_cpus(shares: Sequence[Sequence[int]]) -> str:
    """``shares``, each rank's CPUs, as ``RANK_CPUS`` holds them."""
    return ";".join(",".join(map(str, share)) for share in shares)


def shares_listed(listed: str) -> list[str]:
    """Each rank's entry (``0,1``) in a ``RANK_CPUS`` value; none for an empty one."""
    return listed.split(";") if listed else []


def cpus_of(share: str) -> set[int]:
    """The CPUs one entry of a ``RANK_CPUS`` value lists; ValueError if it lists
    something else."""
    return {int(cpu) for cpu in share.split(",")}


def cpu_shares(cpus: Sequence[int], ranks: int) -> list[list[int]]:
    """Each of ``ranks`` ranks' CPUs on one machine: ``cpus`` in contiguous blocks as even
    as they go, or one each, in turn, where the ranks outnumber them."""
    if ranks >= len(cpus):
        return [[cpus[r % len(cpus)]] for r in range(ranks)]
    return blocks(cpus, ranks)
