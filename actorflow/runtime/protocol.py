"""The actor protocol, sans-IO: plain method calls, no trio, no threads, no kernels.

Rule 1 (h11's ``_state.py``): every decision of the credit protocol lives in this module.
What an act takes, what it releases, what it publishes and to which of its consumers'
calls, when an actor's part of a run starts and ends: a runtime (stream threads, a GPU,
the simulator's virtual clock) asks, and acts on the answer; it decides nothing itself.
A message that breaks the protocol (a second free of a buffer, a free of a buffer never
published, a take before the actor can act) raises a ``ProtocolError`` naming the actor
and the register.

One ``ActorProtocol`` per actor. Per input: a queue of ready registers (buffer indices).
Per output: a pool of free buffers (the credits, reused in the order they came back)
and, for buffers handed on, how many consumers have yet to free them. An actor may act
when every input has a ready register, every output has a credit, and it still has acts
to do in this run.

Where rates differ (micro-batching, see ``plan.Actor.every``), an input may be *held*:
a register taken at act n serves acts n .. n + hold - 1 and is released after the last;
and an output may be *published every* p acts: the buffer taken at act n is written by
acts n .. n + p - 1 and handed to consumers after the last (a buffer nobody consumes is
free again after its last write).

A participant of a reused communication subgraph makes ``calls`` acts per iteration,
one per call site in a fixed order: act n is call n % calls, which reads only input
n % calls and hands each output buffer only to that call's consumers (``call_consumers``:
per output, the number of consumers of each call).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from ..errors import ProtocolError


class Act(NamedTuple):
    """What one act does, as ``ActorProtocol.take`` decides it."""

    number: int
    """The actor's act number, counted since the protocol was made."""
    inputs: list[int | None]
    """The buffer it reads per input slot; None where a reused subgraph's call reads
    another call's input."""
    outputs: list[int]
    """The buffer it writes per output."""
    releases: Sequence[int]
    """The input slots whose register it is the last to read: freed when it ends."""
    publishes: Sequence[int]
    """The outputs it hands on when it ends, to the consumers of ``call``."""
    takes: Sequence[int]
    """The outputs whose buffer it took a credit for (the first write of a period)."""
    call: int
    """Which call of a reused communication subgraph it is (0 for every other actor)."""


