"""A config's run predicted on the virtual clock (``runtime.virtual``), and the cost model
fitted from a measured one.

``predict`` compiles the config's Plan, wires it as a run would (no buffers), and runs it
through the same protocol the stream threads run, each act taking the time the cost
model gives: in the order the replay decided where the runtime would replay it
(``program.schedule``), else choosing as the drivers do. A run is the steps ``actorflow
run`` gives one (``train.steps_per_run``: ``parameter_server.run_end``), the host's time
between runs after each. The simulated acts become spans through the runtime's own
span maker, so the report and the metrics are ``actorflow run``'s, from the same code
(``training.runner.measure``).

A plan over ranks (``ranks``) runs every rank's actors in one simulation
(``wire(plan, None)``): each rank a process with its own GIL, on the machine of its
devices' node; its sends and receives meet on the ranks' communication streams, a
transfer over the link between them; a collective over ranks waits for every
participant, then takes the alpha-beta time over the ranks' link.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..collector import cyclic_gc_paused
from ..config import Config, parse_config
from ..devices import device_order
from ..plan import Actor, Plan
from ..runtime.program import Program, rider, schedule
from ..runtime.runtime import register_stats
from ..runtime.spans import SpanMaker
from ..runtime.virtual import Entry, Host, Timing, meets, simulate
from ..runtime.wiring import Unit, Wiring, acts_in, wire
from ..trace.parse import Trace, from_spans, parse
from ..trace.recorder import Recorder, Span, chrome_trace
from ..training import survival
from ..training.parameter_server import run_end, run_starts
from ..training.runner import RunResult, compile_config, measure
from .costs import (
    NODE,
    CalibrationError,
    CostModel,
    Link,
    features,
    fit,
    flop_rates,
    nnls,
    ring_terms,
    shipped,
)

MAX_CONTENTION = 16.0
"""The most ``CostModel.contention`` a calibration gives."""
MAX_CROWDING = 2.0
"""The most ``CostModel.crowding`` ``fit_crowding`` gives."""
CONTENTIONS_AT_ONCE = 16
"""Contentions weighed in one array (each a copy of the trace's kernels' times)."""
CONTENTIONS = [k / 50 for k in range(100)] + [2 + k / 10 for k in range(round((MAX_CONTENTION - 2) * 10) + 1)]
"""The contentions ``Beside.contention`` tries: every 0.02 up to 2, every 0.1 beyond."""
GUESSES = 4
"""How often ``calibrate`` refits the GIL's shares of the acts and the contention."""
SIMULATED_STEPS = 4
"""Steps simulated: whole runs, at least one, as many as fit in these (or in the
training's steps, if fewer); the rest of a training repeats them."""


@attrs.frozen
class Prediction:
    """A predicted run: its report, the simulated spans (the steps' too) and a step's seconds."""

    result: RunResult
    spans: list[Span]
    step_seconds: float

    @property
    def chrome(self) -> dict[str, Any]:
        """The Chrome trace of the simulated run, as a run's recorder exports it."""
        return chrome_trace(self.spans)


@cyclic_gc_paused()
def predict(
    config: Config, model: CostModel, plan: Plan | None = None, ranks: int = 1, replicas: int = 1
) -> Prediction:
    """``config``'s run over ``ranks`` as the cost model times it (see the module's
    docstring). ``replicas``: the config is one of that many data-parallel replicas (the
    ``layouts.predict_layout`` symmetry): each update first all-reduces its gradient
    over the replicas, timed by the links."""
    plan = plan or compile_config(config, ranks, values=False)
    wiring = wire(plan, None, allocate=False)
    entries, step_seconds, ordered_by = _clock(config, plan, wiring, model, replicas)
    simulated = spans(plan, entries)
    result = measure(
        config,
        plan,
        from_spans(simulated),
        register_stats(plan, wiring.members),
        step_seconds * config.train.steps,
        steps=config.train.steps,
        losses=[],
        parameters={},
        ordered_by=ordered_by,
        ours=[True] * len(config.parallel.stages),
        predicted=True,
    )
    return Prediction(result, simulated, step_seconds)


