"""What the compiler needs to know of each op: which kind of actor it becomes and its kernel."""

from collections.abc import Callable

import attrs


@attrs.frozen
class OpDef:
    """``kind``: compute, copy, collective, feed, fetch or parameter (a parameter has no kernel)."""

    name: str
    kind: str
    kernel: Callable | None


_REGISTRY: dict[str, OpDef] = {}


def register(name: str, kind: str, kernel: Callable | None) -> None:
    if name in _REGISTRY:
        raise ValueError(f"op {name!r} is registered twice")
    if "+" in name:  # a fused chain's op is its members' joined by + (plan.Actor.ops)
        raise ValueError(f"op {name!r}: an op's name has no '+'")
    _REGISTRY[name] = OpDef(name, kind, kernel)


def lookup(name: str) -> OpDef:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no op named {name!r} is registered") from None
