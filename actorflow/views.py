"""Plan views for people: a short overview, and the actor graph as Graphviz text (the
full listing is ``Plan.summary()``)."""

from __future__ import annotations

from .plan import Plan
from .plan_summary import headline, stream_usage

_SYNC_STYLE = {
    "stream": "",
    "event": ', color="red"',
    "implied": ', style="dotted"',
    "completion": ', color="blue"',
}


def overview(plan: Plan) -> str:
    """Streams with their actors per kind, the predicted communication, the SBP of the
    placeholders and parameters on several devices, and memory per device."""
    lines = [headline(plan), *stream_usage(plan)]
    for stream in plan.streams:
        kinds: dict[str, int] = {}
        for a in plan.actors:
            if a.stream == stream.id:
                kind = a.op if a.op == "accumulate" else "fused" if len(a.ops) > 1 else a.kind
                kinds[kind] = kinds.get(kind, 0) + 1
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        lines.append(f"  {stream.name:<20} {counts}")
    if plan.collectives:
        lines.append(f"predicted communication: {plan.communication_per_step():,} bytes a step")
    if plan.sbp:
        leaves = {lt.name for lt in plan.logical}
        shown = [f"{name} {sbp}" for name, sbp in plan.sbp.items() if name in leaves]
        lines.append("SBP of the placeholders and parameters: " + ", ".join(shown))
    lines.append(
        "planned memory: " + ", ".join(f"{d} {n / 2**20:.2f} MiB" for d, n in sorted(plan.memory.items()))
    )
    return "\n".join(lines)


def dot(plan: Plan) -> str:
    """The actor graph: one cluster per stream, an edge per register and consumer,
    labelled with the register's quota; red: the consumer's stream waits on an event,
    blue: ready at the producer's completion, dotted: implied by another event, dashed:
    a control register (order only)."""
    lines = ["digraph plan {", "  rankdir=LR;", '  node [shape=box, fontsize=10, fontname="Helvetica"];']
    for stream in plan.streams:
        lines.append(f"  subgraph cluster_{stream.id} {{")
        lines.append(f"    label={_quoted(stream.name)}; style=rounded;")
        for a in plan.actors:
            if a.stream == stream.id:
                rate = ["once per step"] if a.every > 1 else []
                lines.append(f"    a{a.id} [label={_quoted(a.name, a.op, *rate)}];")
        lines.append("  }")
    for a in plan.actors:
        for i in a.inputs:
            reg = plan.registers[i.register]
            if reg.is_parameter:
                continue
            style = ', style="dashed"' if reg.control else _SYNC_STYLE[i.sync]
            lines.append(f'  a{reg.producer} -> a{a.id} [label="q{reg.quota}", fontsize=8{style}];')
    lines.append("}")
    return "\n".join(lines)


def _quoted(*lines: str) -> str:
    """A Graphviz string of ``lines``, one per line."""
    return '"' + "\\n".join(line.replace("\\", "\\\\").replace('"', '\\"') for line in lines) + '"'
