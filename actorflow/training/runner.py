"""Compile a config's run, train it step by step, and measure what the pipeline did."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ..compiler import compile
from ..compiler.schedules import ZERO_BUBBLE, kept_for_backward
from ..config import Config
from ..devices import is_cuda
from ..errors import RankLost
from ..plan import Plan
from ..runtime import Session
from ..runtime.logical import assemble
from ..runtime.mpi_world import gather
from ..trace.merge import merge
from ..trace.metrics import GAP, balanced_bubbles, pass_seconds, pipeline_theory, summarize_parsed
from ..trace.parse import Trace, parse
from ..trace.recorder import STEP, TRACE_LIMIT, write_chrome
from ..world import this_rank, world_size
from . import checkpoint, parameter_server, survival
from .data import Data, Part, dataset, position, step_feeds
from .machine import matmul_seconds
from .model import build_graph
from .parameter_server import rank_devices, server_devices
from .stopping import Interrupts, Stop, nonfinite

REPORT_SPANS = 50_000  # the most spans an untraced run holds for its report (~35 MB)
REPORT_STEPS = 20
"""The steps an untraced run times for its report: those after its first ``Session.run``
(a warm-up: the report leaves it out once a later run was timed; a run that stops
within it reports on it). Timing every act cost the default config 18% of its samples/s
(26.6k against 32.3k untraced, a Session over 96 steps, alternating); the other steps'
acts cost what an untraced run's do."""


@attrs.frozen
class RunResult:
    """What a run did. ``bubbles``: per stage, the measured idle fraction of its (first
    replica's) compute stream within the steps (see ``trace.metrics``); ``theory``: (p-1)/(m+p-1), or under ZB-H1
    its share with the measured F, B and W (``trace.metrics.pipeline_theory``); ``passes``:
    F, B and W, the kernel seconds per micro-batch and stage of the forward pass, the
    input gradients and the weight gradients (``trace.metrics.pass_seconds``);
    ``bubble_steps``: how many steps the bubbles were measured over, from step
    ``bubble_from`` on: an untraced run times ``REPORT_STEPS`` of them for its report, a
    traced one all, and either holds the spans of its latest steps only,
    ``REPORT_SPANS`` of them (a trace's, ``TRACE_LIMIT``), so memory stays flat however
    long it runs; ``trace_note``:
    what the trace left out, if anything; ``peak_activations``: per stage, the most
    micro-batches whose kept-for-backward registers were held at once; ``activation_quotas``: per stage, the quota the
    schedule gave those registers (the bound on ``peak_activations``); ``kept_bytes``:
    per stage, the bytes of those registers held, each at its most (what recompute
    lowers: see ``af.recompute``); ``memory``: planned bytes per device; ``held_memory``:
    per device, the bytes of the most buffers each register held at once, summed (at
    least what was held at any one moment, at most ``memory``), parameters included;
    ``ordered_by``: how the run ordered its acts (``Runtime.ordered_by``);
    ``handoff_share``: the part of the measured steps' critical
    path (``trace.metrics``) spent between kernels rather than in them, on host hand-offs,
    the transport's polls (over ranks) and queueing: why a bubble is larger than the
    theory's; ``communication_share``: the part of it in sends, receives and
    collectives; ``balanced``:
    per stage, the bubble with its measured busy time and none between kernels (uneven
    stages make it larger than ``theory``; see ``trace.metrics.balanced_bubbles``), empty
    where this rank did not measure every stage; ``stopped``: why the run ended before
    train.steps, with ``losses`` of the steps it ran (see ``stopping``). Over ranks, rank
    0's result has every stage's numbers and every parameter; another rank's, its own."""

    losses: list[float]
    seconds: float
    samples_per_second: float
    bubbles: list[float]
    bubble_steps: int
    bubble_from: int
    theory: float
    peak_activations: list[int]
    activation_quotas: list[int]
    memory: dict[str, int]
    kept_bytes: list[int]
    parameters: dict[str, np.ndarray]
    held_memory: dict[str, int] = attrs.Factory(dict)
    handoff_share: float = 0.0
    communication_share: float = 0.0
    trace_note: str = ""
    balanced: list[float] = attrs.Factory(list)
    kernel_seconds: list[float] = attrs.Factory(list)
    """Per stage measured, its (first replica's) compute stream's kernel seconds a step."""
    passes: dict[str, float] = attrs.Factory(dict)
    ordered_by: str = "replay"
    predicted: bool = False
    """A simulated run's (``actorflow simulate``): no losses, no parameters."""
    stopped: Stop | None = None
    steps: int = 0
    """The steps the run ran: train.steps, unless it ``stopped`` early or was resumed."""
    first_step: int = 0
    """The step the run began after: 0, or its checkpoint's when resumed."""
    staleness: tuple[float, int] | None = None
    """Async parameter servers: the mean and largest staleness of the run's updates, in
    steps (see ``parameter_server``); None for other runs."""
    lost: tuple[str, ...] = ()
    """Parameter servers: the workers the run went on without, a line each (see ``survival``)."""
    ended_with: Config | None = None
    """Where the run lost workers, or resumed a checkpoint of a run that had: the config
    it went on with, without them."""


