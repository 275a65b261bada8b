"""``actorflow simulate``: the virtual clock makes a run's decisions with a cost model's
durations, the cost model's fit recovers known costs, memory is the plan's, and bad
input is one line and exit 2."""

from __future__ import annotations

import json
import math
import re
import statistics
from collections import defaultdict
from types import SimpleNamespace

import attrs
import numpy as np
import pytest

from actorflow.config import load_config
from actorflow.errors import CompileError
from actorflow.graph.builder import is_shape_only
from actorflow.runtime import Session
from actorflow.runtime.virtual import Host, Timing, meets, simulate
from actorflow.runtime.wiring import wire
from actorflow.simulate import CostModel, Link, calibrate, fit_crowding, layouts, predict
from actorflow.simulate.costs import CalibrationError, fit, flop_rates, shipped
from actorflow.simulate.layouts import Candidate, bound, candidates, predict_layout, search
from actorflow.simulate.predict import Beside, _polled, gil_shares, replayed_orders, step_time, unit_times
from actorflow.trace.metrics import summarize
from actorflow.trace.parse import parse
from actorflow.training import compile_config, report
from actorflow.training.data import dataset, step_feeds
from actorflow.training.parameter_server import run_end
from actorflow.training.runner import local_feeds, with_config
from test_cli import run_cli

STEPS = 3
KNOWN = CostModel(
    ops={"matmul": (4e-6, 2e-11, 1e-11), "relu": (1e-6, 0.0, 3e-11), "bias_add": (1e-6, 0.0, 2e-11)},
    overall=(2e-6, 1e-11, 2e-11),
    launch=3e-6,
    hop=2e-5,
    between=5e-5,
    handover=3e-4,
    model={"kind": "mlp"},
)


def unit_costs(plan, wiring, model) -> list[float]:
    """The seconds an act of each of ``wiring``'s units takes by ``model``."""
    return [cost for cost, _ in unit_times(plan, wiring, model)]


def measured_run(name: str, steps: int = STEPS, order: str = "replay") -> tuple:
    """(config, plan, the Chrome trace of a run of it)."""
    config = load_config(f"configs/{name}.yaml", [f"train.steps={steps}", f"runtime.order={order}"])
    plan = compile_config(config)
    data = dataset(config)
    with Session(plan, trace=True, order=order) as session:
        parts = local_feeds(plan, 0)
        for step in range(steps):
            session.run(step_feeds(config, data, step, parts))
        chrome = session.recorder.to_chrome()
    return config, plan, with_config(chrome, config)


def measured_orders(chrome: dict, wiring) -> tuple[list[list[tuple[str, int]]], list[float]]:
    """Per stream of ``wiring``, the (unit, act) its kernels ran in, in order; per unit,
    its median measured seconds."""
    by_name = {u.name: u for u in wiring.units}
    measured: dict[int, list] = defaultdict(list)
    durations: dict[str, list[float]] = defaultdict(list)
    for s in parse(chrome).spans:
        if s.is_kernel:
            measured[by_name[s.name].stream].append((s.start, s.name, s.args["act"]))
            durations[s.name].append((s.end - s.start) / 1e9)
    orders = [[(n, a) for _, n, a in sorted(measured[s.stream.id])] for s in wiring.streams]
    return orders, [statistics.median(durations[u.name]) for u in wiring.units]


def ran_orders(ran: list) -> list[list[tuple[str, int]]]:
    return [[(e.unit.name, e.acts[0].number) for e in stream] for stream in ran]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["1f1b", "zb1"])
def test_with_the_measured_durations_each_stream_runs_the_measured_order(name):
    config, plan, chrome = measured_run(name)
    wiring = wire(plan, 0, allocate=False)
    measured, costs = measured_orders(chrome, wiring)
    orders, ordered_by = replayed_orders(plan, wiring, config.runtime.order, 1)
    assert ordered_by == "replay"
    ran = simulate(wiring, plan.micro_batches, 1, STEPS, Timing(costs, hop=2e-5), orders)
    assert ran is not None
    for stream, got, want in zip(wiring.streams, ran_orders(ran), measured):
        assert got == want, stream.stream.name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb1"])
