"""The runtime: failures, stalls, feed checks, Session, Runtime in trio, traces, results."""

from __future__ import annotations

import json
import os
import threading
import traceback

import attrs
import numpy as np
import pytest
import trio

import actorflow as af
import userfns
from graphs import two_collective_graph

# -- helpers ---------------------------------------------------------------------------------

idents: list[int] = []


def record_ident(a):
    """Identity that records the OS thread it ran on (run-only: the plan is never serialized)."""
    idents.append(threading.get_ident())
    return a


def fail_on_three(a):
    if a.flat[0] == 3:
        raise ZeroDivisionError("three is right out")
    return a


def ones(k: float = 1.0, shape=(4, 8)) -> dict:
    return {"x": np.full(shape, k, np.float32)}


def stream_threads(plan: af.Plan, before: set) -> list[threading.Thread]:
    """Live threads, started since ``before``, named like one of the plan's streams."""
    names = {s.name for s in plan.streams}
    return [t for t in threading.enumerate() if t not in before and t.name in names and t.is_alive()]


def failing_plan(fn=userfns.fail):
    """x on cpu:0 -> relu -> copy to cpu:1 -> call(fn) named 'boom' on cpu:1."""
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 8), dtype="float32", device="cpu:0")
        h = af.ops.relu(x, name="h")
        h1 = af.ops.to_device(h, "cpu:1", name="cp")
        z = af.ops.call(fn, h1, shape=(4, 8), dtype="float32", name="boom")
        af.output("y", z)
    return af.compile(g, quota=2)


def two_device_plan(fn=userfns.thread_name, quota=2):
    """The README's graph: y = fn(2 * relu(x @ w)) with w = 1 (an all-reduce of two copies)."""
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 8), dtype="float32", device="cpu:0")
        w = af.parameter("w", np.ones((8, 3), np.float32), device="cpu:0")
        h = af.ops.relu(af.ops.matmul(x, w, name="mm"), name="h")
        h1 = af.ops.to_device(h, "cpu:1", name="cp")
        r = af.ops.all_reduce([h, h1], op="sum", name="ar")
        z = af.ops.call(fn, r[1], shape=(4, 3), dtype="float32", name="user")
        af.output("y", z)
        af.output("h_out", h)
    return af.compile(g, quota=quota, fuse_kernels=False)


def reference(x: np.ndarray) -> np.ndarray:
    return 2 * np.maximum(x @ np.ones((8, 3), np.float32), 0)


def two_collective_plan():
    return af.compile(two_collective_graph())


def check_note(exc: BaseException, actor: str, stream: str, iteration: int) -> None:
    notes = getattr(exc, "__notes__", [])
    assert len(notes) == 1, notes
    note = notes[0]
    assert repr(actor) in note
    assert repr(stream) in note
    assert f"iteration {iteration}" in note


# -- (a) a failing kernel ---------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_failing_kernel_raises_itself_from_af_run():
    plan = failing_plan()
    before = set(threading.enumerate())
    with pytest.raises(ZeroDivisionError, match="on purpose") as info:
        af.run(plan, [ones() for _ in range(6)])
    assert type(info.value) is ZeroDivisionError
    check_note(info.value, "boom", "cpu:1/compute", 0)
    assert "test_runtime.py" in info.value.__notes__[0]  # where the op was built
    assert stream_threads(plan, before) == []


def test_failing_kernel_note_names_the_failing_iteration():
    plan = failing_plan(fail_on_three)
    before = set(threading.enumerate())
    with pytest.raises(ZeroDivisionError, match="right out") as info:
        af.run(plan, [ones(k) for k in range(6)])
    assert type(info.value) is ZeroDivisionError
    check_note(info.value, "boom", "cpu:1/compute", 3)
    assert stream_threads(plan, before) == []


def test_kernel_returning_the_wrong_shape_fails_with_a_note():
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2, 3), device="cpu:0")
        af.output("y", af.ops.call(userfns.identity, x, shape=(3, 2), name="liar"))
    with pytest.raises(
        af.KernelError, match=r"returned shape \(2, 3\), but the graph declared float32\[3, 2\]"
    ) as info:
        af.run(af.compile(g), {"x": np.zeros((2, 3), np.float32)})
    check_note(info.value, "liar", "cpu:0/compute", 0)


