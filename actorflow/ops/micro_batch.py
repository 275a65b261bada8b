"""The kernel of the ``accumulate`` actor the compiler puts where once-per-micro-batch
values meet once-per-step actors (see ``compiler.micro_batches``)."""

from __future__ import annotations

import numpy as np


def accumulate(ins, outs, micro_batches):
    """Sum a tensor over a step's micro-batches into one buffer, then divide by their
    number: the mean of per-micro-batch gradients is the gradient of the whole batch's
    mean loss. ``ins``: the tensor, then which micro-batch of the step this act is (the
    runtime adds it)."""
    source, phase = ins
    if phase == 0:
        np.copyto(outs[0], source)
    else:
        np.add(outs[0], source, out=outs[0])
    if phase == micro_batches - 1:
        np.divide(outs[0], micro_batches, out=outs[0])