def test_a_dynamic_runs_order_is_the_protocols_and_where_timing_decides_nothing_the_simulated(name):
    """Under ``runtime.order: dynamic`` a driver launches, among the units that can act
    when it looks, the first by priority; which can act depends on when other threads'
    completions reached it, so where two become ready within a thread's wake-up of each
    other, the measured order follows the machine's timing (two dynamic 1F1B runs here
    can differ) and no cost model reproduces it act for act. What holds: each stream
    runs the simulated acts; the measured order is one the protocol allows (the virtual
    clock, made to follow it, runs it to the end); and where the priorities decide every
    choice whatever the timing (GPipe: a stage's queued forwards, then its backwards),
    the simulated order with the measured durations is the measured one."""
    config, plan, chrome = measured_run(name, order="dynamic")
    wiring = wire(plan, 0, allocate=False)
    measured, costs = measured_orders(chrome, wiring)
    assert replayed_orders(plan, wiring, config.runtime.order, 1) == (
        None,
        "dynamic: order='dynamic' was asked for",
    )
    ran = simulate(wiring, plan.micro_batches, 1, STEPS, Timing(costs, hop=2e-5))
    assert ran is not None
    simulated = ran_orders(ran)
    for stream, got, want in zip(wiring.streams, simulated, measured):
        assert sorted(got) == sorted(want), stream.stream.name

    def follow(orders: list[list[tuple[str, int]]]) -> list | None:
        again = wire(plan, 0, allocate=False)
        by_name = {u.name: u for u in again.units}
        units = [[by_name[n] for n, _ in acts] for acts in orders]
        return simulate(again, plan.micro_batches, STEPS, 1, Timing(costs, hop=2e-5), units)

    followed = follow(measured)
    assert followed is not None and ran_orders(followed) == measured
    longest = max(range(len(measured)), key=lambda k: len(measured[k]))
    backwards = [acts[::-1] if k == longest else acts for k, acts in enumerate(measured)]
    assert follow(backwards) is None  # an order the protocol does not allow stalls
    if name == "gpipe":
        assert simulated == measured
        ticks = simulate(wire(plan, 0, allocate=False), plan.micro_batches, 1, STEPS)
        assert ticks is not None and ran_orders(ticks) == measured  # whatever the timing


def test_the_fit_recovers_known_costs_per_kind():
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(60):
        f = {
            k: (int(rng.integers(1, 3)), float(rng.integers(1, 9)) * 1e6, float(rng.integers(1, 9)) * 1e5)
            for k in KNOWN.ops
            if rng.random() < 0.7
        }
        if f:
            samples.append((f, KNOWN.seconds(f)))
    ops, _ = fit(samples)
    for kind, costs in KNOWN.ops.items():
        assert ops[kind] == pytest.approx(costs, rel=0.02, abs=1e-13), kind


def test_a_kinds_seconds_a_flop_the_machine_timed_are_held_where_its_acts_cannot_tell_them():
    """A small model's products all have one flops per byte: alone, the fit may split
    their time between the two rates as it likes, and a wider model's product, of far
    more flops per byte, comes out wrong."""
    a, b, c = KNOWN.ops["matmul"]
    small = [{"matmul": (1, 20.0 * x, x)} for x in (1e4, 3e4, 1e5, 3e5)]
    samples = [(f, KNOWN.seconds(f)) for f in small]
    wide = {"matmul": (1, 2e11, 1e8)}
    guessed, overall = fit(samples)
    assert CostModel(guessed, overall).seconds(wide) < 0.6 * KNOWN.seconds(wide)
    held, overall = fit(samples, {"matmul": b})
    assert held["matmul"] == pytest.approx((a, b, c), rel=0.05)
    assert CostModel(held, overall).seconds(wide) == pytest.approx(KNOWN.seconds(wide), rel=1e-3)


def test_the_machines_products_in_a_trace_are_sizes_and_seconds_or_one_line_says_not():
    timed = {"matmul": [[512, 512, 512, 4e-3], [1024, 1024, 1024, 2e-2]]}  # the larger, the faster
    assert flop_rates(timed, "t.json") == {"matmul": pytest.approx(2e-2 / (2 * 1024**3))}
    assert flop_rates({}, "t.json") == {}
    for bad in ({"matmul": [[512, 512, 2e-3]]}, {"matmul": [[0, 512, 512, 2e-3]]}, []):
        with pytest.raises(CalibrationError, match="^t.json: otherData.machine is not this machine's timed"):
            flop_rates(bad, "t.json")