@pytest.mark.timeout(10)
def test_failing_kernel_raises_itself_from_session_run():
    plan = failing_plan()
    before = set(threading.enumerate())
    session = af.Session(plan)
    try:
        with pytest.raises(ZeroDivisionError) as info:
            session.run([ones() for _ in range(6)])
        assert type(info.value) is ZeroDivisionError
        check_note(info.value, "boom", "cpu:1/compute", 0)
        # after a failure the session is closed, and says so
        with pytest.raises(RuntimeError, match="closed"):
            session.run(ones())
    finally:
        session.close()
    assert stream_threads(plan, before) == []
    assert not any(t.name == "actorflow-session" for t in threading.enumerate() if t not in before)


async def test_failing_kernel_raises_itself_from_runtime_run():
    with trio.fail_after(10):
        plan = failing_plan()
        before = set(threading.enumerate())
        with pytest.raises(ZeroDivisionError) as info:
            async with af.Runtime(plan) as rt:
                await rt.run([ones() for _ in range(6)])
        assert type(info.value) is ZeroDivisionError
        check_note(info.value, "boom", "cpu:1/compute", 0)
        assert stream_threads(plan, before) == []


async def test_failed_runtime_keeps_raising_the_error():
    with trio.fail_after(10):
        plan = failing_plan()
        before = set(threading.enumerate())
        async with af.Runtime(plan) as rt:
            with pytest.raises(ZeroDivisionError) as first:
                await rt.run([ones() for _ in range(3)])
            assert rt.failed
            with pytest.raises(ZeroDivisionError) as second:
                await rt.run(ones())
            assert second.value is first.value
        assert stream_threads(plan, before) == []


def raise_group(a):
    raise ExceptionGroup("kernel group", [ValueError("v"), KeyError("k")])


def raise_group_of_one(a):
    raise ExceptionGroup("kernel group of one", [ValueError("only")])


def group_plan(fn):
    with af.Graph() as g:
        x = af.placeholder("x", shape=(2,), device="cpu:0")
        af.output("y", af.ops.call(fn, x, shape=(2,), name="grouper"))
    return af.compile(g)


X2 = {"x": np.ones(2, np.float32)}


def test_kernel_raising_an_exception_group_raises_it_from_session_run():
    with af.Session(group_plan(raise_group)) as s:
        with pytest.RaisesGroup(ValueError, KeyError, match="kernel group") as info:
            s.run(X2)
    check_note(info.value, "grouper", "cpu:0/compute", 0)


def test_kernel_raising_an_exception_group_raises_it_from_af_run():
    with pytest.RaisesGroup(ValueError, KeyError, match="kernel group") as info:
        af.run(group_plan(raise_group), X2)
    check_note(info.value, "grouper", "cpu:0/compute", 0)


def test_kernel_raising_a_group_of_one_raises_the_group_from_af_run():
    with pytest.RaisesGroup(ValueError, match="kernel group of one") as info:
        af.run(group_plan(raise_group_of_one), X2)
    check_note(info.value, "grouper", "cpu:0/compute", 0)


async def test_kernel_raising_an_exception_group_raises_it_from_runtime_run():
    with trio.fail_after(10):
        with pytest.RaisesGroup(ValueError, KeyError, match="kernel group") as info:
            async with af.Runtime(group_plan(raise_group)) as rt:
                await rt.run(X2)
        check_note(info.value, "grouper", "cpu:0/compute", 0)


# -- (b) stalls -------------------------------------------------------------------------------