def compile_config(config: Config, ranks: int | None = None, values: bool = True) -> Plan:
    """The config's plan; ``ranks``: for that many ranks (default: as the launcher started);
    ``values`` False: parameters of shape only, for a plan simulated, never run."""
    parallel, runtime = config.parallel, config.runtime
    graph = build_graph(config, values)
    return compile(
        graph,
        quota=runtime.quota,
        quotas=parameter_server.quotas(config, graph),
        priority=runtime.priority,
        fusion=runtime.fusion,
        fuse_kernels=runtime.fuse_kernels,
        link_bandwidth=runtime.link_bandwidth,
        link_latency=runtime.link_latency,
        max_streams=runtime.max_streams,
        max_ops_per_stream=runtime.max_ops_per_stream,
        max_labels=runtime.max_labels,
        max_memory=runtime.max_memory,
        comm_reuse=runtime.comm_reuse,
        micro_batches=parallel.micro_batches,
        stages=parallel.stages,
        schedule=parallel.schedule,
        ranks=ranks if parallel.parameter_server is None else _server_ranks(config, ranks),
    )


def _server_ranks(config: Config, ranks: int | None) -> list[list[str]]:
    """With parameter servers, the devices of each rank (``parameter_server.rank_devices``)."""
    world = world_size() if ranks is None else ranks
    if world == 1:
        return [[*config.parallel.devices, *server_devices(config)]]
    return rank_devices(config, world)


def train(
    config: Config,
    on_step: Callable[[int, float], None] | None = None,
    trace: str | None = None,
    resume: str | None = None,
    on_lost: Callable[[str, int], None] | None = None,
) -> RunResult:
    """Run train.steps steps; ``on_step(step, loss)`` after each (the steps of one
    ``Session.run``, ``train.steps_per_run`` of them, once it ends); ``trace``: write a Chrome
    trace; ``resume``: go on from the newest checkpoint in that folder (see ``checkpoint``)
    to train.steps, instead of from step 0. With ``output.checkpoint``, a checkpoint is
    written every ``every`` steps and when the run ends (except at a loss that is not finite).

    Under a launcher every rank runs this, and each trains its own devices' part of the
    plan, fed only its devices' slices of each batch. Each rank writes its own trace
    (``NAME.rankR.json``) and rank 0 also the merged one at ``trace``; rank 0 gathers
    what the report needs from the others once the steps are done. Under parameter
    servers the run goes on without a lost worker (``survival``), and ``on_lost(what,
    step)`` hears, on every survivor, what was lost and the step the run goes on from
    (steps past it run again); the config and plan the run ends with (and its
    ``RunResult``, its report and trace of the steps after the loss) are those without it."""
    data = dataset(config)
    gone = (
        checkpoint.lost_workers(resume, config, world_size())
        if resume is not None
        else checkpoint.LostWorkers()
    )
    config = gone.applied(config)  # a run resumed goes on without the workers lost before
    plan = compile_config(config)
    at = functools.partial(position, config, data, origin=gone.origin)
    saved = checkpoint.load(resume, config, plan, at, this_rank()) if resume is not None else None
    with _Training(config, plan, data, trace, saved, gone) as run:
        start = time.perf_counter()
        stopped = run.steps(on_step, on_lost)
        return run.result(stopped, time.perf_counter() - start)


