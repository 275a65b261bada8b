"""One BLAS thread per stream, so devices don't oversubscribe the cores.

threadpoolctl's limit is process-wide, so every open Runtime shares one, counted: BLAS
runs single-threaded while any Runtime is open (the caller's own numpy work included),
and the original limits come back when the last one closes.

Enter it from the caller's thread: with the OpenBLAS that numpy ships (0.3.31), a limit
set from another thread was seen to have no effect once a limit had been restored.

The BLAS libraries are looked up once per process (the scan of every loaded library took
most of a millisecond, at each Runtime's start); one loaded later is not limited.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from threadpoolctl import ThreadpoolController

_lock = threading.Lock()
_users = 0
_controller: ThreadpoolController | None = None
_limiter: Any = None


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    global _users, _limiter, _controller
    with _lock:
        if _users == 0:
            _controller = _controller or ThreadpoolController()
            _limiter = _controller.limit(limits=1, user_api="blas")
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _limiter is not None:
                _limiter.restore_original_limits()
                _limiter = None
