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
    step = float(t)
    m *= beta1
    m += (1 - beta1) * g
    v *= beta2
    v += (1 - beta2) * np.square(g)
    m_hat = m / (1 - beta1**step)
    v_hat = v / (1 - beta2**step)
    p -= lr * m_hat / (np.sqrt(v_hat) + eps)
