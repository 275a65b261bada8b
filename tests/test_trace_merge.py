"""Rank traces (``Recorder(rank=r)``), merging them into one trace with flows across
ranks, ``actorflow trace merge``, and the summary of a merged trace."""

from __future__ import annotations

import json
import time

import pytest

from actorflow.trace import WAIT, Recorder, summarize
from actorflow.trace.merge import merge
from test_trace_export import check_structure, complete, flows, names, threads
from test_trace_metrics import cli

MS = 1e-3
UNIX = 1.7e9  # rank 0's origin in unix seconds; rank 1's is LATER seconds after it
LATER = 1.5 * MS


def span(rec: Recorder, thread: str, name: str, category: str, start_ms: float, end_ms: float, **args):
    """A span at ``start_ms`` after the recorder's own perf_counter base (different per rank)."""
    base = 50.0 if rec.rank == 0 else 900.0
    process = thread.split("/")[0]
    rec.add(process, thread, name, category, base + start_ms * MS, base + end_ms * MS, args)


def rank_traces() -> list[dict]:
    """Two iterations of a two-stage pipeline over two ranks: fw0 on cpu:0 (rank 0) is sent
    over rank0/comm, received on rank1/comm, read by fw1 on cpu:1 (rank 1), after a wait;
    an all-reduce on rank1/collective. Rank 1's trace comes first."""
    rank0, rank1 = Recorder(enabled=True, rank=0), Recorder(enabled=True, rank=1)
    for it in range(2):
        t = 10.0 * it
        common = {"iteration": it, "act": it}
        span(rank0, "cpu:0/compute", f"fw0 {it}", "compute", t, t + 1, actor="fw0", stage=0, **common)
        span(
            rank0,
            "rank0/comm",
            f"send {it}",
            "send",
            t + 1,
            t + 2,
            actor="fw0->rank1",
            inputs=[["fw0", it]],
            **common,
        )
        span(
            rank1,
            "rank1/comm",
            f"recv {it}",
            "recv",
            t,
            t + 1,
            actor="fw0<-rank0",
            inputs=[["fw0->rank1", it]],
            **common,
        )
        span(rank1, "cpu:1/compute", f"wait {it}", WAIT, t + 0.5, t + 1, iteration=it)
        span(
            rank1,
            "cpu:1/compute",
            f"fw1 {it}",
            "compute",
            t + 1,
            t + 2,
            actor="fw1",
            stage=1,
            inputs=[["fw0<-rank0", it]],
            **common,
        )
        span(
            rank1,
            "rank1/collective",
            f"ar {it}",
            "collective",
            t + 1.5,
            t + 2.5,
            actor="ar",
            inputs=[["fw1", it]],
            **common,
        )
    traces = [rank1.to_chrome(), rank0.to_chrome()]
    traces[0]["otherData"]["origin_unix"] = UNIX + LATER
    traces[1]["otherData"]["origin_unix"] = UNIX
    return traces


def write(tmp_path, name: str, trace: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(trace))
    return str(path)


# ---------------------------------------------------------------- rank traces


def test_a_rank_trace_has_its_rank_and_origin_and_keeps_inputs():
    rec = Recorder(enabled=True, rank=3)
    now = time.perf_counter()
    rec.add("rank3", "rank3/comm", "recv", "recv", now, now + MS, {"act": 0, "inputs": [["send", 0]]})
    trace = rec.to_chrome()
    assert trace["otherData"]["rank"] == 3
    assert abs(trace["otherData"]["origin_unix"] - time.time()) < 60  # the unix time of ts 0
    assert complete(trace)["recv"]["ts"] == 0
    assert complete(trace)["recv"]["args"]["inputs"] == [["send", 0]]


def test_a_one_process_trace_stays_as_it_was():
    rec = Recorder(enabled=True)
    rec.add("cpu:0", "cpu:0/compute", "k", "compute", 1.0, 2.0, {"act": 0, "inputs": [["p", 0]]})
    trace = rec.to_chrome()
    assert "otherData" not in trace
    assert complete(trace)["k"]["args"] == {"act": 0}


# ---------------------------------------------------------------- merge


def test_a_process_per_rank_in_rank_order_with_its_streams():
    merged = merge(rank_traces())
    check_structure(merged)
    process = names(merged, "process_name")
    assert list(process.values()) == ["rank 0", "rank 1"]
    per_rank: dict[str, list[str]] = {}
    for (pid, _), thread in sorted(threads(merged).items()):
        per_rank.setdefault(process[pid], []).append(thread)
    assert per_rank == {
        "rank 0": ["steps", "cpu:0/compute", "rank0/comm"],
        "rank 1": ["steps", "cpu:1/compute", "rank1/collective", "rank1/comm"],
    }
    events = complete(merged)
    assert process[events["send 0"]["pid"]] == "rank 0" and process[events["recv 0"]["pid"]] == "rank 1"
    assert events["wait 1"]["cat"] == WAIT and process[events["wait 1"]["pid"]] == "rank 1"
    assert all("inputs" not in e["args"] for e in events.values())