async def test_a_kernel_that_never_ends_raises_stall_error():
    with trio.fail_after(10):
        with af.Graph() as g:
            x = af.placeholder("x", shape=(2, 3), device="cpu:0")
            af.output("y", af.ops.call(userfns.blocked, af.ops.relu(x), shape=(2, 3), name="sloth"))
        plan = af.compile(g)
        before = set(threading.enumerate())
        userfns.arm_blocked()
        async with af.Runtime(plan, stall_timeout=0.3) as rt:
            try:
                with pytest.raises(af.StallError) as info:
                    await rt.run({"x": np.ones((2, 3), np.float32)})
            finally:
                userfns.release()  # the runtime's exit waits for the kernel to return
    message = str(info.value)
    assert "stall_timeout=0.3" in message
    assert "cpu:0/compute" in message  # the stream with the unfinished kernel
    assert stream_threads(plan, before) == []


@pytest.mark.timeout(10)
@pytest.mark.usefixtures("collectives_in_order")
def test_reversed_collective_order_stalls_and_says_who_waits():
    plan = two_collective_plan()
    bad = attrs.evolve(plan, collectives=plan.collectives[::-1])  # check() would refuse it
    before = set(threading.enumerate())
    feeds = {"x0": np.ones((2, 3), np.float32), "x1": np.ones((2, 3), np.float32)}
    with pytest.raises(af.StallError) as info:
        af.run(bad, feeds, stall_timeout=0.3)
    message = str(info.value)
    assert "Waiting actors" in message
    assert "next in collective order is 'ar2'" in message
    for waiting in ("ar2[cpu:0]", "ar2[cpu:1]", "r0", "r1", "y0", "y1"):
        assert f"  {waiting} on " in message, waiting
    assert "input 'r0' from 'r0' not ready" in message
    assert stream_threads(bad, before) == []
    # the plan in the right order runs
    out = af.run(plan, feeds)
    np.testing.assert_array_equal(out["y1"], np.full((2, 3), 4, np.float32))


@pytest.mark.usefixtures("collectives_in_order")
def test_stall_closes_the_session():
    plan = two_collective_plan()
    bad = attrs.evolve(plan, collectives=plan.collectives[::-1])
    before = set(threading.enumerate())
    feeds = {"x0": np.ones((2, 3), np.float32), "x1": np.ones((2, 3), np.float32)}
    with af.Session(bad, stall_timeout=0.3) as s:
        with pytest.raises(af.StallError, match="ar2"):
            s.run(feeds)
        with pytest.raises(RuntimeError, match="closed"):
            s.run(feeds)
    assert stream_threads(bad, before) == []


def test_in_one_process_collectives_launch_when_they_can_whatever_their_order():
    plan = two_collective_plan()
    bad = attrs.evolve(plan, collectives=plan.collectives[::-1])
    feeds = {"x0": np.ones((2, 3), np.float32), "x1": np.ones((2, 3), np.float32)}
    out = af.run(bad, feeds, stall_timeout=5.0)
    np.testing.assert_array_equal(out["y1"], np.full((2, 3), 4, np.float32))


# -- (c) bad feeds -----------------------------------------------------------------------------

GOOD = np.ones((4, 8), np.float32)


@pytest.mark.parametrize(
    "feeds, match",
    [
        ({}, "missing \\['x'\\]"),
        ({"x": GOOD, "extra": GOOD}, "unknown \\['extra'\\]"),
        ({"x": np.ones((8, 4), np.float32)}, "float32\\[8, 4\\].*float32\\[4, 8\\]"),
        ({"x": np.ones((4, 8), np.float64)}, "float64\\[4, 8\\].*float32\\[4, 8\\]"),
        ({"x": np.ones((4, 8), np.int32)}, "int32"),
        ([{"x": GOOD}, {"x": GOOD}, {}], "iteration 2: .*missing"),
        ([{"x": GOOD}, {"x": GOOD}, {"x": GOOD, "y": GOOD}], "iteration 2: .*unknown \\['y'\\]"),
        ([{"x": GOOD}, {"x": GOOD}, {"x": GOOD[:2]}], "iteration 2: .*float32\\[2, 8\\]"),
        ([{"x": GOOD}, {"x": GOOD}, {"x": GOOD.astype(np.float16)}], "iteration 2: .*float16"),
        ([{"x": GOOD}, {"x": GOOD}, [GOOD]], "iteration 2: .*dict"),
        ([{"x": GOOD}, {"x": GOOD}, GOOD], "iteration 2: .*dict"),
        (None, "missing"),
        ("x", "dict"),
        (GOOD, "dict"),
    ],
    ids=[
        "missing",
        "extra",
        "shape",
        "dtype",
        "int-dtype",
        "list-missing",
        "list-extra",
        "list-shape",
        "list-dtype",
        "list-not-a-dict",
        "list-array",
        "none",
        "string",
        "array",
    ],
)
def test_bad_feeds_raise_feed_error_and_run_nothing(feeds, match):
    plan = two_device_plan()
    with af.Session(plan) as s:
        calls = len(userfns.calls)
        with pytest.raises(af.FeedError, match=match):
            s.run(feeds)
        assert len(userfns.calls) == calls  # no kernel ran
        # the session is still fine, and counts iterations from 0
        out = s.run([{"x": GOOD}, {"x": 2 * GOOD}])
        assert len(userfns.calls) == calls + 2
        np.testing.assert_array_equal(out[1]["y"], reference(2 * GOOD))


