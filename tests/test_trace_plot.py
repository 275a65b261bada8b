"""Timeline PNGs from hand-built traces and a real run; the message when matplotlib is missing."""

from __future__ import annotations

import argparse
import builtins

import numpy as np
import pytest

import actorflow as af
from actorflow.trace import WAIT, Recorder, plot_timeline
from actorflow.trace.cli import add_commands, run
from actorflow.trace.plot import COLORS, STEP_LINE, STEP_SHADES, color_group

image = pytest.importorskip("matplotlib.image")

MS = 1e-3


def hand_built() -> dict:
    rec = Recorder(enabled=True)
    rec.add("cpu:0", "cpu:0/compute", "mm", "compute", 0, 2 * MS, {"act": 0})
    rec.add("cpu:0", "cpu:0/copy", "cp", "copy", 2 * MS, 3 * MS, {"act": 0, "inputs": [["mm", 0]]})
    rec.add("cpu:1", "cpu:1/compute", "w", WAIT, 2 * MS, 3 * MS, {})
    rec.add("cpu:1", "cpu:1/compute", "up", "update", 3 * MS, 4 * MS, {})
    rec.add("rank0", "rank0/collective", "ar", "collective", 3 * MS, 5 * MS, {})
    return rec.to_chrome()


def phased() -> dict:
    """Two steps on two stages, each span with its phase, as a run records them."""
    rec = Recorder(enabled=True)
    for it in range(2):
        t = 10 * it * MS
        for name, thread, category, phase, start, end in (
            ("fw", "cpu:0/compute", "compute", "forward", 0, 2),
            ("cp", "cpu:0/copy", "copy", "communication", 2, 3),
            ("bw", "cpu:1/compute", "compute", "backward", 3, 6),
            ("up", "cpu:1/compute", "update", "update", 6, 7),
        ):
            rec.add(
                thread[:5],
                thread,
                name,
                category,
                t + start * MS,
                t + end * MS,
                {"iteration": it, "phase": phase},
            )
        rec.add("cpu:1", "cpu:1/compute", "wait", WAIT, t + 2 * MS, t + 3 * MS, {"iteration": it})
    return rec.to_chrome()


def rgb(color: str) -> tuple[int, ...]:
    return tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))


def colors(path) -> set[tuple[int, ...]]:
    """The RGB colours of a PNG's pixels, 0-255. (Each pixel packed into one int for
    ``np.unique``: its ``axis=0`` sorts rows of a million pixels a hundred times slower.)"""
    pixels = (image.imread(path)[..., :3] * 255).round().astype(np.int64).reshape(-1, 3)
    packed = np.unique(pixels[:, 0] << 16 | pixels[:, 1] << 8 | pixels[:, 2])
    return {(int(p >> 16), int(p >> 8 & 255), int(p & 255)) for p in packed}


def check_png(path, width: int, height: int) -> None:
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert image.imread(path).shape[:2] == (height, width)
    assert len(colors(path)) > 1


def test_hand_built_trace_renders_at_the_requested_size(tmp_path):
    path = tmp_path / "t.png"
    plot_timeline(hand_built(), path, width=900, height=333)
    check_png(path, 900, 333)


def test_default_height_grows_with_the_streams(tmp_path):
    path = tmp_path / "t.png"
    plot_timeline(hand_built(), path)
    check_png(path, 1600, 200 + 40 * 4)  # no steps: hand-built spans name no iteration


def test_each_op_kind_gets_its_color(tmp_path):
    path = tmp_path / "t.png"
    plot_timeline(hand_built(), path, width=800, height=400)
    seen = colors(path)
    for group in ("compute", "communication", "update", WAIT):
        assert rgb(COLORS[group]) in seen, group


def test_phases_get_their_colors_and_steps_their_row_and_lines(tmp_path):
    path = tmp_path / "t.png"
    plot_timeline(phased(), path, width=800, height=400)
    seen = colors(path)
    for group in ("forward", "backward", "update", "communication", WAIT):
        assert rgb(COLORS[group]) in seen, group
    for color in (*STEP_SHADES, STEP_LINE):
        assert rgb(color) in seen, color
    assert rgb(COLORS["compute"]) not in seen  # every kernel named its phase


def test_color_groups():
    categories = ("compute", "feed", "fetch", "copy", "collective", "send", WAIT, "update", "variable", "x")
    assert [color_group(c) for c in categories] == [
        "compute",
        "communication",
        "communication",
        "communication",
        "communication",
        "communication",
        WAIT,
        "update",
        "update",
        "other",
    ]
    assert [color_group("compute", p) for p in ("forward", "backward", "bogus")] == [
        "forward",
        "backward",
        "compute",
    ]
    assert color_group(WAIT, "forward") == WAIT


def test_an_empty_trace_still_renders(tmp_path):
    path = tmp_path / "empty.png"
    plot_timeline({"traceEvents": []}, path, width=400, height=300)
    check_png(path, 400, 300)


def test_a_real_run_renders(tmp_path):
    with af.Graph() as g:
        x = af.placeholder("x", shape=(8, 16), dtype="float32", device="cpu:0")
        h = af.ops.relu(af.ops.matmul(x, af.parameter("w", np.ones((16, 4), np.float32), device="cpu:0")))
        r = af.ops.all_reduce([h, af.ops.to_device(h, "cpu:1")], op="sum")
        af.output("y", r[1])
    trace = tmp_path / "run.trace.json"
    af.run(af.compile(g), [{"x": np.ones((8, 16), np.float32)}] * 3, trace=trace)
    png = tmp_path / "run.png"
    code = run(parse_cli("trace", "plot", str(trace), "-o", str(png)))
    assert code == 0
    pixels = image.imread(png)
    assert pixels.shape[1] == 1600 and pixels.shape[0] >= 200 + 40 * 3
    assert len(colors(png)) > 1


def parse_cli(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="actorflow")
    add_commands(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


@pytest.fixture
def no_matplotlib(monkeypatch):
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)


def test_missing_matplotlib_says_what_to_install(tmp_path, no_matplotlib):
    with pytest.raises(ImportError, match=r"needs matplotlib: pip install 'actorflow\[plot\]'"):
        plot_timeline(hand_built(), tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_the_plot_command_reports_missing_matplotlib(tmp_path, capsys, no_matplotlib):
    trace = tmp_path / "t.json"
    rec = Recorder(enabled=True)
    rec.add("cpu:0", "cpu:0/compute", "k", "compute", 0, MS, {})
    rec.write(trace)
    code = run(parse_cli("trace", "plot", str(trace), "-o", str(tmp_path / "t.png")))
    assert code == 1
    assert "pip install 'actorflow[plot]'" in capsys.readouterr().err
