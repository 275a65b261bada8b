"""Peak memory of the transformer's text data (``data.kind: text``) against the file's size.

Writes a text of --mb MiB (the shipped sonnets, repeated, with one line of accented and
CJK characters per copy unless --ascii, so the vocabulary is the sonnets' and a few
more) into a temporary folder, then reads it as ``actorflow run`` does (``dataset``) in a
fresh process, and prints that process's peak resident memory (VmHWM) before and after
the read, the growth against the file's size, and the seconds the read took.

Run: python benchmarks/text_data.py [--mb 100] [--ascii]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from actorflow.config import parse_config
from actorflow.training.data import TEXT, dataset
from soak import rss_mb  # benchmarks/ is on sys.path when this script runs

EXTRA = "Élan, naïveté, 東京.\n"


def child(path: str) -> None:
    """Read ``path`` as a transformer config does and print: peak MiB before, after, seconds."""
    config = parse_config(
        {
            "model": {
                "kind": "transformer",
                "vocab": 128,
                "d_model": 16,
                "heads": 2,
                "layers": 1,
                "seq_len": 32,
            },
            "data": {"kind": "text", "samples": 8192, "path": path},
            "train": {"steps": 1, "batch_size": 8, "optimizer": {"lr": 0.01}},
            "parallel": {"stages": ["cpu:0"]},
        }
    )
    before = rss_mb()[1]
    start = time.perf_counter()
    data = dataset(config)
    seconds = time.perf_counter() - start
    assert data["x"].shape == (8192, 32)
    print(before, rss_mb()[1], seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--mb", type=float, default=100, help="the text's size in MiB")
    parser.add_argument("--ascii", action="store_true", help="the sonnets only (one byte a character)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    sonnets = TEXT.read_text(encoding="utf-8")
    copy = (sonnets if args.ascii else sonnets + EXTRA).encode("utf-8")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "text.txt"
        path.write_bytes(copy * int(args.mb * 2**20 / len(copy)))
        size = path.stat().st_size / 2**20
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(path)], capture_output=True, text=True, check=True
        ).stdout
    before, after, seconds = map(float, out.split())
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"text: {size:.1f} MiB ({'ASCII' if args.ascii else 'UTF-8, some characters of 2 and 3 bytes'})")
    print(f"peak RSS before reading: {before:8.1f} MiB")
    print(f"peak RSS after reading:  {after:8.1f} MiB")
    print(
        f"growth: {after - before:.1f} MiB = {(after - before) / size:.2f} x the file, read in {seconds:.2f} s"
    )


if __name__ == "__main__":
    main()
