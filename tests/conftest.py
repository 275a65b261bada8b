"""The suite's one hook: the tests that start MPI ranks (xdist group "mpi", one worker,
one at a time) are collected first, so that their worker is busy with them from the
start while the others share the rest, instead of running them alone at the end."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("xdist_group") is None)
