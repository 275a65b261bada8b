"""Running a Plan from synchronous code: ``af.run`` for one call, ``Session`` to keep the
stream threads alive across calls."""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import trio

from ..plan import Plan
from ..trace.recorder import TRACE_LIMIT, Recorder
from ..world import LOST_AFTER
from .blas import single_threaded_blas
from .runtime import Feeds, Order, Runtime


def run(
    plan: Plan,
    feeds: Feeds | Sequence[Feeds] | None = None,
    *,
    trace: str | os.PathLike | None = None,
    trace_iterations: Collection[int] | None = None,
    trace_limit: int | None = TRACE_LIMIT,
    stall_timeout: float = 60.0,
    lost_after: float = LOST_AFTER,
    order: Order = "replay",
) -> Any:
    """Run ``plan`` once per feed dict (a list pipelines them); ``trace``: write a Chrome
    trace there (of ``trace_iterations`` only, if given; of the latest iterations whose
    spans fit in ``trace_limit``, with a warning when earlier ones were dropped)."""
    rt = Runtime(
        plan,
        trace=trace is not None,
        trace_iterations=trace_iterations,
        trace_limit=trace_limit,
        stall_timeout=stall_timeout,
        lost_after=lost_after,
        order=order,
    )
    checked = rt.check(feeds)

    ran: list[Any] = []  # not main's result: trio's loop, garbage with cycles, would keep it alive

    async def main() -> None:
        async with rt:
            ran.append(await rt.run(checked))
        if trace is not None:
            rt.recorder.write(trace)

    trio.run(main)
    outputs, dropped = ran.pop(), rt.recorder.note()
    if dropped and trace is not None:
        warnings.warn(f"trace {os.fspath(trace)!r}: {dropped}", RuntimeWarning, stacklevel=2)
    return outputs


class Session:
    """``with Session(plan) as s: s.run(feeds)``: one Runtime, its own trio loop on a host
    thread (the stall watchdog, failures, and the calls between runs), stream threads
    living across calls; a run goes from the caller's thread to the streams and back
    without the loop (``Runtime.run_from_thread``). After a failure the session is
    closed."""

    def __init__(
        self,
        plan: Plan,
        *,
        trace: bool = False,
        trace_iterations: Collection[int] | None = None,
        trace_limit: int | None = TRACE_LIMIT,
        stall_timeout: float = 60.0,
        lost_after: float = LOST_AFTER,
        losable: frozenset[int] = frozenset(),
        order: Order = "replay",
    ) -> None:
        self._runtime = Runtime(
            plan,
            trace=trace,
            trace_iterations=trace_iterations,
            trace_limit=trace_limit,
            stall_timeout=stall_timeout,
            lost_after=lost_after,
            losable=losable,
            order=order,
        )
        self._blas = contextlib.ExitStack()
        self._blas.enter_context(single_threaded_blas())
        self._token: trio.lowlevel.TrioToken | None = None
        self._started = threading.Event()
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._host, name="actorflow-session", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._blas.close()
            raise self._error

    def _host(self) -> None:
        async def main() -> None:
            async with self._runtime:
                self._stop = trio.Event()
                self._token = trio.lowlevel.current_trio_token()
                self._started.set()
                await self._stop.wait()

        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = exc
        finally:
            self._started.set()

    def run(self, feeds: Feeds | Sequence[Feeds] | None = None) -> Any:
        self._live_token()  # the loop that watches the run and hears of its failures
        checked = self._runtime.check(feeds)
        try:
            return self._runtime.run_from_thread(checked)
        except BaseException as exc:
            self._abandon(exc)
            self.close()
            if self._error is not None and exc.__cause__ is None:  # the loop itself died
                raise exc from self._error
            raise

    def parameters(self) -> dict[str, np.ndarray]:
        return self._call(self._runtime.parameters)

    def values(self) -> dict[str, np.ndarray]:
        """This rank's parameters and optimizer state (see ``Runtime.values``)."""
        return self._call(self._runtime.values)

    def load(self, values: dict[str, np.ndarray]) -> None:
        """Set this rank's parameters and optimizer state between runs (see ``Runtime.load``)."""
        self._call(lambda: self._runtime.load(values))

    def check(self) -> None:
        """Raise the error that stopped this session's runtime (a lost rank, ...), if one did."""
        self._call(self._runtime.raise_if_failed)

    def register_stats(self) -> dict[str, dict[str, int]]:
        return self._call(self._runtime.register_stats)

    def threads(self) -> dict[str, str]:
        """Per actor, the stream thread that runs it (see ``Runtime.threads``)."""
        return self._runtime.threads()

    @property
    def ordered_by(self) -> str:
        """How the runs order their acts: "replay", or "dynamic: " and why (see ``Runtime``)."""
        return self._runtime.ordered_by

    @property
    def rank(self) -> int:
        """This process's rank in the plan's run (0 in one process)."""
        return self._runtime.rank

    @property
    def recorder(self) -> Recorder:
        return self._runtime.recorder

    def _live_token(self) -> trio.lowlevel.TrioToken:
        if self._token is None:
            raise RuntimeError("this session is closed")
        if not self._thread.is_alive():
            raise self._died() from self._error
        return self._token

    def _died(self) -> RuntimeError:
        self._token = None
        return RuntimeError("this session's event loop stopped (see the cause)")

    def _call(self, fn: Callable[[], Any]) -> Any:
        token = self._live_token()
        try:
            return trio.from_thread.run_sync(fn, trio_token=token)
        except trio.RunFinishedError:
            raise self._died() from self._error

    def close(self) -> None:
        if self._token is not None:
            token, self._token = self._token, None
            try:
                assert self._stop is not None, "a session with a token has started"
                trio.from_thread.run_sync(self._stop.set, trio_token=token)
            except trio.RunFinishedError:
                pass
        self._thread.join()
        self._blas.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self._abandon(exc)
        self.close()

    def _abandon(self, exc: BaseException) -> None:
        """Fail the runtime, if it has not failed, because the program left it with ``exc``
        (a Ctrl-C in a run or between runs): over ranks this tells the other ranks, which
        would otherwise wait for this one's part of their run until they stall."""
        token = self._token
        if token is None or self._runtime.failed:
            return
        left = RuntimeError(f"the program left its Session with {type(exc).__name__}")
        with contextlib.suppress(trio.RunFinishedError):
            trio.from_thread.run_sync(self._runtime.fail, left, trio_token=token)
