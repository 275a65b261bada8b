"""Ops accept tensors that span several devices without knowing about them: an op built
with ``@dispatchable`` hands the whole call to the handler registered for the type of its
first argument that has one (``register``: the parallel layer's GlobalTensor, which
expands it into per-device ops, and its Pending tensor, which records it). The layer
above registers, so no class needs a method that imports the code handling it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
Handler = Callable[[Callable[..., Any], tuple, dict], Any]

_HANDLERS: dict[type, Handler] = {}


def register(cls: type, handler: Handler) -> None:
    """Calls of dispatchable ops given a ``cls`` go to ``handler(op, args, kwargs)``."""
    _HANDLERS[cls] = handler


def _handler(value: Any) -> Handler | None:
    if isinstance(value, (list, tuple)):
        for v in value:
            h = _handler(v)
            if h is not None:
                return h
        return None
    return _HANDLERS.get(type(value))


def dispatchable(op: F) -> F:
    @functools.wraps(op)
    def call(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            handler = _handler(value)
            if handler is not None:
                return handler(op, args, kwargs)
        return op(*args, **kwargs)

    return call  # type: ignore[return-value]
