"""The kernel of a fused all-reduce (see ``compiler.fusion``).

Like every collective kernel it gets the inputs of all participants, then their outputs,
in participant order. Each participant (one per device) reads the ``members`` tensors it
reduces and writes their ``members`` results, then its flat register:

    ins  = [x(dev0, m0), ..., x(dev0, m{k-1}), x(dev1, m0), ...]
    outs = [y(dev0, m0), ..., y(dev0, m{k-1}), flat(dev0), y(dev1, m0), ...]

Each device's inputs are packed into its flat register, the flat registers are reduced
in place across devices with the arithmetic of ``kernels.all_reduce`` (the first
device's copy, then each other device's added in device order, then divided by the
device count for a mean), so every element comes out bitwise as the unfused all-reduce
would have it, and each flat register is split back into its device's outputs.
``across``: as in ``kernels.all_reduce``, for participants on several ranks.
"""

import numpy as np

_REDUCERS = {"sum": np.add, "mean": np.add}


def fused_all_reduce(ins, outs, op, members, across=None):
    devices = len(ins) // members
    stride = members + 1
    flats = [outs[d * stride + members] for d in range(devices)]
    for d, flat in enumerate(flats):
        offset = 0
        for x in ins[d * members : (d + 1) * members]:
            np.copyto(flat[offset : offset + x.size].reshape(x.shape), x)
            offset += x.size
    acc = flats[0]
    reduce = _REDUCERS[op]
    for flat in flats[1:]:
        reduce(acc, flat, out=acc)
    if across is not None:
        across(acc, op)
    if op == "mean":
        acc /= devices if across is None else across.participants
    for d, flat in enumerate(flats):
        if d:
            np.copyto(flat, acc)
        offset = 0
        for y in outs[d * stride : d * stride + members]:
            np.copyto(y, flat[offset : offset + y.size].reshape(y.shape))
            offset += y.size
