"""Hypothesis strategies for random actorflow graphs, and an independent numpy evaluator.

A *recipe* is plain data: a list of nodes, each naming the values (by index) it reads.
``build`` turns a recipe into an ``af.Graph``; ``evaluate`` computes the same graph with
plain numpy expressions in float64 (it never touches ``actorflow.ops.kernels``), so the
two can be compared.

Every value carries an interval [lo, hi] that bounds its elements (simple interval
arithmetic); an op is only generated when its result stays within ``LIMIT``, when ``exp``
cannot overflow, when ``log`` sees positive inputs and when ``div`` divides by something
bounded away from zero.

The module also holds the module-level user functions the property tests run through
``af.ops.call`` (a Plan names functions by import path, so they live at module level):
probes that record the thread they ran on and the data pointer of their input buffer,
constant sources (calls with no inputs), a jittery identity, a counting producer and a
gate for the quota test, and a rendezvous pair for the pipelining test.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

import userfns

LIMIT = 64.0  # no generated value exceeds this in magnitude
DIMS = (2, 3, 4)


# --------------------------------------------------------------------------------------
# module-level user functions for af.ops.call
# --------------------------------------------------------------------------------------

N_PROBES = 8
# PROBE_RECORDS[k]: (thread name, data pointer of the input buffer) per call of probe k
PROBE_RECORDS: list[list[tuple[str, int]]] = [[] for _ in range(N_PROBES)]


def recording_functions(namespace: dict, name: str, note, records: list[list]) -> list:
    """One identity function per list of ``records``, ``name0``, ``name1``, ..., each
    appending ``note(its input)`` to its list; put in ``namespace`` (a module's globals:
    a Plan names a kernel function by its import path)."""

    def make(k: int):
        def record(a):
            records[k].append(note(a))
            return a

        record.__name__ = record.__qualname__ = f"{name}{k}"
        record.__module__ = namespace["__name__"]
        namespace[record.__name__] = record
        return record

    return [make(k) for k in range(len(records))]


PROBES = recording_functions(
    globals(),
    "probe",
    lambda a: (threading.current_thread().name, a.__array_interface__["data"][0]),
    PROBE_RECORDS,
)


def reset_probes() -> None:
    for records in PROBE_RECORDS:
        records.clear()


def jitter(a):
    """Identity after a random sleep of 0-2 ms, so kernel timings interleave."""
    time.sleep(float(np.random.default_rng().uniform(0.0, 0.002)))
    return a


def sleep3ms(a):
    time.sleep(0.003)
    return a


# -- the quota test: a counting producer and a consumer that holds its first buffer until
#    the producer has done everything its credits allow ------------------------------------

GATE: dict = {}
_gate_cond = threading.Condition()


def reset_gate(target: int) -> None:
    with _gate_cond:
        GATE.clear()
        GATE.update(count=0, target=target, opened=False, count_at_open=None, timed_out=False)


def counting(a):
    with _gate_cond:
        GATE["count"] += 1
        _gate_cond.notify_all()
    return a


def gate(a):
    with _gate_cond:
        if not GATE["opened"]:
            ok = _gate_cond.wait_for(lambda: GATE["count"] >= GATE["target"], timeout=10.0)
            GATE.update(opened=True, count_at_open=GATE["count"], timed_out=not ok)
    return a


# -- the pipelining test: stage A (device 0) of iteration i + 1 and stage B (device 1) of
#    iteration i wait for each other to have *started*; the feed carries the iteration -----

RENDEZVOUS: dict = {}
_rv_cond = threading.Condition()


def reset_rendezvous(iterations: int) -> None:
    with _rv_cond:
        RENDEZVOUS.clear()
        RENDEZVOUS.update(a=set(), b=set(), n=iterations, timeouts=[])


def _meet(mine: str, other: str, it: int, wait_for: int) -> None:
    with _rv_cond:
        RENDEZVOUS[mine].add(it)
        _rv_cond.notify_all()
        if 0 <= wait_for < RENDEZVOUS["n"]:
            ok = _rv_cond.wait_for(lambda: wait_for in RENDEZVOUS[other], timeout=3.0)
            if not ok:
                RENDEZVOUS["timeouts"].append((mine, it))


def stage_a(a):
    """On device 0, iteration i (> 0): waits until stage B has started iteration i - 1."""
    userfns.sleepy(a)
    it = int(a.flat[0])
    _meet("a", "b", it, it - 1)
    return a


def stage_b(a):
    """On device 1, iteration i: waits until stage A has started iteration i + 1."""
    userfns.sleepy(a)
    it = int(a.flat[0])
    _meet("b", "a", it, it + 1)
    return a


def _make_const(m: int, n: int):
    def const():  # a plain list, which the call casts to the graph's float dtype
        return (np.arange(m * n, dtype=np.float64).reshape(m, n) / (m * n) - 0.5).tolist()

    const.__name__ = const.__qualname__ = f"const_{m}x{n}"
    const.__module__ = __name__
    return const


# const_MxN(): an (M, N) array in [-0.5, 0.5), for calls with no inputs
for _m in DIMS:
    for _n in DIMS:
        globals()[f"const_{_m}x{_n}"] = _make_const(_m, _n)


CALL_FNS = {
    "identity": userfns.identity,
    "double": userfns.double,
    "sleepy": userfns.sleepy,
    "thread_name": userfns.thread_name,
    "jitter": jitter,
    "add_pair": userfns.add_pair,
    **{f"probe{k}": PROBES[k] for k in range(N_PROBES)},
    **{f"const_{m}x{n}": globals()[f"const_{m}x{n}"] for m in DIMS for n in DIMS},
}


# --------------------------------------------------------------------------------------
# recipes
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Value:
    shape: tuple[int, ...]
    device: str
    lo: float
    hi: float

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class Recipe:
    devices: tuple[str, ...]
    dtype: str
    nodes: list[tuple] = field(default_factory=list)
    values: list[Value] = field(default_factory=list)
    outputs: list[tuple[str, int]] = field(default_factory=list)

    @property
    def bound(self) -> float:
        return max(max(abs(v.lo), abs(v.hi)) for v in self.values)

    def feeds(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n[1], n[2]) for n in self.nodes if n[0] == "feed"]

    def _repr_pretty_(self, p, cycle) -> None:  # how hypothesis prints a failing example
        p.text(repr(self))

    def __repr__(self) -> str:
        lines = [f"Recipe(devices={self.devices}, dtype={self.dtype})"]
        lines += [f"  {node!r}" for node in self.nodes]
        lines.append(f"  outputs {self.outputs}")
        return "\n".join(lines)


def _fits(lo: float, hi: float) -> bool:
    return math.isfinite(lo) and math.isfinite(hi) and max(abs(lo), abs(hi)) <= LIMIT


def _products(a: Value, lo: float, hi: float) -> tuple[float, float]:
    ps = [a.lo * lo, a.lo * hi, a.hi * lo, a.hi * hi]
    return min(ps), max(ps)


def _gelu_bounds(v: Value) -> tuple[float, float]:
    return -0.2, max(v.hi, 0.0)


class _Gen:
    """Grows a recipe one op at a time, with hypothesis drawing every choice."""

    def __init__(self, draw, devices, dtype, call_fns):
        self.draw = draw
        self.r = Recipe(tuple(devices), dtype)
        self.call_fns = call_fns
        self.n_probes = 0
        self.n_params = 0

    # -- bookkeeping ----------------------------------------------------------------
    def node(self, kind: str, *payload, outs: list[Value]) -> list[int]:
        name = f"n{len(self.r.nodes)}"
        self.r.nodes.append((kind, name, *payload))
        first = len(self.r.values)
        self.r.values.extend(outs)
        return list(range(first, first + len(outs)))

    def v(self, i: int) -> Value:
        return self.r.values[i]

    def pick(self, pred=lambda v: True) -> int | None:
        cands = [i for i, v in enumerate(self.r.values) if pred(v)]
        if not cands:
            return None
        return self.draw(st.sampled_from(cands[::-1]))  # shrinks toward the newest

    def on(self, i: int, device: str) -> int:
        """Value ``i`` on ``device``: itself, or a new to_device copy."""
        v = self.v(i)
        if v.device == device:
            return i
        return self.node("to_device", i, device, outs=[Value(v.shape, device, v.lo, v.hi)])[0]

    def param(self, shape, device) -> int:
        seed = self.draw(st.integers(0, 2**16))
        name = f"w{self.n_params}"
        self.n_params += 1
        self.r.nodes.append(("param", name, tuple(shape), device, seed))
        self.r.values.append(Value(tuple(shape), device, -0.5, 0.5))
        return len(self.r.values) - 1

    # -- ops: each returns False when it does not apply -----------------------------
    def unary(self) -> bool:
        op = self.draw(st.sampled_from(["relu", "tanh", "gelu", "exp", "log"]))
        if op == "exp":
            src = self.pick(lambda v: v.hi <= 3.0)
        elif op == "log":
            src = self.pick(lambda v: v.lo >= 0.05)
        else:
            src = self.pick()
        if src is None:
            return False
        v = self.v(src)
        lo, hi = {
            "relu": lambda: (max(v.lo, 0.0), max(v.hi, 0.0)),
            "tanh": lambda: (math.tanh(v.lo), math.tanh(v.hi)),
            "gelu": lambda: _gelu_bounds(v),
            "exp": lambda: (math.exp(v.lo), math.exp(v.hi)),
            "log": lambda: (math.log(v.lo), math.log(v.hi)),
        }[op]()
        self.node("unary", op, src, outs=[Value(v.shape, v.device, lo, hi)])
        return True

    def tanh_fallback(self) -> None:
        src = self.pick()
        v = self.v(src)
        self.node("unary", "tanh", src, outs=[Value(v.shape, v.device, math.tanh(v.lo), math.tanh(v.hi))])

    def binary(self) -> bool:
        op = self.draw(st.sampled_from(["add", "sub", "mul", "div"]))
        a = self.pick()
        av = self.v(a)
        if op == "div":
            b = self.pick(lambda v: v.shape == av.shape and (v.lo >= 0.1 or v.hi <= -0.1))
            if b is None:
                return False
        else:
            b = self.pick(lambda v: v.shape == av.shape)
        bv = self.v(b)
        if op == "add":
            lo, hi = av.lo + bv.lo, av.hi + bv.hi
        elif op == "sub":
            lo, hi = av.lo - bv.hi, av.hi - bv.lo
        elif op == "mul":
            lo, hi = _products(av, bv.lo, bv.hi)
        else:
            lo, hi = _products(av, 1.0 / bv.hi, 1.0 / bv.lo)
        if not _fits(lo, hi):
            return False
        b = self.on(b, av.device)
        self.node("binary", op, a, b, outs=[Value(av.shape, av.device, lo, hi)])
        return True

    def matmul(self) -> bool:
        a = self.pick(lambda v: v.ndim == 2)
        if a is None:
            return False
        av = self.v(a)
        k = av.shape[1]
        b = None
        if self.draw(st.booleans()):
            b = self.pick(lambda v: v.ndim == 2 and v.shape[0] == k)
        if b is None:
            b = self.param((k, self.draw(st.sampled_from(DIMS))), av.device)
        bv = self.v(b)
        plo, phi = _products(av, bv.lo, bv.hi)
        lo, hi = k * min(plo, 0.0), k * max(phi, 0.0)
        if not _fits(lo, hi):
            return False
        b = self.on(b, av.device)
        self.node("matmul", a, b, outs=[Value((av.shape[0], bv.shape[1]), av.device, lo, hi)])
        return True

    def bias_add(self) -> bool:
        x = self.pick(lambda v: v.ndim >= 1)
        if x is None:
            return False
        xv = self.v(x)
        bias = self.param(xv.shape[-1:], xv.device)
        lo, hi = xv.lo - 0.5, xv.hi + 0.5
        if not _fits(lo, hi):
            return False
        self.node("bias_add", x, bias, outs=[Value(xv.shape, xv.device, lo, hi)])
        return True

    def to_device(self) -> bool:
        if len(self.r.devices) < 2:
            return False
        src = self.pick()
        v = self.v(src)
        device = self.draw(st.sampled_from([d for d in self.r.devices if d != v.device]))
        self.on(src, device)
        return True

    def _group_inputs(self, src: int, n: int) -> list[int]:
        """One value per device for n distinct devices, all of ``src``'s shape."""
        v = self.v(src)
        devices = self.draw(st.permutations(self.r.devices))[:n]
        ins = []
        for d in devices:
            same = [i for i, w in enumerate(self.r.values) if w.shape == v.shape and w.device == d]
            if same and self.draw(st.booleans()):
                ins.append(self.draw(st.sampled_from(same)))
            else:
                ins.append(self.on(src, d))
        return ins

    def collective(self) -> bool:
        if len(self.r.devices) < 2:
            return False
        kind = self.draw(
            st.sampled_from(
                ["all_reduce", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"]
            )
        )
        n = self.draw(st.integers(2, len(self.r.devices)))
        if kind == "broadcast":
            src = self.pick()
            v = self.v(src)
            targets = self.draw(st.permutations(self.r.devices))[
                : self.draw(st.integers(1, len(self.r.devices)))
            ]
            self.node("broadcast", src, tuple(targets), outs=[Value(v.shape, d, v.lo, v.hi) for d in targets])
            return True
        if kind in ("all_gather", "reduce_scatter", "all_to_all"):
            src = self.pick(lambda v: v.ndim >= 1)
            if src is None:
                return False
            v = self.v(src)
            axis = self.draw(st.integers(0, v.ndim - 1))
            if kind in ("reduce_scatter", "all_to_all") and v.shape[axis] % n:
                return False
            if kind == "all_gather" and v.shape[axis] * n > 16:
                return False
            if kind == "all_to_all":
                concat_axis = self.draw(st.integers(0, v.ndim - 1))
        else:
            src = self.pick()
            v = self.v(src)
        ins = self._group_inputs(src, n)
        vs = [self.v(i) for i in ins]
        if kind == "all_reduce":
            op = self.draw(st.sampled_from(["sum", "mean", "max"]))
            if op == "sum":
                lo, hi = sum(w.lo for w in vs), sum(w.hi for w in vs)
            elif op == "mean":
                lo, hi = min(w.lo for w in vs), max(w.hi for w in vs)
            else:
                lo, hi = max(w.lo for w in vs), max(w.hi for w in vs)
            if not _fits(lo, hi):
                return False
            self.node("all_reduce", tuple(ins), op, outs=[Value(v.shape, w.device, lo, hi) for w in vs])
        elif kind == "all_gather":
            lo, hi = min(w.lo for w in vs), max(w.hi for w in vs)
            shape = list(v.shape)
            shape[axis] *= n
            self.node(
                "all_gather", tuple(ins), axis, outs=[Value(tuple(shape), w.device, lo, hi) for w in vs]
            )
        elif kind == "all_to_all":
            lo, hi = min(w.lo for w in vs), max(w.hi for w in vs)
            shape = list(v.shape)
            shape[axis] //= n
            shape[concat_axis] *= n
            outs = [Value(tuple(shape), w.device, lo, hi) for w in vs]
            self.node("all_to_all", tuple(ins), axis, concat_axis, outs=outs)
        else:
            lo, hi = sum(w.lo for w in vs), sum(w.hi for w in vs)
            if not _fits(lo, hi):
                return False
            shape = list(v.shape)
            shape[axis] //= n
            self.node(
                "reduce_scatter", tuple(ins), axis, outs=[Value(tuple(shape), w.device, lo, hi) for w in vs]
            )
        return True

    def call(self) -> bool:
        names = list(self.call_fns)
        if self.n_probes < N_PROBES:
            names += ["probe"] * 3
        fn = self.draw(st.sampled_from(names))
        if fn == "probe":
            fn = f"probe{self.n_probes}"
            self.n_probes += 1
        src = self.pick()
        v = self.v(src)
        if fn == "add_pair":
            b = self.pick(lambda w: w.shape == v.shape)
            bv = self.v(b)
            lo, hi = v.lo + bv.lo, v.hi + bv.hi
            if not _fits(lo, hi):
                return False
            b = self.on(b, v.device)
            self.node("call", fn, (src, b), outs=[Value(v.shape, v.device, lo, hi)])
            return True
        lo, hi = (2 * v.lo, 2 * v.hi) if fn == "double" else (v.lo, v.hi)
        if not _fits(lo, hi):
            return False
        self.node("call", fn, (src,), outs=[Value(v.shape, v.device, lo, hi)])
        return True

    def source(self) -> bool:
        """A call with no inputs, placed with device=: an actor that needs no one."""
        m, n = self.draw(st.sampled_from(DIMS)), self.draw(st.sampled_from(DIMS))
        device = self.draw(st.sampled_from(self.r.devices))
        self.node("source", f"const_{m}x{n}", device, outs=[Value((m, n), device, -0.5, 0.5)])
        return True

    def softmax(self) -> bool:
        src = self.pick(lambda v: v.ndim >= 1)
        if src is None:
            return False
        v = self.v(src)
        axis = self.draw(st.integers(-v.ndim, v.ndim - 1))
        lo = math.exp(-(v.hi - v.lo)) / v.shape[axis]
        self.node("softmax", src, axis, outs=[Value(v.shape, v.device, lo, 1.0)])
        return True

    def reduce(self) -> bool:
        op = self.draw(st.sampled_from(["sum", "mean", "max"]))
        src = self.pick()
        v = self.v(src)
        if v.ndim == 0 or self.draw(st.booleans()):
            axis = None
            axes = tuple(range(v.ndim))
        else:
            axis = self.draw(st.integers(-v.ndim, v.ndim - 1))
            axes = (axis % v.ndim,)
        keepdims = self.draw(st.booleans())
        shape = tuple(1 if d in axes else n for d, n in enumerate(v.shape) if keepdims or d not in axes)
        m = int(np.prod([v.shape[d] for d in axes], dtype=np.int64))
        lo, hi = (m * v.lo, m * v.hi) if op == "sum" else (v.lo, v.hi)
        if not _fits(lo, hi):
            return False
        self.node("reduce", op, src, axis, keepdims, outs=[Value(shape, v.device, lo, hi)])
        return True

    def concat(self) -> bool:
        a = self.pick(lambda v: v.ndim >= 1)
        if a is None:
            return False
        av = self.v(a)
        axis = self.draw(st.integers(0, av.ndim - 1))

        def fits(w: Value) -> bool:
            return w.ndim == av.ndim and all(
                x == y for d, (x, y) in enumerate(zip(w.shape, av.shape)) if d != axis
            )

        srcs = [a] + [self.pick(fits) for _ in range(self.draw(st.integers(1, 2)))]
        srcs = [self.on(s, av.device) for s in srcs]
        vs = [self.v(s) for s in srcs]
        shape = list(av.shape)
        shape[axis] = sum(w.shape[axis] for w in vs)
        if shape[axis] > 16:
            return False
        lo, hi = min(w.lo for w in vs), max(w.hi for w in vs)
        self.node("concat", tuple(srcs), axis, outs=[Value(tuple(shape), av.device, lo, hi)])
        return True

    def split(self) -> bool:
        src = self.pick(lambda v: v.ndim >= 1 and max(v.shape) >= 2)
        if src is None:
            return False
        v = self.v(src)
        axis = self.draw(st.sampled_from([d for d in range(v.ndim) if v.shape[d] >= 2]))
        size = v.shape[axis]
        divisors = [k for k in range(1, size + 1) if size % k == 0]
        if self.draw(st.booleans()):
            sections = self.draw(st.sampled_from(divisors))
            sizes = [size // sections] * sections
        else:
            cut = self.draw(st.integers(1, size - 1))
            sections = sizes = [cut, size - cut]
            sections = tuple(sections)
        outs = [
            Value(tuple(s if d == axis else n for d, n in enumerate(v.shape)), v.device, v.lo, v.hi)
            for s in sizes
        ]
        self.node("split", src, sections, axis, outs=outs)
        return True

    def reshape_like(self) -> bool:
        src = self.pick(lambda v: v.ndim >= 1)
        if src is None:
            return False
        v = self.v(src)
        kind = self.draw(st.sampled_from(["transpose", "reshape", "slice"]))
        if kind == "transpose":
            self.node("transpose", src, outs=[Value(v.shape[::-1], v.device, v.lo, v.hi)])
        elif kind == "reshape":
            n = v.size
            shapes = [(n,), (-1,)] + [(k, n // k) for k in range(1, n + 1) if n % k == 0 and k in DIMS]
            shape = self.draw(st.sampled_from(shapes))
            real = (n,) if shape == (-1,) else shape
            self.node("reshape", src, shape, outs=[Value(real, v.device, v.lo, v.hi)])
        else:
            begin, end = [], []
            for n in v.shape[: self.draw(st.integers(1, v.ndim))]:
                b = self.draw(st.integers(0, n - 1))
                begin.append(b)
                end.append(self.draw(st.integers(b + 1, n)))
            shape = tuple(e - b for b, e in zip(begin, end)) + v.shape[len(begin) :]
            self.node("slice", src, tuple(begin), tuple(end), outs=[Value(shape, v.device, v.lo, v.hi)])
        return True

    def sleepy_after(self, ids: list[int]) -> None:
        """A sleepy call on each of these values, on its device (for ordering tests)."""
        for i in ids:
            fn = self.draw(st.sampled_from(["sleepy", "jitter"]))
            v = self.v(i)
            self.node("call", fn, (i,), outs=[Value(v.shape, v.device, v.lo, v.hi)])


OPS = [
    "unary",
    "unary",
    "binary",
    "binary",
    "matmul",
    "matmul",
    "bias_add",
    "to_device",
    "to_device",
    "collective",
    "collective",
    "collective",
    "call",
    "call",
    "source",
    "softmax",
    "reduce",
    "concat",
    "split",
    "reshape_like",
]


@st.composite
def recipes(
    draw,
    *,
    max_devices: int = 4,
    min_devices: int = 1,
    max_ops: int = 14,
    call_fns: tuple[str, ...] = ("identity", "double", "sleepy", "thread_name", "jitter", "add_pair"),
    sleepy: bool = False,
    dtypes: tuple[str, ...] = ("float64", "float32"),
    probe: bool = False,
) -> Recipe:
    """A random graph. ``sleepy``: add many sleeping calls, on random values;
    ``probe``: hold at least one probe call."""
    n_dev = draw(st.sampled_from(range(min_devices, max_devices + 1)))
    devices = [f"cpu:{i}" for i in range(n_dev)]
    dtype = draw(st.sampled_from(dtypes))
    gen = _Gen(draw, devices, dtype, {k: CALL_FNS[k] for k in call_fns})
    for k in range(draw(st.integers(1, 2))):
        shape = (draw(st.sampled_from(DIMS)), draw(st.sampled_from(DIMS)))
        device = draw(st.sampled_from(devices))
        gen.r.nodes.append(("feed", f"x{k}", shape, device))
        gen.r.values.append(Value(shape, device, -1.0, 1.0))
    for _ in range(draw(st.sampled_from(range(2, max_ops + 1)))):
        op = draw(st.sampled_from(OPS))
        if not getattr(gen, op)():
            gen.tanh_fallback()
        if sleepy and draw(st.booleans()):
            # a sleeping call on some value (often not the newest), which later ops may read
            # beside values that did not sleep
            gen.sleepy_after([gen.pick()])
    if probe and gen.n_probes < N_PROBES:  # a last probe, which the outputs keep live
        src = gen.pick()
        v = gen.v(src)
        gen.node("call", f"probe{gen.n_probes}", (src,), outs=[Value(v.shape, v.device, v.lo, v.hi)])
        gen.n_probes += 1
    r = gen.r
    # outputs: the newest value, most values nothing reads (so little is dead code), and
    # maybe a few arbitrary ones (a feed, a parameter, the same tensor twice)
    last = len(r.values) - 1
    if draw(st.booleans()):
        # one output: fewer fetches feed the copy streams, so more edges sync by events
        r.outputs = [("out0", last)]
        return r
    read = {i for node in r.nodes for i in _reads(node)}
    sinks = [i for i in range(last) if i not in read and r.nodes[_node_of(r, i)][0] != "param"]
    sinks = draw(st.lists(st.sampled_from(sinks), unique=True, max_size=4)) if sinks else []
    others = draw(st.lists(st.integers(0, last), max_size=2))
    r.outputs = [(f"out{j}", v) for j, v in enumerate([last, *sinks, *others])]
    return r


@st.composite
def placements(draw, devices: Sequence[str], world: int) -> list[list[str]]:
    """``devices`` over ``world`` ranks (``compile``'s ``ranks``), on at least two of them
    when there are two devices or more."""
    owner = [draw(st.integers(0, world - 1)) for _ in devices]
    if len(devices) > 1 and len(set(owner)) == 1:
        owner[-1] = (owner[0] + 1) % world
    return [[d for d, r in zip(devices, owner) if r == rank] for rank in range(world)]


def _reads(node: tuple) -> list[int]:
    """The value ids a node reads."""
    kind, _, *p = node
    if kind in ("feed", "param", "source"):
        return []
    if kind in ("unary", "reduce"):
        return [p[1]]
    if kind == "binary":
        return [p[1], p[2]]
    if kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "concat"):
        return list(p[0])
    if kind == "call":
        return list(p[1])
    if kind in ("matmul", "bias_add"):
        return [p[0], p[1]]
    return [p[0]]


def _node_of(r: Recipe, value: int) -> int:
    count = 0
    for k, node in enumerate(r.nodes):
        count += _n_outputs(node)
        if value < count:
            return k
    raise IndexError(value)


def _n_outputs(node: tuple) -> int:
    kind, _, *p = node
    if kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        return len(p[0])
    if kind == "broadcast":
        return len(p[1])
    if kind == "split":
        return p[1] if isinstance(p[1], int) else len(p[1])
    return 1


# --------------------------------------------------------------------------------------
# building and evaluating
# --------------------------------------------------------------------------------------


def param_value(recipe: Recipe, shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, shape).astype(recipe.dtype)


def make_feeds(recipe: Recipe, iterations: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {name: rng.uniform(-1.0, 1.0, shape).astype(recipe.dtype) for name, shape in recipe.feeds()}
        for _ in range(iterations)
    ]


def build(recipe: Recipe):
    """The recipe as an af.Graph; returns (graph, tensor per value)."""
    import actorflow as af

    ops = af.ops
    t: list = []
    with af.Graph() as g:
        for node in recipe.nodes:
            kind, name, *p = node
            if kind == "feed":
                t.append(af.placeholder(name, shape=p[0], dtype=recipe.dtype, device=p[1]))
            elif kind == "param":
                t.append(af.parameter(name, param_value(recipe, p[0], p[2]), device=p[1]))
            elif kind == "unary":
                t.append(getattr(ops, p[0])(t[p[1]], name=name))
            elif kind == "binary":
                t.append(getattr(ops, p[0])(t[p[1]], t[p[2]], name=name))
            elif kind == "matmul":
                t.append(ops.matmul(t[p[0]], t[p[1]], name=name))
            elif kind == "bias_add":
                t.append(ops.bias_add(t[p[0]], t[p[1]], name=name))
            elif kind == "to_device":
                t.append(ops.to_device(t[p[0]], p[1], name=name))
            elif kind == "all_reduce":
                t.extend(ops.all_reduce([t[i] for i in p[0]], op=p[1], name=name))
            elif kind == "all_gather":
                t.extend(ops.all_gather([t[i] for i in p[0]], axis=p[1], name=name))
            elif kind == "reduce_scatter":
                t.extend(ops.reduce_scatter([t[i] for i in p[0]], axis=p[1], name=name))
            elif kind == "all_to_all":
                t.extend(ops.all_to_all([t[i] for i in p[0]], split_axis=p[1], concat_axis=p[2], name=name))
            elif kind == "broadcast":
                t.extend(ops.broadcast(t[p[0]], list(p[1]), name=name))
            elif kind == "call":
                fn, srcs = CALL_FNS[p[0]], [t[i] for i in p[1]]
                t.append(ops.call(fn, *srcs, shape=srcs[0].shape, dtype=recipe.dtype, name=name))
            elif kind == "source":
                m, n = (int(d) for d in p[0].removeprefix("const_").split("x"))
                t.append(ops.call(CALL_FNS[p[0]], shape=(m, n), dtype=recipe.dtype, device=p[1], name=name))
            elif kind == "softmax":
                t.append(ops.softmax(t[p[0]], axis=p[1], name=name))
            elif kind == "reduce":
                t.append(getattr(ops, p[0])(t[p[1]], axis=p[2], keepdims=p[3], name=name))
            elif kind == "concat":
                t.append(ops.concat([t[i] for i in p[0]], axis=p[1], name=name))
            elif kind == "split":
                t.extend(
                    ops.split(t[p[0]], p[1] if isinstance(p[1], int) else list(p[1]), axis=p[2], name=name)
                )
            elif kind == "transpose":
                t.append(ops.transpose(t[p[0]], name=name))
            elif kind == "reshape":
                t.append(ops.reshape(t[p[0]], p[1], name=name))
            elif kind == "slice":
                t.append(ops.slice(t[p[0]], list(p[1]), list(p[2]), name=name))
            else:  # pragma: no cover
                raise AssertionError(kind)
        for out_name, vid in recipe.outputs:
            af.output(out_name, t[vid])
    for tensor, value in zip(t, recipe.values):
        assert (tensor.shape, tensor.device) == (value.shape, value.device), (tensor, value)
    return g, t


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


UNARY_REFERENCE = {
    "relu": lambda x: np.where(x > 0, x, 0.0),
    "tanh": np.tanh,
    "gelu": _gelu,
    "exp": np.exp,
    "log": np.log,
}


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def evaluate(recipe: Recipe, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The recipe's outputs for one iteration, in float64 with plain numpy expressions."""
    vals: list[np.ndarray] = []
    for node in recipe.nodes:
        kind, name, *p = node
        if kind == "feed":
            vals.append(np.asarray(feeds[name], np.float64))
        elif kind == "param":
            vals.append(param_value(recipe, p[0], p[2]).astype(np.float64))
        elif kind == "unary":
            vals.append(UNARY_REFERENCE[p[0]](vals[p[1]]))
        elif kind == "binary":
            a, b = vals[p[1]], vals[p[2]]
            vals.append({"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[p[0]](a, b))
        elif kind == "matmul":
            vals.append(vals[p[0]] @ vals[p[1]])
        elif kind == "bias_add":
            vals.append(vals[p[0]] + vals[p[1]])
        elif kind == "to_device":
            vals.append(vals[p[0]].copy())
        elif kind == "all_reduce":
            xs = np.stack([vals[i] for i in p[0]])
            r = {"sum": xs.sum(axis=0), "mean": xs.sum(axis=0) / len(p[0]), "max": xs.max(axis=0)}[p[1]]
            vals.extend(r.copy() for _ in p[0])
        elif kind == "all_gather":
            r = np.concatenate([vals[i] for i in p[0]], axis=p[1])
            vals.extend(r.copy() for _ in p[0])
        elif kind == "reduce_scatter":
            total = sum(vals[i] for i in p[0])
            vals.extend(np.array_split(total, len(p[0]), axis=p[1]))
        elif kind == "all_to_all":
            xs, split_axis, concat_axis = [vals[i] for i in p[0]], p[1], p[2]
            chunks = [np.split(x, len(xs), axis=split_axis) for x in xs]  # chunks[i][k]
            vals.extend(
                np.concatenate([chunks[i][k] for i in range(len(xs))], axis=concat_axis)
                for k in range(len(xs))
            )
        elif kind == "broadcast":
            vals.extend(vals[p[0]].copy() for _ in p[1])
        elif kind == "call":
            xs = [vals[i] for i in p[1]]
            vals.append(
                2.0 * xs[0] if p[0] == "double" else xs[0] + xs[1] if p[0] == "add_pair" else xs[0].copy()
            )
        elif kind == "source":
            m, n = (int(d) for d in p[0].removeprefix("const_").split("x"))
            vals.append(np.arange(m * n, dtype=np.float64).reshape(m, n) / (m * n) - 0.5)
        elif kind == "softmax":
            vals.append(_softmax(vals[p[0]], p[1]))
        elif kind == "reduce":
            x = vals[p[1]]
            f = {"sum": np.sum, "mean": np.mean, "max": np.max}[p[0]]
            vals.append(np.asarray(f(x, axis=p[2], keepdims=p[3])))
        elif kind == "concat":
            vals.append(np.concatenate([vals[i] for i in p[0]], axis=p[1]))
        elif kind == "split":
            x, sections, axis = vals[p[0]], p[1], p[2]
            if isinstance(sections, int):
                vals.extend(np.split(x, sections, axis=axis))
            else:
                vals.extend(np.split(x, np.cumsum(sections)[:-1], axis=axis))
        elif kind == "transpose":
            vals.append(vals[p[0]].T)
        elif kind == "reshape":
            vals.append(vals[p[0]].reshape(p[1]))
        elif kind == "slice":
            x, begin, end = vals[p[0]], p[1], p[2]
            vals.append(x[tuple(slice(b, e) for b, e in zip(begin, end))])
        else:  # pragma: no cover
            raise AssertionError(kind)
    for v, value in zip(vals, recipe.values):
        assert v.shape == value.shape, (v.shape, value)
        # the interval arithmetic that keeps generated values bounded really bounds them
        assert np.all(v >= value.lo - 1e-6) and np.all(v <= value.hi + 1e-6), value
    return {out: vals[vid] for out, vid in recipe.outputs}


# --------------------------------------------------------------------------------------
# training: micro-batched, pipelined over stages, against numpy backpropagation
# --------------------------------------------------------------------------------------

ACTIVATIONS = {
    "relu": (lambda a: np.maximum(a, 0.0), lambda a: (a > 0).astype(np.float64)),
    "tanh": (np.tanh, lambda a: 1.0 - np.tanh(a) ** 2),
    "none": (lambda a: a, lambda a: np.ones_like(a)),
}


@dataclass(frozen=True)
class TrainRecipe:
    """A dense network trained for ``steps`` steps of ``micro_batches`` x ``rows`` rows:
    layer k maps widths[k] -> widths[k + 1] on stage ``layer_stage[k]``, with an optional
    bias and an activation; the loss is the mean squared error against a target or the
    softmax cross-entropy against labels."""

    stages: tuple[str, ...]
    micro_batches: int
    schedule: str | None
    rows: int
    widths: tuple[int, ...]
    layer_stage: tuple[int, ...]
    bias: tuple[bool, ...]
    activations: tuple[str, ...]
    loss: str
    optimizer: tuple  # ("sgd", lr, momentum) or ("adam", lr)
    steps: int
    seed: int

    @property
    def batch(self) -> int:
        return self.micro_batches * self.rows


@st.composite
def training_recipes(draw, *, max_stages: int = 3, max_layers: int = 4) -> TrainRecipe:
    n_stages = draw(st.integers(1, max_stages))
    layers = draw(st.integers(n_stages, max(n_stages, max_layers)))
    # every stage gets at least one layer, in order
    cuts = (
        draw(st.lists(st.integers(1, layers - 1), min_size=n_stages - 1, max_size=n_stages - 1, unique=True))
        if n_stages > 1
        else []
    )
    layer_stage = tuple(sum(k >= c for c in cuts) for k in range(layers))
    widths = tuple(draw(st.lists(st.sampled_from(DIMS), min_size=layers + 1, max_size=layers + 1)))
    optimizer = draw(st.sampled_from([("sgd", 0.1, 0.0), ("sgd", 0.1, 0.9), ("adam", 0.01)]))
    m = draw(st.sampled_from([1, 2, 3, 4]))
    return TrainRecipe(
        stages=tuple(f"cpu:{i}" for i in range(n_stages)),
        micro_batches=m,
        schedule=draw(st.sampled_from(["gpipe", "1f1b"])) if n_stages > 1 else None,
        rows=draw(st.integers(1, 3)),
        widths=widths,
        layer_stage=layer_stage,
        bias=tuple(draw(st.lists(st.booleans(), min_size=layers, max_size=layers))),
        activations=tuple(
            draw(st.lists(st.sampled_from(sorted(ACTIVATIONS)), min_size=layers, max_size=layers))
        ),
        loss=draw(st.sampled_from(["mse", "cross_entropy"])),
        optimizer=optimizer,
        steps=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**16)),
    )


def initial_parameters(recipe: TrainRecipe) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(recipe.seed)
    params = {}
    for k in range(len(recipe.layer_stage)):
        fan_in, fan_out = recipe.widths[k], recipe.widths[k + 1]
        params[f"w{k}"] = rng.uniform(-1.0, 1.0, (fan_in, fan_out)) / math.sqrt(fan_in)
        if recipe.bias[k]:
            params[f"b{k}"] = rng.uniform(-0.1, 0.1, fan_out)
    return params


def training_batches(recipe: TrainRecipe) -> list[dict[str, np.ndarray]]:
    """One whole batch per step: ``x`` and the ``target`` (floats) or ``labels`` (ints)."""
    rng = np.random.default_rng(recipe.seed + 1)
    out_width = recipe.widths[-1]
    batches = []
    for _ in range(recipe.steps):
        b = {"x": rng.standard_normal((recipe.batch, recipe.widths[0]))}
        if recipe.loss == "mse":
            b["target"] = rng.standard_normal((recipe.batch, out_width))
        else:
            b["labels"] = rng.integers(0, out_width, recipe.batch)
        batches.append(b)
    return batches


def micro_batch_feeds(recipe: TrainRecipe, batches) -> list[dict[str, np.ndarray]]:
    """Every step's whole batch cut into its micro-batches, all steps in one list."""
    r = recipe.rows
    return [
        {name: v[k * r : (k + 1) * r] for name, v in b.items()}
        for b in batches
        for k in range(recipe.micro_batches)
    ]


def build_training(recipe: TrainRecipe):
    import actorflow as af

    ops = af.ops
    params = initial_parameters(recipe)
    with af.Graph() as g:
        first = recipe.stages[recipe.layer_stage[0]]
        h = af.placeholder("x", (recipe.rows, recipe.widths[0]), "float64", first)
        for k, stage in enumerate(recipe.layer_stage):
            device = recipe.stages[stage]
            if h.device != device:
                h = ops.to_device(h, device)
            h = ops.matmul(h, af.parameter(f"w{k}", params[f"w{k}"], device))
            if recipe.bias[k]:
                h = ops.bias_add(h, af.parameter(f"b{k}", params[f"b{k}"], device))
            if recipe.activations[k] != "none":
                h = getattr(ops, recipe.activations[k])(h)
        last = recipe.stages[-1]
        if recipe.loss == "mse":
            loss = ops.mse_loss(
                h, af.placeholder("target", (recipe.rows, recipe.widths[-1]), "float64", last)
            )
        else:
            loss = ops.softmax_cross_entropy(h, af.placeholder("labels", (recipe.rows,), "int64", last))
        kind, lr, *rest = recipe.optimizer
        af.minimize(loss, af.optim.SGD(lr=lr, momentum=rest[0]) if kind == "sgd" else af.optim.Adam(lr=lr))
        af.output("loss", loss)
    return g


def _forward(recipe: TrainRecipe, params, x):
    """(pre-activations, activations per layer, the network's output)."""
    pre, acts, h = [], [x], x
    for k in range(len(recipe.layer_stage)):
        a = h @ params[f"w{k}"] + (params[f"b{k}"] if recipe.bias[k] else 0.0)
        h = ACTIVATIONS[recipe.activations[k]][0](a)
        pre.append(a)
        acts.append(h)
    return pre, acts, h


def _loss_and_grad(recipe: TrainRecipe, out, batch):
    """The mean loss of ``out`` over its rows, and its gradient with respect to ``out``."""
    if recipe.loss == "mse":
        diff = out - batch["target"]
        return np.mean(diff**2), 2.0 * diff / diff.size
    z = out - out.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    rows = np.arange(len(out))
    onehot = np.zeros_like(out)
    onehot[rows, batch["labels"]] = 1.0
    return -np.mean(logp[rows, batch["labels"]]), (np.exp(logp) - onehot) / len(out)


def train_reference(recipe: TrainRecipe, batches) -> tuple[dict[str, np.ndarray], list[float]]:
    """Whole-batch training in numpy: (final parameters, the loss of every micro-batch of
    every step, each computed with that step's parameters)."""
    params = initial_parameters(recipe)
    state = {name: [np.zeros_like(p), np.zeros_like(p)] for name, p in params.items()}
    losses = []
    for t, batch in enumerate(batches, start=1):
        for micro in micro_batch_feeds(recipe, [batch]):
            losses.append(float(_loss_and_grad(recipe, _forward(recipe, params, micro["x"])[2], micro)[0]))
        pre, acts, out = _forward(recipe, params, batch["x"])
        grad = _loss_and_grad(recipe, out, batch)[1]
        grads = {}
        for k in reversed(range(len(recipe.layer_stage))):
            grad = grad * ACTIVATIONS[recipe.activations[k]][1](pre[k])
            grads[f"w{k}"] = acts[k].T @ grad
            if recipe.bias[k]:
                grads[f"b{k}"] = grad.sum(axis=0)
            grad = grad @ params[f"w{k}"].T
        kind, lr, *rest = recipe.optimizer
        for name, g in grads.items():
            m, v = state[name]
            if kind == "sgd":
                m *= rest[0]
                m += g
                params[name] = params[name] - lr * m
            else:
                m[:] = 0.9 * m + 0.1 * g
                v[:] = 0.999 * v + 0.001 * g * g
                m_hat, v_hat = m / (1 - 0.9**t), v / (1 - 0.999**t)
                params[name] = params[name] - lr * m_hat / (np.sqrt(v_hat) + 1e-8)
    return params, losses
