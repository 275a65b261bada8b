"""Chrome trace export: tracks, complete events, flows and the iteration filter, on
recorders filled by hand and on real runs."""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import actorflow as af
from actorflow.config import parse_config
from actorflow.runtime import Runtime
from actorflow.trace import STEP, WAIT, Recorder, Span, parse_iterations, summarize
from actorflow.trace.parse import from_spans, parse
from actorflow.trace.recorder import chrome_trace
from actorflow.training import compile_config
from actorflow.training.data import dataset, step_feeds
from actorflow.training.runner import local_feeds

MS = 1e-3


def check_structure(trace: dict) -> None:
    """What any exported trace must satisfy to open well in Perfetto."""
    events = trace["traceEvents"]
    processes = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    complete = [e for e in events if e["ph"] == "X"]
    for e in complete:
        for key in ("name", "ts", "dur", "pid", "tid"):
            assert key in e, (key, e)
        assert e["dur"] >= 0
        assert "inputs" not in e.get("args", {})
    used = {(e["pid"], e["tid"]) for e in events if e["ph"] in ("X", "s", "f")}
    assert used <= threads
    assert {pid for pid, _ in used} <= processes
    # every flow start has its finish and vice versa, each bound inside a slice of its track
    starts = Counter(e["id"] for e in events if e["ph"] == "s")
    finishes = Counter(e["id"] for e in events if e["ph"] == "f")
    assert starts == finishes
    assert all(n == 1 for n in starts.values())
    by_track: dict[tuple[int, int], list[dict]] = {}
    for e in complete:
        by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    for e in events:
        if e["ph"] in ("s", "f"):
            assert e["ph"] == "s" or e["bp"] == "e"
            assert any(x["ts"] <= e["ts"] <= x["ts"] + x["dur"] for x in by_track[(e["pid"], e["tid"])])
    # one stream runs one thing at a time
    for track in by_track.values():
        track.sort(key=lambda e: e["ts"])
        for a, b in pairwise(track):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, (a, b)


def names(trace: dict, kind: str) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == kind}


def threads(trace: dict) -> dict[tuple[int, int], str]:
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def complete(trace: dict) -> dict[str, dict]:
    return {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}


def flows(trace: dict) -> set[tuple[str, str]]:
    """(producer name, consumer name) of each flow, through the slices the flow events bind to."""
    trace_ = parse(trace)
    return {(trace_.spans[p].name, trace_.spans[c].name) for p, c in trace_.flows}


def kernel(
    rec: Recorder, device: str, stream: str, name: str, start_ms: float, end_ms: float, **args
) -> None:
    kind = "collective" if stream == "collective" else stream
    thread = "rank0/collective" if stream == "collective" else f"{device}/{stream}"
    process = "rank0" if stream == "collective" else device
    rec.add(process, thread, name, kind, start_ms * MS, end_ms * MS, {"actor": name, "op": "relu", **args})


def pipeline_recorder(**kw) -> Recorder:
    """a (cpu:0 compute) -> b (cpu:0 copy) -> c (cpu:1 compute) -> ar (collective) -> d (cpu:1
    compute, same track as c), over iterations 0..2, each act reading its own iteration's
    producers; a wait before c on cpu:1/compute."""
    rec = Recorder(enabled=True, **kw)
    for it in range(3):
        t = 10.0 * it
        kernel(rec, "cpu:0", "compute", f"a{it}", t + 0, t + 1, iteration=it, act=it)
        kernel(rec, "cpu:0", "copy", f"b{it}", t + 1, t + 2, iteration=it, act=it, inputs=[[f"a{it}", it]])
        rec.add(
            "cpu:1", "cpu:1/compute", f"wait b{it}", WAIT, (t + 1.5) * MS, (t + 2.0) * MS, {"iteration": it}
        )
        kernel(rec, "cpu:1", "compute", f"c{it}", t + 2, t + 3, iteration=it, act=it, inputs=[[f"b{it}", it]])
        kernel(
            rec, "cpu:1", "collective", f"ar{it}", t + 3, t + 4, iteration=it, act=it, inputs=[[f"c{it}", it]]
        )
        kernel(
            rec,
            "cpu:1",
            "compute",
            f"d{it}",
            t + 4,
            t + 5,
            iteration=it,
            act=it,
            inputs=[[f"ar{it}", it], [f"c{it}", it]],
        )
    return rec


