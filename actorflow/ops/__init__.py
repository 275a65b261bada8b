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
from .gradient_ops import relu_grad, sum_to
from .movement import to_device
from .registry import OpDef, lookup

sum = reduce_sum
mean = reduce_mean
max = reduce_max
slice = slice_

__all__ = [
    "OpDef", "add", "all_gather", "all_reduce", "all_to_all", "bias_add", "broadcast",
    "call", "concat", "div", "exp", "full", "gelu", "log", "lookup", "matmul", "max", "mean",
    "mul", "reduce_scatter", "relu", "relu_grad", "reshape", "slice", "softmax", "split", "sub", "sum", "sum_to",
    "tanh", "to_device", "transpose",
]