class _Training:
    """This rank's side of a training run (``train``): the config and plan it runs, which
    change where it loses workers (``survival``), its session of the plan, and the steps'
    losses. A context manager: leaving it closes the session."""

    def __init__(
        self,
        config: Config,
        plan: Plan,
        data: Data,
        trace: str | None,
        saved: checkpoint.Checkpoint | None,
        gone: checkpoint.LostWorkers,
    ) -> None:
        self.data, self.trace = data, trace
        self.first = self.step = saved.step if saved is not None else 0
        self.losses: list[float] = []
        self.lost: list[str] = []  # what was lost, a line each
        self.dropped = 0  # async updates counted by lost workers' clocks
        self.gone = gone  # the workers lost since step 0 and where the data went on from
        self.snapshots = survival.Snapshots() if survival.possible(config, plan) else None
        self._open(config, plan, saved.values if saved is not None else None)

    def _open(self, config: Config, plan: Plan, values: dict[str, np.ndarray] | None) -> None:
        self.config, self.plan = config, plan
        self.warm = parameter_server.run_end(config, self.step)  # its session's first run's end
        self.session = _open(config, plan, self.trace, values, range(self.step, self.warm + REPORT_STEPS))
        self.rank = self.session.rank
        self.parts = local_feeds(plan, self.rank)
        self.shard = checkpoint.arrays(plan, self.rank) if config.output.checkpoint is not None else {}
        self.at = functools.partial(position, config, self.data, origin=self.gone.origin)

    def __enter__(self) -> _Training:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> None:
        self.session.__exit__(kind, exc, tb)

    def steps(
        self, on_step: Callable[[int, float], None] | None, on_lost: Callable[[str, int], None] | None
    ) -> Stop | None:
        """Train up to train.steps (as ``train`` says); why the run stopped early, if it did."""
        with Interrupts(self.plan.world, lambda: self.session.check()) as interrupts:
            if self.snapshots is not None:
                self.snapshots.take(self.step, self.session)
            while True:
                try:
                    if self.step >= self.config.train.steps:
                        interrupts.finish()  # the ranks' last meeting: a loss in the last step shows here
                        return None
                    if stopped := self._run(on_step) or self._between(interrupts):
                        return stopped
                except RankLost as loss:
                    self._regroup(loss, on_lost)
                    interrupts.regrouped()

    def _run(self, on_step: Callable[[int, float], None] | None) -> Stop | None:
        """One ``Session.run`` of the steps from ``step`` on (``parameter_server.run_end``):
        their losses; a stop at a loss that is not finite."""
        config, step = self.config, self.step
        end = parameter_server.run_end(config, step)
        feeds = [
            f
            for s in range(step, end)
            for f in step_feeds(config, self.data, s, self.parts, self.gone.origin)
        ]
        outputs = self.session.run(feeds)
        if self.snapshots is not None:
            self.snapshots.take(end, self.session)
        m = len(outputs) // (end - step)
        for k in range(end - step):
            self.losses.append(float(np.mean([o["loss"] for o in outputs[k * m : (k + 1) * m]])))
            if on_step is not None:
                on_step(step + k, self.losses[-1])
            if config.train.stop_on_nonfinite and (
                stopped := nonfinite(self.losses, config.train.steps, self.first)
            ):
                return stopped
        self.step = end
        return None

    def _between(self, interrupts: Interrupts) -> Stop | None:
        """Between runs: a Ctrl-C that some rank heard, and the checkpoint due."""
        config, step = self.config, self.step
        stopped = None
        if interrupts.stop_now() and step < config.train.steps:
            stopped = Stop("interrupted", f"interrupted at step {step} of {config.train.steps}")
        keep = config.output.checkpoint
        if keep and (stopped or step % keep.every == 0 or step == config.train.steps):
            meet = None if self.plan.world == 1 else functools.partial(gather, check=self.session.check)
            values = self.session.values()
            checkpoint.save(
                keep.path, step, values, self.shard, config, self.at(step), self.rank, meet, self.gone
            )
        return stopped

    def _regroup(self, loss: RankLost, on_lost: Callable[[str, int], None] | None) -> None:
        """Go on without the lost rank's workers (``survival.regroup``)."""
        assert self.snapshots is not None, "only a run that may lose workers has losable ranks"
        self.session.close()
        went = survival.regroup(self.config, self.plan, loss, self.snapshots, compile_config)
        # the smaller batches go on from where the data was
        self.gone = checkpoint.LostWorkers((*self.gone.lost, went.workers), (went.step, self.at(went.step)))
        self.step = went.step
        del self.losses[went.step - self.first :]
        self.lost.append(went.told)
        self.dropped += went.dropped
        if on_lost is not None:
            on_lost(went.told, went.step)
        self._open(went.config, went.plan, went.values)

    def result(self, stopped: Stop | None, seconds: float) -> RunResult:
        """What the run did (``measure``): over ranks, rank 0 gathers the others' parts."""
        session, config, plan, rank, trace = self.session, self.config, self.plan, self.rank, self.trace
        if trace is None and self.step > self.warm:
            session.recorder.drop_before(self.warm)
        chrome = session.recorder.to_chrome()
        stats = session.register_stats()
        parameters = session.parameters()
        counted = (
            parameter_server.staleness(session.values(), self.dropped)
            if parameter_server.is_async(config)
            else (0, 0, 0)
        )
        if trace is not None:
            on_cpus = plan.world == 1 and not any(map(is_cuda, config.parallel.devices))
            machine = {"matmul": matmul_seconds(config.model.dtype)} if on_cpus else None
            write_chrome(
                with_config(chrome, config, machine), rank_path(trace, rank) if plan.world > 1 else trace
            )
        # gathered while the session still hears of lost ranks, so none waits for good
        gathered = gather((chrome, stats, parameters, counted), session.check) if plan.world > 1 else None
        if gathered is not None:
            for _, their_stats, their_parameters, _ in gathered:
                stats |= their_stats
                parameters |= their_parameters
            parameters = assemble(plan.logical, "parameter", parameters)
            chrome = merge([c for c, *_ in gathered])
            counted = parameter_server.summed([c for *_, c in gathered])
            if trace is not None:
                write_chrome(with_config(chrome, config), trace)
        measured = measure(
            config,
            plan,
            parse(chrome),
            stats,
            seconds,
            steps=len(self.losses),
            losses=self.losses,
            parameters=parameters,
            ordered_by=session.ordered_by,
            stopped=stopped,
            ours=[
                plan.world == 1 or rank == 0 or plan.rank_of(stage[0]) == rank
                for stage in config.parallel.stages
            ],
            trace_note=chrome.get("otherData", {}).get("note", "") if trace is not None else "",
            first_step=self.first,
            staleness=parameter_server.described(counted),
        )
        return attrs.evolve(measured, lost=tuple(self.lost), ended_with=config if self.gone.lost else None)


