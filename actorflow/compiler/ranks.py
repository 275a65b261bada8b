"""split ranks: every device belongs to one rank (process), and what crosses ranks is sent.

A register read on another rank than its producer's becomes, for each such rank, a
``send`` actor beside the producer and a ``recv`` actor beside the readers, which get
the received copy instead (OneFlow's comm-net copy). Both keep the credit protocol: the
send holds the register until the receiver has posted its receive, and the receiver
posts it only with a free buffer, so quotas bound what is in flight across the wire as
well. A copy to a device of the other rank is itself replaced by the receive.

Every rank gets the plan's outputs, so a script reads its results the same way in one
process and under a launcher: an output fetched on one rank is also sent to each other.

Parameters that no optimizer updates need nothing: their values travel in the plan, and
a rank reading one holds its own copy. A collective whose participants span ranks stays
one collective: each rank runs its own participants, together as one MPI call.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..devices import device_order
from ..errors import CompileError
from ..ops import kernels
from ..plan import Actor, Consumer, Input, Output, Plan
from ..records import evolve
from ..world import blocks, world_size

Ranks = int | Sequence[str | Sequence[str]] | None


def place_ranks(devices: Sequence[str], ranks: Ranks) -> tuple[dict[str, int], int]:
    """(rank of each device, number of ranks) for the ``ranks`` option of ``compile``:

    - None: as many ranks as the launcher started (1 without one), the devices spread
      over them as ``int`` does;
    - an int n: n ranks, the devices in order (cpu:0, cpu:1, ...) in n contiguous blocks
      as even as they go (one device per rank for n equal to the devices);
    - a list with a device, or a list of devices, per rank: exactly that (a rank may
      hold none; each of the plan's devices is listed once).
    """
    order = sorted(devices, key=device_order)
    if ranks is None:
        ranks = world_size()
    if isinstance(ranks, int):
        if ranks > max(1, len(order)):
            raise CompileError(
                f"ranks: {ranks} ranks but the plan has {len(order)} devices {order}; every rank needs one "
                "(give ranks as a list of devices per rank to leave a rank without any)"
            )
        return {d: rank for rank, block in enumerate(blocks(order, ranks)) for d in block}, ranks
    placement: dict[str, int] = {}
    for rank, held in enumerate(ranks):
        for device in [held] if isinstance(held, str) else held:
            if device in placement:
                raise CompileError(f"ranks: {device} is listed on rank {placement[device]} and rank {rank}")
            placement[device] = rank
    missing = [d for d in order if d not in placement]
    if missing:
        raise CompileError(f"ranks: {missing} are on no rank; list each of the plan's devices {order} once")
    return placement, len(ranks)


def plan_devices(plan: Plan) -> list[str]:
    return sorted({a.device for a in plan.actors} | {r.device for r in plan.registers}, key=device_order)


def split_ranks(plan: Plan, placement: dict[str, int], world: int) -> Plan:
    plan = evolve(plan, world=world, ranks=dict(placement))
    if world == 1:
        return plan
    return _Split(plan).run()


class _Split:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.actors = list(plan.actors)
        self.registers = list(plan.registers)
        self.outputs = list(plan.outputs)
        self.pairs = 0

    def run(self) -> Plan:
        self._deliver_outputs()
        for reg in list(self.registers):
            if not reg.is_parameter:
                self._cross(reg.id)
        return evolve(
            self.plan, actors=tuple(self.actors), registers=tuple(self.registers), outputs=tuple(self.outputs)
        )

    def rank(self, actor_id: int) -> int:
        return self.plan.rank_of(self.actors[actor_id].device)

    def home(self, rank: int) -> str:
        """Where a rank keeps what it receives for the host: its first device, or the rank itself."""
        held = self.plan.devices_of(rank)
        return min(held, key=device_order) if held else f"rank{rank}"

    def _deliver_outputs(self) -> None:
        for out in list(self.outputs):
            fetch = self.actors[out.actor]
            for rank in range(self.plan.world):
                if rank != self.rank(fetch.id):
                    copy = self._add_actor(
                        evolve(fetch, name=f"{fetch.name}@rank{rank}", device=self.home(rank))
                    )
                    self._consume(fetch.inputs[0].register, copy.id, 0)
                    self.outputs.append(Output(out.name, copy.id))

    def _cross(self, reg_id: int) -> None:
        reg = self.registers[reg_id]
        home = self.plan.rank_of(reg.device)
        remote: dict[int, list[Consumer]] = {}
        for c in reg.consumers:
            if self.rank(c.actor) != home:
                remote.setdefault(self.rank(c.actor), []).append(c)
        producer = self.actors[reg.producer]
        for rank, consumers in sorted(remote.items()):
            tag = self.pairs
            self.pairs += 1
            # as often as the register is published there: once a step for readers that
            # act once a step (an accumulate's sum, pushed to a parameter server)
            every = max(producer.every, *(self.actors[c.actor].every for c in consumers))
            send = self._add_actor(
                _transfer(
                    producer, "send", f"{reg.name}->rank{rank}", reg.device, {"peer": rank, "tag": tag}, every
                )
            )
            kept = [c for c in self.registers[reg_id].consumers if c not in consumers]
            self.registers[reg_id] = evolve(self.registers[reg_id], consumers=(*kept, Consumer(send.id, 0)))
            self.actors[send.id] = evolve(send, inputs=(Input(reg_id),))
            receive = {"peer": home, "tag": tag}
            first = self.actors[consumers[0].actor]
            if (
                len(consumers) == 1
                and first.kind == "copy"
                and len(first.inputs) == 1
                and first.every == every
            ):
                self.actors[first.id] = evolve(
                    _transfer(producer, "recv", first.name, first.device, receive, every),
                    id=first.id,
                    outputs=first.outputs,
                    backward=first.backward,
                    weight_grad=first.weight_grad,
                )
                continue
            recv = self._add_actor(
                _transfer(producer, "recv", f"{reg.name}<-rank{home}", first.device, receive, every)
            )
            mirror = evolve(
                reg,
                id=len(self.registers),
                name=f"{reg.name}@rank{rank}",
                producer=recv.id,
                device=recv.device,
                consumers=tuple(consumers),
                quota=reg.quota,
            )
            self.registers.append(mirror)
            self.actors[recv.id] = evolve(recv, outputs=(mirror.id,))
            for c in consumers:
                reader = self.actors[c.actor]
                inputs = list(reader.inputs)
                inputs[c.slot] = evolve(inputs[c.slot], register=mirror.id)
                self.actors[c.actor] = evolve(reader, inputs=tuple(inputs))

    def _add_actor(self, actor: Actor) -> Actor:
        actor = evolve(actor, id=len(self.actors))
        self.actors.append(actor)
        return actor

    def _consume(self, reg_id: int, actor_id: int, slot: int) -> None:
        reg = self.registers[reg_id]
        self.registers[reg_id] = evolve(reg, consumers=(*reg.consumers, Consumer(actor_id, slot)))


def _transfer(producer: Actor, kind: str, name: str, device: str, attributes: dict, every: int) -> Actor:
    """A send or receive of what ``producer`` makes, acting once per ``every`` micro-batches."""
    return Actor(
        id=-1,
        name=name,
        kind=kind,
        op=kind,
        kernel=getattr(kernels, kind),
        attrs=attributes,
        device=device,
        inputs=(),
        outputs=(),
        where=producer.where,
        every=every,
        backward=producer.backward,
        weight_grad=producer.weight_grad,
    )
