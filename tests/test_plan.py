"""The Plan as data: msgpack round trip, serialization errors, summary()."""

from __future__ import annotations

import re
import subprocess
import sys
import threading

import msgpack
import numpy as np
import pytest

import actorflow as af
import userfns
from actorflow.plan_bytes import _converter, _encode, _seal, _unseal


def build_graph(fn=userfns.double):
    rng = np.random.default_rng(0)
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 8), dtype="float32", device="cpu:0")
        w = af.parameter("w", rng.standard_normal((8, 3)).astype(np.float32), device="cpu:0")
        b = af.parameter("b", np.arange(3, dtype=np.float64), device="cpu:1")
        h = af.ops.relu(af.ops.matmul(x, w, name="mm"), name="h")
        h1 = af.ops.to_device(h, "cpu:1", name="cp")
        r = af.ops.all_reduce([h, h1], op="mean", name="ar")
        z = af.ops.call(fn, r[1], shape=(4, 3), dtype="float32", name="user")
        s = af.ops.reduce_sum(af.ops.transpose(z, name="t"), axis=(0,), keepdims=True, name="rsum")
        g0 = af.ops.all_gather([r[0], af.ops.slice(z, [0], [4], name="sl")], axis=1, name="ag")
        af.output("y", z)
        af.output("s", s)
        af.output("g", g0[0])
        af.output("bias", af.ops.exp(b, name="eb"))
    return g


@pytest.fixture
def plan():
    return af.compile(build_graph(), quota=2, quotas={"h": 3}, fuse_kernels=False)


def feeds(k: int = 0) -> dict:
    return {"x": np.random.default_rng(k).standard_normal((4, 8)).astype(np.float32)}


# -- round trip -----------------------------------------------------------------------


def test_round_trip_is_equal(plan):
    data = plan.to_bytes()
    assert isinstance(data, bytes)
    back = af.Plan.from_bytes(data, allow=["userfns"])
    assert back == plan
    assert back.to_bytes() == data


def test_round_trip_keeps_parameters_collectives_and_functions(plan):
    back = af.Plan.from_bytes(plan.to_bytes(), allow=["userfns"])
    assert [p.name for p in back.parameters] == ["w", "b"]
    for p, q in zip(plan.parameters, back.parameters):
        np.testing.assert_array_equal(p.value, q.value)
        assert p.value.dtype == q.value.dtype
        assert p.value.shape == q.value.shape
        assert q.value.flags.writeable
    assert [c.name for c in back.collectives] == ["ar", "ag"]
    assert back.collectives == plan.collectives
    user = next(a for a in back.actors if a.name == "user")
    assert user.attrs["fn"] is userfns.double
    for a, b in zip(plan.actors, back.actors):
        assert b.kernel is a.kernel
    assert back.memory == plan.memory
    assert back.streams == plan.streams
    assert back.events == plan.events
    assert [r.quota for r in back.registers] == [r.quota for r in plan.registers]


def test_round_tripped_plan_gives_the_same_outputs(plan):
    back = af.Plan.from_bytes(plan.to_bytes(), allow=["userfns"])
    batch = [feeds(k) for k in range(3)]
    want = af.run(plan, batch)
    got = af.run(back, batch)
    assert len(got) == len(want) == 3
    for w, g in zip(want, got):
        assert set(w) == set(g) == {"y", "s", "g", "bias"}
        for name in w:
            np.testing.assert_array_equal(w[name], g[name])


def test_round_trip_of_a_plan_without_parameters_or_collectives():
    with af.Graph() as g:
        x = af.placeholder("x", shape=(3,), dtype="int32", device="cpu:0")
        af.output("y", af.ops.relu(x))
    plan = af.compile(g, quota=1)
    back = af.Plan.from_bytes(plan.to_bytes())
    assert back == plan
    out = af.run(back, {"x": np.array([-1, 0, 5], np.int32)})
    np.testing.assert_array_equal(out["y"], [0, 0, 5])


# -- to_bytes errors -----------------------------------------------------------------------


def test_a_lambda_travels_by_value_and_runs_the_same():
    factor = np.float32(3)
    plan = af.compile(build_graph(fn=lambda a: a * factor))
    back = af.Plan.from_bytes(plan.to_bytes(), trusted=True)
    np.testing.assert_array_equal(af.run(back, feeds())["y"], af.run(plan, feeds())["y"])


