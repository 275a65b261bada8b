"""Update kernels: they write the parameter (ins[0]) and their state in place.

They follow PyTorch's SGD (momentum as v = m v + g; p -= lr v) and Adam (bias-corrected,
no weight decay), so results can be checked against either.
"""

import functools
import importlib
from typing import Any

import numpy as np


def sgd_update(ins, outs, lr, momentum):
    p, g = ins[0], ins[1]
    if not isinstance(p, np.ndarray):
        if momentum:
            _fused("sgd_momentum")(g, lr, momentum, p, ins[2])
        else:
            _fused("sgd")(g, lr, p)
        return
    if momentum:
        v = ins[2]
        v *= momentum
        v += g
        g = v
    p -= lr * g


def adam_update(ins, outs, lr, beta1, beta2, eps):
    p, g, m, v, t = ins
    t += 1
    if not isinstance(p, np.ndarray):
        _fused("adam")(g, t, lr, beta1, beta2, eps, p, m, v)
        return
    step = float(t)
    m *= beta1
    m += (1 - beta1) * g
    v *= beta2
    v += (1 - beta2) * np.square(g)
    m_hat = m / (1 - beta1**step)
    v_hat = v / (1 - beta2**step)
    p -= lr * m_hat / (np.sqrt(v_hat) + eps)


_FUSED = {
    "sgd": ("T g, float64 lr", "T p", "p = p - (T)lr * g;"),
    "sgd_momentum": (
        "T g, float64 lr, float64 momentum",
        "T p, T v",
        "v = v * (T)momentum + g; p = p - (T)lr * v;",
    ),
    "adam": (
        "T g, raw float64 t, float64 lr, float64 beta1, float64 beta2, float64 eps",
        "T p, T m, T v",
        """
        const double step = t[0];
        m = m * (T)beta1 + (T)(1.0 - beta1) * g;
        v = v * (T)beta2 + (T)(1.0 - beta2) * (g * g);
        const T m_hat = m / (T)(1.0 - pow(beta1, step));
        const T v_hat = v / (T)(1.0 - pow(beta2, step));
        p = p - (T)lr * m_hat / (sqrt(v_hat) + (T)eps);
        """,
    ),
}
"""On a GPU, each update as one CUDA kernel (seed 004's fusion: the numpy version's
dozen element-wise passes and temporaries, one pass), with its arithmetic in the numpy
version's order and precision: (in params, out params, operation) of a CuPy
ElementwiseKernel."""


@functools.cache
def _fused(name: str) -> Any:
    in_params, out_params, operation = _FUSED[name]
    cupy = importlib.import_module("cupy")
    return cupy.ElementwiseKernel(in_params, out_params, operation, name=f"actorflow_{name}", no_return=True)


def snapshot(ins, outs):
    """A worker's pull on its server: the parameter copied out (what is sent, so the
    updates may go on writing the parameter) and its version, the steps of which every
    worker's update is in it (the least of the clock's per-worker counts)."""
    param, clock = ins
    outs[0][...] = param
    outs[1][...] = clock.min()


def _arrived(ins, worker, kept):
    """Count the staleness of ``worker``'s update and return the optimizer's inputs.

    ``ins[kept:]``: the clock (updates applied per worker), the staleness so far (sum,
    max) and every worker's pulled version, ``worker``'s the one its gradient came from.
    The update is that worker's step ``clock[worker]``: its staleness is how many steps
    of updates the parameter it read lacked."""
    clock, staleness, versions = ins[kept], ins[kept + 1], ins[kept + 2 :]
    lag = clock[worker] - versions[worker]
    staleness[0] += lag
    staleness[1] = max(staleness[1], lag)
    clock[worker] += 1
    return ins[:kept]


def async_sgd_update(ins, outs, lr, momentum, worker):
    sgd_update(_arrived(ins, worker, 3 if momentum else 2), outs, lr, momentum)


def async_adam_update(ins, outs, lr, beta1, beta2, eps, worker):
    adam_update(_arrived(ins, worker, 5), outs, lr, beta1, beta2, eps)
