"""The cost model of a simulated run: how long each act takes, fitted from a measured run.

A kernel's time is the sum of its parts' (a fused chain runs several ops, see
``ops.chain``), and a part of op kind k takes ``a_k + b_k * flops + c_k * bytes``: a fixed
cost per call, a rate for arithmetic, a rate for memory (its inputs and outputs). A
collective takes an alpha-beta time per algorithm (ring or tree, the faster) over a
two-level topology: links within a node and across nodes (``Link``), a collective over
several nodes reducing within each node first (the two-level collectives of seed 004).
Around the kernels the runtime itself costs time, measured too: ``launch`` per act on
a stream, ``hop`` per message between streams' threads (a wake-up), ``between`` the
host's time from one run's end to the next's start (a run: ``train.steps_per_run``
steps); and the stream threads share the
machine's ``cores`` and their process's GIL (``runtime.virtual.Host``): acts of one
process running at once slow each other down, by their Python parts (``contention``).

``calibrate`` fits all of it from a trace of ``actorflow run --trace`` (which carries its
config, so the plan's shapes can be rebuilt): each actor's median kernel time over its
acts, by non-negative least squares per kind, pulled towards one fit over every kind
(what a kind seen on one shape only can't tell apart: its fixed cost from its rates);
each kernel's time first taken back to what it would have been alone (by how long it
ran beside others of its process, its share that holds the GIL as the fit gives it, and
the contention that makes each actor's acts most alike: ``predict.Beside``); the
stream's time per act from the gaps between its back-to-back kernels, a wake-up from the
delays of idle streams' kernels after what they waited for ended, the time between runs
from the gaps between the trace's whole runs, and the contention (or, for a run of one
thread, the GIL's hand-over) by simulating the measured config and matching its step
time.
The result is a small JSON file a user keeps per machine (``CostModel.to_json``); one per
model kind ships with actorflow (``shipped``), fitted on its developers' 2-core VM.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import Any

import attrs
import numpy as np

from ..errors import ConfigError
from ..ops.collective import ring_bytes
from ..plan import Actor, Plan
from ..plan_data import leaf_parts

FORMAT = "actorflow-calibration/2"
RIDGE = 0.05
"""How strongly a kind's fit is pulled towards the fit over every kind."""

Features = dict[str, tuple[int, float, float]]
"""Per op kind of an act's parts: (calls, flops, bytes)."""


class CalibrationError(ConfigError):
    """A calibration file that can't be read or doesn't fit the config; one line."""


@attrs.frozen
class Link:
    """One level of the topology: ``alpha`` seconds a message, ``bandwidth`` bytes a second."""

    alpha: float
    bandwidth: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha + nbytes / self.bandwidth


NODE = Link(1e-6, 10e9)
"""Within a node, until a calibration measures it."""
NETWORK = Link(5e-6, 4e9)
"""Across nodes: what MPI between two ranks of this machine gave (DESIGN.md's facts,
~5 us small messages, 2-9 GB/s for 16 MiB); settable in the calibration file."""
TRANSPORT = Link(50e-6, 2e9)
"""Between ranks of one node, through actorflow's transport: MPI's shared memory and
the transport thread's polling and wake-ups (a hop between ranks 90-103 us an
iteration, a 1 MiB all-reduce over 2 ranks 0.6-1.3 ms: DESIGN.md's facts and
``benchmarks/ranks.py``); settable in the calibration file."""


