"""Trace metrics on hand-built traces whose answers are known, and ``actorflow trace summary``."""

from __future__ import annotations

import argparse
import json

import pytest

from actorflow.compiler.schedules import ZERO_BUBBLE
from actorflow.trace import WAIT, Recorder, summarize
from actorflow.trace.cli import add_commands, run
from actorflow.trace.metrics import balanced_bubbles, pass_seconds, pipeline_theory
from actorflow.trace.parse import parse
from actorflow.trace.recorder import stream_kind

MS = 1e-3


def span(rec: Recorder, thread: str, name: str, start_ms: float, end_ms: float, category: str = "", **args):
    """A span on ``thread`` (``device/kind``); its category defaults to the stream's kind."""
    process, kind = thread.split("/")
    rec.add(process, thread, name, category or kind, start_ms * MS, end_ms * MS, {"actor": name, **args})


def ms(value_ms: float):
    return pytest.approx(value_ms * MS, abs=1e-12)


def stream(summary, thread: str):
    return next(s for s in summary.streams if s.thread == thread)


def test_empty_trace():
    for trace in (Recorder(enabled=True).to_chrome(), {}, [], {"traceEvents": []}):
        s = summarize(trace)
        assert s.wall_s == 0 and s.streams == () and s.stages == ()
        assert s.overlap is None and s.bubble is None
        assert s.critical_path.length_s == 0 and s.critical_path.kernels == 0
        assert s.critical_path.by_kind == {} and s.critical_path.shares == {}
        assert "wall 0.000 ms, 0 streams" in s.format()
        json.dumps(s.to_dict())


def test_a_single_span():
    rec = Recorder(enabled=True)
    span(rec, "cpu:0/compute", "k", 5, 7)
    s = summarize(rec.to_chrome())
    assert s.wall_s == ms(2)
    only = stream(s, "cpu:0/compute")
    assert (only.kind, only.kernels, only.busy_fraction) == ("compute", 1, 1.0)
    assert only.busy_s == ms(2) and only.wait_s == 0
    assert s.critical_path.length_s == ms(2) and s.critical_path.kernels == 1
    assert s.critical_path.shares == {"compute": 1.0}


def test_busy_is_the_union_of_kernels_and_excludes_waits():
    rec = Recorder(enabled=True)
    span(rec, "cpu:0/compute", "a", 0, 4)
    span(rec, "cpu:0/compute", "b", 2, 6)  # overlaps a: counted once
    span(rec, "cpu:0/compute", "w", 6, 8, category=WAIT)
    span(rec, "cpu:0/compute", "c", 8, 10)
    span(rec, "cpu:0/copy", "d", 1, 2)
    span(rec, "cpu:0/copy", "e", 2, 3)  # touching, not overlapping
    s = summarize(rec.to_chrome())
    assert s.wall_s == ms(10)
    compute, copy = stream(s, "cpu:0/compute"), stream(s, "cpu:0/copy")
    assert compute.busy_s == ms(8) and compute.busy_fraction == pytest.approx(0.8)
    assert compute.wait_s == ms(2) and compute.kernels == 3
    assert copy.busy_s == ms(2) and copy.busy_fraction == pytest.approx(0.2)


def test_wall_counts_waits_too():
    rec = Recorder(enabled=True)
    span(rec, "cpu:0/compute", "w", 0, 2, category=WAIT)
    span(rec, "cpu:0/compute", "a", 2, 4)
    s = summarize(rec.to_chrome())
    assert s.wall_s == ms(4)
    assert stream(s, "cpu:0/compute").busy_fraction == pytest.approx(0.5)


def test_overlap_of_collective_with_any_compute_stream():
    rec = Recorder(enabled=True)
    span(rec, "rank0/collective", "ar", 2, 6)
    span(rec, "cpu:0/compute", "a", 0, 3)  # covers [2, 3] of ar
    span(rec, "cpu:1/compute", "b", 5, 8)  # covers [5, 6]
    span(rec, "cpu:1/compute", "b2", 5.5, 5.8)  # inside b: no double count
    span(rec, "cpu:0/copy", "c", 3, 5)  # copies don't count
    s = summarize(rec.to_chrome())
    assert s.collective_s == ms(4) and s.overlapped_s == ms(2)
    assert s.overlap == pytest.approx(0.5)
    assert "overlap: 50.0% of 4.000 ms collective time ran beside compute" in s.format()