def test_bad_feeds_raise_feed_error_from_af_run():
    plan = two_device_plan()
    calls = len(userfns.calls)
    with pytest.raises(af.FeedError):
        af.run(plan, [{"x": GOOD}, {"x": GOOD}, {"x": GOOD.astype(np.float64)}])
    with pytest.raises(af.FeedError, match="dict"):
        af.run(plan, [{"x": GOOD}, "x"])
    with pytest.raises(ValueError):  # a FeedError is a ValueError too
        af.run(plan, {"y": GOOD})
    assert len(userfns.calls) == calls


@pytest.mark.parametrize("api", ["run", "session"])
def test_a_feed_error_is_raised_before_trio_so_its_traceback_is_short(api):
    plan = two_device_plan()
    bad = {"x": GOOD[:2]}
    with pytest.raises(af.FeedError) as info:
        if api == "run":
            af.run(plan, bad)
        else:
            with af.Session(plan) as s:
                s.run(bad)
    files = [frame.filename for frame in traceback.extract_tb(info.tb)]
    assert not [f for f in files if f"{os.sep}trio{os.sep}" in f], files
    assert len(files) <= 6, files


def test_feeds_that_are_not_a_dict_or_a_list_raise_feed_error():
    plan = two_device_plan()
    with af.Session(plan) as s:
        with pytest.raises(af.FeedError):
            s.run(5)


async def test_bad_feeds_in_runtime_leave_it_usable():
    with trio.fail_after(10):
        plan = two_device_plan()
        async with af.Runtime(plan) as rt:
            calls = len(userfns.calls)
            with pytest.raises(af.FeedError, match="iteration 2"):
                await rt.run([{"x": GOOD}, {"x": GOOD}, {"x": GOOD.T}])
            assert len(userfns.calls) == calls
            out = await rt.run({"x": GOOD})
            np.testing.assert_array_equal(out["y"], reference(GOOD))
            assert len(userfns.calls) == calls + 1


# -- (d) Session --------------------------------------------------------------------------------


def test_session_keeps_its_stream_threads_across_calls():
    plan = two_device_plan(fn=record_ident)
    before = set(threading.enumerate())
    with af.Session(plan) as s:
        idents.clear()
        s.run([{"x": GOOD}] * 3)
        threads1 = {t.name: t.ident for t in stream_threads(plan, before)}
        first = set(idents)
        s.run([{"x": GOOD}] * 3)
        threads2 = {t.name: t.ident for t in stream_threads(plan, before)}
        second = set(idents) - first
        assert sorted(threads1) == sorted(s.name for s in plan.streams)
        assert threads1 == threads2
        assert len(first) == 1  # one compute stream thread ran every call kernel
        assert second == set()  # ... and the same one the second time
        assert first == {threads1["cpu:1/compute"]}
        assert threading.get_ident() not in first
    assert stream_threads(plan, before) == []


def test_session_runs_kernels_on_the_stream_threads():
    plan = two_device_plan()
    with af.Session(plan) as s:
        calls = len(userfns.calls)
        s.run([{"x": GOOD}] * 2)
        assert userfns.calls[calls:] == [("thread_name", "cpu:1/compute")] * 2


