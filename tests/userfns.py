"""Module-level user kernels for ``af.ops.call`` in tests: a Plan serializes them by import path."""

import threading
import time

import numpy as np
import trio

calls: list[tuple[str, str]] = []


def identity(a):
    return a


def double(a):
    return a * 2


def add_pair(a, b):
    return a + b


def thread_name(a):
    """Identity that records (this function, the thread it ran on)."""
    calls.append(("thread_name", threading.current_thread().name))
    return a


def sleepy(a):
    """Identity after a short random sleep, so kernel timings interleave."""
    time.sleep(float(np.random.default_rng().uniform(0.0, 0.004)))
    return a


def fail(a):
    raise ZeroDivisionError("user kernel failed on purpose")


# -- a kernel that stays in its stream until the test lets it go (instead of a long sleep) --

entered = threading.Event()
released = threading.Event()


def blocked(a):
    """Identity that says it has started, then waits until ``release()``."""
    entered.set()
    if not released.wait(timeout=30.0):
        raise TimeoutError("userfns.blocked: the test never released this kernel")
    return a


def arm_blocked() -> None:
    entered.clear()
    released.clear()


def release() -> None:
    released.set()


async def cancel_once_entered(scope: trio.CancelScope) -> None:
    """Cancel ``scope`` as soon as a ``blocked`` kernel is running."""
    if await trio.to_thread.run_sync(entered.wait, 10.0):
        scope.cancel()


blas_threads: list[int] = []


def record_blas_threads(a):
    """Identity that records how many threads BLAS would use on this stream thread."""
    from threadpoolctl import threadpool_info

    blas_threads.extend(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")
    return a


def fail_with_cause(a):
    try:
        raise KeyError("the cause")
    except KeyError as e:
        raise ValueError("the effect") from e


def slow(a):
    """Identity after 50 ms: a kernel much longer than the runtime's hand-offs."""
    time.sleep(0.05)
    return a


def sleep_20ms(a):
    time.sleep(0.02)
    return a


def fail_on_five(a):
    """Identity, except for an input whose first element is 5: that raises."""
    if a.flat[0] == 5:
        raise ValueError("user kernel failed on the input 5")
    return a
