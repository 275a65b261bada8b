"""While a runtime is open, the cyclic collector makes no collection over the whole heap
(``collector.full_collections_paused``): one over PyTorch's, CuPy's and a plan's objects
held every stream's host thread for 170-330 ms on a GPU machine. Its young collections go
on, and the garbage of one run doesn't wait for the end of the program."""

import gc
import tracemalloc

import numpy as np
import pytest

import actorflow as af


class Marker:
    """An object tracked by the collector."""


def tracked(obj: object) -> bool:
    """Whether ``obj`` is in a generation the collector scans (not frozen)."""
    return id(obj) in {id(o) for o in gc.get_objects()}


def plan() -> af.Plan:
    with af.Graph() as g:
        x = af.placeholder("x", (2,))
        af.output("y", af.ops.to_device(af.ops.tanh(x), "cpu:1"))
    return af.compile(g)


def feeds() -> dict[str, np.ndarray]:
    return {"x": np.ones(2, dtype=np.float32)}


@pytest.fixture
def collections():
    """The generations of the collections that start, in order."""
    started: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.collect()
    gc.callbacks.append(note)
    yield started
    gc.callbacks.remove(note)


def make_long_lived_garbage() -> None:
    """Containers that outlive a few young collections, then die: enough of them that
    CPython would collect over the whole heap (they reach its oldest generation)."""
    for _ in range(20):
        held = [[] for _ in range(50_000)]
        del held


def test_no_full_collection_runs_while_a_session_is_open_and_young_ones_go_on(collections):
    before = gc.get_threshold()
    with af.Session(plan()) as second:
        with af.Session(plan()) as first:
            first.run(feeds())
            make_long_lived_garbage()
        second.run(feeds())
        make_long_lived_garbage()
        opened = list(collections)
    assert 0 in opened and 2 not in opened, "a session was open"
    assert gc.get_threshold() == before
    make_long_lived_garbage()
    assert 2 in collections


def test_the_garbage_of_runs_is_collected_as_the_program_goes_on():
    """A run leaves cycles (its wiring, its schedule's simulated acts). When opening a
    runtime froze the heap, they were never collected before the program's end: 680
    objects a run of this plan, 68k after 100 runs."""
    p = plan()
    for _ in range(5):
        af.run(p, feeds())
    gc.collect()
    for _ in range(100):
        af.run(p, feeds())
    assert gc.collect() < 20_000


def test_a_session_leaves_the_programs_frozen_objects_frozen():
    """(As the suite's: ``conftest`` freezes each worker's heap once it is collected.)"""
    marker = Marker()
    gc.freeze()
    with af.Session(plan()) as s:
        s.run(feeds())
    assert not tracked(marker)


def test_a_run_lets_go_of_its_buffers_and_outputs_without_a_collection():
    """A runtime is a graph of cycles, freed only by a collection; its buffers, the outputs
    it handed back and what trio's loop returned are not left with it: 8 MB of buffers
    here (2 MB each), and the output (2 MB) once the caller drops it."""
    with af.Graph() as g:
        x = af.placeholder("x", (512, 512), dtype="float64")
        af.output("y", af.ops.to_device(af.ops.tanh(af.ops.tanh(x)), "cpu:1"))
    p, big = af.compile(g), {"x": np.ones((512, 512))}
    af.run(p, big)
    with af.Session(p) as s:
        s.run(big)
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        for _ in range(3):
            out = af.run(p, big)
            del out
        with af.Session(p) as s:
            out = s.run(big)
            del out
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    assert peak > 8e6 and held < 1e6, (held, peak)