@attrs.frozen
class CostModel:
    """``ops``: per op kind, (seconds a call, seconds a flop, seconds a byte); ``overall``:
    the same fitted over every kind, for a kind the measured run did not have;
    ``node`` and ``network``: the links within and across nodes of ``node_size``
    devices, ``transport``: between ranks of one node; ``cores``: a machine's; ``handover``: how long a woken stream thread waits
    for its process's GIL while another runs acts back to back (at most CPython's switch
    interval; sooner where the runner's kernels release the GIL long enough for the
    woken one to take it); ``contention``: how much an act slows down, by its share
    that holds the GIL (its launch and its calls' fixed costs), while others of its
    process run, and ``crowding`` how that grows with their number (``runtime.virtual.Host``);
    ``model``: the config's ``model`` section the fit was measured on."""

    ops: dict[str, tuple[float, float, float]]
    overall: tuple[float, float, float]
    launch: float = 0.0
    hop: float = 0.0
    between: float = 0.0
    node: Link = NODE
    network: Link = NETWORK
    transport: Link = TRANSPORT
    node_size: int = 8
    cores: int = 2
    handover: float = 0.005
    contention: float = 0.0
    crowding: float = 0.0
    model: dict[str, Any] = attrs.Factory(dict)

    def seconds(self, features: Features) -> float:
        total = 0.0
        for kind, (calls, flops, nbytes) in features.items():
            a, b, c = self.ops.get(kind, self.overall)
            total += calls * a + flops * b + nbytes * c
        return total

    def held(self, features: Features) -> float:
        """Of ``seconds``, the fixed cost of its calls: Python's part, which holds the GIL
        (numpy's loops and BLAS release it)."""
        return sum(calls * self.ops.get(kind, self.overall)[0] for kind, (calls, _, _) in features.items())

    def collective(self, op: str, nbytes: float, devices: Sequence[int], ranks: int = 1) -> float:
        """The faster of ring and tree for ``op`` over ``devices`` (indices; every
        ``node_size`` consecutive ones share a node) of ``nbytes`` a participant's input, who
        are in ``ranks`` processes (within a node, between ranks, over ``transport``)."""
        nodes = len({d // self.node_size for d in devices})
        local = math.ceil(len(devices) / nodes)
        if nodes == 1:
            return _flat(op, nbytes, local, self.node if ranks == 1 else self.transport)
        # within each node a reduce-scatter (or gather), across nodes the rest on 1/local of it
        inner = _flat("reduce_scatter", nbytes, local, self.node) if local > 1 else 0.0
        return 2 * inner + _flat(op, nbytes / local, nodes, self.network)

    def to_json(self) -> str:
        data = attrs.asdict(self)
        data["ops"] = {k: list(v) for k, v in self.ops.items()}
        return json.dumps({"format": FORMAT, **data}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> CostModel:
        try:
            data = json.loads(text)
            if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
                raise ValueError(f"not a calibration of format {FORMAT}")
            data["ops"] = {str(k): _three(v) for k, v in data["ops"].items()}
            data["overall"] = _three(data["overall"])
            for level in ("node", "network", "transport"):
                data[level] = Link(**data[level])
            model = cls(**data)
            links = (model.node, model.network, model.transport)
            if model.node_size < 1 or model.cores < 1 or not all(0 < k.bandwidth < math.inf for k in links):
                raise ValueError("a node of no devices, or a link of no bandwidth or of one not finite")
            times = (model.launch, model.hop, model.between, model.handover, *(k.alpha for k in links))
            if not all(0 <= x < math.inf for x in (*times, model.contention, model.crowding)):
                raise ValueError("a time, contention or crowding that is negative or not finite")
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise CalibrationError(f"{where}: not a calibration file ({type(e).__name__}: {e})") from None
        return model


def shipped(kind: str) -> CostModel:
    """The calibration shipped for a ``kind`` model (``calibrations/KIND.json``), for a
    user without one of their own: fitted on the 2-core VM actorflow is developed on,
    from a run of ``configs/gpipe.yaml`` (micro-batches 2) for the mlp and of
    ``configs/transformer.yaml`` (micro-batches 4) for the transformer, 30 steps each."""
    where = f"the shipped calibration of a {kind} model"
    try:
        text = resources.files(__package__).joinpath("calibrations", f"{kind}.json").read_text()
    except OSError as e:
        raise CalibrationError(f"{where}: none ({e.strerror}); give --calibrate") from None
    return CostModel.from_json(text, where)


def _three(value: Any) -> tuple[float, float, float]:
    a, b, c = (float(x) for x in value)
    if min(a, b, c) < 0 or not all(map(math.isfinite, (a, b, c))):
        raise ValueError(f"costs must be finite and >= 0, got {value!r}")
    return a, b, c


def _flat(op: str, nbytes: float, n: int, link: Link) -> float:
    """One level's collective of ``n`` participants, ``nbytes`` one participant's input:
    the ring (``ring_terms``) or, for an all-reduce, the tree (2 log2 n messages of the
    whole input), the faster."""
    if n <= 1:
        return 0.0
    rounds, moved = ring_terms(op, nbytes, n)
    ring = rounds * link.alpha + moved / link.bandwidth
    if op != "all_reduce":
        return ring
    return min(ring, 2 * math.ceil(math.log2(n)) * link.seconds(nbytes))


def ring_terms(op: str, nbytes: float, n: int) -> tuple[int, float]:
    """(messages, bytes) one participant of a ring ``op`` over ``n`` sends, ``nbytes`` its
    input (``ops.collective.ring_bytes``, what the compiler's link model moves): an
    all-reduce's 2(n-1) messages, a reduce-scatter's, gather's and all-to-all's n-1, a
    broadcast's pipelined n-1."""
    return (2 * (n - 1) if op == "all_reduce" else n - 1), ring_bytes(op, nbytes, n)


def features(plan: Plan, actor: Actor) -> Features:
    """Per op kind of ``actor``'s parts: calls, flops and bytes read and written."""
    shapes_in = [plan.registers[i.register].shape for i in actor.inputs]
    shapes_out = [plan.registers[o].shape for o in actor.outputs]
    itemsize = np.dtype(plan.registers[actor.outputs[0]].dtype).itemsize if actor.outputs else 4
    if len(actor.ops) == 1:
        parts = [(actor.ops[0], actor.attrs, shapes_in, shapes_out)]
    else:
        parts = [
            (
                op,
                part[1],
                [shapes_in[k] if k >= 0 else shapes_out[~k] for k in part[2]],
                [shapes_out[t] for t in part[3]],
            )
            for op, part in zip(actor.ops, leaf_parts(actor.attrs["parts"]))
        ]
    found: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for op, attrs_, ins, outs in parts:
        sizes = [math.prod(s) for s in (*ins, *outs)]
        flops = _flops(op, attrs_, ins, outs)
        entry = found[op]
        entry[0] += 1
        entry[1] += flops
        entry[2] += sum(sizes) * itemsize
    return {k: (int(v[0]), v[1], v[2]) for k, v in found.items()}


def _flops(op: str, attrs_: dict, ins: list[tuple[int, ...]], outs: list[tuple[int, ...]]) -> float:
    out = math.prod(outs[0]) if outs else 0
    if op == "matmul" and ins:
        a = ins[0]
        k = a[-2] if attrs_.get("transpose_a") else a[-1]
        return 2.0 * out * k
    return float(max([out, *(math.prod(s) for s in ins)], default=0))


def flop_rates(machine: Any, where: str) -> dict[str, float]:
    """Per op kind, the seconds a flop the machine took in a trace's ``otherData.machine``
    (``training.machine``): a product's fewest over its sizes (the largest's, where the
    arithmetic outweighs the call and the memory); a CalibrationError where it isn't
    ``{"matmul": [[m, k, n, seconds], ...]}`` of positive numbers."""
    try:
        rows = [(int(m), int(k), int(n), float(t)) for m, k, n, t in machine.get("matmul", [])]
        if not all(min(row) > 0 and math.isfinite(row[3]) for row in rows):
            raise ValueError("a size or time that is not positive")
    except (AttributeError, TypeError, ValueError) as e:
        raise CalibrationError(
            f"{where}: otherData.machine is not this machine's timed products ({e})"
        ) from None
    return {"matmul": min(t / (2.0 * m * k * n) for m, k, n, t in rows)} if rows else {}


def fit(
    samples: Iterable[tuple[Features, float]], rates: Mapping[str, float] | None = None
) -> tuple[dict[str, tuple[float, float, float]], tuple]:
    """Per kind (seconds a call, a flop, a byte) and the fit over every kind, from acts'
    features and measured seconds (see the module's docstring); ``rates``: per kind, the
    seconds a flop where the machine told it (``flop_rates``), held in that kind's fit.

    A small model's acts of a kind may all have about the same flops per byte, which
    leaves the two rates to the least squares' whim: the transformer's matrix products
    were fitted as memory-bound alone, and a product 30 times wider came out 20 times
    too fast."""
    samples = list(samples)
    rates = rates or {}
    kinds = sorted({k for f, _ in samples for k in f})
    weight = np.array([1.0 / max(t, 1e-7) for _, t in samples])  # relative errors count
    scale = _scales(samples)
    whole = np.array([_row({"*": _total(f)}, ["*"], scale) for f, _ in samples]) * weight[:, None]
    target = np.array([t for _, t in samples]) * weight
    overall = nnls(whole, target) if samples else np.zeros(3)
    rows = np.array([_row(f, kinds, scale) for f, _ in samples]).reshape(len(samples), -1) * weight[:, None]
    held = {3 * j + 1: rates[k] * scale[1] for j, k in enumerate(kinds) if k in rates}
    for column, value in held.items():
        target = target - rows[:, column] * value
        rows[:, column] = 0.0
    pull = RIDGE / float(np.median([t for _, t in samples])) if samples else 0.0
    prior = []
    # a kind's fit, less the fit over every kind, relative to a typical act
    for column in range(3 * len(kinds)):
        if column not in held:
            row = np.zeros(3 * len(kinds))
            row[column] = pull
            prior.append((row, pull * overall[column % 3]))
    a = np.concatenate([rows, np.array([r for r, _ in prior]).reshape(len(prior), -1)])
    b = np.concatenate([target, [v for _, v in prior]])
    solved = nnls(a, b) if len(kinds) else np.zeros(0)
    for column, value in held.items():
        solved[column] = value
    ops = {k: tuple(float(solved[3 * j + p] / scale[p]) for p in range(3)) for j, k in enumerate(kinds)}
    return ops, tuple(float(overall[p] / scale[p]) for p in range(3))  # type: ignore[return-value]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: solve, fix the negative ones at 0, solve
    for the rest again, until none is negative (an active set, enough for these few
    columns)."""
    free = np.ones(a.shape[1], bool)
    x = np.zeros(a.shape[1])
    while free.any():
        x[:] = 0.0
        x[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        negative = free & (x < 0)
        if not negative.any():
            return x
        free &= ~negative
    return x


def _total(f: Features) -> tuple[int, float, float]:
    return (sum(v[0] for v in f.values()), sum(v[1] for v in f.values()), sum(v[2] for v in f.values()))


def _scales(samples: list[tuple[Features, float]]) -> tuple[float, float, float]:
    """Per column (calls, flops, bytes) a typical value, so the least squares is well scaled."""
    totals = np.array([_total(f) for f, _ in samples]) if samples else np.ones((1, 3))
    return tuple(float(np.median(c[c > 0])) if (c > 0).any() else 1.0 for c in totals.T)  # type: ignore[return-value]


def _row(f: Features, kinds: list[str], scale: Sequence[float]) -> list[float]:
    row = [0.0] * (3 * len(kinds))
    for j, k in enumerate(kinds):
        if k in f:
            for p in range(3):
                row[3 * j + p] = f[k][p] / scale[p]
    return row