def test_overlap_is_none_without_collectives_and_zero_when_alone():
    rec = Recorder(enabled=True)
    span(rec, "cpu:0/compute", "a", 0, 3)
    assert summarize(rec.to_chrome()).overlap is None
    span(rec, "rank0/collective", "ar", 3, 4)
    assert summarize(rec.to_chrome()).overlap == 0.0


def gpipe(rec: Recorder, *, stage_args: bool) -> None:
    """p = 2 stages, m = 2 micro-batches, forward and backward 1 ms each:
    stage 0 F0 F1 . . B1 B0, stage 1 . F0 F1 B1 B0 .: each stage busy 4 of 6 ms."""
    plan = {
        "cpu:0": [("F0", 0), ("F1", 1), ("B1", 4), ("B0", 5)],
        "cpu:1": [("F0", 1), ("F1", 2), ("B1", 3), ("B0", 4)],
    }
    for stage, (device, kernels) in enumerate(plan.items()):
        for name, t in kernels:
            args = {"stage": stage} if stage_args else {}
            span(rec, f"{device}/compute", f"{name}@{stage}", t, t + 1, **args)
        span(rec, f"{device}/copy", f"send@{stage}", 0.5, 1)  # not a compute stream: no effect


def test_bubble_matches_the_gpipe_formula_with_stages_inferred_or_given():
    p, m = 2, 2
    expected = (p - 1) / (m + p - 1)
    inferred = Recorder(enabled=True)
    gpipe(inferred, stage_args=True)
    given = Recorder(enabled=True)
    gpipe(given, stage_args=False)
    for s in (summarize(inferred.to_chrome()), summarize(given.to_chrome(), stages=["cpu:0", "cpu:1"])):
        assert s.window_s == ms(6)
        assert [(b.stage, b.process) for b in s.stages] == [(0, "cpu:0"), (1, "cpu:1")]
        assert [b.bubble for b in s.stages] == [pytest.approx(expected)] * 2
        assert [b.busy_s for b in s.stages] == [ms(4)] * 2
        assert s.bubble == pytest.approx(expected)
    assert summarize(given.to_chrome()).stages == ()  # nothing to infer from


def test_bubble_window_is_shared_and_a_stage_without_kernels_is_all_bubble():
    rec = Recorder(enabled=True)
    span(rec, "cpu:0/compute", "a", 0, 1)
    span(rec, "cpu:1/compute", "b", 2, 4)
    s = summarize(rec.to_chrome(), stages=["cpu:0", "cpu:1", "cpu:7"])
    assert s.window_s == ms(4)
    assert [b.bubble for b in s.stages] == [pytest.approx(0.75), pytest.approx(0.5), 1.0]
    assert s.bubble == pytest.approx(0.75)
    assert "stage 2  cpu:7" in s.format()


def test_time_that_two_steps_windows_share_counts_once():
    """Over ranks, stage 0 may start step 1 while stage 1 still finishes step 0."""
    rec = Recorder(enabled=True)
    span(rec, "cpu:0/compute", "f0", 0, 2, iteration=0)
    span(rec, "cpu:1/compute", "g0", 2, 4, iteration=0)
    span(rec, "cpu:0/compute", "f1", 3, 5, iteration=1)
    span(rec, "cpu:1/compute", "g1", 5, 7, iteration=1)
    s = summarize(rec.to_chrome(), stages=["cpu:0", "cpu:1"])
    assert s.window_s == ms(7)  # windows [0, 4] and [3, 7]
    assert [b.bubble for b in s.stages] == [pytest.approx(3 / 7)] * 2


def test_critical_path_follows_flows_and_stream_order_with_gaps():
    rec = Recorder(enabled=True)
    span(rec, "cpu:0/compute", "A", 0, 2, act=0)
    span(rec, "cpu:0/compute", "D", 2, 3, act=0)  # after A on its stream, then nothing
    span(rec, "cpu:1/copy", "B", 3, 4, act=0, inputs=[["A", 0]])  # 1 ms gap after A
    span(rec, "cpu:1/compute", "W", 3.5, 4, category=WAIT)  # waits are never on the path
    span(rec, "cpu:1/compute", "C", 4, 7, act=0, inputs=[["B", 0]])
    span(rec, "rank0/collective", "E", 7.5, 8, act=0, inputs=[["C", 0]])  # 0.5 ms gap
    path = summarize(rec.to_chrome()).critical_path
    assert path.length_s == ms(8) and path.kernels == 4
    assert path.by_kind == {"compute": ms(5), "copy": ms(1), "collective": ms(0.5), "gap": ms(1.5)}
    assert path.shares["compute"] == pytest.approx(5 / 8)
    assert sum(path.shares.values()) == pytest.approx(1.0)


