"""Train a config on every rank (run under a launcher by ``test_ranks``); rank 0 saves
what ``trained`` gives to OUT (an .npz)."""

import sys

import numpy as np

from actorflow.config import load_config
from actorflow.training import train
from actorflow.world import this_rank


def trained(config_path: str, *overrides: str) -> dict[str, np.ndarray]:
    """``train`` of a config: its losses, the steps its bubbles were measured over (each
    step once, however many ranks traced it) and every parameter, as ``test_ranks``
    compares them."""
    result = train(load_config(config_path, overrides))
    return {
        "losses": np.array(result.losses),
        "bubble_steps": np.array(result.bubble_steps),
        **{f"p_{k}": v for k, v in result.parameters.items()},
    }


def main(config_path: str, out: str, *overrides: str) -> None:
    arrays = trained(config_path, *overrides)
    if this_rank() == 0:
        np.savez(out, **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:])
