"""What any runtime can get from numpy kernels of a pipelined MLP: its stages as plain
numpy loops, alone or in a bare 1F1B pipeline, with nothing between their kernels.

A stage is a run of the MLP's layers (``h @ w + b``, ReLU after every layer but the
model's last); the last stage ends in the mean softmax cross-entropy. A step is m
micro-batches of ``batch / m`` rows, each a forward and a backward that adds its weight
and bias gradients into the step's, then SGD with momentum (v = mu v + g; w -= lr v).

``rate`` runs the stages six ways, all with one BLAS thread each (as the runtime runs
its devices):

- ``"thread"``: one thread, every stage's step one after the other: a plain training loop;
- ``"threads"``, ``"processes"``: a thread, or a process, per stage, all at once and each
  on its own: a stage that is not the last takes a fixed gradient of its output (its
  sign flipped each step, so that the parameters stay bounded), as if the next stage had
  sent it. With no stage waiting for another's data this is the bound of any pipeline on
  that placement: its bubble and its hand-offs come on top;
- ``"threads 1f1b"``, ``"processes 1f1b"``: the bare pipeline, a thread or a process per
  stage running 1F1B: each activation and gradient copied into a slot of a ring between
  neighbours (shared memory between processes) and handed over with a semaphore, the
  ring's slots the credits (one per micro-batch), no runtime;
- ``"processes 1f1b spin"``: the same over processes, each waiting for its neighbour by
  spinning on a count in shared memory (``Spin``) rather than sleeping on a semaphore:
  no wake-up to pay, where each process has a core of its own.

samples/s = batch / the slowest stage's seconds a step (one thread: the sum of them).
"""

from __future__ import annotations

import functools
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

WARM_STEPS = 5
PLACEMENTS = {
    "thread": "numpy stages on 1 thread",
    "threads": "numpy stages on a thread per stage, each on its own",
    "processes": "numpy stages on a process per stage, each on its own",
    "threads 1f1b": "numpy stages in a bare 1F1B pipeline over threads",
    "processes 1f1b": "numpy stages in a bare 1F1B pipeline over processes",
    "processes 1f1b spin": "numpy stages in a bare 1F1B pipeline over processes, spinning",
}
"""``rate``'s placements (see the module's docstring), each with what a table calls it."""


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

    def forward(self, x: np.ndarray) -> list[np.ndarray]:
        """The stage's input and each layer's output."""
        layers = len(self.w)
        outs = [x]
        for k, (w, b) in enumerate(zip(self.w, self.b)):
            z = outs[-1] @ w + b
            outs.append(z if self.last and k == layers - 1 else np.maximum(z, 0))
        return outs

    def backward(self, outs: list[np.ndarray], dy: np.ndarray | None) -> np.ndarray | None:
        """Add the gradients of the micro-batch ``forward`` gave ``outs`` of, ``dy`` that of
        its output (the last stage: None, the loss's); the gradient of its input (None for
        the first stage)."""
        layers = len(self.w)
        if self.last:
            logits = outs[-1]
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            p[np.arange(len(p)), self.labels] -= 1
            d = p / len(p)
        else:
            assert dy is not None, "a stage before the last is given its output's gradient"
            d = dy
        for k in reversed(range(layers)):
            if not (self.last and k == layers - 1):
                d = d * (outs[k + 1] > 0)
            self.grads[k] += outs[k].T @ d
            self.grads[layers + k] += d.sum(axis=0)
            if k or not self.first:
                d = d @ self.w[k].T
        return None if self.first else d

    def update(self, micro_batches: int, lr: float = 0.05, momentum: float = 0.9) -> None:
        for p, g, v in zip(self.params, self.grads, self.velocity):
            g /= micro_batches
            v *= momentum
            v += g
            p -= lr * v
            g[:] = 0

    def step(self, micro_batches: int) -> None:
        """A step on its own: each micro-batch's forward and backward, then the update."""
        for _ in range(micro_batches):
            self.backward(self.forward(self.x), None if self.last else self.dy)
        self.update(micro_batches)
        self.dy = -self.dy


def stages(sizes: Sequence[int], cuts: Sequence[int], rows: int) -> list[Stage]:
    """The MLP of ``sizes`` cut into stages of ``cuts`` layers each ([2, 2]: two stages of
    two layers)."""
    out, start = [], 0
    for k, layers in enumerate(cuts):
        out.append(Stage(sizes[start : start + layers + 1], rows, k == 0, k == len(cuts) - 1, seed=k))
        start += layers
    return out


class Spin:
    """A semaphore of one releaser and one acquirer, in shared memory (``counts``: a
    RawArray of two: the releases, the acquisitions), that its acquirer waits on by
    spinning."""

    def __init__(self, counts: Any) -> None:
        self.counts = counts

    def acquire(self) -> None:
        counts = self.counts
        want = counts[1] + 1
        while counts[0] < want:
            pass
        counts[1] = want

    def release(self) -> None:
        self.counts[0] += 1


class Ring:
    """One direction between neighbouring stages: its ``buffers`` (the ring's slots), a
    semaphore of the full ones and one of the free ones. The sender and the receiver each
    count their own turns, so either end may be another process's copy of it."""

    def __init__(self, buffers: list[np.ndarray], full: Any, free: Any) -> None:
        self.buffers, self.full, self.free = buffers, full, free
        self.sent = self.received = 0

    def send(self, x: np.ndarray) -> None:
        self.free.acquire()
        np.copyto(self.buffers[self.sent % len(self.buffers)], x)
        self.sent += 1
        self.full.release()

    def receive(self) -> np.ndarray:
        self.full.acquire()
        x = self.buffers[self.received % len(self.buffers)].copy()
        self.received += 1
        self.free.release()
        return x