def test_critical_path_prefers_kernel_time_among_equally_long_chains():
    rec = Recorder(enabled=True)
    span(rec, "cpu:0/compute", "P", 0, 1, act=0)
    span(rec, "cpu:1/copy", "R", 1, 3, act=0, inputs=[["P", 0]])
    span(rec, "cpu:0/compute", "Q", 3, 4, act=0, inputs=[["R", 0]])
    # P -> Q by stream order is 4 ms with a 2 ms gap; P -> R -> Q is 4 ms of kernels
    path = summarize(rec.to_chrome()).critical_path
    assert path.length_s == ms(4) and path.kernels == 3
    assert path.by_kind == {"compute": ms(2), "copy": ms(2)}


def test_critical_path_without_flows_is_the_longest_stream_chain():
    rec = Recorder(enabled=True)
    span(rec, "cpu:0/compute", "a", 0, 1)
    span(rec, "cpu:0/compute", "b", 3, 4)
    span(rec, "cpu:1/compute", "c", 0.5, 2.5)
    span(rec, "cpu:1/compute", "d", 2, 3)  # overlaps c: no gap, and the overlap counts once
    path = summarize(rec.to_chrome()).critical_path
    assert path.length_s == ms(4) and path.by_kind == {"compute": ms(2), "gap": ms(2)}
    rec2 = Recorder(enabled=True)
    span(rec2, "cpu:1/compute", "c", 0.5, 2.5)
    span(rec2, "cpu:1/compute", "d", 2, 3)
    path = summarize(rec2.to_chrome()).critical_path
    assert path.length_s == ms(2.5) and path.by_kind == {"compute": ms(2.5)}


def test_receives_posted_ahead_make_no_path_longer_than_the_wall():
    """A rank's sends and receives are in flight together: the communication stream's
    order chains nothing, and a receive counts from where its chain reached."""
    rec = Recorder(enabled=True)
    span(rec, "rank1/comm", "r1", 0, 5, category="recv", act=0)  # posted at once, data at 5
    span(rec, "rank1/comm", "r2", 0.5, 9, category="recv", act=0)
    span(rec, "cpu:0/compute", "f1", 0, 4, act=0)
    span(rec, "rank0/comm", "s1", 4, 5, category="send", act=0, inputs=[["f1", 0]])
    span(rec, "cpu:1/compute", "g1", 5, 6, act=0, inputs=[["r1", 0]])
    span(rec, "cpu:0/compute", "f2", 4, 8, act=1)
    span(rec, "cpu:1/compute", "g2", 9, 10, act=1, inputs=[["r2", 0]])
    s = summarize(rec.to_chrome())
    path = s.critical_path
    assert path.length_s <= s.wall_s
    # r1 -> g1 -> g2 (10 ms) beats r2 -> g2 (9.5 ms); chained by the stream's order,
    # r1 -> r2 -> g2 would have summed 14.5 ms of a 10 ms wall
    assert path.length_s == ms(10) and path.kernels == 3
    assert path.by_kind == {"recv": ms(5), "compute": ms(2), "gap": ms(3)}
    assert path.communication_share == pytest.approx(0.5)


def test_parse_is_lenient_with_foreign_traces():
    """No metadata, string ids, a flow finish binding to the next slice, a flow pointing back in time."""
    events = [
        {"ph": "X", "name": "a", "cat": "collective", "ts": 0, "dur": 10, "pid": "p", "tid": 1},
        {"ph": "X", "name": "b", "cat": "copy", "ts": 20, "dur": 10, "pid": "p", "tid": 2},
        {"ph": "X", "name": "c", "cat": "weird", "ts": 5, "dur": 1, "pid": "q", "tid": 1},
        {"ph": "s", "id": 7, "cat": "x", "ts": 5, "pid": "p", "tid": 1},
        {"ph": "f", "id": 7, "cat": "x", "ts": 15, "pid": "p", "tid": 2},
        {"ph": "s", "id": 8, "cat": "x", "ts": 25, "pid": "p", "tid": 2},
        {"ph": "f", "id": 8, "cat": "x", "ts": 5, "bp": "e", "pid": "p", "tid": 1},
        {"ph": "s", "id": 9, "cat": "x", "ts": 99, "pid": "p", "tid": 2},  # binds to nothing
        {"ph": "i", "name": "instant", "ts": 3, "pid": "p", "tid": 1},
    ]
    trace = parse(events)
    assert [(t.process, t.thread, t.kind) for t in trace.tracks] == [
        ("p", "1", "collective"),
        ("p", "2", "copy"),
        ("q", "1", "compute"),
    ]
    names = [s.name for s in trace.spans]
    assert {(names[p], names[c]) for p, c in trace.flows} == {("a", "b"), ("b", "a")}
    s = summarize(events)
    assert s.wall_s == pytest.approx(30e-6)
    assert s.critical_path.length_s == pytest.approx(30e-6)  # a -> b; the backward flow is ignored