def test_tracks_per_device_and_collective_stream():
    trace = pipeline_recorder().to_chrome()
    check_structure(trace)
    assert list(names(trace, "process_name").values()) == ["host", "cpu:0", "cpu:1", "rank0"]
    assert sorted(threads(trace).values()) == [
        "cpu:0/compute",
        "cpu:0/copy",
        "cpu:1/compute",
        "rank0/collective",
        "steps",
    ]
    process = names(trace, "process_name")
    collective = next(e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "collective")
    assert process[collective["pid"]] == "rank0"  # its own process track, beside the devices'


def test_processes_sort_naturally_devices_first():
    rec = Recorder(enabled=True)
    for device in ("rank0", "cpu:10", "cpu:2"):
        rec.add(device, f"{device}/compute", "k", "compute", 0.0, 1.0, {})
    assert list(names(rec.to_chrome(), "process_name").values()) == ["cpu:2", "cpu:10", "rank0"]


def test_complete_events_in_microseconds_from_the_first_span_with_their_args():
    trace = pipeline_recorder().to_chrome()
    events = complete(trace)
    assert events["a0"]["ts"] == 0 and events["a0"]["dur"] == pytest.approx(1000)
    assert events["c1"]["ts"] == pytest.approx(12000) and events["c1"]["dur"] == pytest.approx(1000)
    assert events["d2"]["args"] == {"actor": "d2", "op": "relu", "iteration": 2, "act": 2}
    assert events["c0"]["cat"] == "compute" and events["ar0"]["cat"] == "collective"


def test_wait_spans_sit_on_the_waiting_stream():
    trace = pipeline_recorder().to_chrome()
    wait = complete(trace)["wait b0"]
    c0 = complete(trace)["c0"]
    assert wait["cat"] == WAIT
    assert (wait["pid"], wait["tid"]) == (c0["pid"], c0["tid"])
    assert wait["ts"] + wait["dur"] == pytest.approx(c0["ts"])


def test_flows_cross_tracks_only():
    trace = pipeline_recorder().to_chrome()
    check_structure(trace)
    expected = set()
    for it in range(3):
        # c -> d is same-track: stream order already says it, no arrow
        expected |= {(f"a{it}", f"b{it}"), (f"b{it}", f"c{it}"), (f"c{it}", f"ar{it}"), (f"ar{it}", f"d{it}")}
    assert flows(trace) == expected
    ids = [e["id"] for e in trace["traceEvents"] if e["ph"] == "s"]
    assert len(ids) == len(set(ids)) == 12


def test_one_producer_many_consumers_and_one_consumer_many_producers():
    rec = Recorder(enabled=True)
    kernel(rec, "cpu:0", "compute", "p", 0, 1, act=0)
    kernel(rec, "cpu:1", "compute", "q", 0, 1, act=0)
    kernel(rec, "cpu:0", "copy", "c1", 1, 2, act=0, inputs=[["p", 0]])
    kernel(rec, "cpu:1", "copy", "c2", 1, 2, act=0, inputs=[["p", 0], ["q", 0], ["q", 0]])
    trace = rec.to_chrome()
    check_structure(trace)
    assert flows(trace) == {("p", "c1"), ("p", "c2"), ("q", "c2")}
    assert sum(e["ph"] == "s" for e in trace["traceEvents"]) == 3  # the repeated input once


def test_unrecorded_or_unknown_producers_leave_no_half_flow():
    rec = Recorder(enabled=True)
    kernel(rec, "cpu:0", "compute", "p", 0, 1, act=0)
    kernel(rec, "cpu:1", "compute", "c", 1, 2, act=0, inputs=[["p", 1], ["ghost", 0], ["p", 0]])
    trace = rec.to_chrome()
    check_structure(trace)
    assert flows(trace) == {("p", "c")}


def test_waits_take_no_part_in_flows_even_with_actor_and_act():
    rec = Recorder(enabled=True)
    kernel(rec, "cpu:0", "compute", "p", 0, 1, act=0)
    rec.add(
        "cpu:1", "cpu:1/compute", "wait p", WAIT, 0, 1 * MS, {"actor": "c", "act": 0, "inputs": [["p", 0]]}
    )
    kernel(rec, "cpu:1", "compute", "c", 1, 2, act=0, inputs=[["p", 0]])
    kernel(rec, "cpu:0", "copy", "d", 2, 3, act=0, inputs=[["c", 0]])
    trace = rec.to_chrome()
    check_structure(trace)
    assert flows(trace) == {("p", "c"), ("c", "d")}