def one_f_one_b(k: int, p: int, m: int) -> list[tuple[str, int]]:
    """Stage k of p's order of forwards ("F", i) and backwards ("B", i) under 1F1B."""
    warm = min(p - k - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(warm, m):
        order += [("F", i), ("B", i - warm)]
    return order + [("B", i) for i in range(m - warm, m)]


def _pipelined_step(stage: Stage, order: list[tuple[str, int]], rings: tuple[Ring | None, ...]) -> None:
    """A step of ``stage`` in the pipeline: ``rings``: (activations in, out; gradients in, out)."""
    into, onward, back_in, back_out = rings
    saved = {}
    for kind, i in order:
        if kind == "F":
            saved[i] = outs = stage.forward(stage.x if into is None else into.receive())
            if onward is not None:
                onward.send(outs[-1])
        else:
            dx = stage.backward(saved.pop(i), None if back_in is None else back_in.receive())
            if back_out is not None and dx is not None:
                back_out.send(dx)
    stage.update(len(order) // 2)


def _seconds_a_step(step: Callable[[], None], steps: int, barrier: Any = None) -> float:
    for _ in range(WARM_STEPS):
        step()
    if barrier is not None:
        barrier.wait()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def _stage_step(
    stage: Stage, k: int, cuts: Sequence[int], micro_batches: int, rings: list | None
) -> Callable[[], None]:
    """Stage k's step: on its own (``rings`` None) or in the pipeline, its rings (the
    ``Ring`` arguments of each boundary: activations, gradients)."""
    if rings is None:
        return functools.partial(stage.step, micro_batches)
    p = len(cuts)

    def ring(boundary: int, direction: int) -> Ring | None:
        return Ring(*rings[boundary][direction]) if 0 <= boundary < p - 1 else None

    ends = (ring(k - 1, 0), ring(k, 0), ring(k, 1), ring(k - 1, 1))
    order = one_f_one_b(k, p, micro_batches)
    return functools.partial(_pipelined_step, stage, order, ends)


def _rings(
    boundaries: Sequence[int],
    slots: int,
    buffer: Callable[[int], Any],
    counts: Callable[[int], tuple[Any, Any]],
) -> list:
    """Per boundary between stages (its width), the ``Ring`` arguments of its two
    directions (activations, gradients): ``slots`` of ``buffer(width)``, and the
    semaphores of the full and of the free slots, ``counts(slots)``."""
    return [[([buffer(width) for _ in range(slots)], *counts(slots)) for _ in "ab"] for width in boundaries]


def _process(sizes, cuts, rows, k, micro_batches, steps, rings, spin, barrier, results) -> None:
    if rings is not None:  # shared memory as numpy arrays (and counts as ``Spin``s), in this process
        rings = [
            [
                (
                    [np.frombuffer(raw, np.float32).reshape(rows, -1) for raw in raws],
                    *((Spin(full), Spin(free)) if spin else (full, free)),
                )
                for raws, full, free in pair
            ]
            for pair in rings
        ]
    with threadpool_limits(1, user_api="blas"):
        step = _stage_step(stages(sizes, cuts, rows)[k], k, cuts, micro_batches, rings)
        results.put((k, _seconds_a_step(step, steps, barrier)))


def rate(
    placement: str, sizes: Sequence[int], cuts: Sequence[int], batch: int, micro_batches: int, steps: int
) -> float:
    """samples/s of the stages placed as ``placement`` says (see the module's docstring)."""
    rows, p = batch // micro_batches, len(cuts)
    boundaries = [sizes[sum(cuts[: k + 1])] for k in range(p - 1)]  # the width crossing each
    pipelined, spin = " 1f1b" in placement, placement.endswith(" spin")
    if placement.startswith("processes"):
        context = multiprocessing.get_context("spawn")
        rings = None
        if pipelined:

            def counts(n: int) -> tuple[Any, Any]:
                if spin:
                    return context.RawArray("q", [0, 0]), context.RawArray("q", [n, 0])
                return context.Semaphore(0), context.Semaphore(n)

            rings = _rings(
                boundaries, micro_batches, lambda width: context.RawArray("f", rows * width), counts
            )
        together, results = context.Barrier(p), context.Queue()
        workers = [
            context.Process(
                target=_process,
                args=(sizes, cuts, rows, k, micro_batches, steps, rings, spin, together, results),
            )
            for k in range(p)
        ]
        for w in workers:
            w.start()
        seconds: list[float] = []
        while len(seconds) < p:
            try:
                seconds.append(results.get(timeout=1)[1])
            except queue.Empty:
                if any(w.exitcode for w in workers):
                    for w in workers:
                        w.kill()
                    raise RuntimeError(
                        f"a stage's process failed: exit codes {[w.exitcode for w in workers]}"
                    ) from None
        for w in workers:
            w.join()
        return batch / max(seconds)
    with threadpool_limits(1, user_api="blas"):
        parts = stages(sizes, cuts, rows)
        if placement == "thread":
            return batch / sum(
                _seconds_a_step(functools.partial(s.step, micro_batches), steps) for s in parts
            )
        thread_rings = None
        if pipelined:
            thread_rings = _rings(
                boundaries,
                micro_batches,
                lambda width: np.empty((rows, width), np.float32),
                lambda n: (threading.Semaphore(0), threading.Semaphore(n)),
            )
        barrier = threading.Barrier(p)
        seconds = [0.0] * p

        def run(k: int) -> None:
            step = _stage_step(parts[k], k, cuts, micro_batches, thread_rings)
            seconds[k] = _seconds_a_step(step, steps, barrier)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return batch / max(seconds)
