"""The transformer a config describes (``model.kind: transformer``), as one micro-batch's
graph: a decoder-only character model whose blocks are split over the pipeline's stages.

Each stage holds data_parallel x tensor_parallel devices. With data parallelism the
batch is split (S(0)) and every parameter replicated (B); with tensor parallelism a
stage's devices split each block Megatron-style by annotating only the weights: the
query, key, value and first MLP weights by column (S(1), so each device holds whole
heads and a slice of the MLP), the attention output and second MLP weights by row
(S(0)); every other parameter is replicated. The SBP signatures then keep attention
split by heads and make exactly one all-reduce in each half of a block forward (the
row-split product is partial), and one in each half backward (the gradient of the
replicated block input).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from .. import ops
from ..config import Config
from ..graph.builder import shape_only
from ..graph.ir import Graph
from ..parallel import B, GlobalTensor, P, S, box, gradients, output, parameter, placeholder, recompute
from ..parallel.sbp import SBP
from .optimizer import minimize_loss, optimizer

COLUMN, ROW = S(1), S(0)


def initial_parameters(config: Config, values: bool = True) -> dict[str, np.ndarray]:
    """Embeddings ~ N(0, 0.02), weights ~ N(0, 1/fan_in), layer-norm gains 1, biases 0,
    from data.seed; ``values`` False: the matrices of shape only (``shape_only``)."""
    model = config.model
    rng = np.random.default_rng(config.data.seed + 1)
    d, v, dtype = model.d_model, model.vocab, model.dtype

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(dtype) if values else shape_only(shape, dtype)

    made = {"embedding": normal((v, d), 0.02), "position": normal((model.seq_len, d), 0.02)}
    for k in range(model.layers):
        for name in ("wq", "wk", "wv", "wo"):
            made[f"h{k}.{name}"] = normal((d, d), 1 / math.sqrt(d))
        made[f"h{k}.w1"] = normal((d, 4 * d), 1 / math.sqrt(d))
        made[f"h{k}.w2"] = normal((4 * d, d), 1 / math.sqrt(4 * d))
        for name, size in (("bo", d), ("b1", 4 * d), ("b2", d), ("ln1.beta", d), ("ln2.beta", d)):
            made[f"h{k}.{name}"] = np.zeros(size, dtype)
        for name in ("ln1.gamma", "ln2.gamma"):
            made[f"h{k}.{name}"] = np.ones(d, dtype)
    made["ln.gamma"], made["ln.beta"] = np.ones(d, dtype), np.zeros(d, dtype)
    made["head"] = normal((d, v), 1 / math.sqrt(d))
    return made


TENSOR_PARALLEL = {"wq": COLUMN, "wk": COLUMN, "wv": COLUMN, "w1": COLUMN, "wo": ROW, "w2": ROW}
"""The Megatron annotations: a block's weights and their SBP over a tensor-parallel group."""


def build_graph(config: Config, annotated: Collection[str] | None = None, values: bool = True) -> Graph:
    """Feeds ``x`` (micro-batch, seq_len) character ids and ``labels`` (the next ones);
    outputs ``loss``, the mean cross-entropy per character. ``annotated``: the
    placeholders and parameters that keep their SBP over several devices (default:
    all); the compiler chooses the others' (``compiler.sbp_search``); ``values``: see
    ``initial_parameters``."""
    par = config.parallel
    if par.data_parallel > 1 and par.tensor_parallel > 1:
        return _data_and_tensor_parallel(config, values)
    initial = initial_parameters(config, values)
    stages = [list(stage) if len(stage) > 1 else stage[0] for stage in par.stages]
    data_sbp = S(0) if par.data_parallel > 1 else B if par.tensor_parallel > 1 else None

    def sbp(name: str, sbp: SBP | None) -> SBP | None:
        return sbp if annotated is None or name in annotated else None

    def param(name: str, stage, tensor_parallel: SBP = B):
        if par.tensor_parallel > 1:
            return parameter(name, initial[name], stage, sbp(name, tensor_parallel))
        return parameter(name, initial[name], stage, sbp(name, B) if par.data_parallel > 1 else None)

    rows, seq = config.micro_batch_size, config.model.seq_len
    with Graph() as graph:
        ids = placeholder("x", (rows, seq), "int64", stages[0], data_sbp and sbp("x", data_sbp))
        labels = placeholder("labels", (rows, seq), "int64", stages[-1], data_sbp and sbp("labels", data_sbp))
        loss = _forward(config, stages, rows, ids, labels, param)
        minimize_loss(config, loss)
        output("loss", loss)
    return graph


