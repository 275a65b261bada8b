"""compile's options as one record, every option checked once, when the record is made,
before any pass runs: a bad value is a CompileError that starts with the option's name.
What only the plan can tell (a ``quotas`` name the plan does not hold, more ranks than
devices, a device no stage lists) is checked by the pass that meets it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..devices import parse_device
from ..errors import CompileError
from ..graph.ir import Tensor
from ..plan import DEFAULT_RESOURCES, Resources
from ..plan_check import is_int
from .ranks import Ranks
from .reuse import reuse_limit
from .schedules import SCHEDULES

Check = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _integer(least: int) -> Check:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not is_int(value) or value < least:
            raise CompileError(f"{attribute.name}: an int >= {least}, got {value!r}")

    return check


def _flag(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise CompileError(f"{attribute.name}: True or False, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _link_bandwidth(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (_is_number(value) and value > 0):
        raise CompileError(f"link_bandwidth: bytes/s > 0, or None (no emulated link), got {value!r}")


def _link_latency(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not (_is_number(value) and value >= 0):
        raise CompileError(f"link_latency: seconds >= 0, got {value!r}")


def _quota_names(quotas: Mapping[str | Tensor, int] | None) -> dict[str, int]:
    """Per-tensor quotas keyed by name, each an int >= 1."""
    if quotas is None:
        return {}
    if not isinstance(quotas, Mapping):
        raise CompileError(f"quotas: a mapping of tensor (or name) to quota, got {quotas!r}")
    named = {(k.name if isinstance(k, Tensor) else k): v for k, v in quotas.items()}
    for name, q in named.items():
        if not is_int(q) or q < 1:
            raise CompileError(f"quotas: {name}: a quota is an int >= 1, got {q!r}")
    return named


def _stage_devices(stages: Sequence[str | Sequence[str]] | None) -> tuple[tuple[str, ...], ...] | None:
    """The pipeline's stages as devices per stage, each device in one stage."""
    if stages is None:
        return None
    if not stages or isinstance(stages, str):
        raise CompileError(_needs_stages(stages))
    try:
        devices = tuple(tuple(parse_device(d) for d in ([s] if isinstance(s, str) else s)) for s in stages)
    except (TypeError, ValueError) as e:
        raise CompileError(f"stages: {e}") from None
    seen = [d for stage in devices for d in stage]
    twice = sorted({d for d in seen if seen.count(d) > 1})
    if twice:
        raise CompileError(f"stages: {twice} appear in more than one place; a device belongs to one stage")
    return devices


def _needs_stages(stages: Any) -> str:
    return f"stages: a schedule needs stages: a list with a device, or a list of devices, per stage; got {stages!r}"


def _schedule(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value not in SCHEDULES:
        raise CompileError(f"schedule: one of {', '.join(SCHEDULES)}, got {value!r}")


def _ranks(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, list, tuple)):
        raise CompileError(f"ranks: a number of ranks or a list of devices per rank, got {value!r}")
    if isinstance(value, int) and value < 1:
        raise CompileError(f"ranks: at least 1, got {value}")
    if isinstance(value, (list, tuple)) and not value:
        raise CompileError("ranks: the list of devices per rank is empty")


@attrs.frozen(kw_only=True)
class CompileOptions:
    """Everything ``compile`` can be told (its docstring says what each option does).

    ``quotas`` holds tensor names, ``stages`` devices per stage (None: no stages), and
    ``reuse`` the collectives communication subgraph reuse may take (0: off), from
    ``comm_reuse`` or ``ACTORFLOW_COMM_REUSE``, which wins when set."""

    quota: int = attrs.field(default=2, validator=_integer(1))
    quotas: dict[str, int] = attrs.field(factory=dict, converter=_quota_names)
    priority: bool = attrs.field(default=True, validator=_flag)
    link_bandwidth: float | None = attrs.field(default=None, validator=_link_bandwidth)
    link_latency: float = attrs.field(default=0.0, validator=_link_latency)
    fusion: bool = attrs.field(default=True, validator=_flag)
    fuse_kernels: bool = attrs.field(default=True, validator=_flag)
    cuda_chains: bool = attrs.field(default=True, validator=_flag)
    bucket_first: int = attrs.field(default=1 << 20, validator=_integer(0))
    bucket_cap: int = attrs.field(default=25 << 20, validator=_integer(0))
    overlap: bool = attrs.field(default=True, validator=_flag)
    micro_batches: int = attrs.field(default=1, validator=_integer(1))
    stages: tuple[tuple[str, ...], ...] | None = attrs.field(default=None, converter=_stage_devices)
    schedule: str | None = attrs.field(default=None, validator=_schedule)
    ranks: Ranks = attrs.field(default=None, validator=_ranks)
    max_streams: int = attrs.field(default=DEFAULT_RESOURCES.max_streams, validator=_integer(1))
    max_ops_per_stream: int = attrs.field(default=DEFAULT_RESOURCES.max_ops_per_stream, validator=_integer(1))
    max_labels: int = attrs.field(default=DEFAULT_RESOURCES.max_labels, validator=_integer(1))
    max_memory: int | None = attrs.field(default=None, validator=attrs.validators.optional(_integer(1)))
    comm_reuse: int | None = None
    reuse: int = attrs.field(init=False)

    @reuse.default
    def _reuse(self) -> int:
        return reuse_limit(self.comm_reuse)

    def __attrs_post_init__(self) -> None:
        if self.schedule is not None and self.stages is None:
            raise CompileError(_needs_stages(None))

    @property
    def resources(self) -> Resources:
        """The device resource model the plan is compiled within (see ``resources``)."""
        return Resources(self.max_streams, self.max_ops_per_stream, self.max_labels, self.max_memory or 0)


def compile_options(**options: Any) -> CompileOptions:
    """The options record, or a CompileError naming an option ``compile`` does not have."""
    unknown = sorted(set(options) - {f.alias for f in attrs.fields(CompileOptions) if f.init})
    if unknown:
        raise CompileError(f"compile has no option {', '.join(unknown)}")
    return CompileOptions(**options)
