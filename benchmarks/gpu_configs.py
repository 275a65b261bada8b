"""Every shipped config (configs/*.yaml) trained on cuda: devices against the same run on
cpu: devices: a few steps of each, in this process, on one GPU (the configs' devices
become logical cuda devices sharing it; a parameter server's servers stay on the host).
Prints per config the largest loss difference relative to the loss, and samples/s of
both (small models: on a GPU these measure the runtime's host path, not the GPU).

Run: python benchmarks/gpu_configs.py [--steps 5] [CONFIG ...]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import warnings

import numpy as np

from actorflow.config import load_config
from actorflow.runtime.cuda import unavailable
from actorflow.text import columns
from actorflow.training import train

CONFIGS = sorted((pathlib.Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def on_cuda(path: pathlib.Path, folder: str) -> pathlib.Path:
    """``path``'s config with every cpu:N device named cuda:N."""
    moved = pathlib.Path(folder) / path.name
    moved.write_text(path.read_text().replace("cpu:", "cuda:"))
    return moved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5, help="steps of each run (default 5)")
    parser.add_argument("configs", nargs="*", type=pathlib.Path, help="configs (default: every shipped one)")
    args = parser.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"gpu_configs.py needs CuPy and a GPU: {why}")
        return 2
    sets = [f"train.steps={args.steps}"]
    rows = [
        ("config", "steps", "max |loss diff| / loss", "samples/s cpu", "samples/s cuda", "ordered by (cuda)")
    ]
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the devices sharing one GPU
        for path in args.configs or CONFIGS:
            cpu = train(load_config(path, sets))
            gpu = train(load_config(on_cuda(path, folder), sets))
            diff = np.max(np.abs(np.subtract(gpu.losses, cpu.losses)) / np.abs(cpu.losses))
            rows.append(
                (
                    path.stem,
                    str(len(gpu.losses)),
                    f"{diff:.1e}",
                    f"{cpu.samples_per_second:.0f}",
                    f"{gpu.samples_per_second:.0f}",
                    gpu.ordered_by[:50],
                )
            )
    print("\n".join(columns(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
