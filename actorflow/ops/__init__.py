"""The ops users build graphs with, and the registry the compiler reads."""

from .collective import all_gather, all_reduce, all_to_all, broadcast, reduce_scatter
from .compute import (
    add,
    bias_add,
    call,
    concat,
    div,
    exp,
    full,
    gelu,
    log,
    matmul,
    mul,
    reduce_max,
    reduce_mean,
    reduce_sum,
    relu,
    reshape,
    slice_,
    softmax,
    split,
    sub,
    tanh,
    transpose,
)
from .gradient_ops import (
    broadcast_to,
    equal_mask,
    gelu_grad,
    max_grad,
    pad,
    relu_grad,
    scale,
    softmax_grad,
    sum_to,
    tanh_grad,
)
from .losses import mse_loss, mse_loss_grad, softmax_cross_entropy, softmax_cross_entropy_grad
from .movement import to_device
from .registry import OpDef, lookup

sum = reduce_sum
mean = reduce_mean
max = reduce_max
slice = slice_

__all__ = [
    "OpDef",
    "add",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "bias_add",
    "broadcast",
    "broadcast_to",
    "call",
    "concat",
    "div",
    "equal_mask",
    "exp",
    "full",
    "gelu",
    "gelu_grad",
    "log",
    "lookup",
    "matmul",
    "max",
    "max_grad",
    "mean",
    "mse_loss",
    "mse_loss_grad",
    "mul",
    "pad",
    "reduce_scatter",
    "relu",
    "relu_grad",
    "reshape",
    "scale",
    "slice",
    "softmax",
    "softmax_cross_entropy",
    "softmax_cross_entropy_grad",
    "softmax_grad",
    "split",
    "sub",
    "sum",
    "sum_to",
    "tanh",
    "tanh_grad",
    "to_device",
    "transpose",
]