def test_spans_without_flow_fields_export_plainly():
    rec = Recorder(enabled=True)
    rec.add("cpu:0", "cpu:0/compute", "k", "compute", 1.0, 1.5, {"actor": "k", "op": "relu", "iteration": 0})
    rec.add("cpu:1", "cpu:1/compute", "m", "compute", 1.5, 2.0, {})
    trace = rec.to_chrome()
    check_structure(trace)
    assert not [e for e in trace["traceEvents"] if e["ph"] in ("s", "f")]
    assert complete(trace)["m"]["ts"] == pytest.approx(500000)


def test_empty_recorder_exports_an_empty_trace():
    trace = Recorder(enabled=True).to_chrome()
    assert trace["traceEvents"] == []
    check_structure(trace)


def test_iteration_filter_keeps_selected_iterations_and_no_dangling_flows():
    rec = pipeline_recorder(iterations={1})
    # an act of iteration 1 that reads a register written in iteration 0 (which is dropped)
    kernel(rec, "cpu:0", "copy", "late", 15, 16, iteration=1, act=3, inputs=[["a0", 0], ["a1", 1]])
    # spans without an iteration are kept
    rec.add("cpu:0", "cpu:0/compute", "setup", "compute", 30 * MS, 31 * MS, {})
    trace = rec.to_chrome()
    check_structure(trace)
    kept = complete(trace)
    assert {e["args"].get("iteration") for e in kept.values()} == {1, None}
    assert set(kept) == {"a1", "b1", "wait b1", "c1", "ar1", "d1", "late", "setup", "step 1"}
    assert ("a1", "late") in flows(trace) and ("a0", "late") not in flows(trace)
    assert kept["a1"]["ts"] == 0  # time counts from the first recorded span


def test_iteration_filter_takes_any_collection_and_parse_iterations():
    assert Recorder(True, iterations=range(2, 4)).iterations == {2, 3}
    assert Recorder(True).iterations is None
    assert parse_iterations("0, 3,5-7") == {0, 3, 5, 6, 7}
    assert parse_iterations("4") == {4}
    for bad in ("", "a", "3-1", "1,,2", "-2"):
        with pytest.raises(ValueError, match="0,3,5-7"):
            parse_iterations(bad)


def test_write_is_compact_json_of_to_chrome(tmp_path):
    rec = pipeline_recorder()
    path = tmp_path / "t.json"
    rec.write(path)
    text = path.read_text()
    assert json.loads(text) == json.loads(json.dumps(rec.to_chrome()))
    assert ", " not in text


def test_write_turns_numpy_scalars_in_args_into_numbers(tmp_path):
    rec = Recorder(enabled=True)
    rec.add(
        "cpu:0",
        "cpu:0/compute",
        "k",
        "compute",
        0.0,
        1.0,
        {"micro_batch": np.int64(3), "register": np.int32(1)},
    )
    rec.write(tmp_path / "t.json")
    args = complete(json.loads((tmp_path / "t.json").read_text()))["k"]["args"]
    assert args == {"micro_batch": 3, "register": 1}


# ---------------------------------------------------------------- real runs


def two_device_plan() -> af.Plan:
    with af.Graph() as g:
        x = af.placeholder("x", shape=(8, 16), dtype="float32", device="cpu:0")
        w = af.parameter("w", np.ones((16, 4), np.float32), device="cpu:0")
        h = af.ops.relu(af.ops.matmul(x, w))
        h1 = af.ops.to_device(h, "cpu:1")
        r = af.ops.all_reduce([h, h1], op="sum")
        af.output("y", af.ops.relu(r[1]))
    return af.compile(g, quota=2)


def feeds(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((8, 16)).astype(np.float32)} for _ in range(n)]


def test_a_real_run_exports_a_well_formed_trace(tmp_path):
    path = tmp_path / "run.trace.json"
    af.run(two_device_plan(), feeds(3), trace=path)
    trace = json.loads(path.read_text())
    check_structure(trace)
    assert {"cpu:0", "cpu:1", "rank0"} <= set(names(trace, "process_name").values())
    assert {"cpu:0/compute", "cpu:1/copy", "rank0/collective"} <= set(threads(trace).values())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] not in (WAIT, STEP)]
    assert {e["args"]["iteration"] for e in events} == {0, 1, 2}
    assert all({"actor", "op"} <= set(e["args"]) for e in events)
    assert any(e["cat"] == "collective" for e in events)


