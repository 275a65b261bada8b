"""The most any runtime can get from numpy kernels of a pipelined MLP: each stage's
forward and backward as a plain numpy loop, with nothing between its kernels and no
hand-off between the stages.

A stage is a run of the MLP's layers (``h @ w + b``, ReLU after every layer but the
model's last); the last stage ends in the mean softmax cross-entropy. A step is m
micro-batches of ``batch / m`` rows, each a forward and a backward that adds its weight
and bias gradients into the step's, then SGD with momentum (v = mu v + g; w -= lr v).
A stage that is not the last takes a fixed gradient of its output, as if the next stage
had sent it (its sign flipped each step, so that the parameters stay bounded); one that is not the first computes the gradient of its input, as if it sent
it back.

``bound`` runs the stages three ways, all with one BLAS thread (as the runtime runs its
devices):

- ``"thread"``: one thread, every stage's step one after the other: a plain training loop;
- ``"threads"``: a thread per stage, all at once;
- ``"processes"``: a process per stage, all at once.

With no stage waiting for another's data, a pipeline over the same placement can only be
slower: its bubble and its hand-offs come on top. samples/s = batch / the slowest stage's
seconds a step (one thread: the sum of them).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Sequence

import numpy as np
from threadpoolctl import threadpool_limits

WARM_STEPS = 5


class Stage:
    """Layers ``sizes[0] -> sizes[1] -> ...`` of an MLP, with random parameters and input."""

    def __init__(self, sizes: Sequence[int], rows: int, first: bool, last: bool, seed: int) -> None:
        rng = np.random.default_rng(seed)
        pairs = list(zip(sizes, sizes[1:]))
        self.w = [(rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32) for a, b in pairs]
        self.b = [np.zeros(b, np.float32) for _, b in pairs]
        self.params = [*self.w, *self.b]
        self.grads = [np.zeros_like(p) for p in self.params]
        self.velocity = [np.zeros_like(p) for p in self.params]
        self.x = rng.standard_normal((rows, sizes[0])).astype(np.float32)
        self.dy = (rng.standard_normal((rows, sizes[-1])) / rows).astype(np.float32)
        self.labels = rng.integers(0, sizes[-1], rows)
        self.first, self.last = first, last

    def micro_batch(self) -> np.ndarray:
        """One micro-batch's forward and backward; the gradient of its input (the last
        layer's, for the first stage)."""
        layers = len(self.w)
        outs = [self.x]
        for k, (w, b) in enumerate(zip(self.w, self.b)):
            z = outs[-1] @ w + b
            outs.append(z if self.last and k == layers - 1 else np.maximum(z, 0))
        if self.last:
            logits = outs[-1]
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(p)), self.labels] -= 1
            d = p / len(p)
        else:
            d = self.dy
        for k in reversed(range(layers)):
            if not (self.last and k == layers - 1):
                d = d * (outs[k + 1] > 0)
            self.grads[k] += outs[k].T @ d
            self.grads[layers + k] += d.sum(axis=0)
            if k or not self.first:
                d = d @ self.w[k].T
        return d

    def step(self, micro_batches: int, lr: float = 0.05, momentum: float = 0.9) -> None:
        for _ in range(micro_batches):
            self.micro_batch()
        for p, g, v in zip(self.params, self.grads, self.velocity):
            g /= micro_batches
            v *= momentum
            v += g
            p -= lr * v
            g[:] = 0
        self.dy = -self.dy


def stages(sizes: Sequence[int], cuts: Sequence[int], rows: int) -> list[Stage]:
    """The MLP of ``sizes`` cut into stages after the layers in ``cuts`` (as the layer
    counts per stage run: [2, 2] is two stages of two layers)."""
    out, start = [], 0
    for k, layers in enumerate(cuts):
        out.append(Stage(sizes[start : start + layers + 1], rows, k == 0, k == len(cuts) - 1, seed=k))
        start += layers
    return out


def _seconds_a_step(stage: Stage, micro_batches: int, steps: int, barrier=None) -> float:
    for _ in range(WARM_STEPS):
        stage.step(micro_batches)
    if barrier is not None:
        barrier.wait()
    start = time.perf_counter()
    for _ in range(steps):
        stage.step(micro_batches)
    return (time.perf_counter() - start) / steps


def _process(sizes, cuts, rows, k, micro_batches, steps, barrier, results) -> None:
    with threadpool_limits(1, user_api="blas"):
        results.put((k, _seconds_a_step(stages(sizes, cuts, rows)[k], micro_batches, steps, barrier)))


def bound(
    placement: str, sizes: Sequence[int], cuts: Sequence[int], batch: int, micro_batches: int, steps: int
) -> float:
    """samples/s of the stages placed as ``placement`` says (see the module's docstring)."""
    rows = batch // micro_batches
    if placement == "processes":
        context = multiprocessing.get_context("spawn")
        together, results = context.Barrier(len(cuts)), context.Queue()
        args = (sizes, cuts, rows)
        workers = [
            context.Process(target=_process, args=(*args, k, micro_batches, steps, together, results))
            for k in range(len(cuts))
        ]
        for w in workers:
            w.start()
        seconds = [results.get(timeout=600)[1] for _ in workers]
        for w in workers:
            w.join()
        return batch / max(seconds)
    with threadpool_limits(1, user_api="blas"):
        parts = stages(sizes, cuts, rows)
        if placement == "thread":
            return batch / sum(_seconds_a_step(s, micro_batches, steps) for s in parts)
        barrier = threading.Barrier(len(parts))
        seconds = [0.0] * len(parts)

        def run(k: int) -> None:
            seconds[k] = _seconds_a_step(parts[k], micro_batches, steps, barrier)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(parts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return batch / max(seconds)
