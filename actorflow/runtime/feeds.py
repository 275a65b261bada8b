"""A run's feeds, checked against the Plan before anything runs: names, shapes, dtypes,
whole steps. Synchronous and safe from any thread, so the sync API raises a FeedError
before entering trio, with a traceback that is the caller's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import FeedError
from ..plan import Plan
from .logical import feed_names, split_feeds

Feeds = Mapping[str, Any]


class CheckedFeeds(NamedTuple):
    """A run's feeds as ``FeedCheck.check`` leaves them: one array per local placeholder.
    ``single``: one dict was given (not a list), so one dict of outputs goes back."""

    single: bool
    feeds: list[dict[str, np.ndarray]]


class FeedCheck:
    """The checks of one rank's feeds of ``plan``."""

    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan = plan
        self._names = feed_names(plan)
        self._parts = {part: lt.name for lt in plan.logical if lt.kind == "feed" for part in lt.parts}
        self._local = [f.name for f in plan.feeds if plan.rank_of(plan.actors[f.actor].device) == rank]
        self._specs = {f.name: f for f in plan.feeds}
        self._dtypes = {f.name: np.dtype(f.dtype) for f in plan.feeds}
        self._exact = set(self._local)
        self._expected = [(name, self._specs[name].shape, self._dtypes[name]) for name in self._local]

    def check(self, feeds: Feeds | Sequence[Feeds] | CheckedFeeds | None) -> CheckedFeeds:
        if isinstance(feeds, CheckedFeeds):
            return feeds
        batch: list[Any]
        single = feeds is None or isinstance(feeds, Mapping)
        if single:
            batch = [feeds or {}]
        elif isinstance(feeds, Sequence) and not isinstance(feeds, (str, bytes)):
            batch = list(feeds)
        else:
            raise FeedError(
                f"feeds are a dict of name -> array, or a list of such dicts, not {type(feeds).__name__}"
            )
        arrays = [self._one(f, k if not single else None) for k, f in enumerate(batch)]
        m = self.plan.micro_batches
        if self.plan.actors and len(arrays) % m:
            raise FeedError(
                f"this plan takes whole steps of {m} micro-batches (one feed dict each); "
                f"got {len(arrays)} feed dicts"
            )
        return CheckedFeeds(single, arrays)

    def _one(self, feeds: Any, iteration: int | None) -> dict[str, np.ndarray]:
        """This rank's feeds, checked: each placeholder of its devices must be given, by its
        own name or, for a part of a logical feed, by the logical name (split here). Feeds
        of other ranks' devices are accepted and left alone."""
        if feeds.__class__ is dict and feeds.keys() == self._exact:
            arrays = self._as_expected(feeds)
            if arrays is not None:
                return arrays
        where = "" if iteration is None else f"iteration {iteration}: "
        if not isinstance(feeds, Mapping):
            raise FeedError(f"{where}feeds are a dict of name -> array, not {type(feeds).__name__}")
        parts = self._parts
        whole = {parts.get(name, name) for name in self._local if name not in feeds}
        missing = sorted(whole - set(feeds))
        extra = sorted(set(feeds) - self._names - parts.keys())
        if missing or extra:
            raise FeedError(
                f"{where}feeds do not match the placeholders: missing {missing}, unknown {extra} "
                f"(expected {sorted(self._names)})"
            )
        split = split_feeds(self.plan, {k: v for k, v in feeds.items() if k in whole}, where)
        arrays = {}
        for name in self._local:
            spec = self._specs[name]
            array = np.asarray(feeds[name] if name in feeds else split[name])
            # dtype.name is slow to make (45% of the check): asked only where they differ
            if array.shape != spec.shape or (
                array.dtype != self._dtypes[name] and array.dtype.name != spec.dtype
            ):
                raise FeedError(
                    f"{where}feed {name!r} is {array.dtype.name}{list(array.shape)}, "
                    f"the placeholder wants {spec.dtype}{list(spec.shape)}"
                )
            arrays[name] = array
        return arrays

    def _as_expected(self, feeds: dict[str, Any]) -> dict[str, np.ndarray] | None:
        """The common case's check: exactly this rank's placeholders, each an array of its
        shape and dtype; None for anything else, which ``_one`` checks in full (and says
        what is wrong). Every iteration's feeds are checked before a run starts: for
        ``benchmarks/overhead.py``'s chains, 0.9 µs an iteration against 7 µs in full."""
        arrays = {}
        for name, shape, dtype in self._expected:
            array = feeds[name]
            if array.__class__ is not np.ndarray or array.shape != shape or array.dtype != dtype:
                return None
            arrays[name] = array
        return arrays