def step_time(config: Config, plan: Plan, model: CostModel, replicas: int = 1) -> float:
    """The seconds a step of ``plan`` takes, as ``predict`` gives them, without its trace
    and report (what the layouts' search compares)."""
    return _clock(config, plan, wire(plan, None, allocate=False), model, replicas)[1]


def work(plan: Plan, model: CostModel, micro_batches: int) -> float:
    """The seconds of a core a step of ``plan``'s acts takes, each a launch and a kernel
    by its parts' op kinds (``costs.features``), without those the links time."""
    return sum(
        acts_in(a, micro_batches) * (model.launch + model.seconds(features(plan, a)))
        for a in plan.actors
        if a.kind not in ("collective", "copy", "send", "recv")
    )


def _polled(
    config: Config, plan: Plan, wiring: Wiring, node: Sequence[int], cores: int, replayed: bool = True
) -> frozenset[int]:
    """The ranks where a thread polls beside their streams all along: the transport's,
    where no compute stream of the rank rides its communication stream
    (``program.rider``; nor does it where the rank may survive another's loss, or in a
    run not ``replayed``), and the rider itself where its node has fewer cores than
    ranks (its polls take turns for the cores with the other ranks' threads). A rider
    beside other compute streams of its rank with no core to spare polls with back-off
    while they compute (``Transport.stays``), too seldom to slow them: 2x2 over 2 ranks
    (two devices a rank) measured 13.1 ms a step, predicted 16.0 ms with it polling all
    along and 14.0 ms without, in one invocation (2026-11-28; 11.2 against 16.9 and 13.0
    in another)."""
    if plan.world == 1:
        return frozenset()
    if not replayed:
        return frozenset(range(plan.world))
    losable = bool(survival.losable(config, plan))
    per_rank = {n: cores / ranks for n, ranks in Counter(node).items()}
    kinds: dict[int, list[str | None]] = defaultdict(list)
    for s in wiring.streams:
        kinds[s.stream.rank].append(s.stream.kind if s.units else None)

    def polls(r: int) -> bool:
        return losable or per_rank[node[r]] < 1 or rider(kinds[r]) < 0

    return frozenset(r for r in range(plan.world) if polls(r))


Replayed = tuple[list[list[Unit]] | None, str]
"""``replayed_orders``' answer: per stream the units a one-step run launches, and why."""


