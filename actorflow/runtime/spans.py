"""A traced kernel's span, made from what its stream recorded (``trace.recorder`` calls
``SpanMaker`` when the trace is first read, not on the stream's thread)."""

from __future__ import annotations

from typing import Any, SupportsFloat

from ..plan import Actor, Plan
from ..plan_check import transfer_peers
from ..trace.recorder import Recorder, Span
from .protocol import Act, last_micro_batch
from .wiring import InputSpec, Unit


class SpanMaker:
    def __init__(self, plan: Plan, rank: int) -> None:
        self.plan = plan
        self._args = {a.id: _span_args(plan, a, rank) for a in plan.actors}
        self._peers = transfer_peers(plan)
        self._calls: dict[tuple[int, int], int] = {}
        """(actor id, input slot) -> the call of a reused producer that input reads."""

    def record(
        self,
        recorder: Recorder,
        unit: Unit,
        act: int,
        start: SupportsFloat,
        end: SupportsFloat,
        acts: list[Act],
    ) -> None:
        """Hand ``recorder`` the span of ``unit``'s act ``act`` (its members' ``acts``),
        made when spans are read: of a run's kernel, or of a simulated one. ``start`` and
        ``end`` are read as floats then (a GPU kernel's, ``cuda.GpuTime``)."""
        actor = unit.actor
        step = act // actor.calls * actor.every // self.plan.micro_batches
        register = acts[0].outputs[0] if acts[0].outputs else None
        recorder.record(step, self, unit, act, step, start, end, register)

    def __call__(
        self,
        unit: Unit,
        act: int,
        iteration: int,
        start: SupportsFloat,
        end: SupportsFloat,
        register: int | None,
    ) -> Span:
        """A kernel's span: ``iteration`` (the step), micro-batch, buffer written, stage,
        rank, phase and the producer acts it read, for flow arrows."""
        actor = unit.actor
        stream = self.plan.streams[actor.stream]
        m, every = self.plan.micro_batches, actor.every
        call, step = act % actor.calls, act // actor.calls  # a reused subgraph acts once a call
        args: dict[str, Any] = {"actor": unit.name, "op": actor.op, "iteration": iteration, "act": act}
        args |= self._args[actor.id]
        if actor.calls > 1:
            args["call"] = call
        if m > 1 and every == 1:
            args["micro_batch"] = step % m
        if register is not None:
            args["register"] = register
        args["inputs"] = [
            [
                spec.producer.unit.name,
                self._producer_act(member.actor, slot, spec, last_micro_batch(step, every)),
            ]
            for member in unit.members
            for slot, spec in enumerate(member.inputs)
            if spec.producer is not None and (actor.calls == 1 or slot == call)  # a call reads its own input
        ]
        if actor.kind == "recv":  # its act n receives the send's act n, on another rank
            args["inputs"].append([self._peers[actor.id].name, act])
        return Span(stream.device, stream.name, unit.name, actor.kind, float(start), float(end), args)

    def _producer_act(self, actor: Actor, slot: int, spec: InputSpec, micro_batch: int) -> int:
        """The act of ``spec``'s producer that made what input ``slot`` of ``actor`` read at
        ``micro_batch``: a reused subgraph's acts count its calls."""
        assert spec.producer is not None, "only produced inputs have flows"
        producer = spec.producer.actor
        made = micro_batch // producer.every
        if producer.calls == 1:
            return made
        key = (actor.id, slot)
        if key not in self._calls:
            reg = self.plan.registers[producer.outputs[spec.out]]
            self._calls |= {(c.actor, c.slot): c.call for c in reg.consumers}
        return made * producer.calls + self._calls[key]


def _span_args(plan: Plan, actor: Actor, rank: int) -> dict[str, Any]:
    """What every span of ``actor`` carries besides its act: its stage (where the plan has
    stages), its rank and its phase (see ``trace.recorder``)."""
    stage = plan.stage_of(actor.device)
    return ({} if stage is None else {"stage": stage}) | {"rank": rank, "phase": _phase(actor)}


def _phase(actor: Actor) -> str:
    if actor.kind in ("update", "variable"):
        return "update"
    if actor.kind == "compute":
        return "weight" if actor.weight_grad else "backward" if actor.backward else "forward"
    return "communication"
