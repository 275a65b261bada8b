"""Arrays on the host (numpy) or on a GPU (CuPy), handled through their own namespace, so
one kernel serves both: ``namespace(x)`` is numpy or cupy, whichever ``x`` belongs to.
CuPy is imported only where a device array exists, never to handle numpy ones."""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

import numpy as np


def namespace(x: Any) -> Any:
    """The array module of ``x``: numpy for host arrays and scalars, cupy for CuPy's."""
    if isinstance(x, np.ndarray | np.generic) or not hasattr(x, "__cuda_array_interface__"):
        return np
    return sys.modules["cupy"]


def on_device(x: Any) -> bool:
    return namespace(x) is not np


def to_host(x: Any) -> Any:
    """A numpy copy of ``x`` the caller may keep (a device array is copied off the GPU,
    after the work its stream has queued); anything else as it is."""
    if isinstance(x, np.ndarray):
        return x.copy()
    if on_device(x):
        return x.get()
    return x


def to_host_soon(x: Any) -> Any:
    """A host copy of ``x``; of a device array, queued on the current CUDA stream into
    pinned memory, which holds the value once that stream's work is done."""
    if not on_device(x):
        return to_host(x)
    out = importlib.import_module("cupyx").empty_pinned(x.shape, x.dtype)
    x.get(out=out, blocking=False)
    return out


def copy_into(dst: Any, src: Any) -> None:
    """``dst[...] = src`` where either may be on the host or a device: host to device and
    device to device on the current CUDA stream; device to host once the current stream's
    work is done (``get`` waits for it; what another stream wrote, the caller waits for)."""
    if isinstance(dst, np.ndarray):
        if on_device(src):
            src.get(out=dst)
        else:
            np.copyto(dst, src)
    elif isinstance(src, np.ndarray) or np.isscalar(src):
        dst.set(np.asarray(src, dtype=dst.dtype).reshape(dst.shape))
    else:
        namespace(dst).copyto(dst, src)


@functools.cache
def raw_kernel(source: str, name: str) -> Any:
    """Kernel ``name`` of the CUDA C++ ``source``, as a CuPy ``RawKernel`` (compiled on its
    first launch on each GPU, and cached by CuPy): one object per kernel for the process."""
    return importlib.import_module("cupy").RawKernel(source, name)