def test_a_run_of_several_steps_overlaps_them_and_pays_the_host_time_between_runs_once():
    """(Without GIL hand-overs: with KNOWN's, the busier threads of overlapped steps wait
    for the GIL longer than the time between runs they save.)"""
    model = attrs.evolve(KNOWN, handover=0.0)

    def predicted(per_run: int):
        config = load_config("configs/default.yaml", ["train.steps=4", f"train.steps_per_run={per_run}"])
        return predict(config, model)

    alone, together = predicted(1), predicted(4)
    assert alone.step_seconds - together.step_seconds >= model.between * 3 / 4
    kernels = [s for s in parse(together.chrome).spans if s.is_kernel]
    first_of_second = min(s.start for s in kernels if s.args["iteration"] == 1)
    assert first_of_second < max(s.end for s in kernels if s.args["iteration"] == 0)


@pytest.mark.timeout(120)
def test_calibrating_on_a_trace_with_known_costs_gives_them_back():
    config = load_config("configs/default.yaml", ["train.steps=4", "train.steps_per_run=2"])  # two runs
    plan = compile_config(config, 1)
    # its kernels run together, so a hand-over in the trace is fitted as launch time (below)
    known = attrs.evolve(KNOWN, handover=0.0)
    made = predict(config, known, plan)
    product = {"matmul": (1, 2.0 * 1024**3, 3 * 1024**2 * 4.0)}
    machine = {"matmul": [[1024, 1024, 1024, known.seconds(product)]]}  # as a run of this machine timed it
    model = calibrate(with_config(made.chrome, config, machine), "synthetic")
    assert model.ops["matmul"][1] == flop_rates(machine, "")["matmul"]
    wiring = wire(plan, 0, allocate=False)
    assert unit_costs(plan, wiring, model) == pytest.approx(unit_costs(plan, wiring, known), rel=0.03)
    assert model.between == pytest.approx(known.between, rel=1e-3)
    assert model.launch == pytest.approx(known.launch, rel=0.05)  # fitted to the step: it takes the costs' 3%
    assert predict(config, model, plan).step_seconds == pytest.approx(made.step_seconds, rel=0.03)
    with_handover = calibrate(with_config(predict(config, KNOWN, plan).chrome, config, machine), "synthetic")
    assert with_handover.launch > KNOWN.launch and with_handover.handover == 0.0


def test_calibrating_on_a_trace_without_a_whole_runs_steps_says_so():
    config = load_config("configs/default.yaml", ["train.steps=4"])
    chrome = with_config(predict(config, KNOWN).chrome, config)
    chrome["traceEvents"] = [e for e in chrome["traceEvents"] if e.get("cat") != "step"]
    with pytest.raises(CalibrationError, match="^t.json: a trace without every step of one run"):
        calibrate(chrome, "t.json")


@pytest.mark.timeout(120)
def test_calibrating_recovers_how_much_kernels_of_one_process_slow_each_other_down():
    known = attrs.evolve(KNOWN, handover=0.0, contention=0.5)
    config = load_config("configs/default.yaml", ["train.steps=4"])
    plan = compile_config(config, 1)
    made = predict(config, known, plan)
    wiring = wire(plan, 0, allocate=False)
    threads = {u.name: u.stream for u in wiring.units}
    beside = Beside.of(parse(made.chrome), threads, known.launch)
    gil = gil_shares(plan, wiring, known)
    assert beside.together() and beside.contention(gil) == pytest.approx(0.5, abs=0.05)
    assert beside.contention() < 0.5  # taking every act as all Python: less contention explains the spans
    model = calibrate(with_config(made.chrome, config), "synthetic")
    # the fit splits a kind's time into its fixed cost (the GIL's) and its rates otherwise
    # than ``known`` does, and the contention then differs; the costs and the step do not
    assert model.contention > 0.0 and model.handover == 0.0
    for got, want in zip(unit_costs(plan, wiring, model), unit_costs(plan, wiring, known)):
        if want > 1e-5:  # a short kernel's few µs blur with its launch's
            assert got == pytest.approx(want, rel=0.03)
    assert predict(config, model, plan).step_seconds == pytest.approx(made.step_seconds, rel=0.03)