class ActorProtocol:
    __slots__ = (
        "name",
        "registers",
        "ready",
        "free",
        "pending",
        "consumers",
        "quotas",
        "acts_left",
        "in_flight",
        "number",
        "max_held",
        "holds",
        "periods",
        "uniform",
        "current_in",
        "current_out",
        "calls",
        "call_consumers",
        "_outputs",
        "_all_inputs",
        "_all_outputs",
    )

    def __init__(
        self,
        n_inputs: int,
        quotas: Sequence[int],
        consumers: Sequence[int],
        holds: Sequence[int] | None = None,
        periods: Sequence[int] | None = None,
        call_consumers: Sequence[Sequence[int]] | None = None,
        name: str = "actor",
        registers: Sequence[str] | None = None,
    ) -> None:
        self.name = name
        """The actor's name, and its outputs' register names, for errors."""
        self.registers = list(registers or (f"output {k}" for k in range(len(quotas))))
        self.ready: list[deque[int]] = [deque() for _ in range(n_inputs)]
        self.free: list[deque[int]] = [deque(range(q)) for q in quotas]
        self.pending: list[list[int]] = [[0] * q for q in quotas]
        self.consumers = list(consumers)
        self.quotas = list(quotas)
        self.acts_left = 0
        self.in_flight = 0
        self.number = 0
        self.max_held = [0] * len(quotas)
        self.holds = list(holds or [1] * n_inputs)
        self.periods = list(periods or [1] * len(quotas))
        self.call_consumers = [list(c) for c in call_consumers or ()]
        self.calls = len(self.call_consumers[0]) if self.call_consumers else 1
        self.uniform = (
            self.calls == 1 and all(h == 1 for h in self.holds) and all(p == 1 for p in self.periods)
        )
        """One register per input and one buffer per output, each act: the common case."""
        self.current_in: list[int | None] = [None] * n_inputs
        self.current_out = [0] * len(quotas)
        self._outputs = list(zip(self.free, self.pending, self.consumers, self.quotas, range(len(quotas))))
        self._all_inputs = tuple(range(n_inputs))
        self._all_outputs = tuple(range(len(quotas)))

    # -- a run --------------------------------------------------------------------------

    def start(self, acts: int) -> None:
        """A run begins that asks ``acts`` more acts of this actor."""
        self.acts_left += acts

    def complete(self) -> bool:
        """An act's kernel ended; True if that was this actor's last act of the run."""
        if self.in_flight <= 0:
            raise ProtocolError(f"actor {self.name!r}: an act completed that was never taken")
        self.in_flight -= 1
        return self.in_flight == 0 and self.acts_left == 0

    # -- acts ---------------------------------------------------------------------------

    def can_act(self) -> bool:
        if self.acts_left <= 0:
            return False
        if self.uniform:
            return all(self.ready) and all(self.free)
        if self.calls > 1:
            return bool(self.ready[self.number % self.calls]) and all(self.free)
        n = self.number
        return all(q or n % h for q, h in zip(self.ready, self.holds)) and all(
            pool or n % p for pool, p in zip(self.free, self.periods)
        )

    def take(self) -> Act:
        """Consume one ready register per input and one credit per output (or keep using
        the held ones, see the module's docstring). An output nobody consumes gets its
        credit back at once: the next write to it comes later on the same stream."""
        if self.acts_left <= 0:
            raise ProtocolError(f"actor {self.name!r} took act {self.number} with no act left in the run")
        try:
            return self._take()
        except IndexError:  # an empty queue or pool: a fatal error, whatever it left half done
            raise ProtocolError(
                f"actor {self.name!r} took act {self.number - 1} before it could act"
            ) from None

    def _take(self) -> Act:
        number = self.number
        self.number = number + 1
        self.acts_left -= 1
        self.in_flight += 1
        if self.uniform:
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
            ins: list[int | None] = [q.popleft() for q in self.ready]
            return Act(number, ins, outs, self._all_inputs, self._all_outputs, self._all_outputs, 0)
        call = number % self.calls
        releases: list[int] = []
        if self.calls > 1:
            ins = [q.popleft() if k == call else None for k, q in enumerate(self.ready)]
            releases.append(call)
        else:
            ins = []
            for k, q in enumerate(self.ready):
                hold = self.holds[k]
                if number % hold == 0:
                    self.current_in[k] = q.popleft()
                if number % hold == hold - 1:
                    releases.append(k)
                ins.append(self.current_in[k])
        outs = []
        publishes: list[int] = []
        takes: list[int] = []
        for k, pool in enumerate(self.free):
            period = self.periods[k]
            if number % period == 0:
                takes.append(k)
                index = self.current_out[k] = pool.popleft()
                held = self.quotas[k] - len(pool)
                if held > self.max_held[k]:
                    self.max_held[k] = held
            else:
                index = self.current_out[k]
            if number % period == period - 1:  # its last write: handed on, or free again
                publishes.append(k)
                consumers = self.call_consumers[k][call] if self.calls > 1 else self.consumers[k]
                if consumers:
                    self.pending[k][index] = consumers
                else:
                    pool.append(index)
            outs.append(index)
        return Act(number, ins, outs, releases, publishes, takes, call)

    # -- messages -----------------------------------------------------------------------

    def on_ready(self, slot: int, index: int) -> None:
        """A producer handed buffer ``index`` on to input ``slot``."""
        self.ready[slot].append(index)

    def on_free(self, out: int, index: int) -> bool:
        """A consumer is done with buffer ``index`` of output ``out``; True if it is free again."""
        pending = self.pending[out]
        if not pending[index]:
            raise ProtocolError(
                f"actor {self.name!r}: register {self.registers[out]!r} buffer {index} was freed "
                "but no consumer holds it (a second free, or a free of a buffer never published)"
            )
        pending[index] -= 1
        if pending[index] == 0:
            self.free[out].append(index)
            return True
        return False

    # -- what it waits on ---------------------------------------------------------------

    def held(self, out: int) -> int:
        """Buffers of output ``out`` taken and not free again."""
        return self.quotas[out] - len(self.free[out])

    def lacking(self) -> tuple[list[int], list[int]]:
        """(inputs with nothing ready, outputs with no credit): what keeps it from acting."""
        n = self.number
        if self.calls > 1:
            call = n % self.calls
            return ([call] if not self.ready[call] else []), [
                k for k, pool in enumerate(self.free) if not pool
            ]
        inputs = [k for k, q in enumerate(self.ready) if not q and n % self.holds[k] == 0]
        outputs = [k for k, pool in enumerate(self.free) if not pool and n % self.periods[k] == 0]
        return inputs, outputs

    def in_use(self, out: int) -> set[int]:
        """The buffers of output ``out`` that some consumer has yet to free."""
        return {i for i, n in enumerate(self.pending[out]) if n}

    def keeps(self, slot: int, buffers: set[int]) -> bool:
        """Whether input ``slot`` keeps one of ``buffers`` from its producer: ready here
        but not taken, or held for this actor's next acts."""
        if any(i in buffers for i in self.ready[slot]):
            return True
        current = self.current_in[slot]
        return bool(self.number % self.holds[slot]) and current is not None and current in buffers

    def __repr__(self) -> str:
        ins, outs = self.lacking()
        return (
            f"<{self.name}: act {self.number}, {self.acts_left} left, {self.in_flight} in flight, "
            f"lacking inputs {ins} and outputs {outs}>"
        )


def last_micro_batch(act: int, every: int) -> int:
    """The last micro-batch that act ``act`` of an actor acting every ``every`` serves:
    where its result is fetched, and what its inputs' producers made it from."""
    return (act + 1) * every - 1


def act_text(calls: int, act: int, base: int) -> str:
    """An act of an actor with ``calls`` calls as people count it: the iteration (from
    ``base``) and, for a reused communication subgraph, which call of it."""
    if calls == 1:
        return f"iteration {act - base}"
    return f"iteration {act // calls - base}, call {act % calls}"
