"""What the GPU tests (``test_cuda``) share: why CUDA can't be used here, the property
tests' random graphs moved onto ``cuda:`` devices, and the user kernels they run.

CuPy is imported inside the kernels only: this module imports on a machine without it,
where the tests that need a GPU skip with ``UNAVAILABLE`` as their reason.
"""

from __future__ import annotations

import dataclasses

import graph_strategies as gs

try:
    import actorflow.runtime.cuda as cuda
except ModuleNotFoundError as missing:  # an actorflow without CUDA devices (not a failing import in it)
    if missing.name != "actorflow.runtime.cuda":
        raise
    cuda = None

UNAVAILABLE: str | None = "actorflow.runtime.cuda missing" if cuda is None else cuda.unavailable()
"""None where CuPy and a GPU are usable; else why not (the GPU tests' skip reason)."""


# --------------------------------------------------------------------------------------
# the property tests' graphs on cuda: devices
# --------------------------------------------------------------------------------------


def cuda_device(device: str) -> str:
    """``cpu:N`` -> ``cuda:N``; any other device as it is."""
    return "cuda:" + device.removeprefix("cpu:") if device.startswith("cpu:") else device


def _moved(x):
    """A recipe node's field with every ``cpu:N`` in it (a placement, a broadcast's
    targets) made ``cuda:N``; names, functions and shapes never look like a device."""
    if isinstance(x, str):
        return cuda_device(x)
    if isinstance(x, tuple):
        return tuple(_moved(y) for y in x)
    return x


def on_cuda(recipe: gs.Recipe) -> gs.Recipe:
    """The same random graph with each ``cpu:N`` placement on ``cuda:N``."""
    return dataclasses.replace(
        recipe,
        devices=tuple(cuda_device(d) for d in recipe.devices),
        nodes=[tuple(_moved(x) for x in node) for node in recipe.nodes],
        values=[dataclasses.replace(v, device=cuda_device(v.device)) for v in recipe.values],
        outputs=list(recipe.outputs),
    )


def without_probes(recipe: gs.Recipe) -> gs.Recipe:
    """The recipe with each probe call (which reads a numpy array's ``__array_interface__``,
    which a CuPy array lacks) an identity call, as ``evaluate`` already computes it."""
    nodes = [
        ("call", node[1], "identity", *node[3:])
        if node[0] == "call" and node[2].startswith("probe")
        else node
        for node in recipe.nodes
    ]
    return dataclasses.replace(recipe, nodes=nodes, values=list(recipe.values), outputs=list(recipe.outputs))


def training_on_cuda(recipe: gs.TrainRecipe) -> gs.TrainRecipe:
    return dataclasses.replace(recipe, stages=tuple(cuda_device(d) for d in recipe.stages))


# --------------------------------------------------------------------------------------
# user kernels (module level: a Plan names them by import path)
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Seen:
    """What a recording kernel saw of one call: CuPy's current stream (its handle) and
    device, its input's array module, its input's device and data pointer (None on CPU)."""

    stream: int | None
    device: int | None
    module: str
    array_device: int | None
    data: int


N_RECORDERS = 6
SEEN: list[list[Seen]] = [[] for _ in range(N_RECORDERS)]


def reset_seen() -> None:
    for calls in SEEN:
        calls.clear()


def _seen(a) -> Seen:
    module = type(a).__module__.split(".")[0]
    if module != "cupy":
        return Seen(None, None, module, None, a.__array_interface__["data"][0])
    import cupy

    return Seen(cupy.cuda.get_current_stream().ptr, cupy.cuda.Device().id, module, a.device.id, a.data.ptr)


RECORDERS = gs.recording_functions(globals(), "record", _seen, SEEN)


def _burn() -> None:
    """Keep the GPU busy for some milliseconds on the current stream (matmuls of a matrix
    that stays what it is: n x n of 1/n), while the host goes on at once."""
    import cupy

    n = 2048
    b = cupy.full((n, n), 1.0 / n, dtype=cupy.float32)
    for _ in range(24):
        b = b @ b


def slow_add_one(a):
    """a + 1, written after the GPU spent milliseconds on other work on this stream: a
    reader not waiting for this kernel's event would see the buffer's previous value."""
    _burn()
    return a + 1


def slow_double(a):
    """2 a, read only after the GPU spent milliseconds on other work on this stream: a
    writer of ``a``'s buffer not waiting for this kernel would change it under the read."""
    _burn()
    return a * 2


def add_one(a):
    return a + 1