def test_a_local_function_travels_by_value_and_runs_the_same():
    def local_triple(a):
        return a * 3

    plan = af.compile(build_graph(fn=local_triple), fuse_kernels=False)
    back = af.Plan.from_bytes(plan.to_bytes(), trusted=True)
    (user,) = [a for a in back.actors if a.name == "user"]
    assert user.attrs["fn"] is not local_triple
    np.testing.assert_array_equal(af.run(back, feeds())["y"], af.run(plan, feeds())["y"])


def test_a_kernel_of_a_script_loads_in_another_program(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        "import numpy as np\n"
        "import actorflow as af\n"
        "def halve(a):\n"
        "    return a / 2\n"
        "with af.Graph() as g:\n"
        "    x = af.placeholder('x', (2, 3), 'float32', 'cpu:0')\n"
        "    af.output('y', af.ops.call(halve, x, shape=(2, 3), dtype='float32'))\n"
        "open(sys.argv[1], 'wb').write(af.compile(g).to_bytes())\n"
    )
    subprocess.run([sys.executable, str(script), str(tmp_path / "plan.bin")], check=True, timeout=60)
    plan = af.Plan.from_bytes((tmp_path / "plan.bin").read_bytes(), trusted=True)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(af.run(plan, {"x": x})["y"], x / 2)


def test_a_function_that_cannot_travel_is_an_error_naming_the_actor():
    lock = threading.Lock()

    def locked(a):
        with lock:
            return a * 2

    plan = af.compile(build_graph(fn=locked), fuse_kernels=False)
    with pytest.raises(af.PlanSerializationError, match="'user'") as info:
        plan.to_bytes()
    assert "locked" in str(info.value)


def test_unserializable_plan_still_runs():
    lock = threading.Lock()

    def locked(a):
        with lock:
            return a * 2

    out = af.run(af.compile(build_graph(fn=locked)), feeds())
    ref = af.run(af.compile(build_graph()), feeds())
    np.testing.assert_array_equal(out["y"], ref["y"])


# -- from_bytes errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not a plan at all",
        bytes(range(256)),
        msgpack.packb([1, 2, 3]),
        msgpack.packb(7),
        msgpack.packb({"format": 999, "plan": {}}),
        msgpack.packb({"hello": "world"}),
    ],
    ids=["empty", "text", "bytes", "list", "int", "format", "dict"],
)
def test_garbage_is_a_plan_serialization_error(data):
    with pytest.raises(af.PlanSerializationError):
        af.Plan.from_bytes(data, allow=["userfns"])


def test_truncated_plan_is_a_plan_serialization_error(plan):
    data = plan.to_bytes()
    for cut in (1, len(data) // 2, len(data) - 1):
        with pytest.raises(af.PlanSerializationError):
            af.Plan.from_bytes(data[:cut], allow=["userfns"])


def resealed(payload: bytes) -> bytes:
    """Bytes whose digest matches a payload edited after to_bytes: what reaches the checks
    behind the digest."""
    return _seal(payload)


def edited(plan: af.Plan, edit) -> bytes:
    """``plan`` serialized after ``edit`` changed its unstructured form, sealed afresh."""
    data = _converter.unstructure(plan)
    edit(data)
    return resealed(msgpack.packb(data, default=_encode))


def load_error(data: bytes) -> af.PlanSerializationError:
    with pytest.raises(af.PlanSerializationError) as info:
        af.Plan.from_bytes(data, allow=["userfns"])
    return info.value


def named(items, name: str) -> int:
    return next(k for k, x in enumerate(items) if x["name"] == name)


def test_plan_naming_a_missing_function_is_a_plan_serialization_error(plan):
    payload = _unseal(plan.to_bytes()).replace(b"userfns:double", b"userfns:nosuch")
    assert "userfns:nosuch" in str(load_error(resealed(payload)))


def test_any_changed_byte_is_refused_by_the_digest(plan):
    data = bytearray(plan.to_bytes())
    for k in (len(data) // 3, len(data) // 2, len(data) - 20):
        changed = bytes(data[:k]) + bytes([data[k] ^ 0x04]) + bytes(data[k + 1 :])
        assert "digest does not match" in str(load_error(changed))


def test_a_plan_of_another_format_is_refused_naming_the_format(plan):
    payload = _unseal(plan.to_bytes())
    data = msgpack.packb({"format": 1, "plan": msgpack.unpackb(payload, strict_map_key=False)})
    assert "a serialized Plan of format 1; this actorflow reads format 4" in str(load_error(data))


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb({}),
        msgpack.packb([1, 2]),
        msgpack.packb({"actors": 3, "registers": []}),
        msgpack.packb({"__function__": 5}),
        b"\xc1",
    ],
    ids=["empty-plan", "list", "wrong-types", "bad-function", "not-msgpack"],
)
def test_corrupt_plan_is_a_plan_serialization_error(payload):
    load_error(resealed(payload))


