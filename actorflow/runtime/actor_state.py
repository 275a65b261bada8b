"""One actor's flow-control state, as a sans-IO state machine: plain method calls, no trio,
no threads, so it is testable on its own.

Per input: a queue of ready registers (buffer index and the event to wait on). Per
output: a pool of free buffers (the credits) and, for buffers in use, how many consumers
have yet to free them. An actor may act when every input has a ready register, every
output has a credit, and it still has acts to do this run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any


class ActorState:
    __slots__ = ("ready", "free", "pending", "consumers", "quotas", "acts_left", "iteration", "max_held")

    def __init__(self, n_inputs: int, quotas: Sequence[int], consumers: Sequence[int]) -> None:
        self.ready: list[deque[tuple[int, Any]]] = [deque() for _ in range(n_inputs)]
        self.free: list[deque[int]] = [deque(range(q)) for q in quotas]
        self.pending: list[list[int]] = [[0] * q for q in quotas]
        self.consumers = list(consumers)
        self.quotas = list(quotas)
        self.acts_left = 0
        self.iteration = 0
        self.max_held = [0] * len(quotas)

    def can_act(self) -> bool:
        return self.acts_left > 0 and all(self.ready) and all(self.free)

    def take(self) -> tuple[int, list[tuple[int, Any]], list[int]]:
        """Consume one ready register per input and one credit per output.

        Returns (iteration, [(buffer, event) per input], [buffer per output]). An output
        nobody consumes gets its credit back at once: the next write to it comes later on
        the same stream.
        """
        iteration = self.iteration
        self.iteration += 1
        self.acts_left -= 1
        ins = [q.popleft() for q in self.ready]
        outs = []
        for k, pool in enumerate(self.free):
            index = pool.popleft()
            held = self.quotas[k] - len(pool)
            if held > self.max_held[k]:
                self.max_held[k] = held
            if self.consumers[k]:
                self.pending[k][index] = self.consumers[k]
            else:
                pool.append(index)
            outs.append(index)
        return iteration, ins, outs

    def on_ready(self, slot: int, index: int, event: Any) -> None:
        self.ready[slot].append((index, event))

    def on_free(self, out: int, index: int) -> bool:
        """A consumer is done with buffer ``index`` of output ``out``; True if it is free again."""
        self.pending[out][index] -= 1
        if self.pending[out][index] == 0:
            self.free[out].append(index)
            return True
        return False

    def held(self, out: int) -> int:
        return self.quotas[out] - len(self.free[out])

    def lacking(self) -> tuple[list[int], list[int]]:
        """(inputs with nothing ready, outputs with no credit): what keeps it from acting."""
        inputs = [k for k, q in enumerate(self.ready) if not q]
        outputs = [k for k, pool in enumerate(self.free) if not pool]
        return inputs, outputs
