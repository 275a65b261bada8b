"""fuse chains: a compute actor whose only data input is another compute actor's output,
on the same device and at the same rate, runs inside that producer's act, as the next
part of one kernel (``ops.chain``).

Why: every hand-off between two actors is host work (a credit taken, a register readied,
a trip through the driver's queue), tens of µs on these machines against kernels of the
same size; OneFlow's first habit on GPUs is the same, many element-wise kernels become
one. A fused chain acts once where its members acted once each: a gradient and its
``accumulate``, a bias's sum and its ``accumulate``, a chain of ``call``s.

What is safe to fuse: the consumer waits for nothing but its producer (its other inputs
are parameters, or variables, which wait on nothing and are there from the step's
start), so running them as one act adds no cycle. It adds one wait: whoever else reads
the producer's output now gets it after the consumer's kernel too, so a producer fuses
only where every other reader is on its own stream (which ran them in order anyway);
one read on another device, a copy or a collective keeps it apart. Both are plain
compute actors (no collective, nothing ``af.recompute`` marked or copied) of the same
pass (forward, backward, weight gradient), so pipeline schedules and phases see the
fused actor as they saw each.
A register that only the next part read stays as an output of the fused actor with no
consumer: its credit comes back at once, so it needs one buffer (the names returned).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from ..devices import is_cuda
from ..ops.chain import Part, chain
from ..ops.cuda_habits import chain_code, element_wise, fits_one_kernel, fused_chain, worth_one_kernel
from ..ops.transformer_kernels import scaled_kernel
from ..plan import Actor, Input, Plan, Register
from ..records import evolve
from .registers import wish_quotas
from .streams import stream_key
from .topology import renumber, with_consumers

MAX_MEMBERS = 8
"""The most actors one fused actor runs: past a few, an act's host cost is a small part
of its kernels' anyway, and a longer chain (a deep model's whole forward pass on one
device) would only make a name nobody reads in a trace or an error."""


def fuse_chains(plan: Plan) -> Plan:
    """The plan with each chain one actor, wishing one buffer for each register now
    internal to a chain."""
    following = _links(plan)
    if not following:
        return plan
    followers = set(following.values())
    heads = [a.id for a in plan.actors if a.id in following and a.id not in followers]
    actors = list(plan.actors)
    moved: dict[int, int] = {}  # register -> the fused actor that now produces it
    dead: set[int] = set()
    internal: set[str] = set()
    for start in heads:
        path = [plan.actors[start]]
        while path[-1].id in following:
            path.append(plan.actors[following[path[-1].id]])
        for k in range(0, len(path) - 1, MAX_MEMBERS):  # a last one alone stays as it is
            members = path[k : k + MAX_MEMBERS]
            head = members[0].id
            actors[head] = _fused(plan, members)
            for m in members[1:]:
                dead.add(m.id)
                link = next(i.register for i in m.inputs if not _constant(plan, i.register))
                if len(plan.registers[link].consumers) == 1:
                    internal.add(plan.registers[link].name)
            moved.update(dict.fromkeys(actors[head].outputs, head))
    live = [a for a in actors if a.id not in dead]
    registers = with_consumers(
        live, [evolve(r, producer=moved[r.id]) if r.id in moved else r for r in plan.registers]
    )
    fused = renumber(evolve(plan, actors=tuple(actors), registers=registers), plan.collectives, dead, set())
    return wish_quotas(fused, dict.fromkeys(sorted(internal), 1))


def _links(plan: Plan) -> dict[int, int]:
    """Producer -> the consumer fused after it: per producer, the first consumer (by id)
    whose only data input it makes (besides parameters and variables), with both
    fusable alike, unless another of its readers feeds communication: fused with the
    input gradient's matmul, a layer's output gradient would hold the weight and bias
    gradients that read it, and their all-reduces, behind that matmul, and gradients
    ready late are what an all-reduce can't hide behind the backward pass. (A consumer
    that feeds communication itself, a pipeline stage's input gradient, may fuse.)"""
    candidates: dict[int, list[Actor]] = {}
    for consumer in plan.actors:
        reads = [i for i in consumer.inputs if not _constant(plan, i.register)]
        if len(reads) != 1 or not _fusable(consumer):
            continue
        reg = plan.registers[reads[0].register]
        producer = plan.actors[reg.producer]
        if reg.control or not _fusable(producer):
            continue
        if _pass(producer) == _pass(consumer) and producer.device == consumer.device:
            if all(_on_stream_of(plan, producer, o, consumer) for o in producer.outputs):
                candidates.setdefault(producer.id, []).append(consumer)
    following: dict[int, int] = {}
    for head, consumers in candidates.items():
        talking = {r.id for r in _readers(plan, plan.actors[head]) if _feeds_communication(plan, r)}
        allowed = [c.id for c in consumers if talking <= {c.id}]
        if allowed:
            following[head] = min(allowed)
    return following