def test_crowding_slows_acts_only_where_more_than_two_of_a_process_run_at_once():
    def step(name: str, crowding: float, *sets: str) -> float:
        config = load_config(f"configs/{name}.yaml", ["train.steps=2", *sets])
        return predict(config, attrs.evolve(KNOWN, contention=0.5, crowding=crowding)).step_seconds

    one = "parallel.stages=[cpu:0]"  # a compute stream and its copy stream: at most one beside
    assert step("default", 0.0, one) == step("default", 1.0, one)
    assert step("2x2", 0.0) < step("2x2", 0.5) < step("2x2", 1.0)  # four compute streams


@pytest.mark.timeout(120)
def test_fitting_crowding_on_a_run_of_four_devices_gives_it_back():
    known = attrs.evolve(KNOWN, handover=0.0, contention=0.5, crowding=0.6)
    config = load_config("configs/2x2.yaml", ["train.steps=4"])
    made = predict(config, known)
    model = fit_crowding(attrs.evolve(known, crowding=0.0), with_config(made.chrome, config), "t.json")
    assert model.crowding == pytest.approx(0.6, abs=0.05)
    assert attrs.evolve(model, crowding=0.0) == attrs.evolve(known, crowding=0.0)
    assert predict(config, model).step_seconds == pytest.approx(made.step_seconds, rel=0.01)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "field, value",
    [
        ("launch", math.nan),
        ("hop", math.inf),
        ("between", -1.0),
        ("contention", math.inf),
        ("node", math.nan),
    ],
)
def test_a_calibration_of_a_time_not_finite_is_refused(field, value):
    data = json.loads(shipped("mlp").to_json())
    if field == "node":
        data["node"]["alpha"] = value
    else:
        data[field] = value
    with pytest.raises(CalibrationError, match="^c.json: not a calibration file .*not finite"):
        CostModel.from_json(json.dumps(data), "c.json")


def test_crowding_from_the_command_line_is_fitted_saved_and_checked(capsys, tmp_path, calibration):
    def trace(name: str) -> str:
        config = load_config(f"configs/{name}.yaml", ["train.steps=2"])
        known = attrs.evolve(KNOWN, contention=0.5, crowding=0.6, model={"kind": config.model.kind})
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(with_config(predict(config, known).chrome, config)))
        return str(path)

    saved = tmp_path / "cal.json"
    args = ["simulate", "configs/2x2.yaml", "--steps", "2", "--calibrate", calibration, "--crowding"]
    code, out, err = run_cli(capsys, *args, trace("2x2"), "--save-calibration", str(saved))
    assert code == 0, err
    assert CostModel.from_json(saved.read_text(), "saved").crowding > 0.3
    wrong = [
        (trace("default"), "says nothing of crowding"),
        (trace("transformer"), "a run of a transformer model"),
        (calibration, "not a trace of actorflow run --trace"),
    ]
    for path, says in wrong:
        code, out, err = run_cli(capsys, *args, path)
        assert code == 2 and out == ""
        assert len(err.strip().splitlines()) == 1 and says in err, err


def test_a_kernels_time_alone_is_its_span_less_what_it_lost_beside_other_threads_acts():
    us = 1000  # the trace's nanoseconds

    def kernel(name: str, start: int, end: int) -> SimpleNamespace:
        return SimpleNamespace(name=name, start=start * us, end=end * us, is_kernel=True)

    # thread 0 runs a over 0-100 µs; thread 1 launches b at 40 (10 µs) and runs it over 50-150
    trace = SimpleNamespace(spans=[kernel("a", 0, 100), kernel("b", 50, 150)])
    beside = Beside.of(trace, {"a": 0, "b": 1}, launch=10e-6)
    assert beside.seconds * 1e6 == pytest.approx(np.array([[40, 60], [50, 50]]))
    assert beside.work(1.0) * 1e6 == pytest.approx([40 + 60 / 2, 50 + 50 / 2])
    assert beside.work(1.0, {"a": 0.5, "b": 0.0}) * 1e6 == pytest.approx([40 + 60 / 1.5, 100])
    assert beside.together() and not Beside.of(trace, {"a": 0, "b": 0}, 10e-6).together()


def one_step(name: str) -> tuple:
    """(plan, wiring, its streams' replayed orders, its units' costs by ``KNOWN``) of a
    one-step run of ``configs/NAME.yaml``."""
    config = load_config(f"configs/{name}.yaml", ["train.steps=1"])
    plan = compile_config(config, 1)
    wiring = wire(plan, 0, allocate=False)
    orders, _ = replayed_orders(plan, wiring, config.runtime.order, 1)
    return plan, wiring, orders, unit_costs(plan, wiring, KNOWN)