def _clock(
    config: Config,
    plan: Plan,
    wiring: Wiring,
    model: CostModel,
    replicas: int = 1,
    replayed: Replayed | None = None,
) -> tuple[list[Entry], float, str]:
    """The simulated acts of the runs of ``SIMULATED_STEPS`` steps (see there), the
    seconds a step takes (the host's time between runs included), and how the
    run orders its acts (``replayed``: ``replayed_orders`` of this wiring for a run of
    ``run_end(config, 0)`` steps, where the caller has it)."""
    per_run = run_end(config, 0)
    orders, ordered_by = replayed or replayed_orders(plan, wiring, config.runtime.order, per_run)
    runs = max(1, min(config.train.steps, SIMULATED_STEPS) // per_run)
    node = rank_nodes(plan, model)
    process = [s.stream.rank for s in wiring.streams]
    polled = _polled(config, plan, wiring, node, model.cores, replayed=orders is not None)
    host = Host(
        process,
        [node[r] for r in process],
        model.cores,
        model.handover,
        model.contention,
        polled,
        model.crowding,
    )
    times = unit_times(plan, wiring, model, replicas, config.parallel.tensor_parallel)
    costs = [cost for cost, _ in times]
    timing = Timing(
        costs, model.launch, model.hop, model.between, host, meets(plan, wiring), _gil(times, model)
    )
    ran = simulate(wiring, plan.micro_batches, per_run, runs, timing, orders, deps=False)
    if ran is None:
        raise CalibrationError("the plan stalls on the virtual clock (a real run would stall too)")
    entries = [e for stream in ran for e in stream]
    end = max((e.end for e in entries), default=0.0)
    return entries, (end + model.between) / (runs * per_run), ordered_by


def replayed_orders(plan: Plan, wiring: Wiring, order: str, steps: int) -> Replayed:
    """Per stream, the units a run of ``steps`` steps launches, where the runtime would
    replay ``plan`` (``Runtime``'s choice); and how the run orders its acts."""
    program: Program | str = "order='dynamic' was asked for" if order == "dynamic" else schedule(plan, None)
    if not isinstance(program, Program):
        return None, f"dynamic: {program}"
    orders = []
    for k, block in enumerate(program.blocks):
        shifts = [b * program.period for b in program.span(k, steps)]
        orders.append([wiring.units[e.unit.id] for s in shifts for e in block if 0 <= e.step + s < steps])
    return orders, "replay"


def rank_nodes(plan: Plan, model: CostModel) -> list[int]:
    """Per rank, the node (machine) it runs on: its first device's."""
    place = device_places(plan)
    first = [len(place)] * plan.world
    for device, k in place.items():
        rank = plan.rank_of(device)
        first[rank] = min(first[rank], k)
    return [k // model.node_size for k in first]


def unit_times(
    plan: Plan, wiring: Wiring, model: CostModel, replicas: int = 1, tensor_parallel: int = 1
) -> list[tuple[float, float]]:
    """Per unit, the seconds an act of it takes and, of them, those its kernel holds the
    GIL (``CostModel.held``; none for what the links time). A collective's, a transfer's
    between ranks and a copy's across nodes go by the links, any other kernel by its
    parts' op kinds; an update's, with ``replicas``, after its gradient's all-reduce over
    them (replica r's devices follow replica 0's in each stage of ``tensor_parallel``
    devices a replica, as ``layouts.with_layout`` places them)."""
    place = device_places(plan)
    node = rank_nodes(plan, model)
    times = []
    for unit in wiring.units:
        actor = unit.actor
        if actor.kind == "update" and replicas > 1:
            stage, k = divmod(place[actor.device], tensor_parallel)
            replica_places = [(stage * replicas + r) * tensor_parallel + k for r in range(replicas)]
            gradient = plan.registers[actor.inputs[0].register].nbytes
            own = features(plan, actor)
            times.append(
                (
                    model.collective("all_reduce", gradient, replica_places) + model.seconds(own),
                    model.held(own),
                )
            )
            continue
        if actor.kind == "collective":
            op, nbytes = _collective_input(plan, actor)
            members = [m.actor.device for m in unit.members]
            ranks = len({plan.rank_of(d) for d in members})
            times.append((model.collective(op, nbytes, [place[d] for d in members], ranks), 0.0))
            continue
        if actor.kind in ("send", "recv"):
            here, peer = plan.rank_of(actor.device), actor.attrs["peer"]
            link = model.transport if node[here] == node[peer] else model.network
            registers = [i.register for i in actor.inputs] + list(actor.outputs)
            times.append((link.seconds(sum(plan.registers[r].nbytes for r in registers)), 0.0))
            continue
        nodes = {place[plan.registers[r].device] // model.node_size for r in _moved(actor, plan)}
        if actor.kind == "copy" and len(nodes) > 1:
            times.append((model.network.seconds(sum(plan.registers[o].nbytes for o in actor.outputs)), 0.0))
        else:
            own = features(plan, actor)
            times.append((model.seconds(own), model.held(own)))
    return times


def _moved(actor: Any, plan: Plan) -> list[int]:
    return [i.register for i in actor.inputs if not plan.registers[i.register].is_parameter] + list(
        actor.outputs
    )


def device_places(plan: Plan) -> dict[str, int]:
    """Each device's place in the plan's device order (by its number): consecutive
    places share a node."""
    devices = sorted({r.device for r in plan.registers}, key=device_order)
    return {d: k for k, d in enumerate(devices)}


def spans(plan: Plan, entries: Sequence[Entry]) -> list[Span]:
    """The spans of simulated acts and their steps, made as a run's (``runtime.spans``)."""
    recorder = Recorder(True, limit=None)
    maker = SpanMaker(plan, 0)
    for e in entries:
        maker.record(recorder, e.unit, e.acts[0].number, e.start, e.end, e.acts)
    return recorder.with_steps()


def cost_model(path: str | None, kind: str, crowding: str | None = None) -> CostModel:
    """The cost model in the file at ``path`` (a trace of ``actorflow run --trace``, fitted
    here, or a saved calibration), or the one shipped for a ``kind`` model when None, its
    ``crowding`` fitted on the trace at ``crowding`` where given (``fit_crowding``); a
    CalibrationError for a file that is neither, or of another model."""
    if path is None:
        model = shipped(kind)
    else:
        text, trace = _read(path)
        model = calibrate(trace, path) if trace is not None else CostModel.from_json(text, path)
    if model.model.get("kind") != kind:
        raise CalibrationError(
            f"{path}: fitted on a {model.model.get('kind')} model, this config's is a {kind}: "
            "calibrate on a run of this model"
        )
    if crowding is not None:
        _, trace = _read(crowding)
        if trace is None:
            raise CalibrationError(f"{crowding}: not a trace of actorflow run --trace")
        model = fit_crowding(model, trace, crowding)
    return model


def _read(path: str) -> tuple[str, dict[str, Any] | None]:
    """The text of the file at ``path``, and the Chrome trace it holds (None if none)."""
    try:
        with open(path) as f:
            text = f.read()
        data = json.loads(text)
    except (OSError, ValueError) as err:
        raise CalibrationError(f"{path}: cannot read a calibration: {err}") from None
    return text, data if isinstance(data, dict) and "traceEvents" in data else None


def _measured(chrome: dict[str, Any], where: str) -> tuple[Config, Plan, Wiring, Trace]:
    """The config, plan, wiring and parsed trace of a trace of ``actorflow run --trace``."""
    other = chrome.get("otherData", {}) if isinstance(chrome, dict) else {}
    if "config" not in other:
        raise CalibrationError(f"{where}: a trace without its config (write it with actorflow run --trace)")
    if "rank" in other:
        raise CalibrationError(f"{where}: a rank's trace; calibrate on a run of one process")
    config = parse_config(other["config"], source=where)
    plan = compile_config(config, 1, values=False)
    return config, plan, wire(plan, 0, allocate=False), parse(chrome)


def calibrate(chrome: dict[str, Any], where: str) -> CostModel:
    """The cost model of the run a trace of ``actorflow run --trace`` measured (see
    ``costs``), with no ``crowding``; ``where``: the file, for errors."""
    config, plan, wiring, trace = _measured(chrome, where)
    other = chrome["otherData"]
    threads = {u.name: u.stream for u in wiring.units}
    launch, hop = _host_times(trace, threads)
    kernels = Beside.of(trace, threads, launch)
    makespan, gap = _runs_measured(trace, config, where)
    rates = flop_rates(other.get("machine", {}), where)

    def fitted(contention: float, gil: Mapping[str, float] | None) -> CostModel:
        durations = kernels.alone(contention, gil)
        measured = {u.id: _typical(durations[u.name]) for u in wiring.units if durations.get(u.name)}
        samples = [
            (features(plan, u.actor), measured[u.id])
            for u in wiring.units
            if u.id in measured and u.actor.kind != "collective"
        ]
        if not samples:
            raise CalibrationError(f"{where}: a trace with no kernel of its config's plan")
        ops, overall = fit(samples, rates)
        return CostModel(
            ops,
            overall,
            launch=launch,
            hop=hop,
            between=gap,
            node=_node_link(plan, wiring, measured) or NODE,
            cores=os.cpu_count() or 1,
            contention=contention,
            model=other["config"]["model"],
        )

    model = fitted(0.0, None)  # the kernels' times as measured: a first guess
    for _ in range(GUESSES):
        shares = gil_shares(plan, wiring, model)
        model = fitted(kernels.contention(shares), shares)
    return _overheads(config, plan, model, makespan, kernels.together())


def fit_crowding(model: CostModel, chrome: dict[str, Any], where: str) -> CostModel:
    """``model`` with the ``crowding`` (from 0 to ``MAX_CROWDING``) that makes the run a
    trace of ``actorflow run --trace`` measured last as long on the clock as it did, by
    bisection: a run of the same model with more than two compute streams in its process
    (``model``'s own run tells contention, at two at most)."""
    config, plan, _, trace = _measured(chrome, where)
    if config.model.kind != model.model.get("kind"):
        raise CalibrationError(
            f"{where}: a run of a {config.model.kind} model, the calibration's is a {model.model.get('kind')}"
        )
    if sum(s.kind == "compute" for s in plan.streams) <= 2:
        raise CalibrationError(
            f"{where}: a run of at most two devices says nothing of crowding; fit it on one of more "
            "(e.g. configs/2x2.yaml)"
        )
    makespan, _ = _runs_measured(trace, config, where)

    def trial(crowding: float) -> CostModel:
        return attrs.evolve(model, crowding=crowding, between=0.0)

    return attrs.evolve(model, crowding=_bisected(config, plan, trial, MAX_CROWDING, makespan))


def _runs_measured(trace: Trace, config: Config, where: str) -> tuple[float, float]:
    """(the seconds a step took, the median over the trace's whole runs of their time by
    their steps; the host's time between two runs, their median gap) of a trace of
    ``config``'s training (the file ``where``), whose runs begin where ``run_starts`` says
    (a run's steps overlap, so only a run's time tells)."""
    starts = run_starts(config)
    by_step = {s.args["iteration"]: (s.start, s.end) for s in trace.spans if s.category == "step"}
    runs = [
        [by_step[k] for k in range(begin, end)]
        for begin, end in zip(starts, [*starts[1:], config.train.steps])
        if all(k in by_step for k in range(begin, end))  # a trace keeps the latest whole steps
    ]
    if not runs:
        raise CalibrationError(f"{where}: a trace without every step of one run (actorflow run's steps)")
    makespan = statistics.median((run[-1][1] - run[0][0]) / len(run) for run in runs) / 1e9
    gaps = [max(0, b[0][0] - a[-1][1]) for a, b in zip(runs, runs[1:])]
    return makespan, statistics.median(gaps or [0]) / 1e9


def gil_shares(plan: Plan, wiring: Wiring, model: CostModel) -> dict[str, float]:
    """Per unit (by name), the share of its act that holds the GIL, as the virtual clock
    takes it (``_gil``)."""
    return dict(zip((u.name for u in wiring.units), _gil(unit_times(plan, wiring, model), model)))


def _gil(times: Sequence[tuple[float, float]], model: CostModel) -> list[float]:
    """Per unit of ``times`` (``unit_times``), the share of its act, launch and kernel,
    that holds the GIL (``runtime.virtual.Timing.gil``)."""
    launch = model.launch
    return [(launch + held) / (launch + cost) if launch + cost > 0 else 1.0 for cost, held in times]


@attrs.frozen
class Beside:
    """A measured run's kernels: per kernel its unit's name, and ``seconds[i, j]``: how
    long kernel i ran beside j acts of other threads of its process (each act its
    kernel and the ``launch`` before it)."""

    names: list[str]
    seconds: np.ndarray

    @classmethod
    def of(cls, trace: Trace, threads: dict[str, int], launch: float) -> Beside:
        kernels = [
            (s.name, threads[s.name], s.start, s.end)
            for s in trace.spans
            if s.is_kernel and s.name in threads and s.end > s.start
        ]
        lines: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for _, thread, start, end in kernels:
            lines[thread].append((start, end))
        spans = {t: _launched(sorted(v), round(launch * 1e9)) for t, v in lines.items()}
        seconds = np.zeros((len(kernels), max(1, len(spans))))
        for i, (_, thread, start, end) in enumerate(kernels):
            edges = [(start, 0), (end, 0)]
            for other, (starts, ends) in spans.items():
                if other != thread:
                    lo, hi = np.searchsorted(ends, start, "right"), np.searchsorted(starts, end, "left")
                    edges += [(max(int(b), start), 1) for b in starts[lo:hi]]
                    edges += [(min(int(e), end), -1) for e in ends[lo:hi]]
            edges.sort()
            running = 0
            for (at, step), (later, _) in zip(edges, edges[1:]):
                running += step
                seconds[i, running] += (later - at) / 1e9
        return cls([k[0] for k in kernels], seconds)

    def together(self) -> bool:
        """Whether some kernels ran beside others."""
        return bool(self.seconds[:, 1:].any())

    def work(self, contention: float | np.ndarray, gil: Mapping[str, float] | None = None) -> np.ndarray:
        """Per kernel, the seconds it would have taken alone, were ``contention`` the
        process's and ``gil[unit]`` the share of its unit's acts that holds the GIL (all
        where None): ``runtime.virtual``'s rule, beside others at 1 / (1 + contention *
        share) of its speed. For an array of contentions, a row per contention."""
        shares = np.array([1.0 if gil is None else gil.get(n, 1.0) for n in self.names])
        beside = np.minimum(np.arange(self.seconds.shape[1]), 1)
        slowed = np.multiply.outer(contention, np.outer(shares, beside))
        return (self.seconds / (1 + slowed)).sum(axis=-1)

    def alone(self, contention: float, gil: Mapping[str, float] | None = None) -> dict[str, list[float]]:
        """Per unit, its kernels' ``work``."""
        durations: dict[str, list[float]] = defaultdict(list)
        for name, seconds in zip(self.names, self.work(contention, gil)):
            durations[name].append(float(seconds))
        return durations

    def contention(self, gil: Mapping[str, float] | None = None) -> float:
        """The contention that makes each unit's acts' work most alike (least squares of
        the logarithms around each unit's median, a unit weighing as much as its median
        work: a few µs of launch weigh on a short kernel's time alone): the acts that ran
        alone (a pipeline's warm-up and cool-down) against those that ran beside others.
        A run of one thread tells none: 0."""
        if not self.together():
            return 0.0
        units: dict[str, list[int]] = defaultdict(list)
        for i, name in enumerate(self.names):
            units[name].append(i)
        misfits = []
        for lo in range(0, len(CONTENTIONS), CONTENTIONS_AT_ONCE):
            logs = np.log(self.work(np.array(CONTENTIONS[lo : lo + CONTENTIONS_AT_ONCE]), gil))
            misfit = np.zeros(len(logs))  # a row of logs per contention
            for group in units.values():
                unit = logs[:, group]
                median = np.median(unit, axis=1)
                misfit += ((unit - median[:, None]) ** 2).sum(axis=1) * np.exp(median)
            misfits.append(misfit)
        return CONTENTIONS[int(np.argmin(np.concatenate(misfits)))]


def _launched(kernels: list[tuple[int, int]], launch: int) -> np.ndarray:
    """A thread's acts from its kernels (start, end; in order): each from ``launch``
    before its kernel, or the last kernel's end, the later."""
    acts = np.array(kernels, dtype=np.int64).T
    acts[0, 1:] = np.maximum(acts[0, 1:] - launch, acts[1, :-1])
    acts[0, 0] -= launch
    return acts


def _host_times(trace: Trace, threads: dict[str, int]) -> tuple[float, float]:
    """(launch, hop) from a trace whose kernels ran on ``threads[name]`` (a copy's track
    is its device's copy stream; its thread, its producer's): the median gap between two
    kernels of a thread where the second had nothing left to wait for when the first
    ended; of the delays of a kernel of an idle thread after the last kernel it waited
    for (on another thread) ended, the tenth percentile, less a launch (a wake-up that
    found the GIL free)."""
    producers: dict[int, list[int]] = defaultdict(list)
    for p, c in trace.flows:
        producers[c].append(p)
    spans = trace.spans
    kernels = [i for i, s in enumerate(spans) if s.is_kernel and s.name in threads]
    by_thread: dict[int, list[int]] = defaultdict(list)
    for i in kernels:
        by_thread[threads[spans[i].name]].append(i)
    previous = {b: a for ids in by_thread.values() for a, b in zip(ids, ids[1:])}
    gaps, delays = [], []
    for i in kernels:
        before = previous.get(i)
        if before is None:
            continue
        s, last = spans[i], spans[before].end
        ready = max((spans[p].end for p in producers[i]), default=last)
        if ready <= last:
            gaps.append((s.start - last) / 1e9)
        elif s.start >= ready:
            delays.append((s.start - ready) / 1e9)
    launch = statistics.median(gaps) if gaps else 0.0
    return launch, max(0.0, float(np.quantile(delays, 0.1)) - launch) if delays else 0.0


def _collective_input(plan: Plan, actor: Actor) -> tuple[str, int]:
    """(op, one participant's input bytes a call) of a collective actor, as the ring
    formulas take them (a fused all-reduce an all-reduce of its members' inputs)."""
    op = "all_reduce" if actor.op.endswith("all_reduce") else actor.op
    data = (plan.registers[i.register] for i in actor.inputs)
    return op, sum(r.nbytes for r in data if not r.control) // actor.calls


def _node_link(plan: Plan, wiring: Wiring, measured: dict[int, float]) -> Link | None:
    """Within a node, alpha and bandwidth from the ring formula's rounds and bytes of the
    measured collectives (None without any)."""
    rows, times = [], []
    for u in wiring.units:
        if u.actor.kind == "collective" and u.id in measured:
            rows.append(ring_terms(*_collective_input(plan, u.actor), len(u.members)))
            times.append(measured[u.id])
    if not rows:
        return None
    alpha, per_byte = nnls(np.array(rows, float), np.array(times))
    return Link(float(alpha), 1.0 / per_byte if per_byte > 0 else 1e12)


def _overheads(config: Config, plan: Plan, model: CostModel, makespan: float, together: bool) -> CostModel:
    """The measured config's simulated step made to last as long as it measured
    (``makespan``), by bisection: where its kernels ran beside each other (``together``), of
    ``launch``, an act's host time, from 0 to the step (with the contention their spans
    show and no ``handover``): the gaps the trace shows between a thread's kernels leave
    out the host work that other threads' acts put in their way (their protocol, the
    GIL); else of ``handover`` (up to CPython's switch interval). The measured time
    between runs (``model.between``) includes the next run's first launch.

    A fixed host time per act, not a larger contention, because it keeps its share of a
    step as the acts grow more and smaller: fitted on the MLP under GPipe at 2
    micro-batches, the contention (1.65) predicted 8 micro-batches 29% slow, this 7%
    (2026-11-28, benchmarks/README)."""

    def trial(value: float, between: float) -> CostModel:
        if together:
            return attrs.evolve(model, launch=value, handover=0.0, between=between)
        return attrs.evolve(model, handover=value, between=between)

    top = makespan if together else sys.getswitchinterval()
    value = _bisected(config, plan, lambda v: trial(v, 0.0), top, makespan)
    return trial(value, max(0.0, model.between - model.launch))


def _bisected(
    config: Config, plan: Plan, trial: Callable[[float], CostModel], top: float, makespan: float
) -> float:
    """The value from 0 to ``top`` whose ``trial`` cost model makes the plan's simulated
    step last ``makespan`` (the step grows with it), by bisection."""
    wiring = wire(plan, None, allocate=False)  # the same each trial: only the value changes
    replayed = replayed_orders(plan, wiring, config.runtime.order, run_end(config, 0))
    lo, hi = 0.0, top
    for _ in range(20):
        mid = (lo + hi) / 2
        _, seconds, _ = _clock(config, plan, wiring, trial(mid), replayed=replayed)
        lo, hi = (mid, hi) if seconds < makespan else (lo, mid)
    return lo


def _typical(seconds: list[float]) -> float:
    """An act's typical time: the mean of its measured times, leaving out those the
    machine stretched past 4x the median (a preemption, a collection)."""
    median = statistics.median(seconds)
    return statistics.fmean(s for s in seconds if s <= 4 * median)
