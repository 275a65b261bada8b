"""records.evolve against attrs.evolve, on the Plan's own records and on a class with a
private field (whose init argument is its alias)."""

from __future__ import annotations

import attrs
import pytest

from actorflow.plan import Actor, Input, Register
from actorflow.records import evolve


@attrs.frozen
class Private:
    _hidden: int
    shown: str = "x"


def kernel() -> None:
    pass


ACTOR = Actor(3, "a", "compute", "relu", kernel, {"k": 1}, "cpu:0", (Input(1, "event"),), (2,))


@pytest.mark.parametrize(
    ("record", "changes"),
    [
        (ACTOR, {}),
        (ACTOR, {"stream": 4, "priority": -2}),
        (ACTOR, {"inputs": (), "weight_grad": True}),
        (Register(0, "r", 1, "cpu:0", (2, 3), "float32"), {"quota": 3}),
        (Private(1), {"hidden": 2}),
        (Private(1, "y"), {"shown": "z"}),
    ],
)
def test_evolve_equals_attrs_evolve(record, changes):
    got = evolve(record, **changes)
    assert got == attrs.evolve(record, **changes)
    assert type(got) is type(record)
    assert got is not record


def test_an_unknown_field_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="priorty"):
        evolve(ACTOR, priorty=1)