def test_acts_of_one_process_slow_each_other_down_and_of_two_processes_do_not_unless_polled():
    plan, wiring, orders, costs = one_step("default")

    def makespan(processes: list[int], contention: float, polled: frozenset[int] = frozenset()) -> float:
        host = Host(processes, [0] * len(processes), 64, 0.0, contention, polled)
        ran = simulate(wiring, plan.micro_batches, 1, 1, Timing(costs, KNOWN.launch, host=host), orders)
        assert ran is not None
        return max(e.end for stream in ran for e in stream)

    one, two = [0] * len(wiring.streams), list(range(len(wiring.streams)))
    assert makespan(one, 0.5) > makespan(one, 0.1) > makespan(one, 0.0)
    assert makespan(two, 0.5) == pytest.approx(makespan(two, 0.0), rel=1e-9)
    # a rank's transport thread polls beside its streams: alone, an act there runs beside it
    assert makespan(two, 0.5, frozenset(two)) > makespan(two, 0.5)
    assert makespan(two, 0.5, frozenset(two)) == pytest.approx(makespan(one, 0.5, frozenset([0])), rel=1e-9)


def test_stream_threads_share_the_cores_and_wait_for_the_gil():
    plan, wiring, orders, costs = one_step("2x2")
    streams = len(wiring.streams)

    def run(cores: int, handover: float) -> list:
        host = Host([0] * streams, [0] * streams, cores, handover)
        ran = simulate(
            wiring, plan.micro_batches, 1, 1, Timing(costs, launch=KNOWN.launch, host=host), orders
        )
        assert ran is not None
        return [e for stream in ran for e in stream]

    def makespan(entries: list) -> float:
        return max(e.end for e in entries)

    work = sum(costs[e.unit.id] + KNOWN.launch for e in run(64, 0.0))
    one_core = run(1, 0.0)
    assert makespan(one_core) == pytest.approx(work, rel=1e-6)  # every act waits for the one core
    assert makespan(one_core) > makespan(run(2, 0.0)) > makespan(run(64, 0.0))
    # a woken thread waits for the GIL while another runs back to back, and gets it when
    # that one goes idle, long before a hand-over of a second
    assert makespan(run(64, 0.0)) < makespan(run(64, 1.0)) < 0.1


def test_a_kernel_starts_where_its_launch_ends_at_the_rates_it_got_and_runs_no_faster_than_a_core():
    plan, wiring, orders, costs = one_step("2x2")
    streams = len(wiring.streams)
    launch = 20e-6  # long against the short kernels, so that rates change within launches
    host = Host([0] * streams, [0] * streams, 2, 0.0, contention=4.0)
    ran = simulate(wiring, plan.micro_batches, 1, 1, Timing(costs, launch, host=host), orders)
    assert ran is not None
    for stream in ran:
        for before, entry in zip([None, *stream], stream):
            launched = 0.0 if before is None else before.end
            assert entry.start - launched >= launch * (1 - 1e-9)
            assert entry.end - entry.start >= costs[entry.unit.id] * (1 - 1e-9)


@pytest.mark.parametrize("handover", [0.0, 3e-4, 1.0])
def test_each_run_starts_when_the_last_acts_ended_whatever_the_gil_waits_left_pending(handover):
    config = load_config("configs/default.yaml", ["train.steps=1"])
    plan = compile_config(config, 1)

    def makespan(runs: int) -> float:
        wiring = wire(plan, 0, allocate=False)
        orders, _ = replayed_orders(plan, wiring, config.runtime.order, 1)
        host = Host([0] * len(wiring.streams), [0] * len(wiring.streams), 2, handover)
        timing = Timing(unit_costs(plan, wiring, KNOWN), KNOWN.launch, host=host)
        ran = simulate(wiring, plan.micro_batches, 1, runs, timing, orders)
        assert ran is not None
        return max(e.end for stream in ran for e in stream)

    assert makespan(4) == pytest.approx(4 * makespan(1), rel=1e-9)


