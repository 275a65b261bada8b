"""optimizer shards: optimizer parallel (ZeRO-1/2; MindSpore's parallel optimizer) for
the data-parallel parameters ``minimize(..., shard=True)`` chose (``Graph.optimizer_shards``).

A replicated parameter's replicas each hold the whole parameter and the whole optimizer
state, and update all of it with the same all-reduced gradient: the same arithmetic
done once per replica. Sharded, replica k of n keeps only the k-th of n slices of the
parameter and of its optimizer state (momentum, Adam's moments): the all-reduce of the
gradient becomes a reduce-scatter (each replica gets the sum of its own slice), each
replica updates its slice where it lives, and an all-gather of the slices gives every
replica the whole parameter for the next step's forward and backward passes, once per
step (its register has one buffer, as a variable's has).

With micro-batches the gradient is either reduce-scattered at each micro-batch and
accumulated as a slice (``accumulate_sharded``, ZeRO-2: the step's gradient is never
held whole) or accumulated whole and reduce-scattered once per step. The pass runs on
the plan ``split_micro_batches`` made, so it swaps the accumulate and the collective for
the first and keeps their order for the second.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import CompileError
from ..graph.builder import is_shape_only
from ..graph.ir import OptimizerShard
from ..ops import kernels
from ..plan import Actor, Collective, Consumer, Input, Plan, Register
from ..records import evolve
from .registers import wish_quotas
from .topology import with_consumers


def shard_optimizer(plan: Plan, shards: Sequence[OptimizerShard]) -> Plan:
    """The plan with each of ``shards`` applied, wishing one buffer for each register
    that holds a gathered parameter (one value per step)."""
    if not shards:
        return plan
    edit = _Edit(plan)
    gathered = [name for shard in shards for name in edit.shard(shard)]
    return wish_quotas(edit.plan(), dict.fromkeys(gathered, 1))


class _Edit:
    def __init__(self, plan: Plan) -> None:
        self.base = plan
        self.actors = list(plan.actors)
        self.registers = list(plan.registers)
        self.collectives = list(plan.collectives)
        self.parameters = {p.name: p for p in plan.parameters}
        self.parameter_of = {p.register: p.name for p in plan.parameters}
        self.logical = {lt.name: lt for lt in plan.logical if lt.kind == "parameter"}

    def plan(self) -> Plan:
        logical = tuple(self.logical[lt.name] if lt.kind == "parameter" else lt for lt in self.base.logical)
        return evolve(
            self.base,
            actors=tuple(self.actors),
            registers=with_consumers(self.actors, self.registers),
            collectives=tuple(self.collectives),
            parameters=tuple(self.parameters[p.name] for p in self.base.parameters),
            logical=logical,
        )

    def shard(self, spec: OptimizerShard) -> list[str]:
        lt = self.logical[spec.parameter]
        n = len(lt.parts)
        variables = [self.registers[self.parameters[part].register] for part in lt.parts]
        updates = [self._update_of(reg) for reg in variables]
        reduce = self._all_reduce_of(spec.parameter, updates, [reg.device for reg in variables])
        gathered = []
        for k, (var, update) in enumerate(zip(variables, updates)):
            full = var.shape
            for reg in [var, *(self.registers[i.register] for i in update.inputs[2:])]:
                if reg.id == var.id or (reg.is_parameter and reg.shape == full):
                    self._slice(reg, spec.axis, k, n)
            gathered.append(self._gather(var, update, full, spec))
        self._reduce_scatter(reduce, updates, spec)
        self.logical[spec.parameter] = evolve(lt, sbp="S", axis=spec.axis)
        self.collectives.append(
            Collective(
                len(self.collectives),
                f"{spec.parameter}.all_gather",
                "all_gather",
                tuple(self.registers[r].producer for r in gathered),
            )
        )
        return [self.registers[r].name for r in gathered]

    def _update_of(self, var: Register) -> Actor:
        updates = [self.actors[c.actor] for c in var.consumers if self.actors[c.actor].kind == "update"]
        if var.producer < 0 or len(updates) != 1:
            raise CompileError(f"optimizer shard: {var.name!r} is not a parameter one optimizer updates")
        return updates[0]

    def _all_reduce_of(self, name: str, updates: list[Actor], devices: list[str]) -> Collective:
        """The all-reduce of the parameter's gradient, its participants in part order."""
        producers = [self.actors[self.registers[u.inputs[1].register].producer] for u in updates]
        groups = {a.group for a in producers}
        coll = self.collectives[producers[0].group] if len(groups) == 1 and producers[0].group >= 0 else None
        if (
            coll is None
            or coll.op != "all_reduce"
            or producers[0].attrs.get("op") != "sum"
            or [self.actors[a].device for a in coll.actors] != devices
            or any(len(self.registers[a.outputs[0]].consumers) != 1 for a in producers)
        ):
            raise CompileError(
                f"optimizer shard: the gradient of {name!r} does not come from one sum all-reduce "
                "over its replicas read only by their updates"
            )
        return coll

    def _slice(self, reg: Register, axis: int, k: int, n: int) -> None:
        self.registers[reg.id] = evolve(reg, shape=_sliced(reg.shape, axis, n))
        if reg.id in self.parameter_of:
            param = self.parameters[self.parameter_of[reg.id]]
            value = np.split(param.value, n, axis=axis)[k]
            value = value if is_shape_only(value) else np.ascontiguousarray(value)
            self.parameters[param.name] = evolve(param, value=value)

    def _gather(self, var: Register, update: Actor, full: tuple[int, ...], spec: OptimizerShard) -> int:
        """An all-gather participant reading the variable; the variable's readers other
        than its update read what it gathers instead. Returns the gathered register."""
        actor_id, reg_id = len(self.actors), len(self.registers)
        self.registers.append(Register(reg_id, f"{var.name}.gathered", actor_id, var.device, full, var.dtype))
        for c in var.consumers:
            if c.actor != update.id:
                self._rewire(c, reg_id)
        variable = self.actors[var.producer]
        self.actors.append(
            Actor(
                id=actor_id,
                name=f"{spec.parameter}.all_gather[{var.device}]",
                kind="collective",
                op="all_gather",
                kernel=kernels.all_gather,
                attrs={"axis": spec.axis},
                device=var.device,
                inputs=(Input(var.id),),
                outputs=(reg_id,),
                group=len(self.collectives),
                where=variable.where,
                every=variable.every,
            )
        )
        return reg_id

    def _reduce_scatter(self, coll: Collective, updates: list[Actor], spec: OptimizerShard) -> None:
        n = len(coll.actors)
        self.collectives[coll.id] = evolve(coll, op="reduce_scatter")
        for actor_id, update in zip(coll.actors, updates):
            reduce = self.actors[actor_id]
            out = self.registers[reduce.outputs[0]]
            source = self.registers[reduce.inputs[0].register]
            accumulate = self.actors[source.producer] if source.producer >= 0 else None
            reduce = evolve(
                reduce, op="reduce_scatter", kernel=kernels.reduce_scatter, attrs={"axis": spec.axis}
            )
            self.actors[actor_id] = reduce
            self.registers[out.id] = evolve(out, shape=_sliced(out.shape, spec.axis, n))
            if not (spec.accumulate_sharded and accumulate is not None and accumulate.op == "accumulate"):
                continue
            # dW -> accumulate -> all-reduce -> update becomes dW -> reduce-scatter -> accumulate -> update
            self.actors[actor_id] = evolve(reduce, inputs=accumulate.inputs, every=accumulate.every)
            self.actors[accumulate.id] = evolve(accumulate, inputs=(Input(out.id),))
            self._rewire(Consumer(update.id, 1), source.id)
            self.registers[source.id] = evolve(source, shape=_sliced(source.shape, spec.axis, n))

    def _rewire(self, consumer: Consumer, register: int) -> None:
        actor = self.actors[consumer.actor]
        inputs = list(actor.inputs)
        inputs[consumer.slot] = evolve(inputs[consumer.slot], register=register)
        self.actors[actor.id] = evolve(actor, inputs=tuple(inputs))


def _sliced(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return (*shape[:axis], shape[axis] // n, *shape[axis + 1 :])
