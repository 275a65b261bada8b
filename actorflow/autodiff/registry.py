"""Gradient rules, one per differentiable op.

A rule gets the forward node, tensor handles on its inputs and outputs, and the gradients
flowing into its outputs (None where an output gets none), and returns one gradient per
input (None where the input gets none). It builds the backward ops with the ordinary op
builders, so the backward pass is ops like any other: compiled, placed, and run the same.
A gradient lives on the same device, with the same shape and dtype, as its tensor;
``gradients`` checks that, gives integer inputs no gradient, and skips ops with no
floating-point input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..graph.ir import Node, Tensor

Grads = Sequence[Tensor | None]
Rule = Callable[[Node, list[Tensor], list[Tensor], Grads], list[Tensor | None]]

_RULES: dict[str, Rule] = {}


def rule(*ops: str) -> Callable[[Rule], Rule]:
    """Register the decorated function as the gradient rule of ``ops``."""

    def register(fn: Rule) -> Rule:
        for op in ops:
            if op in _RULES:
                raise ValueError(f"op {op!r} has two gradient rules")
            _RULES[op] = fn
        return fn

    return register


def rule_for(op: str) -> Rule | None:
    return _RULES.get(op)