@pytest.mark.parametrize(
    ("name", "ranks", "cores", "polled"),
    [
        ("default", 2, 2, set()),
        ("2x2", 2, 2, set()),
        ("2x2", 2, 6, set()),
        ("2x2", 4, 4, set()),
        ("2x2", 4, 2, {0, 1, 2, 3}),
    ],
)
def test_a_rank_whose_compute_stream_rides_its_sends_has_no_thread_polling_beside_it(
    name, ranks, cores, polled
):
    """As the runtime decides (``program.rider``, ``Transport.stays``): a rank whose
    compute stream rides its transfers waits for them in MPI with no transport thread
    polling beside its kernels; a rider polls itself where its node has fewer cores than
    ranks. Beside another compute stream of its rank (two devices a rank) with no core
    to spare it polls with back-off while that one computes, too seldom to count."""
    config = load_config(f"configs/{name}.yaml", ["train.steps=2"])
    plan = compile_config(config, ranks)
    wiring = wire(plan, None, allocate=False)
    assert _polled(config, plan, wiring, [0] * ranks, cores) == polled


@pytest.mark.parametrize(("name", "ranks"), [("default", 2), ("2x2", 2), ("2x2", 4)])
def test_over_ranks_each_send_and_its_receive_end_together_after_the_transfer(name, ranks):
    config = load_config(f"configs/{name}.yaml", ["train.steps=2"])
    plan = compile_config(config, ranks)
    wiring = wire(plan, None, allocate=False)
    halves = meets(plan, wiring)
    costs = unit_costs(plan, wiring, KNOWN)
    assert {u.actor.kind for u in wiring.units if u.id in halves} == {"send", "recv"}
    ran = simulate(wiring, plan.micro_batches, 2, 1, Timing(costs, meets=halves))
    assert ran is not None
    pairs = defaultdict(list)
    for e in (e for stream in ran for e in stream if e.unit.id in halves):
        pairs[(halves[e.unit.id], e.acts[0].number)].append(e)
    assert pairs and all(len(p) == 2 for p in pairs.values())
    for send, recv in pairs.values():
        assert send.end == recv.end == max(send.start, recv.start) + costs[send.unit.id]
    one = predict(config, KNOWN, ranks=1).step_seconds
    assert (
        predict(config, attrs.evolve(KNOWN, transport=Link(1e-3, 1e9)), ranks=ranks).step_seconds > one + 1e-3
    )


@pytest.mark.parametrize("name", ["2x2", "transformer"])
def test_a_plan_of_shape_only_parameters_is_the_plan_and_holds_no_values(name):
    config = load_config(f"configs/{name}.yaml", ["train.optimizer.shard=true"] if name == "2x2" else [])
    real, shaped = compile_config(config, 1), compile_config(config, 1, values=False)
    assert [(a.name, a.inputs, a.outputs) for a in shaped.actors] == [
        (a.name, a.inputs, a.outputs) for a in real.actors
    ]
    assert shaped.memory == real.memory
    assert all(p.value.shape == q.value.shape for p, q in zip(shaped.parameters, real.parameters))
    assert (
        sum(p.value.nbytes for p in shaped.parameters if not is_shape_only(p.value)) < 2**16
    )  # biases, gains


@pytest.mark.parametrize(
    "name, sets",
    [
        ("2x2", []),  # tensor parallel: all-reduces
        (  # a data-parallel replica's gradients reduce-scattered, fused, its parameters gathered
            "default",
            [
                "parallel.stages=[[cpu:0, cpu:1]]",
                "parallel.data_parallel=2",
                "train.optimizer.shard=true",
                "train.optimizer.shard_threshold_kb=0",
            ],
        ),
    ],
)
def test_a_collective_costs_what_the_compilers_ring_model_moves(name, sets):
    """Each collective's act, over one level of links, is its ring's messages times alpha
    plus the bytes the compiler's link model says it moves (``Collective.nbytes``, all
    participants together) over the bandwidth: a fused all-reduce counts its members'
    inputs once, a reduce-scatter its whole input, a gather its shard."""
    config = load_config(f"configs/{name}.yaml", [*sets, "train.steps=1"])
    plan = compile_config(config, ranks=1)
    wiring = wire(plan, None, allocate=False)
    alpha, bandwidth = 1e-3, 1e6
    model = attrs.evolve(KNOWN, node=Link(alpha, bandwidth))
    costs = unit_costs(plan, wiring, model)
    of_actor = {a: c for c in plan.collectives for a in c.actors}
    ops = set()
    for unit, seconds in zip(wiring.units, costs):
        if unit.actor.kind != "collective":
            continue
        coll = of_actor[unit.actor.id]
        n = len(coll.actors)
        rounds = 2 * (n - 1) if coll.op == "all_reduce" else n - 1
        want = rounds * alpha + coll.nbytes / n / bandwidth
        assert seconds == pytest.approx(want, rel=1e-9), (unit.actor.name, coll.op)
        ops.add(coll.op)
    assert ops, "the plan should hold collectives"