async def test_a_real_run_records_only_the_selected_iterations():
    async with Runtime(two_device_plan(), trace=True) as rt:
        rt.recorder = Recorder(enabled=True, iterations={1})
        await rt.run(feeds(3))
    trace = rt.recorder.to_chrome()
    check_structure(trace)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert events
    assert {e["args"].get("iteration") for e in events} == {1}


# ---------------------------------------------------------------- steps and the limit


def test_one_step_span_per_iteration_on_the_hosts_steps_track():
    trace = pipeline_recorder().to_chrome()
    check_structure(trace)
    events = complete(trace)
    for it in range(3):
        step = events[f"step {it}"]
        assert step["cat"] == STEP and step["args"] == {"iteration": it, "rank": 0}
        assert names(trace, "process_name")[step["pid"]] == "host"
        assert threads(trace)[(step["pid"], step["tid"])] == "steps"
        # from its first kernel's start to its last kernel's end (a0 .. d{it})
        assert step["ts"] == pytest.approx(events[f"a{it}"]["ts"])
        assert step["ts"] + step["dur"] == pytest.approx(events[f"d{it}"]["ts"] + events[f"d{it}"]["dur"])
    assert ("a0", "step 0") not in flows(trace) and len(flows(trace)) == 12  # steps take no part in flows


def test_pipelined_steps_do_not_overlap_on_their_track():
    rec = Recorder(enabled=True)
    kernel(rec, "cpu:0", "compute", "f0", 0, 4, iteration=0)
    kernel(rec, "cpu:0", "compute", "f1", 4, 6, iteration=1)
    kernel(rec, "cpu:1", "compute", "g0", 4, 8, iteration=0)  # step 0 ends after step 1 began
    kernel(rec, "cpu:1", "compute", "g1", 8, 9, iteration=1)
    steps = {s.name: (s.start / MS, s.end / MS) for s in rec.steps()}
    assert steps == {"step 0": (0, 8), "step 1": (8, 9)}
    check_structure(rec.to_chrome())


def test_the_limit_holds_the_latest_whole_iterations():
    rec = Recorder(enabled=True, limit=10)
    for it in range(10):
        for k in range(4):
            kernel(rec, "cpu:0", "compute", f"k{it}.{k}", 10 * it + k, 10 * it + k + 1, iteration=it)
            assert len(rec.spans) <= 10
    assert rec.kept_from == 8 and rec.dropped == 8
    assert Counter(s.args["iteration"] for s in rec.spans) == {8: 4, 9: 4}
    kernel(rec, "cpu:0", "compute", "late", 100, 101, iteration=7)  # of a dropped iteration: refused
    assert len(rec.spans) == 8
    trace = rec.to_chrome()
    check_structure(trace)
    assert trace["otherData"]["kept_from"] == 8
    assert "8 iterations before 8 were dropped" in trace["otherData"]["note"]
    assert sorted(e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == STEP) == [
        "step 8",
        "step 9",
    ]


def test_an_iteration_bigger_than_the_limit_goes_whole_and_spans_without_one_go_first():
    rec = Recorder(enabled=True, limit=3)
    rec.add("cpu:0", "cpu:0/compute", "setup", "compute", 0.0, 1.0, {})
    for k in range(3):
        kernel(rec, "cpu:0", "compute", f"a{k}", k, k + 1, iteration=0)
    assert [s.name for s in rec.spans] == ["a0", "a1", "a2"] and rec.kept_from is None
    kernel(rec, "cpu:0", "compute", "a3", 3, 4, iteration=0)
    assert rec.spans == [] and rec.kept_from == 1


def test_a_recorded_span_is_made_once_when_spans_are_first_read_and_obeys_the_filter_and_limit():
    made = []

    def make(name: str, start_ms: float, iteration: int) -> Span:
        made.append(name)
        args = {"iteration": iteration}
        return Span("cpu:0", "cpu:0/compute", name, "compute", start_ms * MS, (start_ms + 1) * MS, args)

    rec = Recorder(enabled=True, iterations={1, 2, 3}, limit=3)
    for it in range(4):
        rec.record(it, make, f"k{it}", 10.0 * it, it)
    kernel(rec, "cpu:0", "compute", "eager", 35, 36, iteration=3)  # eager and recorded spans mix
    assert made == [] and rec.kept_from == 2  # iteration 0 filtered out, 1 dropped unmade
    assert [s.name for s in rec.spans] == ["k2", "k3", "eager"]
    assert [s.name for s in rec.spans] == ["k2", "k3", "eager"] and made == ["k2", "k3"]  # made once
    rec.record(3, make, "later", 40.0, 3)
    assert [s.name for s in rec.kernels()] == ["k3", "eager", "later"] and made == ["k2", "k3", "later"]
    check_structure(rec.to_chrome())


