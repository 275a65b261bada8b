"""SBP: how a logical tensor maps onto the devices of its placement (OneFlow's terms).

``S(axis)``: split into equal parts along ``axis``, part k on device k; ``B``: every
device holds the whole tensor; ``P``: every device holds a partial value, the tensor is
their sum.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Split:
    axis: int

    def __repr__(self) -> str:
        return f"S({self.axis})"


@attrs.frozen
class Broadcast:
    def __repr__(self) -> str:
        return "B"


@attrs.frozen
class Partial:
    def __repr__(self) -> str:
        return "P"


SBP = Split | Broadcast | Partial
S = Split
B = Broadcast()
P = Partial()


def sbp_code(sbp: SBP) -> tuple[str, int]:
    """("S", axis), ("B", 0) or ("P", 0): how a Plan records it."""
    if isinstance(sbp, Split):
        return "S", sbp.axis
    return ("B", 0) if isinstance(sbp, Broadcast) else ("P", 0)
