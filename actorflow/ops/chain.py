"""The kernel of a fused chain of actors (see ``compiler.chains``): one act runs each
member's kernel in order, a member reading the fused actor's inputs or an earlier
member's outputs, so the hand-offs between them cost nothing and happen on one thread.

``parts``: per member, ``(kernel, attrs, sources, targets, phased, name, where)``:

- ``sources``: where each of its inputs is, ``k >= 0`` the fused actor's input k, ``~j``
  (negative) its output j, which an earlier member wrote in this act;
- ``targets``: its outputs, as indexes into the fused actor's outputs;
- ``phased``: it takes the act's phase, the runtime's last input (an ``accumulate``);
- ``name`` and ``where``: the member's actor and the user's line that built its op, which
  a member's failure names (the fused actor's own ``where`` is its first member's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Part = tuple[Callable, dict[str, Any], Sequence[int], Sequence[int], bool, str, str]


def chain(ins: list, outs: list, parts: Sequence[Part]) -> None:
    for kernel, attrs, sources, targets, phased, name, where in parts:
        # one source and one target, the common case, without a comprehension's frame (a
        # third of a part's cost on small arrays)
        if len(sources) == 1:
            k = sources[0]
            part_ins = [ins[k] if k >= 0 else outs[~k]]
        else:
            part_ins = [ins[k] if k >= 0 else outs[~k] for k in sources]
        if phased:
            part_ins.append(ins[-1])
        part_outs = [outs[targets[0]]] if len(targets) == 1 else [outs[t] for t in targets]
        try:
            kernel(part_ins, part_outs, **attrs)
        except Exception as exc:
            exc.add_note(f"actorflow: in part {name!r} of the fused chain, built at {where}")
            raise