def test_session_parameters_by_name():
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((8, 3)).astype(np.float32)
    b1 = np.arange(3, dtype=np.float64)
    with af.Graph() as g:
        x = af.placeholder("x", shape=(4, 8), device="cpu:0")
        w = af.parameter("w", w0, device="cpu:0")
        b = af.parameter("b", b1, device="cpu:1")
        af.output("y", af.ops.matmul(x, w))
        af.output("eb", af.ops.exp(b))
    with af.Session(af.compile(g)) as s:
        params = s.parameters()
        assert set(params) == {"w", "b"}
        np.testing.assert_array_equal(params["w"], w0)
        np.testing.assert_array_equal(params["b"], b1)
        assert params["b"].dtype == np.float64
        params["w"][:] = 0  # a copy: the session's value does not change
        out = s.run({"x": GOOD})
        np.testing.assert_allclose(out["y"], GOOD @ w0, rtol=1e-5)
        np.testing.assert_array_equal(s.parameters()["w"], w0)


def test_closed_session_raises():
    plan = two_device_plan()
    s = af.Session(plan)
    s.run({"x": GOOD})
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.run({"x": GOOD})
    with pytest.raises(RuntimeError, match="closed"):
        s.parameters()
    with pytest.raises(RuntimeError, match="closed"):
        s.register_stats()
    s.close()  # closing twice is fine


def test_session_register_stats_stay_within_quota():
    plan = two_device_plan(fn=userfns.sleepy, quota=2)
    with af.Session(plan) as s:
        s.run([{"x": GOOD}] * 8)
        stats = s.register_stats()
    assert set(stats) == {r.name for r in plan.registers if not r.is_parameter}
    for name, st in stats.items():
        assert st["quota"] == 2
        assert 1 <= st["max_held"] <= 2, name


# -- (e) Runtime in the caller's trio loop -----------------------------------------------------


async def test_runtime_runs_several_times_in_one_trio_loop():
    with trio.fail_after(10):
        plan = two_device_plan(fn=userfns.sleepy)
        rng = np.random.default_rng(0)
        async with af.Runtime(plan) as rt:
            for n in (1, 3, 2):
                xs = [rng.standard_normal((4, 8)).astype(np.float32) for _ in range(n)]
                outs = await rt.run([{"x": x} for x in xs])
                assert len(outs) == n
                for x, out in zip(xs, outs):
                    np.testing.assert_allclose(out["y"], reference(x), rtol=1e-5)
            single = await rt.run({"x": xs[0]})
            assert isinstance(single, dict)
            np.testing.assert_allclose(single["y"], reference(xs[0]), rtol=1e-5)
            assert await rt.run([]) == []


async def test_runtime_serves_concurrent_runs():
    with trio.fail_after(10):
        plan = two_device_plan(fn=userfns.sleepy)
        results: dict[int, list] = {}
        async with af.Runtime(plan) as rt:

            async def one(k: int) -> None:
                results[k] = await rt.run([{"x": np.full((4, 8), k, np.float32)}] * 3)

            async with trio.open_nursery() as nursery:
                for k in range(4):
                    nursery.start_soon(one, k)
        for k in range(4):
            for out in results[k]:
                np.testing.assert_array_equal(out["y"], reference(np.full((4, 8), k, np.float32)))


async def test_error_in_the_callers_body_propagates_as_itself():
    with trio.fail_after(10):
        plan = two_device_plan()
        before = set(threading.enumerate())
        with pytest.raises(KeyError, match="mine"):
            async with af.Runtime(plan) as rt:
                await rt.run({"x": GOOD})
                raise KeyError("mine")
        assert stream_threads(plan, before) == []


async def test_cancelling_a_run_from_outside_stops_cleanly():
    with trio.fail_after(10):
        with af.Graph() as g:
            x = af.placeholder("x", shape=(2, 3), device="cpu:0")
            af.output("y", af.ops.call(userfns.blocked, x, shape=(2, 3)))
        plan = af.compile(g)
        before = set(threading.enumerate())
        userfns.arm_blocked()
        with trio.CancelScope() as scope:
            async with af.Runtime(plan) as rt:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(userfns.cancel_once_entered, scope)
                    try:
                        await rt.run({"x": np.ones((2, 3), np.float32)})
                    finally:
                        userfns.release()
        assert scope.cancelled_caught
        assert stream_threads(plan, before) == []


