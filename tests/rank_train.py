"""Train a config on every rank (run under a launcher by ``test_ranks``); rank 0 saves
the losses and every parameter to OUT (an .npz)."""

import sys

import numpy as np

from actorflow.config import load_config
from actorflow.training import train
from actorflow.world import this_rank


def main(config_path: str, out: str, *overrides: str) -> None:
    result = train(load_config(config_path, overrides))
    if this_rank() == 0:
        np.savez(
            out,
            losses=np.array(result.losses),
            bubble_steps=np.array(result.bubble_steps),
            **{f"p_{k}": v for k, v in result.parameters.items()},
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