def test_no_limit_and_a_bad_limit():
    rec = Recorder(enabled=True, limit=None)
    for it in range(300):
        kernel(rec, "cpu:0", "compute", "k", it, it + 1, iteration=it)
    assert len(rec.spans) == 300 and rec.kept_from is None and rec.note() == ""
    assert "otherData" not in rec.to_chrome()
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="limit"):
            Recorder(enabled=True, limit=bad)


def test_a_long_run_holds_at_most_the_limit_and_its_last_iterations_whole():
    plan = two_device_plan()
    with af.Session(plan, trace=True, trace_limit=100) as s:
        for _ in range(20):
            s.run(feeds(25))
        assert len(s.recorder.spans) <= 100
        per_iteration = Counter(sp.args["iteration"] for sp in s.recorder.kernels())
        assert max(per_iteration) == 499 and min(per_iteration) == s.recorder.kept_from > 0
        units = len(plan.collectives) + sum(a.group < 0 for a in plan.actors)  # a collective is one kernel
        assert set(per_iteration.values()) == {units}  # every iteration held is whole


def test_the_trace_of_a_window_equals_the_full_trace_of_the_same_iterations():
    """What a bounded recorder measures is what a full trace measures over the same steps."""

    class Both(Recorder):
        def record(self, iteration, make, *args) -> None:
            full.record(iteration, make, *args)
            super().record(iteration, make, *args)

    full = Recorder(enabled=True, limit=None)
    plan = two_device_plan()
    with af.Session(plan, trace=True) as s:
        s._runtime.recorder = bounded = Both(enabled=True, limit=150)
        for _ in range(6):
            s.run(feeds(5))
    assert bounded.kept_from is not None and bounded.kept_from > 0
    same = Recorder(enabled=True, iterations=range(bounded.kept_from, 30), limit=None)
    for sp in full.spans:
        same.add(sp.process, sp.thread, sp.name, sp.category, sp.start, sp.end, sp.args)
    window, whole = bounded.to_chrome(), same.to_chrome()
    assert window["traceEvents"] == whole["traceEvents"]
    assert summarize(window) == summarize(whole)


def test_af_run_warns_when_its_trace_dropped_iterations(tmp_path):
    path = tmp_path / "t.json"
    with pytest.warns(RuntimeWarning, match="were dropped to hold at most 50 spans"):
        af.run(two_device_plan(), feeds(30), trace=path, trace_limit=50)
    assert json.loads(path.read_text())["otherData"]["kept_from"] > 0


# ---------------------------------------------------------------- stage, rank and phase


def test_every_span_of_a_pipelined_run_carries_its_stage_rank_and_phase():
    config = parse_config(PIPELINE_YAML)
    plan = compile_config(config)
    assert plan.stages == (("cpu:0",), ("cpu:1",))
    with af.Session(plan, trace=True) as s:
        data = dataset(config)
        for step in range(2):
            s.run(step_feeds(config, data, step, local_feeds(plan, 0)))
        spans = s.recorder.spans
    by_name = {}
    for a in plan.actors:
        by_name.setdefault(a.name, a)
    for sp in spans:
        actor = by_name[sp.args.get("actor", sp.name)] if sp.category != WAIT else None
        assert sp.args["rank"] == 0
        assert sp.args["stage"] == int(sp.process[-1])  # cpu:0 is stage 0, cpu:1 stage 1
        if actor is not None:
            expected = (
                "update"
                if actor.kind in ("update", "variable")
                else ("weight" if actor.weight_grad else "backward" if actor.backward else "forward")
                if actor.kind == "compute"
                else "communication"
            )
            assert sp.args["phase"] == expected, sp
    phases = Counter(sp.args["phase"] for sp in spans)
    assert {"forward", "backward", "weight", "update", "communication"} <= set(phases)