def _readers(plan: Plan, actor: Actor) -> list[Actor]:
    return [plan.actors[c.actor] for o in actor.outputs for c in plan.registers[o].consumers]


def _feeds_communication(plan: Plan, actor: Actor) -> bool:
    """Whether a collective, a send or a copy to another device reads what ``actor``
    writes."""
    return any(
        r.group >= 0 or r.kind == "send" or (r.kind == "copy" and r.device != actor.device)
        for r in _readers(plan, actor)
    )


def _on_stream_of(plan: Plan, producer: Actor, register: int, consumer: Actor) -> bool:
    """Whether every reader of ``register`` but ``consumer`` runs on ``producer``'s
    stream, where fusing delays none of them past what stream order did. (Ranks are not
    placed yet; a compute stream's key does not depend on them.)"""
    stream = stream_key(producer.kind, producer.device, 0)
    readers = (plan.actors[c.actor] for c in plan.registers[register].consumers if c.actor != consumer.id)
    return all(stream_key(r.kind, r.device, 0) == stream for r in readers)


def _constant(plan: Plan, register: int) -> bool:
    """A parameter, or a variable's register: there from the step's start, waiting on
    nothing (a variable has no inputs), so a chain may read it at any of its parts."""
    reg = plan.registers[register]
    return reg.is_parameter or plan.actors[reg.producer].kind == "variable"


def _fusable(actor: Actor) -> bool:
    return actor.kind == "compute" and actor.group < 0 and actor.calls == 1 and not actor.recompute


def _pass(actor: Actor) -> tuple:
    """What must agree for two actors to act as one: rate and pass."""
    return (actor.every, actor.backward, actor.weight_grad)


def _fused(plan: Plan, members: list[Actor]) -> Actor:
    """One actor for ``members``, a chain in order: the head's inputs, then the
    parameters and variables the others read; every member's outputs; one part per
    member."""
    head = members[0]
    inputs: list[Input] = []
    data_in = 0  # the data (not control) inputs so far: the kernel gets only those
    outputs = [o for m in members for o in m.outputs]
    data_out = {o: k for k, o in enumerate(o for o in outputs if not plan.registers[o].control)}
    parts = []
    for m in members:
        sources = []
        for i in m.inputs:
            reg = plan.registers[i.register]
            if m is not head and not _constant(plan, reg.id):  # the link: an earlier part's output
                sources.append(~data_out[reg.id])
                continue
            if not reg.control:
                sources.append(data_in)
                data_in += 1
            inputs.append(Input(i.register) if m is not head else i)
        targets = [data_out[o] for o in m.outputs if o in data_out]
        phased = plan.phases(m) > 1  # it takes the act's phase, as an accumulate does
        parts.append((m.kernel, dict(m.attrs), tuple(sources), tuple(targets), phased, m.name, m.where))
    return evolve(
        head,
        name="+".join(m.name for m in members),
        op="+".join(m.op for m in members),
        kernel=chain,
        attrs={"parts": tuple(parts)},
        inputs=tuple(inputs),
        outputs=tuple(outputs),
    )


def cuda_chains(plan: Plan, on: Callable[[str], bool] = is_cuda) -> Plan:
    """Each fused chain on a CUDA device (``on``) whose parts are all element-wise, as one
    CUDA kernel (``ops.cuda_habits.fused_chain``, seed 004's first habit): each
    element's intermediates stay in registers and only the outputs someone reads are
    written, where the plain ``chain`` launches a kernel per part, each writing its
    register. An element-wise actor alone is a chain of one part, so a gelu's eight
    passes are one too; in a chain with other parts (a matmul), each run of element-wise
    parts becomes one such part (a bias add and the gelu after it). A lone op CuPy runs
    in one pass anyway (an add) stays as it is (``worth_one_kernel``). Registers that don't
    fit one kernel (not float32, an output smaller than an input) keep their parts."""
    actors = list(plan.actors)
    regs = plan.registers
    for actor in plan.actors:
        if not on(actor.device) or actor.kind != "compute":
            continue
        ins = [regs[i.register] for i in actor.inputs if not regs[i.register].control]
        outs = [regs[o] for o in actor.outputs if not regs[o].control]
        parts = actor.attrs["parts"] if actor.kernel is chain else (_alone(plan, actor, len(ins)),)
        if not worth_one_kernel(parts):
            continue
        code = chain_code(parts, [k for k, r in enumerate(outs) if r.consumers])
        if code is not None and fits_one_kernel(
            code, [(r.shape, r.dtype) for r in ins], [(r.shape, r.dtype) for r in outs]
        ):
            attrs = {"parts": parts, "written": code.outputs}
            actors[actor.id] = evolve(actor, kernel=fused_chain, attrs=attrs)
        elif actor.kernel is chain:
            fused = _fused_runs(_scaled_softmaxes(parts, outs), ins, outs)
            if fused != parts:
                actors[actor.id] = evolve(actor, attrs={**actor.attrs, "parts": fused})
    return evolve(plan, actors=tuple(actors))


