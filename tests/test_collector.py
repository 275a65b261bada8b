"""While a runtime is open, the heap it found is frozen out of the cyclic collector
(``collector.heap_frozen``): a full collection over PyTorch's, CuPy's and a plan's objects
held every stream's host thread for 170-330 ms on a GPU machine."""

import gc

import numpy as np

import actorflow as af


class Marker:
    """An object tracked by the collector, made before a session opens."""


def tracked(obj: object) -> bool:
    """Whether ``obj`` is in a generation the collector scans (not frozen)."""
    return id(obj) in {id(o) for o in gc.get_objects()}


def session() -> af.Session:
    with af.Graph() as g:
        x = af.placeholder("x", (2,))
        af.output("y", af.ops.to_device(af.ops.tanh(x), "cpu:1"))
    return af.Session(af.compile(g))


def feeds() -> dict[str, np.ndarray]:
    return {"x": np.ones(2, dtype=np.float32)}


def test_an_open_session_freezes_the_heap_it_found_and_the_last_to_close_thaws_it():
    marker = Marker()
    first = session()
    assert not tracked(marker)
    second = session()
    first.run(feeds())
    first.close()
    assert not tracked(marker), "one session is still open"
    second.run(feeds())
    second.close()
    assert tracked(marker) and gc.get_freeze_count() == 0


def test_objects_the_program_froze_are_collectable_once_the_last_session_closes():
    gc.freeze()
    assert not tracked(Marker)
    with session() as s:
        s.run(feeds())
    assert tracked(Marker) and gc.get_freeze_count() == 0
