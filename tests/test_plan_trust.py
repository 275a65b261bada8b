"""Loading a Plan runs nothing it says: functions import only from actorflow, numpy's
ufuncs and the modules a caller allows, functions carried by value unpickle only for a
caller who trusts the plan, and a keyed seal (an HMAC) detects tampering."""

from __future__ import annotations

import pickle
import sys

import msgpack
import numpy as np
import pytest

import actorflow as af
import userfns
from actorflow.plan_bytes import FORMAT_VERSION, _digest, _seal, _unseal


class _Touch:
    """Unpickled, it creates the file at ``path``: what an attacker's payload would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _sealed(payload: bytes) -> bytes:
    return msgpack.packb({"format": FORMAT_VERSION, "blake2b": _digest(payload), "plan": payload})


def _edited(data: bytes, function: dict) -> bytes:
    """``data`` resealed with every function entry replaced by ``function``."""

    def edit(value):
        if isinstance(value, dict):
            if "__function__" in value or "__pickled_function__" in value:
                return function
            return {k: edit(v) for k, v in value.items()}
        if isinstance(value, list):
            return [edit(v) for v in value]
        return value

    return _seal(msgpack.packb(edit(msgpack.unpackb(_unseal(data), strict_map_key=False))))


def _plan(fn=userfns.double) -> af.Plan:
    with af.Graph() as g:
        x = af.placeholder("x", (3,), "float64", "cpu:0")
        af.output("y", af.ops.call(fn, x, shape=(3,), dtype="float64", name="user"))
    return af.compile(g)


def test_a_file_that_is_not_a_plan_runs_nothing_as_it_is_refused(tmp_path):
    """The proof of concept: six lines of msgpack whose pickle would create a file."""
    path = tmp_path / "pwned"
    payload = msgpack.packb({"anything": {"__pickled_function__": pickle.dumps(_Touch(str(path)))}})
    with pytest.raises(af.PlanSerializationError):
        af.Plan.from_bytes(_sealed(payload))
    assert not path.exists()


def test_a_plan_whose_kernel_is_a_pickle_loads_only_when_trusted(tmp_path):
    path = tmp_path / "pwned"
    plan = _plan(lambda a: a * 3)
    evil = _edited(plan.to_bytes(), {"__pickled_function__": pickle.dumps(_Touch(str(path)))})
    with pytest.raises(af.PlanSerializationError, match=r"actor '.*': .*pickled.* trusted=True"):
        af.Plan.from_bytes(evil)
    assert not path.exists()
    back = af.Plan.from_bytes(plan.to_bytes(), trusted=True)
    np.testing.assert_array_equal(af.run(back, {"x": np.ones(3)})["y"], np.full(3, 3.0))


def test_a_function_of_a_module_not_allowed_is_refused_before_its_module_is_imported():
    sys.modules.pop("this", None)
    with pytest.raises(
        af.PlanSerializationError, match=r"function this:s is in module this.*allow=\['this'\]"
    ):
        af.Plan.from_bytes(_edited(_plan().to_bytes(), {"__function__": "this:s"}))
    assert "this" not in sys.modules


def test_allowed_modules_load_and_run():
    with pytest.raises(af.PlanSerializationError, match=r"allow=\['userfns'\]"):
        af.Plan.from_bytes(_plan().to_bytes())
    back = af.Plan.from_bytes(_plan().to_bytes(), allow=["userfns"])
    np.testing.assert_array_equal(af.run(back, {"x": np.ones(3)})["y"], np.full(3, 2.0))


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("actorflow.ops.kernels:np.load", "is not a function defined there"),
        ("numpy:load", "only ufuncs load"),
    ],
    ids=["through-an-allowed-module", "numpy-not-a-ufunc"],
)
def test_only_functions_defined_where_they_are_named_load(path, message):
    with pytest.raises(af.PlanSerializationError, match=message):
        af.Plan.from_bytes(_edited(_plan().to_bytes(), {"__function__": path}))


def test_numpy_ufuncs_load_by_default():
    with af.Graph() as g:
        x = af.placeholder("x", (3,), "float64", "cpu:0")
        af.output("y", af.ops.call(np.negative, x, shape=(3,), dtype="float64"))
    back = af.Plan.from_bytes(af.compile(g).to_bytes())
    np.testing.assert_array_equal(af.run(back, {"x": np.ones(3)})["y"], -np.ones(3))


def test_a_keyed_seal_detects_tampering_and_needs_its_key():
    plan = _plan()
    key = b"shared secret"
    data = plan.to_bytes(key=key)
    assert af.Plan.from_bytes(data, key=key, allow=["userfns"]) == plan
    sealed = msgpack.unpackb(data)
    changed = _unseal(_edited(plan.to_bytes(), {"__function__": "userfns:identity"}))
    forged = msgpack.packb({**sealed, "plan": changed})
    with pytest.raises(af.PlanSerializationError, match="HMAC does not match"):
        af.Plan.from_bytes(forged, key=key, allow=["userfns"])
    with pytest.raises(af.PlanSerializationError, match="HMAC does not match"):
        af.Plan.from_bytes(data, key=b"another key", allow=["userfns"])
    with pytest.raises(af.PlanSerializationError, match="sealed with a key: pass key="):
        af.Plan.from_bytes(data, allow=["userfns"])
    with pytest.raises(af.PlanSerializationError, match="not sealed with a key"):
        af.Plan.from_bytes(plan.to_bytes(), key=key, allow=["userfns"])
