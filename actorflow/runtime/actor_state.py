"""One actor's flow-control state, as a sans-IO state machine: plain method calls, no trio,
no threads, so it is testable on its own.

Per input: a queue of ready registers (buffer indices). Per
output: a pool of free buffers (the credits) and, for buffers in use, how many consumers
have yet to free them. An actor may act when every input has a ready register, every
output has a credit, and it still has acts to do this run.

Where rates differ (micro-batching, see ``plan.Actor.every``), an input may be *held*:
a register taken at act n serves acts n .. n + hold - 1 and is released after the last;
and an output may be *published every* p acts: the buffer taken at act n is written by
acts n .. n + p - 1 and handed to consumers after the last.

A participant of a reused communication subgraph makes ``calls`` acts per iteration,
one per call site in a fixed order: act n is call n % calls, which reads only input
n % calls and hands each output buffer only to that call's consumers (``call_consumers``:
per output, the number of consumers of each call).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class ActorState:
    __slots__ = (
        "ready",
        "free",
        "pending",
        "consumers",
        "quotas",
        "acts_left",
        "iteration",
        "max_held",
        "holds",
        "periods",
        "uniform",
        "current_in",
        "current_out",
        "calls",
        "call_consumers",
        "_outputs",
    )

    def __init__(
        self,
        n_inputs: int,
        quotas: Sequence[int],
        consumers: Sequence[int],
        holds: Sequence[int] | None = None,
        periods: Sequence[int] | None = None,
        call_consumers: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.ready: list[deque[int]] = [deque() for _ in range(n_inputs)]
        self.free: list[deque[int]] = [deque(range(q)) for q in quotas]
        self.pending: list[list[int]] = [[0] * q for q in quotas]
        self.consumers = list(consumers)
        self.quotas = list(quotas)
        self.acts_left = 0
        self.iteration = 0
        self.max_held = [0] * len(quotas)
        self.holds = list(holds or [1] * n_inputs)
        self.periods = list(periods or [1] * len(quotas))
        self.call_consumers = [list(c) for c in call_consumers or ()]
        self.calls = len(self.call_consumers[0]) if self.call_consumers else 1
        self.uniform = (
            self.calls == 1 and all(h == 1 for h in self.holds) and all(p == 1 for p in self.periods)
        )
        self.current_in: list[int | None] = [None] * n_inputs
        self.current_out = [0] * len(quotas)
        self._outputs = list(zip(self.free, self.pending, self.consumers, self.quotas, range(len(quotas))))

    def can_act(self) -> bool:
        if self.acts_left <= 0:
            return False
        if self.uniform:
            return all(self.ready) and all(self.free)
        if self.calls > 1:
            return bool(self.ready[self.iteration % self.calls]) and all(self.free)
        n = self.iteration
        return all(q or n % h for q, h in zip(self.ready, self.holds)) and all(
            pool or n % p for pool, p in zip(self.free, self.periods)
        )

    def take(self) -> tuple[int, list[int | None], list[int]]:
        """Consume one ready register per input and one credit per output (or keep using
        the held ones, see the module's docstring).

        Returns (iteration, [buffer per input], [buffer per output]); a reused
        subgraph's act takes only its call's input, the others are None. An output
        nobody consumes gets its credit back at once: the next write to it comes later on
        the same stream.
        """
        iteration = self.iteration
        self.iteration = iteration + 1
        self.acts_left -= 1
        if self.uniform:  # the common case, on every act: one input each, every output handed on
            outs = []
            for pool, pending, consumers, quota, k in self._outputs:
                index = pool.popleft()
                if quota - len(pool) > self.max_held[k]:
                    self.max_held[k] = quota - len(pool)
                if consumers:
                    pending[index] = consumers
                else:
                    pool.append(index)
                outs.append(index)
            return iteration, [q.popleft() for q in self.ready], outs
        ins: list[int | None]
        if self.calls > 1:
            call = iteration % self.calls
            ins = [q.popleft() if k == call else None for k, q in enumerate(self.ready)]
        else:
            ins = []
            for k, q in enumerate(self.ready):
                if iteration % self.holds[k] == 0:
                    self.current_in[k] = q.popleft()
                register = self.current_in[k]
                assert register is not None, "act 0 takes every input"
                ins.append(register)
        outs = []
        for k, pool in enumerate(self.free):
            if iteration % self.periods[k]:
                outs.append(self.current_out[k])
                continue
            index = pool.popleft()
            held = self.quotas[k] - len(pool)
            if held > self.max_held[k]:
                self.max_held[k] = held
            consumers = (
                self.call_consumers[k][iteration % self.calls] if self.calls > 1 else self.consumers[k]
            )
            if consumers:
                self.pending[k][index] = consumers
            else:
                pool.append(index)
            self.current_out[k] = index
            outs.append(index)
        return iteration, ins, outs

    def releases(self, slot: int, iteration: int) -> bool:
        """Whether act ``iteration`` is the last to use the register of input ``slot``."""
        if self.calls > 1:
            return slot == iteration % self.calls
        return iteration % self.holds[slot] == self.holds[slot] - 1

    def publishes(self, out: int, iteration: int) -> bool:
        """Whether act ``iteration`` hands output ``out``'s buffer to its consumers."""
        return iteration % self.periods[out] == self.periods[out] - 1

    def on_ready(self, slot: int, index: int) -> None:
        self.ready[slot].append(index)

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
        n = self.iteration
        if self.calls > 1:
            call = n % self.calls
            return ([call] if not self.ready[call] else []), [
                k for k, pool in enumerate(self.free) if not pool
            ]
        inputs = [k for k, q in enumerate(self.ready) if not q and n % self.holds[k] == 0]
        outputs = [k for k, pool in enumerate(self.free) if not pool and n % self.periods[k] == 0]
        return inputs, outputs
