"""Update kernels: they write the parameter (ins[0]) and their state in place.

They follow PyTorch's SGD (momentum as v = m v + g; p -= lr v) and Adam (bias-corrected,
no weight decay), so results can be checked against either.
"""

import functools
import importlib
from typing import Any

import numpy as np

from ..arrays import namespace


def sgd_update(ins, outs, lr, momentum):
    p, g = ins[0], ins[1]
    if _fused_update(p):
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
    if _fused_update(p):
        corrections = namespace(p).empty(2, np.float32)
        _fused("adam_step")(beta1, beta2, t, corrections)
        _fused("adam")(g, corrections, lr, beta1, beta2, eps, p, m, v)
        return
    t += 1
    step = float(t)
    m *= beta1
    m += (1 - beta1) * g
    v *= beta2
    v += (1 - beta2) * np.square(g)
    m_hat = m / (1 - beta1**step)
    v_hat = v / (1 - beta2**step)
    p -= lr * m_hat / (np.sqrt(v_hat) + eps)


def _fused_update(p) -> bool:
    """A float32 parameter on a GPU: updated by one fused kernel (``_FUSED``); any other
    runs the numpy code, which CuPy's arrays take too."""
    return not isinstance(p, np.ndarray) and p.dtype == np.float32


_FUSED = {
    "sgd": ("float32 g, float64 lr", "float32 p", "p = __fsub_rn(p, __fmul_rn((float)lr, g));"),
    "sgd_momentum": (
        "float32 g, float64 lr, float64 momentum",
        "float32 p, float32 v",
        "v = __fadd_rn(__fmul_rn(v, (float)momentum), g); p = __fsub_rn(p, __fmul_rn((float)lr, v));",
    ),
    "adam_step": (
        "float64 beta1, float64 beta2",
        "float64 t, raw float32 corrections",
        """
        t = t + 1.0;
        corrections[0] = (float)(1.0 - pow(beta1, t));
        corrections[1] = (float)(1.0 - pow(beta2, t));
        """,
    ),
    "adam": (
        "float32 g, raw float32 corrections, float64 lr, float64 beta1, float64 beta2, float64 eps",
        "float32 p, float32 m, float32 v",
        """
        m = __fadd_rn(__fmul_rn(m, (float)beta1), __fmul_rn((float)(1.0 - beta1), g));
        v = __fadd_rn(__fmul_rn(v, (float)beta2), __fmul_rn((float)(1.0 - beta2), __fmul_rn(g, g)));
        const float m_hat = __fdiv_rn(m, corrections[0]);
        const float v_hat = __fdiv_rn(v, corrections[1]);
        p = __fsub_rn(p, __fdiv_rn(__fmul_rn((float)lr, m_hat), __fadd_rn(__fsqrt_rn(v_hat), (float)eps)));
        """,
    ),
}
"""On a GPU, each float32 update as one CUDA kernel (seed 004's fusion: the numpy
version's dozen element-wise passes and temporaries, one pass): (in params, out params,
operation) of a CuPy ElementwiseKernel. Each step is the numpy version's, rounded as it
rounds (the intrinsics keep the compiler from fusing a multiply and an add into one
rounding), so a GPU's update is the host's bit for bit, but for ``pow``. Adam's step
count and bias corrections are one thread's work (``adam_step``, on the step count's
0-d array, so the host never reads it), not two float64 ``pow``s in every element's."""


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
