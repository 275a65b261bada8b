"""Tensors on several devices as the user sees them (``plan.LogicalTensor``): a logical
feed is split into its parts, logical outputs and parameters are put back together."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import FeedError
from ..plan import LogicalTensor, Plan


def split_feeds(plan: Plan, feeds: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Replace each logical feed by its parts; other feeds pass through."""
    out = dict(feeds)
    for lt in plan.logical:
        if lt.kind != "feed" or lt.name not in out:
            continue
        value = np.asarray(out.pop(lt.name))
        if lt.sbp == "B":
            out.update({part: value for part in lt.parts})
            continue
        n = len(lt.parts)
        if value.ndim <= lt.axis or value.shape[lt.axis] % n:
            raise FeedError(
                f"{where}feed {lt.name!r} of shape {value.shape} does not split into {n} parts along axis {lt.axis}"
            )
        out.update(zip(lt.parts, np.split(value, n, axis=lt.axis)))
    return out


def feed_names(plan: Plan) -> set[str]:
    """The names a caller feeds: logical feeds instead of their parts."""
    names = {f.name for f in plan.feeds}
    for lt in plan.logical:
        if lt.kind == "feed":
            names -= set(lt.parts)
            names.add(lt.name)
    return names


def assemble(
    logical: tuple[LogicalTensor, ...], kind: str, values: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Replace the parts of each logical tensor of ``kind`` by the tensor itself: an array,
    0-d for a scalar, as a tensor of one device is."""
    out = dict(values)
    for lt in logical:
        if lt.kind != kind or not all(p in out for p in lt.parts):
            continue
        parts = [out.pop(p) for p in lt.parts]
        if lt.sbp == "S":
            out[lt.name] = np.concatenate(parts, axis=lt.axis)
        elif lt.sbp == "P":
            out[lt.name] = np.asarray(np.sum(parts, axis=0))
        else:
            out[lt.name] = parts[0]
    return out