def test_summary_text_and_json_round_trip():
    rec = Recorder(enabled=True)
    gpipe(rec, stage_args=True)
    span(rec, "rank0/collective", "ar", 1, 2)
    s = summarize(rec.to_chrome())
    text = s.format()
    for part in (
        "wall 6.000 ms, 5 streams",
        "cpu:0/compute",
        "rank0/collective",
        "stage 0  cpu:0",
        "bubble per stage (window 6.000 ms): mean 33.3%",
        "overlap: 100.0%",
        "critical path: ",
    ):
        assert part in text, part
    data = json.loads(s.to_json())
    assert data["overlap"] == 1.0 and data["bubble"] == pytest.approx(1 / 3)
    assert data["streams"][0]["thread"] == "cpu:0/compute"
    assert data["critical_path"]["shares"]


# ---------------------------------------------------------------- the command


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="actorflow")
    add_commands(parser.add_subparsers(dest="command"))
    try:
        code = run(parser.parse_args(list(argv)))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def write_gpipe(tmp_path) -> str:
    rec = Recorder(enabled=True)
    gpipe(rec, stage_args=False)
    path = tmp_path / "g.trace.json"
    rec.write(path)
    return str(path)


def test_trace_summary_command(capsys, tmp_path):
    path = write_gpipe(tmp_path)
    code, out, _ = cli(capsys, "trace", "summary", path)
    assert code == 0 and "wall 6.000 ms, 4 streams" in out and "bubble: no stages" in out
    code, out, _ = cli(capsys, "trace", "summary", path, "--stages", "cpu:0,cpu:1")
    assert code == 0 and "mean 33.3%" in out
    code, out, _ = cli(capsys, "trace", "summary", "--json", path)
    assert code == 0 and json.loads(out)["wall_s"] == pytest.approx(6e-3)


def test_trace_summary_errors(capsys, tmp_path):
    code, _, err = cli(capsys, "trace", "summary", str(tmp_path / "missing.json"))
    assert code == 1 and "can't read" in err and "missing.json" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, _, err = cli(capsys, "trace", "summary", str(bad))
    assert code == 1 and "can't read" in err
    bad.write_text('{"traceEvents": 3}')
    code, _, err = cli(capsys, "trace", "summary", str(bad))
    assert code == 1 and "not a Chrome trace" in err
    code, _, err = cli(capsys, "trace")
    assert code == 2 and "SUBCOMMAND" in err


def test_steps_are_no_stream_and_no_kernel():
    rec = Recorder(enabled=True)
    span(rec, "cpu:0/compute", "a", 0, 1, iteration=0, stage=0)
    span(rec, "cpu:1/compute", "b", 1, 3, iteration=0, stage=1)
    span(rec, "cpu:0/compute", "c", 3, 4, iteration=1, stage=0)
    with_steps = summarize(rec.to_chrome())
    assert [s.thread for s in with_steps.streams] == ["cpu:0/compute", "cpu:1/compute"]
    assert set(with_steps.critical_path.by_kind) == {"compute", "gap"}  # a, then c after a gap
    kinds = {t.thread: t.kind for t in parse(rec.to_chrome()).tracks}
    assert kinds["steps"] == "step"