def _open(
    config: Config, plan: Plan, trace: str | None, values: dict[str, np.ndarray] | None, report: range
) -> Session:
    """The run's session of ``plan``, holding ``values`` (a checkpoint's) if given: it
    times every step for a ``trace``, else the steps ``report`` (its first run and the
    ``REPORT_STEPS`` after it), for the report."""
    session = Session(
        plan,
        trace=True,
        trace_iterations=report if trace is None else None,
        trace_limit=REPORT_SPANS if trace is None else TRACE_LIMIT,
        order=config.runtime.order,
        lost_after=config.runtime.lost_after,
        losable=survival.losable(config, plan),
    )
    if values is not None:
        try:
            session.load(values)
        except BaseException:
            session.close()
            raise
    return session


def measure(
    config: Config,
    plan: Plan,
    parsed: Trace,
    stats: dict[str, dict[str, int]],
    seconds: float,
    *,
    steps: int,
    losses: list[float],
    parameters: dict[str, np.ndarray],
    ordered_by: str,
    ours: list[bool],
    trace_note: str = "",
    predicted: bool = False,
    stopped: Stop | None = None,
    first_step: int = 0,
    staleness: tuple[float, int] | None = None,
) -> RunResult:
    """What a run of ``config``'s ``plan`` did, from its trace (``parsed``), its registers'
    ``stats`` and its ``seconds``: a measured run's, or a simulated one's
    (``actorflow simulate``), of ``steps`` steps. ``ours``: per stage, whether this rank measured it (a rank
    other than 0 measures the stages whose first replica it holds)."""
    stages = config.parallel.stages
    p, m = len(stages), config.parallel.micro_batches
    peaks, quotas = kept_per_stage(plan, stats, stages)
    kept = kept_bytes_per_stage(plan, stats, stages)
    summary = summarize_parsed(parsed, [stage[0] for stage, mine in zip(stages, ours) if mine])
    passes = pass_seconds(parsed, m)
    schedule = config.parallel.schedule
    theory = (
        pipeline_theory(p, m, passes["forward"], passes["backward"], passes["weight"], zero_bubble=True)
        if schedule in ZERO_BUBBLE
        else (p - 1) / (m + p - 1)
    )
    measured = iter(summary.stages)
    bubbles = [next(measured).bubble if mine else float("nan") for mine in ours]
    balanced = balanced_bubbles([b.busy_s for b in summary.stages], m) if all(ours) else []
    # the steps the trace holds (a report's window, a long trace's latest ones, a
    # simulation's few, which the run repeats), each once however many ranks' step tracks
    held = {s.args["iteration"] for s in parsed.spans if s.category == STEP}
    measured_steps = max(1, len(held))
    return RunResult(
        losses=losses,
        seconds=seconds,
        samples_per_second=steps * config.train.batch_size / seconds,
        bubbles=bubbles,
        bubble_steps=measured_steps,
        bubble_from=min(held, default=first_step),
        trace_note=trace_note,
        theory=theory,
        passes=passes,
        balanced=balanced,
        kernel_seconds=[b.busy_s / measured_steps for b in summary.stages],
        peak_activations=peaks,
        activation_quotas=quotas,
        kept_bytes=kept,
        memory=dict(plan.memory),
        held_memory=held_memory(plan, stats),
        parameters=parameters,
        handoff_share=summary.critical_path.shares.get(GAP, 0.0),
        communication_share=summary.critical_path.communication_share,
        ordered_by=ordered_by,
        predicted=predicted,
        stopped=stopped,
        steps=steps,
        first_step=first_step,
        staleness=staleness,
    )