# -- schema: the fields of every class, their types, nothing more ---------------------------


def test_an_unknown_key_is_refused_naming_it(plan):
    def misspell(data):
        reg = data["registers"][named(data["registers"], "h")]
        reg["consulers"] = reg.pop("consumers")

    message = str(load_error(edited(plan, misspell)))
    assert (
        "Register without ['consumers'] and with unknown keys ['consulers'] @ $plan.registers[4]" in message
    )


@pytest.mark.parametrize(
    ("kind", "field"), [("actors", "kernel"), ("registers", "quota"), ("streams", "rank")]
)
def test_a_missing_key_is_refused_naming_where_even_with_a_default(plan, kind, field):
    def drop(data):
        del data[kind][2][field]

    message = str(load_error(edited(plan, drop)))
    assert f"without [{field!r}] @ $plan.{kind}[2]" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("quota", "2"),
        ("quota", 2.0),
        ("quota", True),
        ("shape", "ab"),
        ("shape", b"ab"),
        ("name", 7),
        ("control", 1),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_naming_where(plan, field, value):
    def retype(data):
        data["registers"][1][field] = value

    message = str(load_error(edited(plan, retype)))
    assert f"$plan.registers[1].{field}" in message


def test_a_function_field_that_is_not_a_function_is_refused(plan):
    def unfunction(data):
        data["actors"][0]["kernel"] = {"__funktion__": "actorflow.ops.kernels:copy"}

    assert "$plan.actors[0].kernel" in str(load_error(edited(plan, unfunction)))


# -- consistency: ids, consumers, streams, events, ends, ranks, deadlock ------------------------


def test_a_consumer_that_does_not_exist_is_refused_naming_the_register(plan):
    def dangle(data):
        reg = data["registers"][named(data["registers"], "h")]
        reg["consumers"] = (*reg["consumers"], {"actor": 99, "slot": 0, "call": 0})

    error = load_error(edited(plan, dangle))
    assert "register 'h': consumer actor 99 does not exist" in str(error)
    assert type(error.__cause__) is af.CompileError


def test_an_input_its_register_does_not_list_is_refused_naming_both(plan):
    def forget(data):
        data["registers"][named(data["registers"], "h")]["consumers"] = ()

    assert "reads register 'h' (input 0), which does not list it" in str(load_error(edited(plan, forget)))


def test_an_input_from_another_stream_without_an_event_is_refused_naming_the_stream(plan):
    def unsync(data):
        mm = data["actors"][named(data["actors"], "mm")]
        mm["inputs"] = ({**mm["inputs"][0], "sync": "stream"}, *mm["inputs"][1:])

    message = str(load_error(edited(plan, unsync)))
    assert "actor 'mm': input 0" in message and "'cpu:0/copy'" in message


def test_an_actor_on_another_devices_stream_is_refused(plan):
    def move(data):
        streams = data["streams"]
        data["actors"][named(data["actors"], "mm")]["stream"] = named(streams, "cpu:1/compute")

    message = str(load_error(edited(plan, move)))
    assert "actor 'mm'" in message and "cpu:1/compute" in message


def test_a_register_whose_shape_changed_after_planning_is_refused(plan):
    def reshape(data):
        data["registers"][named(data["registers"], "mm")]["shape"] = (4, 4)

    assert "planned memory does not match" in str(load_error(edited(plan, reshape)))


def test_a_feed_that_disagrees_with_its_register_is_refused(plan):
    def reshape(data):
        data["feeds"][0]["shape"] = (4, 9)

    assert "feed 'x' is float32[4, 9]" in str(load_error(edited(plan, reshape)))