def test_spans_share_one_timeline_by_the_ranks_origins():
    events = complete(merge(rank_traces()))
    at = {name: (e["ts"], e["dur"]) for name, e in events.items()}
    later = LATER * 1e6
    assert at["fw0 0"] == (0, pytest.approx(1000))
    assert at["send 1"][0] == pytest.approx(11000)
    assert at["recv 0"][0] == pytest.approx(later, abs=0.5)
    assert at["fw1 1"][0] == pytest.approx(later + 11000, abs=0.5)
    assert at["ar 0"][1] == pytest.approx(1000, abs=1e-3)


def test_flows_cross_ranks_from_send_to_receive():
    merged = merge(rank_traces())
    edges = flows(merged)
    for it in range(2):
        assert {
            (f"fw0 {it}", f"send {it}"),
            (f"send {it}", f"recv {it}"),
            (f"recv {it}", f"fw1 {it}"),
            (f"fw1 {it}", f"ar {it}"),
        } <= edges
    process = names(merged, "process_name")
    events = complete(merged)
    send, recv = events["send 0"], events["recv 0"]
    on_send = [e for e in merged["traceEvents"] if (e["tid"], e.get("ts")) == (send["tid"], send["ts"])]
    [start] = [e for e in on_send if e["ph"] == "s"]  # send 0's one consumer: recv 0
    finish = next(e for e in merged["traceEvents"] if e["ph"] == "f" and e["id"] == start["id"])
    assert process[start["pid"]] == "rank 0" and process[finish["pid"]] == "rank 1"
    assert (finish["tid"], finish["ts"]) == (recv["tid"], recv["ts"])


def test_merge_refuses_no_traces_traces_without_rank_and_two_of_one_rank():
    one_process = Recorder(enabled=True).to_chrome()
    rank0 = rank_traces()[1]
    cases = [
        ([], "no traces to merge"),
        ([rank0, one_process], "trace 1 is not a rank's trace"),
        ([[]], "trace 0 is not a rank's trace"),
        ([rank0, rank0], "trace 0 and trace 1 are both rank 0"),
    ]
    for traces, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            merge(traces)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- the command and the summary


def test_the_merge_command_writes_the_merged_trace(capsys, tmp_path):
    rank1, rank0 = rank_traces()
    paths = [write(tmp_path, "t.rank1.json", rank1), write(tmp_path, "t.rank0.json", rank0)]
    out = tmp_path / "t.json"
    code, stdout, _ = cli(capsys, "trace", "merge", *paths, "-o", str(out))
    assert code == 0 and str(out) in stdout
    assert json.loads(out.read_text()) == json.loads(json.dumps(merge([rank1, rank0])))


def test_the_merge_command_errors(capsys, tmp_path):
    rank0 = write(tmp_path, "t.rank0.json", rank_traces()[1])
    plain = write(tmp_path, "plain.json", Recorder(enabled=True).to_chrome())
    again = write(tmp_path, "again.json", rank_traces()[1])
    out = str(tmp_path / "t.json")
    cases = [
        ([rank0, plain], f"{plain} is not a rank's trace"),
        ([rank0, again], f"{rank0} and {again} are both rank 0"),
        ([rank0, str(tmp_path / "missing.json")], "can't read"),
    ]
    for paths, message in cases:
        code, _, err = cli(capsys, "trace", "merge", *paths, "-o", out)
        assert code == 2
        assert err.startswith("actorflow trace merge: error: ") and message in err
        assert err.count("\n") == 1
    assert not (tmp_path / "t.json").exists()


def test_a_merged_trace_summarizes_per_stream_and_per_stage(capsys, tmp_path):
    merged = merge(rank_traces())
    for s in (summarize(merged), summarize(merged, stages=["cpu:0", "cpu:1"])):
        kinds = {st.thread: st.kind for st in s.streams}
        assert kinds == {
            "cpu:0/compute": "compute",
            "rank0/comm": "comm",
            "cpu:1/compute": "compute",
            "rank1/collective": "collective",
            "rank1/comm": "comm",
        }
        assert all(st.busy_s > 0 for st in s.streams)
        assert [(b.stage, b.process) for b in s.stages] == [(0, "cpu:0"), (1, "cpu:1")]
        assert all(0 < b.bubble < 1 for b in s.stages)
    path = write(tmp_path, "t.json", merged)
    code, out, _ = cli(capsys, "trace", "summary", path, "--stages", "cpu:0,cpu:1")
    assert code == 0 and "rank1/comm" in out and "stage 1  cpu:1" in out


def test_ranks_that_dropped_iterations_merge_over_the_iterations_all_hold():
    rank0, rank1 = Recorder(enabled=True, rank=0, limit=4), Recorder(enabled=True, rank=1, limit=6)
    for it in range(6):
        for k in range(2):
            for stage, recorder in enumerate((rank0, rank1)):
                start = 10 * it + k
                span(
                    recorder,
                    f"cpu:{stage}/compute",
                    f"s{stage}.{it}.{k}",
                    "compute",
                    start,
                    start + 1,
                    iteration=it,
                    stage=stage,
                )
    assert (rank0.kept_from, rank1.kept_from) == (4, 3)
    merged = merge([rank0.to_chrome(), rank1.to_chrome()])
    check_structure(merged)
    kept = {e["args"]["iteration"] for e in merged["traceEvents"] if e["ph"] == "X"}
    assert kept == {4, 5}
    assert merged["otherData"]["kept_from"] == 4 and "from 4 on" in merged["otherData"]["note"]
    assert "otherData" not in merge(rank_traces())  # nothing dropped, nothing said
