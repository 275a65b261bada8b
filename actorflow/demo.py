"""The demo job: a two-device graph with a copy, a collective and a user kernel, checked
against numpy. It is what ``actorflow demo`` runs until YAML training runs exist."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from . import ops
from .compiler import compile
from .graph import Graph, output, parameter, placeholder
from .plan import Plan
from .runtime import Session


def scale_half(a: np.ndarray) -> np.ndarray:
    return a * 0.5


def build(batch: int = 64, width: int = 256, quota: int = 2) -> tuple[Plan, Callable]:
    """The demo Plan and a numpy function computing the same output from ``x``."""
    rng = np.random.default_rng(0)
    w0 = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    w1 = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    with Graph() as g:
        x = placeholder("x", (batch, width), "float32", "cpu:0")
        h0 = ops.relu(ops.matmul(x, parameter("w0", w0, "cpu:0")))
        h1 = ops.gelu(ops.matmul(ops.to_device(h0, "cpu:1"), parameter("w1", w1, "cpu:1")))
        total = ops.all_reduce([h0, h1], op="sum")
        y = ops.call(scale_half, total[1], shape=(batch, width), dtype="float32")
        output("y", ops.softmax(y, axis=-1))

    def reference(x: np.ndarray) -> np.ndarray:
        h0 = np.maximum(x @ w0, 0)
        a = h0 @ w1
        h1 = 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))
        y = (h0 + h1) * 0.5
        e = np.exp(y - y.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)

    return compile(g, quota=quota), reference


def main(iterations: int, batch: int, width: int, quota: int, trace: str | None) -> int:
    plan, reference = build(batch, width, quota)
    print(plan.summary())
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((batch, width)).astype(np.float32)} for _ in range(iterations)]
    with Session(plan, trace=trace is not None) as session:
        session.run(feeds[:1])
        start = time.perf_counter()
        outputs = session.run(feeds)
        elapsed = time.perf_counter() - start
        stats = session.register_stats()
        if trace is not None:
            session.recorder.write(trace)
    error = max(float(np.abs(o["y"] - reference(f["x"])).max()) for o, f in zip(outputs, feeds))
    print(f"\nran {iterations} iterations (batch {batch}, width {width}, quota {quota})")
    print(
        f"  y: float32{list(outputs[-1]['y'].shape)}, rows sum to {outputs[-1]['y'].sum(axis=1).mean():.6f}"
    )
    print(f"  max |actorflow - numpy| = {error:.2e}")
    print(f"  {elapsed * 1e3:.1f} ms in all, {elapsed / iterations * 1e3:.2f} ms per iteration")
    held = max(s["max_held"] for s in stats.values())
    print(f"  most buffers held by one register: {held} (quota {quota})")
    if trace is not None:
        print(f"  trace written to {trace} (open it in ui.perfetto.dev)")
    return 0 if error < 1e-4 else 1
