"""Feed a plan from a memory-mapped .npy file of images (rows, height, width), its
placeholder split S(axis) over two devices, for axis 0, 1 and 2 (run under a launcher,
one device a rank, by ``test_data``): each rank reads its devices' parts with
``read_parts`` and saves to OUT/rankR_axisA.npz the outputs and which elements of the
file it read."""

from __future__ import annotations

import sys

import numpy as np

import actorflow as af
from actorflow.training.data import Data, read_parts
from actorflow.training.runner import local_feeds
from actorflow.world import this_rank

ROWS = 4
"""Rows a micro-batch; the file has more, and each step takes the next ROWS of them."""

STEPS = 3


class Recording:
    """An array that marks each element an indexing reads (``read``)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array, self.shape, self.ndim = array, array.shape, array.ndim
        self.read = np.zeros(array.shape, bool)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index):
        self.read[index] = True
        return self.array[index]


def image_plan(shape: tuple[int, ...], axis: int, ranks: int) -> af.Plan:
    """tanh of feed ``x`` (ROWS, *shape[1:]) split S(axis) over cpu:0 and cpu:1."""
    with af.Graph() as graph:
        x = af.placeholder("x", (ROWS, *shape[1:]), "float64", ["cpu:0", "cpu:1"], af.S(axis))
        af.output("y", af.ops.tanh(x))
    return af.compile(graph, ranks=ranks)


def step_rows(step: int, samples: int) -> np.ndarray:
    return (step * ROWS + np.arange(ROWS)) % samples


def read_steps(plan: af.Plan, data: Data, rank: int) -> list[Data]:
    """STEPS steps of ``rank``'s feeds."""
    parts = local_feeds(plan, rank)
    return [read_parts(data, step_rows(step, len(data["x"])), parts) for step in range(STEPS)]


def main(path: str, out: str) -> None:
    rank = this_rank()
    for axis in range(3):
        images = Recording(np.load(path, mmap_mode="r"))
        plan = image_plan(images.shape, axis, ranks=2)
        outputs = af.run(plan, read_steps(plan, {"x": images}, rank))  # type: ignore[dict-item]
        np.savez(
            f"{out}/rank{rank}_axis{axis}.npz",
            read=images.read,
            **{f"{name}@{step}": value for step, o in enumerate(outputs) for name, value in o.items()},
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