def _forward(config: Config, stages: list, rows: int, ids, labels, param) -> Any:
    """The loss of ``rows`` sequences, block by block over ``stages`` (a device or a
    tensor-parallel group each); ``param(name, stage, sbp)`` makes each parameter."""
    model = config.model
    seq, d, heads = model.seq_len, model.d_model, model.heads

    def split_heads(t):
        t = ops.reshape(t, (rows, seq, heads, d // heads))
        return ops.transpose(t, (0, 2, 1, 3))  # (rows, heads, seq, d / heads)

    def block(h, k: int, stage):
        p = {name: param(f"h{k}.{name}", stage, TENSOR_PARALLEL.get(name, B)) for name in _BLOCK}
        a = ops.layer_norm(h, p["ln1.gamma"], p["ln1.beta"])
        q, kk, v = (split_heads(ops.matmul(a, p[w])) for w in ("wq", "wk", "wv"))
        scores = ops.scale(ops.matmul(q, kk, transpose_b=True), 1 / math.sqrt(d // heads))
        attended = ops.matmul(ops.causal_softmax(scores), v)
        merged = ops.reshape(ops.transpose(attended, (0, 2, 1, 3)), (rows * seq, d))
        h = ops.add(h, ops.bias_add(ops.matmul(merged, p["wo"]), p["bo"]))
        m = ops.layer_norm(h, p["ln2.gamma"], p["ln2.beta"])
        u = ops.gelu(ops.bias_add(ops.matmul(m, p["w1"]), p["b1"]))
        return ops.add(h, ops.bias_add(ops.matmul(u, p["w2"]), p["b2"]))

    h = ops.embedding(ids, param("embedding", stages[0]))
    h = ops.reshape(ops.bias_add(h, param("position", stages[0])), (rows * seq, d))
    layer = 0
    for stage, count, again in zip(stages, config.stage_layers, config.parallel.recomputed):
        h = ops.to_device(h, stage)
        with recompute() if again else contextlib.nullcontext():
            for _ in range(count):
                h = block(h, layer, stage)
                layer += 1
    last = stages[-1]
    h = ops.layer_norm(h, param("ln.gamma", last), param("ln.beta", last))
    logits = ops.matmul(h, param("head", last))
    return ops.softmax_cross_entropy(logits, ops.reshape(labels, (rows * seq,)))


def _data_and_tensor_parallel(config: Config, values: bool) -> Graph:
    """Tensor and data parallelism at once, without a 2-D device mesh: each stage's
    devices form data_parallel groups of tensor_parallel consecutive ones, and replica r
    is the model built on the r-th group of every stage, Megatron-style, with its own
    parameters (named ``NAME@r`` past replica 0) and the r-th slice of the batch, which
    the group's first device is fed and broadcasts to the others. Each gradient, reduced
    within its group to its parameter's SBP, is averaged part by part over the replicas
    (an all-reduce over the devices holding part k), and every replica takes the same
    update; the loss is the replicas' mean."""
    par, seq = config.parallel, config.model.seq_len
    dp, tp = par.data_parallel, par.tensor_parallel
    initial = initial_parameters(config, values)
    replicas = [[list(stage[r * tp : (r + 1) * tp]) for stage in par.stages] for r in range(dp)]
    with Graph() as graph:
        first = [groups[0][0] for groups in replicas]
        last = [groups[-1][0] for groups in replicas]
        x = placeholder("x", (config.micro_batch_size, seq), "int64", first, S(0))
        y = placeholder("labels", (config.micro_batch_size, seq), "int64", last, S(0))
        losses, params = [], []
        for r, groups in enumerate(replicas):
            made: dict[str, GlobalTensor] = {}

            def param(name: str, stage, tensor_parallel: SBP = B, r=r, made=made):
                made[name] = parameter(
                    name if r == 0 else f"{name}@{r}", initial[name], stage, tensor_parallel
                )
                return made[name]

            ids, labels = _spread(x.locals[r], groups[0]), _spread(y.locals[r], groups[-1])
            losses.append(_forward(config, groups, config.replica_batch_size, ids, labels, param))
            params.append(made)
        update = optimizer(config.train.optimizer)
        grads = [dict(zip(made, gradients(loss, list(made.values())))) for loss, made in zip(losses, params)]
        for name in params[0]:
            mine = [(made[name], box(grad[name], made[name].sbp)) for made, grad in zip(params, grads)]
            for k in range(tp):
                mean = ops.all_reduce([g.locals[k] for _, g in mine], "mean")
                for (p, _), g in zip(mine, mean):
                    update.update(p.locals[k], g)
        parts = [ops.scale(box(loss, B).locals[0], 1 / dp) for loss in losses]
        output("loss", GlobalTensor((), P, tuple(parts)))
    return graph


def _spread(part, group: Sequence[str]) -> GlobalTensor:
    """``part`` broadcast from its device to every device of ``group``, as one B tensor."""
    return GlobalTensor(part.shape, B, tuple(ops.broadcast(part, group)))


_BLOCK = (
    "ln1.gamma",
    "ln1.beta",
    "wq",
    "wk",
    "wv",
    "wo",
    "bo",
    "ln2.gamma",
    "ln2.beta",
    "w1",
    "b1",
    "w2",
    "b2",
)