# -- (f) traces ----------------------------------------------------------------------------------


def test_trace_is_chrome_json_with_named_tracks_and_no_overlap(tmp_path):
    plan = two_device_plan(fn=userfns.sleepy)
    path = tmp_path / "run.trace.json"
    n = 4
    outs = af.run(plan, [{"x": GOOD}] * n, trace=path)
    assert len(outs) == n
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    spans = [e for e in events if e["ph"] == "X" and e["cat"] not in ("wait", "step")]
    meta = [e for e in events if e["ph"] == "M"]

    units = {c.name for c in plan.collectives} | {a.name for a in plan.actors if a.group < 0}
    assert len(spans) == n * len(units)
    seen = set()
    for e in spans:
        for key in ("name", "ts", "dur", "pid", "tid", "args"):
            assert key in e, (key, e)
        assert e["dur"] >= 0
        assert e["ts"] >= 0
        assert e["args"]["actor"] == e["name"]
        assert 0 <= e["args"]["iteration"] < n
        seen.add((e["name"], e["args"]["iteration"]))
    assert seen == {(u, k) for u in units for k in range(n)}

    process_names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    thread_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    for e in spans:
        assert e["pid"] in process_names
        assert (e["pid"], e["tid"]) in thread_names
    assert set(thread_names.values()) == {s.name for s in plan.streams} | {"steps"}
    assert set(process_names.values()) == {s.device for s in plan.streams} | {"host"}
    by_name = {a.name: a for a in plan.actors}
    for e in spans:
        actor = by_name.get(e["name"]) or by_name[f"{e['name']}[cpu:0]"]
        stream = plan.streams[actor.stream]
        assert thread_names[(e["pid"], e["tid"])] == stream.name
        assert process_names[e["pid"]] == stream.device

    tracks: dict[tuple[int, int], list] = {}
    for e in spans:
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track in tracks.values():
        track.sort(key=lambda e: e["ts"])
        for a, b in zip(track, track[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)


def test_no_trace_without_asking():
    plan = two_device_plan()
    with af.Session(plan) as s:
        s.run({"x": GOOD})
        assert s.recorder.spans == []
    with af.Session(plan, trace=True) as s:
        s.run([{"x": GOOD}] * 2)
        assert len(s.recorder.spans) > 0


# -- (g) results ----------------------------------------------------------------------------------


def test_multi_iteration_results_come_back_in_feed_order():
    plan = two_device_plan(fn=userfns.sleepy, quota=2)
    xs = [np.full((4, 8), k, np.float32) for k in range(10)]
    outs = af.run(plan, [{"x": x} for x in xs])
    assert isinstance(outs, list)
    assert len(outs) == len(xs)
    for x, out in zip(xs, outs):
        assert set(out) == {"y", "h_out"}
        np.testing.assert_array_equal(out["y"], reference(x))
        np.testing.assert_array_equal(out["h_out"], reference(x) / 2)


def test_single_dict_gives_a_dict_and_a_list_of_one_gives_a_list():
    plan = two_device_plan()
    single = af.run(plan, {"x": GOOD})
    assert isinstance(single, dict)
    listed = af.run(plan, [{"x": GOOD}])
    assert isinstance(listed, list) and len(listed) == 1
    np.testing.assert_array_equal(single["y"], listed[0]["y"])
    assert af.run(plan, []) == []


def test_results_are_independent_copies():
    plan = two_device_plan(quota=1)
    outs = af.run(plan, [{"x": np.full((4, 8), k, np.float32)} for k in range(4)])
    ys = [o["y"] for o in outs]
    assert len({id(y) for y in ys}) == 4
    for k, y in enumerate(ys):
        np.testing.assert_array_equal(y, reference(np.full((4, 8), k, np.float32)))


@pytest.mark.parametrize("quota", [1, 2, 3])
def test_results_in_order_across_quotas_in_a_session(quota):
    plan = two_device_plan(fn=userfns.sleepy, quota=quota)
    with af.Session(plan) as s:
        for n in (3, 5):
            xs = [np.full((4, 8), 10 * n + k, np.float32) for k in range(n)]
            outs = s.run([{"x": x} for x in xs])
            assert [float(o["y"][0, 0]) for o in outs] == [float(reference(x)[0, 0]) for x in xs]


def test_plan_without_placeholders_runs_with_no_feeds():
    with af.Graph() as g:
        w = af.parameter("w", np.arange(6, dtype=np.float32).reshape(2, 3), device="cpu:1")
        af.output("w_out", w)
        af.output("e", af.ops.exp(w))
    plan = af.compile(g)
    out = af.run(plan)
    np.testing.assert_array_equal(out["w_out"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert len(af.run(plan, [{}, {}])) == 2


def test_a_session_run_goes_through_no_round_trip_of_trios_loop(monkeypatch):
    """``Session.run`` hands the run over from the caller's thread and the last stream
    wakes it: it neither calls into trio's loop nor waits on it."""
    plan = two_device_plan()
    with af.Session(plan) as s:
        s.run({"x": GOOD})

        def refused(*args, **kwargs):
            raise AssertionError("a run called into trio's loop")

        monkeypatch.setattr(trio.from_thread, "run", refused)
        monkeypatch.setattr(trio.from_thread, "run_sync", refused)
        np.testing.assert_array_equal(s.run({"x": GOOD})["y"], reference(GOOD))
        outs = s.run([{"x": GOOD}, {"x": -GOOD}])
        np.testing.assert_array_equal(outs[1]["y"], reference(-GOOD))
        monkeypatch.undo()  # closing the session stops trio's loop through it


def test_a_failure_told_as_a_session_run_starts_ends_the_run_with_it(monkeypatch):
    """A failure that reaches the runtime between a run's checks and its start (a lost
    rank, heard by the transport just then) finds no waiter to wake; the run's start sees
    it instead, and the run raises it rather than waiting for good."""
    plan = two_device_plan()
    raised: list[BaseException] = []
    with af.Session(plan) as s:
        s.run({"x": GOOD})
        runtime = s._runtime
        begin = runtime._begin

        def failing_first(arrays, wake):
            runtime.fail(RuntimeError("told as the run starts"))
            begin(arrays, wake)

        monkeypatch.setattr(runtime, "_begin", failing_first)

        def run() -> None:
            try:
                s.run({"x": GOOD})
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                raised.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), "the run waited for good"
    assert [str(e) for e in raised] == ["told as the run starts"]


def test_session_runs_from_two_threads_take_turns():
    """Two threads running one Session at once each get their own outputs, as when the
    runs went through trio's loop, where they queued."""
    plan = two_device_plan()
    wrong: list[str] = []
    with af.Session(plan) as s:

        def runs(sign: float) -> None:
            for _ in range(20):
                x = sign * GOOD
                try:
                    out = s.run({"x": x})["y"]
                except BaseException as exc:  # noqa: BLE001 - the test reads it
                    wrong.append(repr(exc))
                    return
                if not np.array_equal(out, reference(x)):
                    wrong.append(f"sign {sign}: another run's outputs")

        threads = [threading.Thread(target=runs, args=(sign,)) for sign in (1.0, -1.0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(t.is_alive() for t in threads), "a run waited for good"
        np.testing.assert_array_equal(s.run({"x": GOOD})["y"], reference(GOOD))
    assert wrong == []


async def test_run_from_thread_refuses_trios_own_thread_and_serves_another():
    """On trio's own thread a run that waits on a thread's event would block the loop
    that hears of failures: refused, with what to call instead."""
    with trio.fail_after(20):
        async with af.Runtime(two_device_plan()) as rt:
            with pytest.raises(RuntimeError, match="await run"):
                rt.run_from_thread({"x": GOOD})
            out = await trio.to_thread.run_sync(rt.run_from_thread, {"x": GOOD})
            np.testing.assert_array_equal(out["y"], reference(GOOD))
