"""The suite's three hooks and one setting, all about its wall time on few cores, and two
fixtures that several test files share (``launches``, ``collectives_in_order``).

The tests that start MPI ranks (xdist group "mpi", one worker, one at a time) are
collected first, so that their worker is busy with them from the start while the others
share the rest, instead of running them alone at the end; then the tests marked
``long`` (ten seconds or more), so that none of them starts last and runs alone. And ``-n auto`` starts one
worker more than there are cores: the "mpi" worker mostly waits on its ranks (and on
the failure tests' deadlines), so the cores are shared by the ranks and two workers.

Once collected, a worker's heap (the modules, hypothesis, the tests) is frozen out of the
cyclic collector (``gc.freeze``): the suite opens thousands of runtimes, whose garbage
(their wiring's cycles, a trio loop each) came to 54 collections over the whole heap in
one worker, and the workers' collections took 11-29 s each.

The setting: bytecode is cached even where ``PYTHONDONTWRITEBYTECODE`` says not to (as
on the machines this project is built on), for this process and the ones it starts.
Else each Python process the suite starts (ranks, launchers, command lines) compiled
the package from source again, 0.15-0.2 s of CPU each, and each xdist worker rewrote
and compiled every test module (5 of its 8 s of collection): from a clean clone, the
suite took 507 CPU-s without it and 490 with it (263 and 257 s).
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(
        key=lambda item: (
            item.get_closest_marker("xdist_group") is None,
            item.get_closest_marker("long") is None,
        )
    )


def pytest_collection_finish() -> None:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return (os.cpu_count() or 1) + 1


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the kernels ``ops.cuda_rows`` launched (each still launched): the GPU
    tests of its row and column kernels."""
    from actorflow.ops import cuda_rows

    names: list[str] = []
    launch = cuda_rows._launch

    def counted(name, grid, block, args):
        names.append(name)
        launch(name, grid, block, args)

    monkeypatch.setattr(cuda_rows, "_launch", counted)
    return names


@pytest.fixture
def collectives_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every collective stream follows the collective order, as a stream of collectives
    over ranks does (one within a process launches what can act): how one process
    shows what a bad order does over ranks."""
    from actorflow.runtime import wiring

    monkeypatch.setattr(
        wiring, "_spanning_ranks", lambda plan: {a.stream for a in plan.actors if a.kind == "collective"}
    )