def test_the_summary_of_a_training_runs_trace_finds_its_stages(capsys, tmp_path):
    from actorflow.config import parse_config
    from actorflow.training import train

    config = parse_config(
        "model: {kind: mlp, sizes: [8, 16, 16, 4]}\n"
        "data: {kind: synthetic_classification, samples: 64}\n"
        "train: {steps: 3, batch_size: 16, optimizer: {kind: sgd, lr: 0.1}}\n"
        "parallel: {stages: [cpu:0, cpu:1], micro_batches: 2, schedule: gpipe}\n"
    )
    path = tmp_path / "t.json"
    result = train(config, trace=str(path))
    code, out, _ = cli(capsys, "trace", "summary", str(path))
    assert code == 0 and "no stages" not in out
    assert "stage 0  cpu:0" in out and "stage 1  cpu:1" in out
    found = summarize(json.loads(path.read_text()))
    assert [b.bubble for b in found.stages] == pytest.approx(result.bubbles)


def test_a_groups_further_collective_streams_count_as_collective_streams():
    kinds = {
        "cpu:0/compute": "compute",
        "cpu:1/copy": "copy",
        "rank0/collective": "collective",
        "rank0/collective1": "collective",
        "rank1/comm": "comm",
        "host": None,
        "x/y2": None,
    }
    assert {name: stream_kind(name) for name in kinds} == kinds
    rec = Recorder(enabled=True)
    span(rec, "rank0/collective1", "ar", 0, 2, category="collective")
    span(rec, "cpu:0/copy", "c", 0, 1, category="copy")
    order = [t.thread for t in parse(rec.to_chrome()).tracks]
    assert order.index("cpu:0/copy") < order.index("rank0/collective1")  # copies sort first


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_balanced_bubbles_of_even_stages_are_the_theory(p, m):
    assert balanced_bubbles([3.0] * p, m) == pytest.approx([(p - 1) / (m + p - 1)] * p)


def test_balanced_bubbles_of_uneven_stages():
    """Stage times 2 and 1 per micro-batch, m = 4: a step lasts 2 + 1 + 3 * 2 = 9, of which
    stage 0 computes 8 and stage 1 computes 4."""
    assert balanced_bubbles([8.0, 4.0], 4) == pytest.approx([1 / 9, 5 / 9])
    assert balanced_bubbles([0.0, 0.0], 4) == [0.0, 0.0]


def test_pass_seconds_splits_compute_by_phase_per_micro_batch_and_stream():
    def span(tid, phase, mb, ts, dur):
        args = {"phase": phase, "micro_batch": mb, "iteration": 0}
        return {
            "ph": "X",
            "pid": 0,
            "tid": tid,
            "name": "k",
            "cat": "compute",
            "ts": ts,
            "dur": dur,
            "args": args,
        }

    events = [
        span(1, "forward", 0, 0, 10),
        span(1, "forward", 1, 10, 10),
        span(1, "backward", 0, 20, 6),
        span(1, "weight", 0, 26, 2),
        span(2, "forward", 0, 5, 30),
        span(2, "update", 0, 40, 100),  # not a pass
    ]
    got = pass_seconds(parse({"traceEvents": events}))
    # 2 micro-batches x 2 streams: (10 + 10 + 30) us / 4, 6 us / 4, 2 us / 4
    assert got == pytest.approx({"forward": 12.5e-6, "backward": 1.5e-6, "weight": 0.5e-6})


def test_with_one_micro_batch_every_compute_kernel_is_its_steps_pass():
    events = [
        {"ph": "X", "pid": 0, "tid": 1, "name": "k", "cat": "compute", "ts": t, "dur": 4, "args": args}
        for t, args in [
            (0, {"phase": "forward", "iteration": 0}),
            (10, {"phase": "weight", "iteration": 0}),
            (20, {"phase": "forward", "iteration": 1}),
        ]
    ]
    got = pass_seconds(parse({"traceEvents": events}), micro_batches=1)
    assert got == pytest.approx({"forward": 4e-6, "backward": 0.0, "weight": 2e-6})


@pytest.mark.parametrize(
    "schedule, p, m, f, b, w, expected",
    [
        ("1f1b", 2, 4, 1, 1, 1, 1 / 5),  # (p-1)/(m+p-1) at even passes
        ("gpipe", 4, 8, 2, 3, 1, 3 / 11),
        ("zb1", 2, 4, 1, 1, 1, 1 / 13),  # (p-1)(F+B-W) / (3m(F) + that)
        ("zbh1", 3, 8, 1, 1, 3, 0.0),  # W covers F + B: no bubble
    ],
)
def test_pipeline_theory_follows_the_zero_bubble_paper(schedule, p, m, f, b, w, expected):
    zero_bubble = schedule in ZERO_BUBBLE
    assert pipeline_theory(p, m, f, b, w, zero_bubble=zero_bubble) == pytest.approx(expected)