def forwards_before_backward(schedule: str) -> list[int]:
    """Per step, how many micro-batches began their forward on stage 0 before stage 0's
    first backward kernel: what the schedule bounds (1F1B: p, GPipe: m). Repeats, which
    hand a parameter to each micro-batch and keep nothing for backward, don't count."""
    config = parse_config(PIPELINE_YAML, [f"parallel.schedule={schedule}"])
    plan = compile_config(config)
    with af.Session(plan, trace=True) as s:
        data = dataset(config)
        for step in range(config.train.steps):
            s.run(step_feeds(config, data, step, local_feeds(plan, 0)))
        spans = [
            sp for sp in s.recorder.kernels() if sp.thread == "cpu:0/compute" and "micro_batch" in sp.args
        ]
    counts = []
    for step in range(config.train.steps):
        mine = [sp for sp in spans if sp.args["iteration"] == step]
        first_backward = min(sp.start for sp in mine if sp.args["phase"] == "backward")
        counts.append(
            len(
                {
                    sp.args["micro_batch"]
                    for sp in mine
                    if sp.args["phase"] == "forward" and sp.start < first_backward
                }
            )
        )
    return counts


def test_phases_tell_1f1b_from_gpipe():
    assert max(forwards_before_backward("1f1b")) <= 2
    assert max(forwards_before_backward("gpipe")) > 2


PIPELINE_YAML = """\
model: {kind: mlp, sizes: [8, 32, 32, 4], activation: tanh}
data: {kind: synthetic_classification, samples: 64, seed: 5}
train: {steps: 4, batch_size: 16, optimizer: {kind: sgd, lr: 0.1}}
parallel: {stages: [cpu:0, cpu:1], micro_batches: 4, schedule: 1f1b}
"""


def test_spans_are_made_outside_the_lock_so_streams_record_meanwhile():
    """Reading spans makes the recorded ones (a GPU span waits for its kernel's event):
    meanwhile a stream thread's record must not wait, and what it recorded is read next."""
    import threading

    recorder = Recorder(enabled=True)
    making, go, recorded = threading.Event(), threading.Event(), threading.Event()

    def slow() -> Span:
        making.set()
        assert go.wait(5)
        return Span("cpu:0", "compute", "slow", "compute", 0.0, 1.0, {})

    recorder.record(0, slow)
    reader = threading.Thread(target=lambda: recorder.spans)
    reader.start()
    assert making.wait(5)
    stream = threading.Thread(
        target=lambda: (
            recorder.record(0, lambda: Span("cpu:0", "compute", "fast", "compute", 2.0, 3.0, {})),
            recorded.set(),
        )
    )
    stream.start()
    assert recorded.wait(2), "a record waited on a reader"
    go.set()
    reader.join(5)
    stream.join(5)
    assert [s.name for s in recorder.spans] == ["slow", "fast"]


@st.composite
def recorded_spans(draw) -> list[Span]:
    """Spans on a few tracks (kernels, waits, zero-length ones, ties to the ns), each kernel an
    act of its actor that may read acts of others: what a run or a simulation records."""
    tracks = [
        ("cpu:0", "cpu:0/compute"),
        ("cpu:0", "cpu:0/copy"),
        ("cpu:1", "cpu:1/compute"),
        ("rank0", "rank0/comm"),
    ]
    made = []
    for k in range(draw(st.integers(0, 24))):
        process, thread = draw(st.sampled_from(tracks))
        start = draw(st.integers(0, 40)) * 0.25e-6 + draw(st.sampled_from([0.0, 1e-10, 2e-10]))  # ties in ns
        end = start + draw(st.integers(0, 8)) * 0.25e-6
        if draw(st.booleans()) and k % 5 == 4:
            made.append(Span(process, thread, f"wait {k}", WAIT, start, end, {"iteration": 0}))
            continue
        actor = f"a{k % 6}"
        inputs = draw(
            st.lists(st.tuples(st.sampled_from([f"a{j}" for j in range(6)]), st.integers(0, 3)), max_size=3)
        )
        args = {"actor": actor, "act": k // 6, "iteration": k % 2, "inputs": [list(i) for i in inputs]}
        made.append(Span(process, thread, actor, thread.rsplit("/", 1)[1], start, end, args))
    return made


@given(recorded_spans())
@settings(max_examples=60, deadline=None)
def test_a_trace_from_spans_in_memory_is_what_their_chrome_trace_parses_to(spans):
    assert from_spans(spans) == parse(chrome_trace(spans))