def test_a_layout_is_one_replica_with_the_data_parallel_all_reduce_charged():
    config = load_config("configs/transformer.yaml", ["train.steps=2", "parallel.micro_batches=4"])
    replica, one = predict_layout(config, KNOWN, (1, 2, 2))
    assert replica.parallel.data_parallel == 1 and replica.train.batch_size == 32
    half, two = predict_layout(config, KNOWN, (2, 2, 2))
    assert half.train.batch_size == 16 and two.step_seconds < one.step_seconds  # half the batch a replica
    slow = attrs.evolve(KNOWN, network=Link(1e-3, 1e6), node_size=2)
    assert predict_layout(config, slow, (2, 2, 2))[1].step_seconds > two.step_seconds + 1e-3


@pytest.mark.long
@pytest.mark.parametrize("contention", [0.0, 2.0])
def test_the_layouts_search_finds_what_predicting_every_layout_finds_and_clocks_fewer(
    monkeypatch, contention
):
    model = attrs.evolve(KNOWN, contention=contention)
    config = load_config(
        "configs/default.yaml",
        ["train.steps=2", "model.sizes=[1024,1024,1024,1024,10]", "runtime.max_memory=60000000"],
    )
    fits, refused = [], 0
    for replica, layout, m, schedule in candidates(config, 8):
        try:
            _, prediction = predict_layout(config, model, layout, m, schedule)
        except CompileError:  # over max_memory
            refused += 1
            continue
        _, seconds = layouts.one_device(replica, model)
        assert bound(seconds, layout[1], layout[2], model, run_end(replica, 0)) <= prediction.step_seconds
        fits.append(
            Candidate(layout, m, schedule, prediction.step_seconds, max(prediction.result.memory.values()))
        )
    assert refused and fits
    clocked = []
    monkeypatch.setattr(layouts, "step_time", lambda *a, **k: clocked.append(a) or step_time(*a, **k))
    assert search(config, 8, model, keep=4) == sorted(fits, key=lambda c: c.step_seconds)[:4]
    assert 4 <= len(clocked) < len(fits)  # the bound leaves out the slowest layouts unclocked


def test_the_layouts_search_over_worker_processes_finds_what_it_finds_here():
    """Two processes clock candidates ahead of the bound; the answer is the same."""
    config = load_config(
        "configs/default.yaml",
        ["train.steps=2", "model.sizes=[1024,1024,1024,1024,10]", "runtime.max_memory=60000000"],
    )
    here = search(config, 8, KNOWN, keep=3)
    assert len(here) == 3
    assert search(config, 8, KNOWN, keep=3, workers=2) == here


@pytest.mark.parametrize("name", ["default", "gpipe", "2x2", "transformer"])
def test_predicted_memory_is_the_plans(name):
    config = load_config(f"configs/{name}.yaml", ["train.steps=2"])
    plan = compile_config(config, 1)
    result = predict(config, KNOWN, plan).result
    assert result.predicted
    assert result.memory == plan.memory
    assert all(result.held_memory[d] <= planned for d, planned in plan.memory.items())
    assert all(0 < peak <= quota for peak, quota in zip(result.peak_activations, result.activation_quotas))


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "cal.json"
    path.write_text(KNOWN.to_json())
    return str(path)


@pytest.mark.timeout(120)
def test_simulate_prints_the_run_report_marked_predicted_and_writes_metrics_and_trace(
    capsys, tmp_path, calibration
):
    metrics, trace = tmp_path / "m.json", tmp_path / "t.json"
    code, out, err = run_cli(
        capsys,
        "simulate",
        "configs/zb1.yaml",
        "--calibrate",
        calibration,
        "--steps",
        "5",
        "--metrics",
        str(metrics),
        "--trace",
        str(trace),
    )
    assert code == 0, err
    assert out.startswith("predicted (simulated, no kernel run): 5 steps of 256 samples")
    assert "bubble" in out and "critical path" in out and "MiB planned" in out
    data = json.loads(metrics.read_text())
    assert data["predicted"] is True and len(data["stages"]) == 2
    assert parse(json.loads(trace.read_text())).spans


