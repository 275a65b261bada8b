"""Update kernels: they write the parameter (ins[0]) and their state in place.

They follow PyTorch's SGD (momentum as v = m v + g; p -= lr v) and Adam (bias-corrected,
no weight decay), so results can be checked against either.
"""

import numpy as np


def sgd_update(ins, outs, lr, momentum):
    p, g = ins[0], ins[1]
    if momentum:
        v = ins[2]
        v *= momentum
        v += g
        g = v
    p -= lr * g


def adam_update(ins, outs, lr, beta1, beta2, eps):
    p, g, m, v, t = ins
    t += 1
    # on a GPU the step stays there (float() would make the host wait), its bias
    # corrections rounded to the parameter's dtype as a Python float's would be
    step = float(t) if isinstance(t, np.ndarray) else t.astype(np.float64)
    m *= beta1
    m += (1 - beta1) * g
    v *= beta2
    v += (1 - beta2) * np.square(g)
    m_hat = m / _dtype_of(m, 1 - beta1**step)
    v_hat = v / _dtype_of(v, 1 - beta2**step)
    p -= lr * m_hat / (np.sqrt(v_hat) + eps)


def _dtype_of(x, correction):
    """A bias correction as ``x``'s arithmetic takes it: a Python float as it is, a
    device scalar rounded to ``x``'s dtype (what numpy does with the Python float)."""
    return correction if isinstance(correction, float) else correction.astype(x.dtype)


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