def _scaled_softmaxes(parts: Sequence[Part], outs: list[Register]) -> tuple[Part, ...]:
    """``parts`` with each scale before a softmax along the last axis (attention's
    scores, ``1 / sqrt(d)`` times q k^T), and each scale after a softmax gradient (their
    gradient), as one part (``transformer_kernels.scaled_kernel`` says which pairs),
    where only the second reads the first's float32 output: one kernel that scales as
    it reads or writes, one pass over the scores fewer."""
    result = list(parts)
    k = 0
    while k + 1 < len(result):
        pair = _scaled_pair(result[k], result[k + 1], result[k + 2 :], outs)
        if pair is not None:
            result[k : k + 2] = [pair]
        k += 1
    return tuple(result)


def _scaled_pair(first: Part, second: Part, after: Sequence[Part], outs: list[Register]) -> Part | None:
    """``first`` and ``second`` as one nested part, where they are such a pair."""
    if len(first[3]) != 1 or tuple(second[2]) != (~first[3][0],) or first[4] or second[4]:
        return None
    link = first[3][0]
    if outs[link].consumers or any(~link in part[2] for part in after) or outs[link].dtype != "float32":
        return None
    kernel = scaled_kernel(first, second, len(outs[link].shape))
    if kernel is None:
        return None
    inner = (
        (*first[:2], tuple(range(len(first[2]))), (0,), *first[4:]),
        (*second[:2], (~0,), tuple(range(1, 1 + len(second[3]))), *second[4:]),
    )
    return (
        kernel,
        {"parts": inner},
        first[2],
        (link, *second[3]),
        False,
        f"{first[5]}+{second[5]}",
        first[6],
    )


def _fused_runs(parts: Sequence[Part], ins: list[Register], outs: list[Register]) -> tuple[Part, ...]:
    """``parts`` with each run of element-wise parts as one ``fused_chain`` part, where its
    code fits one kernel. A run's part reads the chain's inputs and earlier parts' outputs
    that the run reads, renumbered as its own inputs, and writes the run's outputs that
    a later part or another actor reads."""
    result: list[Part] = []
    for fusable, group in itertools.groupby(range(len(parts)), key=lambda k: element_wise(parts[k][0])):
        places = list(group)
        run = parts[places[0] : places[-1] + 1]
        part = (
            _one_part(run, parts[places[-1] + 1 :], ins, outs) if fusable and worth_one_kernel(run) else None
        )
        result.extend(run if part is None else [part])
    return tuple(result)


def _one_part(
    run: Sequence[Part], after: Sequence[Part], ins: list[Register], outs: list[Register]
) -> Part | None:
    made = [t for part in run for t in part[3]]
    sources: list[int] = []  # the chain's places the run reads, in first-read order
    for part in run:
        sources += [s for s in part[2] if (s >= 0 or ~s not in made) and s not in sources]
    local = {s: k for k, s in enumerate(sources)} | {~t: ~k for k, t in enumerate(made)}
    renumbered: list[Part] = [
        (p[0], p[1], tuple(local[s] for s in p[2]), tuple(made.index(t) for t in p[3]), p[4], p[5], p[6])
        for p in run
    ]
    read_after = {~s for part in after for s in part[2] if s < 0}
    written = [k for k, t in enumerate(made) if outs[t].consumers or t in read_after]
    code = chain_code(renumbered, written)
    shape = [ins[s] if s >= 0 else outs[~s] for s in sources]
    if code is None or not fits_one_kernel(
        code, [(r.shape, r.dtype) for r in shape], [(outs[t].shape, outs[t].dtype) for t in made]
    ):
        return None
    phased = any(part[4] for part in run)
    name = "+".join(part[5] for part in run)
    return (
        fused_chain,
        {"parts": tuple(renumbered), "written": code.outputs},
        tuple(sources),
        tuple(made),
        phased,
        name,
        run[0][6],
    )


def _alone(plan: Plan, actor: Actor, inputs: int) -> Part:
    """An actor as the one part of a chain: it reads the chain's inputs, writes its output."""
    return (
        actor.kernel,
        dict(actor.attrs),
        tuple(range(inputs)),
        (0,),
        plan.phases(actor) > 1,
        actor.name,
        actor.where,
    )