def with_config(
    chrome: dict[str, Any], config: Config, machine: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A trace that says which config ran (``otherData.config``), so ``actorflow simulate
    --calibrate`` can rebuild its plan's shapes, and what ``machine`` timed of the machine
    it ran on (``otherData.machine``, see ``machine``) where given."""
    other = chrome.get("otherData", {}) | {"config": config.to_dict()}
    return chrome | {"otherData": other if machine is None else other | {"machine": machine}}


def local_feeds(plan: Plan, rank: int) -> dict[str, Part]:
    """The feeds of ``rank``'s devices, as ``step_feeds`` takes them: the whole ``x`` and
    ``labels`` where this rank holds every part, else the parts it holds."""
    mine = {f.name for f in plan.feeds if plan.rank_of(plan.actors[f.actor].device) == rank}
    parts: dict[str, Part] = {}
    for lt in plan.logical:
        if lt.kind != "feed":
            continue
        if set(lt.parts) <= mine:
            parts[lt.name] = Part(lt.name)
        else:  # a slice of one split S(axis), or the whole of a broadcast one
            parts.update(
                (part, Part(lt.name, k, len(lt.parts), lt.axis) if lt.sbp == "S" else Part(lt.name))
                for k, part in enumerate(lt.parts)
                if part in mine
            )
        mine -= set(lt.parts)
    parts.update((name, Part(name)) for name in mine)
    return parts


def rank_path(path: str, rank: int) -> str:
    """``t.json`` -> ``t.rank1.json``: where rank 1 of a run writes its own trace."""
    stem, dot, suffix = path.rpartition(".")
    return f"{stem}.rank{rank}.{suffix}" if dot and "/" not in suffix else f"{path}.rank{rank}"


def held_memory(plan: Plan, stats: dict[str, dict[str, int]]) -> dict[str, int]:
    """Per device, the bytes of each register's most buffers held at once, summed over
    the registers ``stats`` covers, and of the parameters."""
    held: dict[str, int] = {}
    for reg in plan.registers:
        buffers = 1 if reg.is_parameter else stats.get(reg.name, {}).get("max_held", 0)
        held[reg.device] = held.get(reg.device, 0) + buffers * reg.nbytes
    return held


def kept_per_stage(
    plan: Plan, stats: dict[str, dict[str, int]], stages: tuple[tuple[str, ...], ...]
) -> tuple[list[int], list[int]]:
    """Per stage, over the registers it keeps for backward: (the most buffers one of them
    held at once, the largest quota among them). ``stats`` may cover only some of the
    registers (a rank's own): the others are left out."""
    stage_of = {d: k for k, devices in enumerate(stages) for d in devices}
    peaks, quotas = [0] * len(stages), [0] * len(stages)
    for reg in kept_for_backward(plan):
        if reg.name not in stats:
            continue
        k = stage_of[reg.device]
        peaks[k] = max(peaks[k], stats[reg.name]["max_held"])
        quotas[k] = max(quotas[k], reg.quota)
    return peaks, quotas


def kept_bytes_per_stage(
    plan: Plan, stats: dict[str, dict[str, int]], stages: tuple[tuple[str, ...], ...]
) -> list[int]:
    """Per stage, over the registers it keeps for backward: the sum of the most bytes each
    held at once (``stats`` as in ``kept_per_stage``)."""
    stage_of = {d: k for k, devices in enumerate(stages) for d in devices}
    kept = [0] * len(stages)
    for reg in kept_for_backward(plan):
        if reg.name in stats:
            kept[stage_of[reg.device]] += stats[reg.name]["max_held"] * reg.nbytes
    return kept
