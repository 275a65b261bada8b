"""``evolve(record, **changes)``: a copy of a frozen attrs record with some fields changed.

It does what ``attrs.evolve`` does, at about 60% of the cost. The compiler's passes copy
every actor and register several times (a stream, a priority, new ids, consumers), and
``attrs.evolve`` looks the class's fields up and builds a dict of them on every call: a
fifth of compile time at 100k actors. Here each class gets, on first use, a generated
function that passes every field straight to ``__init__``, as attrs generates
``__init__`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import attrs

R = TypeVar("R")

_UNCHANGED = object()


def evolve(record: R, **changes: Any) -> R:
    """A copy of ``record`` with ``changes`` (init argument names, as for ``attrs.evolve``)."""
    copy = _COPIERS.get(type(record))
    if copy is None:
        copy = _COPIERS[type(record)] = _copier(type(record))
    return copy(record, **changes)


_COPIERS: dict[type, Callable[..., Any]] = {}


def _copier(cls: type) -> Callable[..., Any]:
    fields = [f for f in attrs.fields(cls) if f.init]
    params = "".join(f", {f.alias}=_UNCHANGED" for f in fields)
    args = ", ".join(f"{f.alias}=record.{f.name} if {f.alias} is _UNCHANGED else {f.alias}" for f in fields)
    namespace: dict[str, Any] = {"_UNCHANGED": _UNCHANGED, "cls": cls}
    exec(f"def copy(record, *{params}):\n    return cls({args})\n", namespace)
    copy: Callable[..., Any] = namespace["copy"]
    return copy
