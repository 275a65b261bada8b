"""Ops accept tensors that span several devices without knowing about them: an op built
with ``@dispatchable`` hands the whole call to the first argument whose type defines
``__actorflow_dispatch__(op, args, kwargs)`` (the parallel layer's GlobalTensor), which
expands it into per-device ops."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def _handler(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        for v in value:
            h = _handler(v)
            if h is not None:
                return h
        return None
    return getattr(type(value), "__actorflow_dispatch__", None)


def dispatchable(op: F) -> F:
    @functools.wraps(op)
    def call(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            handler = _handler(value)
            if handler is not None:
                return handler(op, args, kwargs)
        return op(*args, **kwargs)

    return call  # type: ignore[return-value]