def test_a_layout_prints_what_all_its_replicas_make_together(capsys, calibration):
    """The report is one replica's (its share of the batch); the line above it says what
    the whole layout makes, so a large model's layout is not read as a fraction of a
    sample a second."""
    code, out, err = run_cli(
        capsys, "simulate", "configs/default.yaml", "--calibrate", calibration, "--layout", "2,1,2"
    )
    assert code == 0, err
    together = re.search(r"all 2 together: 256 samples a step, ([\d,]+) samples/s", out)
    replica = re.search(r"steps of 128 samples in [\d.]+ s: ([\d,]+) samples/s; step time ([\d.]+) ms", out)
    assert together and replica, out
    assert int(together[1].replace(",", "")) == pytest.approx(256 / (float(replica[2]) / 1e3), rel=1e-3)
    assert int(together[1].replace(",", "")) == pytest.approx(2 * int(replica[1].replace(",", "")), abs=2)


def test_a_predictions_kernel_seconds_a_step_are_its_simulated_steps_whatever_the_steps_asked():
    """The few simulated steps stand for all: their busy time is divided by their own
    number, not by the run's steps (it was: 30 steps gave 0.44 ms a stage, 100 gave 0.13)."""
    results = {}
    for steps in (8, 40):
        config = load_config("configs/default.yaml", [f"train.steps={steps}"])
        prediction = predict(config, KNOWN)
        results[steps] = result = prediction.result
        simulated = sum(s.category == "step" for s in parse(prediction.chrome).spans)
        assert result.bubble_steps == simulated < steps
        busy = [b.busy_s for b in summarize(prediction.chrome, ["cpu:0", "cpu:1"]).stages]
        assert result.kernel_seconds == pytest.approx([b / simulated for b in busy], rel=1e-9)
    assert results[8].kernel_seconds == pytest.approx(results[40].kernel_seconds, rel=1e-9)
    shown = report.table(load_config("configs/default.yaml", ["train.steps=40"]), results[40])
    assert "bubbles and kernel times of 4 simulated steps, which the 40 repeat" in shown


@pytest.mark.parametrize("name", ["default", "transformer"])
def test_without_calibrate_the_calibration_shipped_for_the_model_is_used(capsys, name):
    config = load_config(f"configs/{name}.yaml", [])
    model = shipped(config.model.kind)
    assert model.model["kind"] == config.model.kind and model.ops and model.cores == 2
    code, out, err = run_cli(capsys, "simulate", f"configs/{name}.yaml", "--steps", "2")
    assert code == 0, err
    assert "the calibration shipped for the" in err and "2-core VM" in err
    step = predict(load_config(f"configs/{name}.yaml", ["train.steps=2"]), model).step_seconds
    assert f"step time {step * 1e3:.3f} ms" in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--layout", "2,2"], "--layout: expected D,T,P"),
        (["--layout", "1,1,9"], "parallel.stages"),
        (["--layouts", "7"], "--layouts: no layout of 7 devices"),
        (["--calibrate-corrupt"], "not a calibration file"),
        (["--calibrate-negative"], "a time, contention or crowding that is negative"),
        (["--calibrate-unreadable"], "cannot read a calibration"),
        (["--other-model"], "fitted on a transformer model"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, calibration, args, says):
    path = calibration
    if args == ["--calibrate-corrupt"]:
        path, args = str(tmp_path / "c.json"), []
        (tmp_path / "c.json").write_text(json.dumps({"format": "actorflow-calibration/1", "ops": 3}))
    elif args == ["--calibrate-negative"]:
        path, args = str(tmp_path / "c.json"), []
        (tmp_path / "c.json").write_text(attrs.evolve(KNOWN, contention=-1.0).to_json())
    elif args == ["--calibrate-unreadable"]:
        path, args = str(tmp_path / "c.json"), []
        (tmp_path / "c.json").write_text('{"ops": ')
    elif args == ["--other-model"]:
        path, args = str(tmp_path / "c.json"), []
        (tmp_path / "c.json").write_text(
            CostModel(KNOWN.ops, KNOWN.overall, model={"kind": "transformer"}).to_json()
        )
    code, out, err = run_cli(capsys, "simulate", "configs/default.yaml", "--calibrate", path, *args)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and says in err, err
