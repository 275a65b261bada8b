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

``chain`` interprets the parts at every act. The runtime instead calls ``bind``'s
function (``chain.actorflow_bind``), the same calls generated once as straight-line code
(as torch.fx turns a graph into Python): about a microsecond less a part (the default model's kernels on
tiny arrays, called back to back: 1,289 against 1,128 µs a step).
"""

from __future__ import annotations

import functools
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
            _note(exc, name, where)
            raise


def bind(parts: Sequence[Part]) -> Callable[[list, list], None]:
    """``chain`` with ``parts`` bound: a function generated to call each part's kernel in
    turn on its places in ``ins`` and ``outs``, counting the part it is at, which a
    failure is noted with as ``chain`` notes it."""
    names: dict[str, Any] = {"parts": parts, "note": _note}
    lines = ["def chain(ins, outs):", "    try:"]
    for p, (kernel, attrs, sources, targets, phased, *_) in enumerate(parts):
        names[f"k{p}"] = functools.partial(kernel, **attrs) if attrs else kernel
        reads = [f"ins[{int(k)}]" if k >= 0 else f"outs[{~int(k)}]" for k in sources] + ["ins[-1]"] * phased
        writes = [f"outs[{int(t)}]" for t in targets]
        lines += [f"        p = {p}", f"        k{p}([{', '.join(reads)}], [{', '.join(writes)}])"]
    lines += ["        pass"] * (not parts) + [
        "    except Exception as exc:",
        "        note(exc, *parts[p][-2:])",
        "        raise",
    ]
    exec(compile("\n".join(lines), "<actorflow: a fused chain>", "exec"), names)
    return names["chain"]


def _note(exc: Exception, name: str, where: str) -> None:
    exc.add_note(f"actorflow: in part {name!r} of the fused chain, built at {where}")


chain.actorflow_bind = bind  # type: ignore[attr-defined]