def test_an_attribute_the_kernel_does_not_take_is_refused_naming_the_actor(plan):
    def misspell(data):
        rsum = data["actors"][named(data["actors"], "rsum")]
        rsum["attrs"] = {("keepdimz" if k == "keepdims" else k): v for k, v in rsum["attrs"].items()}

    message = str(load_error(edited(plan, misspell)))
    assert "actor 'rsum'" in message and "keepdimz" in message


def test_a_collective_order_that_can_deadlock_is_refused_naming_the_cycle(plan):
    def reverse(data):
        data["collectives"] = data["collectives"][::-1]

    error = load_error(edited(plan, reverse))
    assert "wait-for cycle" in str(error) and "collective order" in str(error)
    assert type(error.__cause__) is af.DeadlockError


def test_a_plan_over_ranks_round_trips_and_its_sends_are_checked(plan):
    over_ranks = af.compile(build_graph(), ranks=2)
    assert af.Plan.from_bytes(over_ranks.to_bytes(), allow=["userfns"]) == over_ranks
    sends = [a.name for a in over_ranks.actors if a.kind == "send"]
    assert sends

    def retag(data):
        send = data["actors"][named(data["actors"], sends[0])]
        send["attrs"] = {**send["attrs"], "tag": 999}

    message = str(load_error(edited(over_ranks, retag)))
    assert re.search(r"(send|recv) actor '[^']+' \(tag \d+\) has no (recv|send) actor", message)

    def misdirect(data):
        send = data["actors"][named(data["actors"], sends[0])]
        send["attrs"] = {**send["attrs"], "peer": 0}

    assert f"send actor {sends[0]!r} names rank 0" in str(load_error(edited(over_ranks, misdirect)))


# -- summary --------------------------------------------------------------------------------


def test_summary_mentions_streams_actors_quotas_events_collectives_and_memory(plan):
    text = plan.summary()
    assert text.splitlines()[0] == (
        f"Plan: {len(plan.actors)} actors on {len(plan.streams)} streams, "
        f"2 collectives, {len(plan.events)} events"
    )
    for s in plan.streams:
        assert f"stream {s.name}" in text
    for a in plan.actors:
        assert a.name in text
    assert "out h: float32[4, 3] quota 3" in text
    assert "out mm: float32[4, 3] quota 2" in text
    assert "w (parameter)" in text
    assert "x (event)" in text  # mm waits on the feed's event
    assert "h (completion)" in text  # the copy stream of cpu:1 is fed by several streams
    assert "events (producer -> consumer" in text
    assert "x (cpu:0/copy) -> mm (cpu:0/compute)" in text
    assert "collective order" in text
    # a ring all-reduce sends 2(n-1)/n of its input from each of n devices, an all-gather
    # (n-1) inputs
    ar, ag = (plan.actors[c.actors[0]] for c in plan.collectives)
    ar_bytes = 2 * plan.registers[ar.inputs[0].register].nbytes
    ag_bytes = 2 * plan.registers[ag.inputs[0].register].nbytes
    assert f"0. ar (all_reduce over 2 devices, {ar_bytes} bytes an act)" in text
    assert f"1. ag (all_gather over 2 devices, {ag_bytes} bytes an act)" in text
    assert f"predicted communication: {ar_bytes + ag_bytes} bytes a step over the links" in text
    assert "planned memory" in text
    for device, nbytes in plan.memory.items():
        assert f"{device}: {nbytes / 1024:.1f} KiB" in text


def test_summary_lists_collectives_in_plan_order():
    with af.Graph() as g:
        x0 = af.placeholder("x0", shape=(2,), device="cpu:0")
        x1 = af.placeholder("x1", shape=(2,), device="cpu:1")
        a = af.ops.all_reduce([x0, x1], name="first")
        b = af.ops.all_reduce([af.ops.exp(a[0]), af.ops.exp(a[1])], name="second")
        af.output("y", b[0])
    text = af.compile(g, fuse_kernels=False).summary()
    assert text.index("0. first") < text.index("1. second")


def test_a_parameter_naming_a_register_of_several_buffers_is_refused(plan):
    def repoint(data):
        data["parameters"][0]["register"] = named(data["registers"], "mm")

    message = str(load_error(edited(plan, repoint)))
    assert (
        "parameter 'w' names register 'mm', which is not a parameter's or a variable's one buffer" in message
    )
