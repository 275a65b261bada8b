"""The runtime on ``cuda:`` devices (CuPy): ``pytest -m gpu`` on a machine with a GPU.

Where CuPy or a GPU is missing, every test marked ``gpu`` skips with the reason
``actorflow.runtime.cuda.unavailable()`` gives, so a CI run without a GPU stays green;
one test, not marked, runs only there: a ``cuda:`` device is then a ``DeviceError``
naming the extra to install, when the Runtime opens.

On the GPU (several logical devices share it, so every multi-device shape runs on one):

1. the property tests' random graphs (``graph_strategies``), their devices made
   ``cuda:``, compiled with random quotas (``test_properties.compile_random``), compute
   what the CPU backend computes, in both orders; micro-batched training pipelined over
   random stages too;
2. quotas are counted and kept: the runtime's count of buffers held never passes a
   register's quota, and the kernels reading a register see no more distinct buffers than
   its quota, the same ones run after run (allocated once);
3. every kernel runs with CuPy's current stream set to its actor's stream, on its GPU;
4. events order what they must: a reader on another stream waits for a producer's slow
   write (read after write), a producer waits for a slow reader before writing the buffer
   again (write after read), a kernel waits for every input; and a mixed plan (``cpu:``
   and ``cuda:``) moves through its copies;
5. the shipped configs train on ``cuda:`` devices as on ``cpu:`` ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import actorflow as af
import cuda_support as cs
import graph_strategies as gs
import userfns
from actorflow.arrays import to_host
from actorflow.config import load_config
from actorflow.training import train
from test_properties import SETTINGS, check_outputs, compile_random, live, tolerances

ORDER_NAMES = ["replay", "dynamic"]


def gpu(test):
    """A GPU test: marked ``gpu`` (``pytest -m gpu``), skipped with the reason where CUDA
    is not usable. (Not a module-level ``pytestmark``: the DeviceError test at the end
    runs exactly where these skip.)"""
    return pytest.mark.gpu(pytest.mark.skipif(cs.UNAVAILABLE is not None, reason=str(cs.UNAVAILABLE))(test))


def cupy():
    assert cs.cuda is not None
    return cs.cuda.import_cupy()


def gpu_of(device: str) -> int:
    """The GPU a logical ``cuda:N`` runs on: the process's current one, for every N."""
    return cupy().cuda.Device().id


def check_quotas(plan: af.Plan, stats: dict[str, dict[str, int]]) -> None:
    """The runtime counted every produced register, and none held more than its quota."""
    produced = {r.name: r.quota for r in plan.registers if not r.is_parameter}
    assert {name: s["quota"] for name, s in stats.items()} == produced
    for name, s in stats.items():
        assert 0 <= s["max_held"] <= s["quota"], (name, s)
    if produced:
        assert max(s["max_held"] for s in stats.values()) >= 1


def actor_running(plan: af.Plan, fn) -> af.plan.Actor:
    """The actor whose act runs the user kernel ``fn``, alone or in a fused chain."""
    (actor,) = [a for a in plan.actors for _, attrs in a.kernels() if attrs.get("fn") is fn]
    return actor


# --------------------------------------------------------------------------------------
# 1. random graphs compute what the CPU backend computes
# --------------------------------------------------------------------------------------


@gpu
@pytest.mark.timeout(300)
@settings(max_examples=15, **SETTINGS)
@given(st.data())
def test_random_graphs_on_cuda_compute_what_the_cpu_backend_computes(data):
    """On 1-3 logical cuda devices, with random quotas, fusion and priorities: every
    output of every iteration is the CPU backend's (to float tolerance) and the float64
    numpy evaluator's, a numpy array of its dtype, in both orders; the parameters are
    untouched and the quotas kept."""
    recipe = cs.without_probes(data.draw(gs.recipes(max_devices=3), label="recipe"))
    on_gpu = cs.on_cuda(recipe)
    plan = compile_random(data, on_gpu)
    n = data.draw(st.integers(1, 4), label="iterations")
    feeds = gs.make_feeds(recipe, n, data.draw(st.integers(0, 2**16), label="feed seed"))
    event(f"{len(recipe.devices)} devices, {recipe.dtype}")

    cpu_plan = af.compile(gs.build(recipe)[0])
    with af.Session(cpu_plan, stall_timeout=20) as s:
        want = s.run(live(cpu_plan, feeds))
    rtol, atol = tolerances(recipe)
    for order in ORDER_NAMES:
        with af.Session(plan, stall_timeout=20, order=order) as s:
            got = s.run(live(plan, feeds))
            again = s.run(live(plan, feeds[::-1]))  # the same session again: nothing leaks
            params = {name: to_host(v) for name, v in s.parameters().items()}
            stats = s.register_stats()
        check_outputs(on_gpu, feeds, got)
        check_outputs(on_gpu, feeds[::-1], again)
        for it, (g, w) in enumerate(zip(got, want)):
            for name, value in w.items():
                np.testing.assert_allclose(
                    g[name], value, rtol=rtol, atol=atol, err_msg=f"{order}: iteration {it}, output {name!r}"
                )
        for p in plan.parameters:
            np.testing.assert_array_equal(params[p.name], p.value)
        check_quotas(plan, stats)


@gpu
@pytest.mark.timeout(300)
@settings(max_examples=8, **SETTINGS)
@given(st.data())
def test_random_micro_batched_training_on_cuda_equals_the_cpu_backend(data):
    """Dense networks pipelined over 1-3 cuda stages, m micro-batches a step, steps
    overlapping in one run: each micro-batch's loss and the trained parameters are the
    CPU backend's and numpy's (float64), and the quotas kept."""
    recipe = data.draw(gs.training_recipes(), label="recipe")
    options = dict(
        quota=data.draw(st.sampled_from([1, 2, 3]), label="quota"),
        priority=data.draw(st.booleans(), label="priority"),
        micro_batches=recipe.micro_batches,
        schedule=recipe.schedule,
    )
    order = data.draw(st.sampled_from(ORDER_NAMES), label="order")
    event(f"{len(recipe.stages)} stages, {recipe.micro_batches} micro-batches, {order}")
    batches = gs.training_batches(recipe)
    feeds = gs.micro_batch_feeds(recipe, batches)
    runs = []
    for r in (recipe, cs.training_on_cuda(recipe)):
        plan = af.compile(gs.build_training(r), stages=list(r.stages) if r.schedule else None, **options)
        with af.Session(plan, stall_timeout=20, order=order) as s:
            losses = [float(o["loss"]) for o in s.run(feeds)]
            params = {name: to_host(v) for name, v in s.parameters().items()}
            check_quotas(plan, s.register_stats())
        runs.append((losses, params))
    (cpu_losses, cpu_params), (losses, params) = runs
    want, want_losses = gs.train_reference(recipe, batches)
    np.testing.assert_allclose(losses, cpu_losses, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-9, atol=1e-12)
    for name, value in want.items():
        np.testing.assert_allclose(params[name], cpu_params[name], rtol=1e-7, atol=1e-10, err_msg=name)
        np.testing.assert_allclose(params[name], value, rtol=1e-7, atol=1e-10, err_msg=name)


# --------------------------------------------------------------------------------------
# 2. quotas counted
# --------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("order", ORDER_NAMES)
@pytest.mark.parametrize("q", [1, 2, 3])
def test_quotas_on_cuda_are_counted_and_kept(q, order):
    """p (cuda:0) is read by a recorder there and copied to k (cuda:1), which a recorder
    and a slow kernel read. Over two runs of 2q + 3 iterations: each recorder saw at most
    q distinct buffers of the register it reads, the same in both runs (registers are
    allocated once, on the GPU, and kernels get them, not copies); the runtime's count
    never passed a quota, and under the drivers the slow reader made the copy use every
    credit (the host learns a credit back when the GPU is done, not sooner)."""
    shape = (256, 256)
    with af.Graph() as g:
        x = af.placeholder("x", shape, "float32", "cuda:0")
        p = af.ops.relu(x, name="p")
        af.output("a", af.ops.call(cs.record0, p, shape=shape, name="read_p"))
        k = af.ops.to_device(p, "cuda:1", name="k")
        af.output("b", af.ops.call(cs.record1, k, shape=shape, name="read_k"))
        af.output("y", af.ops.call(cs.slow_double, k, shape=shape, name="slow"))
    plan = af.compile(g, quota=q, fuse_kernels=False)
    n = 2 * q + 3
    feeds = [{"x": np.full(shape, i - 1.5, np.float32)} for i in range(n)]
    cs.reset_seen()
    with af.Session(plan, stall_timeout=20, order=order) as s:
        runs = [s.run(feeds) for _ in range(2)]
        stats = s.register_stats()
    for outs in runs:
        for i, out in enumerate(outs):
            v = max(i - 1.5, 0.0)
            for name, want in (("a", v), ("b", v), ("y", 2 * v)):
                np.testing.assert_array_equal(out[name], np.full(shape, want, np.float32), err_msg=name)
    check_quotas(plan, stats)
    if order == "dynamic":
        assert stats["k"] == {"quota": q, "max_held": q}, stats
    for k, (reader, device) in enumerate([("read_p", "cuda:0"), ("read_k", "cuda:1")]):
        seen = cs.SEEN[k]
        assert len(seen) == 2 * n, reader
        assert {s.module for s in seen} == {"cupy"}
        assert {s.array_device for s in seen} == {gpu_of(device)}
        first, second = ({s.data for s in seen[r * n : (r + 1) * n]} for r in range(2))
        assert 1 <= len(first | second) <= q, f"{reader} saw {len(first | second)} buffers, quota {q}"
        assert first == second, f"{reader}: the second run read other buffers than the first"


# --------------------------------------------------------------------------------------
# 3. every kernel on its stream
# --------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("order", ORDER_NAMES)
async def test_every_kernel_runs_on_its_actors_cuda_stream(order):
    """Recording kernels on cuda:0, 1 and 2, before and after copies and an all-reduce:
    each saw CuPy's current stream be the CUDA stream of its actor's plan stream
    (``rt.device_stream``), its GPU current, and a CuPy array on that GPU. Every compute,
    copy and collective stream of the plan is a CUDA stream of its own, none the legacy
    default stream."""
    shape = (64, 64)
    devices = ["cuda:0", "cuda:1", "cuda:2"]
    with af.Graph() as g:
        x = af.placeholder("x", shape, "float32", "cuda:0")
        h = [af.ops.call(cs.record0, af.ops.tanh(x), shape=shape, name="h0")]
        for k, d in enumerate(devices[1:], start=1):
            h.append(af.ops.call(cs.RECORDERS[k], af.ops.to_device(h[-1], d), shape=shape, name=f"h{k}"))
        reduced = af.ops.all_reduce(h, op="sum", name="ar")
        for k, r in enumerate(reduced):
            af.output(f"y{k}", af.ops.call(cs.RECORDERS[3 + k], r, shape=shape, name=f"after{k}"))
    plan = af.compile(g, quota=2)
    assert {s.kind for s in plan.streams} >= {"compute", "copy", "collective"}
    n = 4
    feeds = [{"x": np.full(shape, i / 10, np.float32)} for i in range(n)]
    cs.reset_seen()
    async with af.Runtime(plan, order=order, stall_timeout=20) as rt:
        outs = await rt.run(feeds)
        streams = {s.name: rt.device_stream(s.name) for s in plan.streams}
    for i, out in enumerate(outs):
        for k in range(3):
            np.testing.assert_allclose(
                out[f"y{k}"], 3 * np.tanh(np.full(shape, i / 10)), rtol=1e-5, atol=1e-6
            )

    for name, stream in streams.items():
        assert stream is not None, f"{name} has no CUDA stream"
        assert stream.ptr != 0, f"{name} is the legacy default stream"
    handles = [stream.ptr for stream in streams.values()]
    assert len(set(handles)) == len(handles), streams
    for k, fn in enumerate(cs.RECORDERS):
        actor = actor_running(plan, fn)
        stream = plan.streams[actor.stream]
        assert stream.kind == "compute", stream
        seen = cs.SEEN[k]
        assert len(seen) == n, actor.name
        assert {s.stream for s in seen} == {streams[stream.name].ptr}, (actor.name, stream.name)
        assert {s.module for s in seen} == {"cupy"}
        assert {s.device for s in seen} == {s.array_device for s in seen} == {gpu_of(actor.device)}


# --------------------------------------------------------------------------------------
# 4. events order what they must
# --------------------------------------------------------------------------------------


def _read_after_slow_write(slow: str):
    """x (cuda:0) -> p = x + 1 -> copy to cuda:1 -> y = 2 p; ``slow``: which of the
    producer and the reader spends milliseconds of GPU time first."""
    shape = (512, 512)
    with af.Graph() as g:
        x = af.placeholder("x", shape, "float32", "cuda:0")
        p = af.ops.call(cs.slow_add_one if slow == "producer" else cs.add_one, x, shape=shape, name="p")
        k = af.ops.to_device(p, "cuda:1", name="k")
        fn = cs.slow_double if slow == "reader" else userfns.double
        af.output("y", af.ops.call(fn, k, shape=shape, name="reader"))
    feeds = [{"x": np.full(shape, float(i), np.float32)} for i in range(6)]
    return g, feeds, [{"y": 2 * (f["x"] + 1)} for f in feeds]


def _every_input():
    """A kernel on cuda:1 reads a feed and the copies of two slow results of cuda:0."""
    shape = (256, 64)
    with af.Graph() as g:
        x0 = af.placeholder("x0", shape, "float32", "cuda:0")
        x1 = af.placeholder("x1", shape, "float32", "cuda:1")
        a = af.ops.call(cs.slow_add_one, af.ops.relu(x0), shape=shape)
        b = af.ops.call(cs.slow_double, af.ops.tanh(x0), shape=shape)
        y = af.ops.concat([x1, af.ops.to_device(a, "cuda:1"), af.ops.to_device(b, "cuda:1")])
        af.output("y", af.ops.to_device(y, "cuda:2"))
    feeds = [
        {"x0": np.full(shape, i - 2.5, np.float32), "x1": np.full(shape, float(i), np.float32)}
        for i in range(6)
    ]
    wants = [
        {"y": np.concatenate([f["x1"], np.maximum(f["x0"], 0) + 1, 2 * np.tanh(f["x0"].astype(np.float64))])}
        for f in feeds
    ]
    return g, feeds, wants


def _implied():
    """On cuda:1, add(x, tanh(x)) reads the copy x of a slow result both directly and
    through tanh (an edge the compiler may leave to the other's wait)."""
    shape = (256, 64)
    with af.Graph() as g:
        x0 = af.placeholder("x", shape, "float32", "cuda:0")
        a = af.ops.call(cs.slow_add_one, af.ops.relu(x0), shape=shape)
        x = af.ops.to_device(a, "cuda:1")
        af.output("y", af.ops.add(x, af.ops.tanh(x)))
    feeds = [{"x": np.full(shape, (i - 2) / 3, np.float32)} for i in range(6)]
    wants = []
    for f in feeds:
        v = np.maximum(f["x"].astype(np.float64), 0) + 1
        wants.append({"y": v + np.tanh(v)})
    return g, feeds, wants


EVENT_GRAPHS = {
    "read after a slow write": lambda: _read_after_slow_write("producer"),
    "write after a slow read": lambda: _read_after_slow_write("reader"),
    "every input": _every_input,
    "implied": _implied,
}


@gpu
@pytest.mark.parametrize("order", ORDER_NAMES)
@pytest.mark.parametrize("quota", [1, 2])
@pytest.mark.parametrize("graph", list(EVENT_GRAPHS))
def test_events_order_what_they_must(graph, quota, order):
    """Each iteration's feed differs, and the slow kernels (milliseconds of matmuls on the
    GPU before they write or read) leave a reader that does not wait for its producer's
    event a stale or half-written buffer, and a producer that does not wait for its
    readers to be done a buffer still being read: every iteration's result is right."""
    g, feeds, wants = EVENT_GRAPHS[graph]()
    plan = af.compile(g, quota=quota)
    with af.Session(plan, stall_timeout=20, order=order) as s:
        outs = s.run(feeds)
    for i, (out, want) in enumerate(zip(outs, wants)):
        for name, value in want.items():
            np.testing.assert_allclose(out[name], value, rtol=1e-5, atol=1e-6, err_msg=f"iteration {i}")


@gpu
@pytest.mark.parametrize("order", ORDER_NAMES)
async def test_a_mixed_plan_moves_between_cpu_and_cuda_devices_through_copies(order):
    """cpu:0 -> cuda:0 -> cpu:1 through copies, with a parameter on cuda:0 and fetches from
    cuda:0 and cpu:1: numpy's results; kernels get numpy arrays on cpu: devices and CuPy
    arrays on cuda: ones; cpu: streams have no CUDA stream, cuda: ones do."""
    w = np.random.default_rng(0).uniform(-0.5, 0.5, (16, 8)).astype(np.float32)
    with af.Graph() as g:
        x = af.placeholder("x", (4, 16), "float32", "cpu:0")
        z = af.placeholder("z", (4, 8), "float32", "cpu:1")
        h = af.ops.call(cs.record0, af.ops.relu(x), shape=(4, 16), name="on_cpu0")
        h = af.ops.tanh(af.ops.matmul(af.ops.to_device(h, "cuda:0"), af.parameter("w", w, "cuda:0")))
        h = af.ops.call(cs.record1, h, shape=(4, 8), name="on_cuda0")
        af.output("mid", h)
        y = af.ops.add(af.ops.to_device(h, "cpu:1"), z)
        af.output("y", af.ops.call(cs.record2, y, shape=(4, 8), name="on_cpu1"))
    plan = af.compile(g, quota=2)
    rng = np.random.default_rng(1)
    feeds = [
        {
            "x": rng.uniform(-1, 1, (4, 16)).astype(np.float32),
            "z": rng.uniform(-1, 1, (4, 8)).astype(np.float32),
        }
        for _ in range(5)
    ]
    cs.reset_seen()
    async with af.Runtime(plan, order=order, stall_timeout=20) as rt:
        outs = await rt.run(feeds)
        streams = {s.name: (s.device, rt.device_stream(s.name)) for s in plan.streams}
        params = {name: to_host(v) for name, v in rt.parameters().items()}
    np.testing.assert_array_equal(params["w"], w)
    for f, out in zip(feeds, outs):
        mid = np.tanh(np.maximum(f["x"].astype(np.float64), 0) @ w)
        for name, want in (("mid", mid), ("y", mid + f["z"])):
            assert isinstance(out[name], np.ndarray) and out[name].dtype == np.float32, name
            np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-5, err_msg=name)
    assert [{s.module for s in cs.SEEN[k]} for k in range(3)] == [{"numpy"}, {"cupy"}, {"numpy"}]
    assert {s.stream for s in cs.SEEN[1]} == {streams["cuda:0/compute"][1].ptr}
    for name, (device, stream) in streams.items():
        if device.startswith("cpu:"):
            assert stream is None, name
        elif device.startswith("cuda:"):
            assert stream is not None, name


# --------------------------------------------------------------------------------------
# 5. the shipped configs on cuda: devices
# --------------------------------------------------------------------------------------

CONFIGS = {
    "default": (
        "configs/default.yaml",
        ["train.steps=3"],
        "parallel.stages=[{0}:0, {0}:1]",
    ),
    "transformer": (
        "configs/transformer.yaml",
        ["train.steps=3", "model.d_model=32", "model.seq_len=16", "train.batch_size=8"],
        "parallel.stages=[[{0}:0, {0}:1], [{0}:2, {0}:3]]",
    ),
}


@gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_shipped_config_trains_on_cuda_as_on_cpu(name):
    """The default MLP (2 stages, 4 micro-batches, 1F1B, SGD with momentum) and the
    transformer scaled down (2 stages of 2 tensor-parallel devices, Adam), in float32, a
    few steps: each step's loss is the CPU run's; the MLP's parameters too (Adam's first
    steps can turn a gradient at rounding level into a whole step, so the transformer's
    are left to the losses)."""
    path, sets, stages = CONFIGS[name]
    cpu, on_gpu = (train(load_config(path, [*sets, stages.format(kind)])) for kind in ("cpu", "cuda"))
    assert len(on_gpu.losses) == 3
    np.testing.assert_allclose(on_gpu.losses, cpu.losses, rtol=1e-4)
    if name == "default":
        assert on_gpu.parameters.keys() == cpu.parameters.keys()
        for param, value in cpu.parameters.items():
            np.testing.assert_allclose(
                to_host(on_gpu.parameters[param]), value, rtol=1e-4, atol=1e-5, err_msg=param
            )


# --------------------------------------------------------------------------------------
# without CuPy or a GPU
# --------------------------------------------------------------------------------------


@pytest.mark.skipif(cs.UNAVAILABLE is None, reason="CUDA is usable here")
async def test_a_cuda_device_without_cupy_or_a_gpu_is_a_device_error_naming_the_extra():
    """Importing actorflow and compiling a cuda: plan work anywhere; opening a Runtime on
    it, where CuPy or a GPU is missing, raises a DeviceError that says what to install."""
    from actorflow.errors import DeviceError

    with af.Graph() as g:
        x = af.placeholder("x", (2, 3), "float32", "cuda:0")
        af.output("y", af.ops.relu(x))
    plan = af.compile(g)
    with pytest.raises(DeviceError, match=r"actorflow\[cuda\]"):
        async with af.Runtime(plan) as rt:
            await rt.run({"x": np.ones((2, 3), np.float32)})


@gpu
@pytest.mark.parametrize("order", ORDER_NAMES)
async def test_traced_gpu_kernels_span_their_time_on_the_gpu(order):
    """Traced, a kernel on a GPU stream spans its time on the GPU, not its launch: the
    slow kernel (milliseconds of matmuls queued at once) spans far longer than its quick
    successor, and every span lies within the run, on the host's clock."""
    import time

    with af.Graph() as g:
        x = af.placeholder("x", (64,), "float32", "cuda:0")
        slow = af.ops.call(cs.slow_add_one, x, shape=(64,), dtype="float32", name="slow")
        af.output("y", af.ops.call(cs.add_one, slow, shape=(64,), dtype="float32", name="quick"))
    plan = af.compile(g, fuse_kernels=False)
    async with af.Runtime(plan, trace=True, order=order) as rt:
        await rt.run({"x": np.zeros(64, np.float32)})  # compiles CuPy's kernels
        rt.recorder.clear()
        began = time.perf_counter()
        out = await rt.run([{"x": np.zeros(64, np.float32)}] * 3)
        ended = time.perf_counter()
    assert [o["y"][0] for o in out] == [2.0] * 3
    spans = {}
    for s in rt.recorder.kernels():
        assert began <= s.start <= s.end <= ended, s
        spans.setdefault(s.name, []).append(s.end - s.start)
    assert len(spans["slow"]) == len(spans["quick"]) == 3
    assert min(spans["slow"]) > 10 * max(spans["quick"]), spans


@gpu
@pytest.mark.parametrize("kind", ["sgd", "sgd_momentum", "adam"])
def test_a_gpu_update_is_one_fused_kernel_equal_to_the_numpy_update(kind):
    """On a GPU, SGD (with or without momentum) and Adam update in one CUDA kernel each;
    over several steps, the parameter and state stay the numpy update's: bit for bit
    for SGD (each step rounded as numpy rounds it, no fused multiply-add), to rounding
    for Adam."""
    from actorflow.optim import kernels

    cp = cupy()
    rng = np.random.default_rng(0)
    p, m, v = (rng.standard_normal(1000).astype(np.float32) for _ in range(3))
    v = np.abs(v)
    host = [p.copy(), m.copy(), v.copy(), np.zeros((), np.float64)]
    device = [cp.asarray(a) for a in host]
    for _ in range(5):
        g = rng.standard_normal(1000).astype(np.float32)
        for arrays, grad in ((host, g), (device, cp.asarray(g))):
            if kind == "adam":
                kernels.adam_update(
                    [arrays[0], grad, *arrays[1:]], [], lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8
                )
            else:
                state = [arrays[1]] if kind == "sgd_momentum" else []
                kernels.sgd_update([arrays[0], grad, *state], [], lr=0.05, momentum=0.9 if state else 0.0)
    for name, h, d in zip(["p", "m", "v", "t"], host, device):
        if kind == "adam":  # the bias corrections' pow, the GPU's and the host's, may differ
            np.testing.assert_allclose(cp.asnumpy(d), h, rtol=1e-6, atol=0, err_msg=name)
        else:  # rounded step by step as numpy rounds: bit for bit
            np.testing.assert_array_equal(cp.asnumpy(d), h, err_msg=name)


@gpu
@pytest.mark.parametrize("order", ORDER_NAMES)
async def test_an_emulated_link_on_a_gpu_takes_its_time_on_the_gpu(order):
    """An all-reduce over a link emulated at 30 ms (``link_bandwidth``) between two cuda
    devices: on the GPU the collective stream spends the link's time (its traced span
    lasts at least that), the reader of its result waits for it, and the sums are right."""
    with af.Graph() as g:
        x0 = af.placeholder("x0", (4,), "float32", "cuda:0")
        x1 = af.placeholder("x1", (4,), "float32", "cuda:1")
        r = af.ops.all_reduce([af.ops.relu(x0), af.ops.relu(x1)], name="ar")
        af.output("r0", af.ops.call(cs.add_one, r[0], shape=(4,), dtype="float32", name="after"))
    plan = af.compile(g, link_bandwidth=4 * 4 / 0.03)
    feeds = {"x0": np.ones(4, np.float32), "x1": np.full(4, 2.0, np.float32)}
    async with af.Runtime(plan, trace=True, order=order) as rt:
        outs = await rt.run([feeds] * 3)
        spans = rt.recorder.kernels()
    for out in outs:
        np.testing.assert_array_equal(out["r0"], np.full(4, 4.0, np.float32))
    links = sorted((s.start, s.end) for s in spans if s.name == "ar")
    after = sorted(s.start for s in spans if s.name == "after")
    assert len(links) == len(after) == 3
    for (start, end), reader in zip(links, after):
        assert end - start >= 0.025, (start, end)
        assert reader >= end - 1e-4


@gpu
@pytest.mark.parametrize("overlap", [False, True])
async def test_with_overlap_off_a_collective_never_runs_beside_compute_on_the_gpu(overlap):
    """overlap=False on cuda devices: the collective waits on the GPU for what its held
    compute streams launched, and they for it, so no GPU-timed span of the all-reduce
    (over a 30 ms emulated link) meets one of independent slow compute on its devices;
    with overlap on, they do meet. The sums and the compute are right either way."""
    with af.Graph() as g:
        x0 = af.placeholder("x0", (4,), "float32", "cuda:0")
        x1 = af.placeholder("x1", (4,), "float32", "cuda:1")
        r = af.ops.all_reduce([af.ops.relu(x0), af.ops.relu(x1)], name="ar")
        af.output("r0", r[0])
        af.output("side", af.ops.call(cs.slow_add_one, x0, shape=(4,), dtype="float32", name="slow"))
    plan = af.compile(g, link_bandwidth=4 * 4 / 0.03, overlap=overlap)
    feeds = {"x0": np.ones(4, np.float32), "x1": np.full(4, 2.0, np.float32)}
    async with af.Runtime(plan, trace=True, order="dynamic") as rt:
        await rt.run(feeds)  # compiles CuPy's kernels
        rt.recorder.clear()
        outs = await rt.run([feeds] * 3)
        spans = rt.recorder.kernels()
    for out in outs:
        np.testing.assert_array_equal(out["r0"], np.full(4, 3.0, np.float32))
        np.testing.assert_array_equal(out["side"], np.full(4, 2.0, np.float32))
    collective = [s for s in spans if s.name == "ar"]
    compute = [s for s in spans if s.name == "slow"]
    together = [(c, k) for c in collective for k in compute if c.start < k.end and k.start < c.end]
    assert len(collective) == len(compute) == 3
    assert bool(together) is overlap


def test_a_plan_too_large_for_the_gpu_is_a_device_error_before_anything_is_allocated():
    """Compiling checks each device against the host's memory; opening checks the cuda
    devices' registers together against the GPU's free memory (``fits_gpu``, run on the
    CPU here with the GPU's figures given)."""
    from actorflow.errors import DeviceError
    from actorflow.runtime.cuda import fits_gpu

    with af.Graph() as g:
        x = af.placeholder("x", (256, 1024), "float32", "cuda:0")
        af.output("y", af.ops.relu(af.ops.to_device(af.ops.tanh(x), "cuda:1")))
    plan = af.compile(g)
    devices = ["cuda:0", "cuda:1"]
    planned = sum(plan.memory[d] for d in devices)
    fits_gpu(plan, devices, free=planned, total=2 * planned)
    with pytest.raises(DeviceError, match=r"cuda:0, cuda:1 take .* MiB .* free of .*: lower the quotas"):
        fits_gpu(plan, devices, free=planned - 1, total=2 * planned)


def test_a_gpu_kernels_span_times_are_read_when_the_trace_is_read_not_when_the_run_ends():
    """A traced GPU kernel's start and end (``GpuTime``) are its events' times from the
    run's reference event, read (after waiting for the event) only when the recorder's
    spans are read: a run that ends doesn't wait for them; after a CUDA error, the host's
    times (on the CPU, with stand-ins for CUDA's events)."""
    from actorflow.runtime.cuda import GpuTime
    from actorflow.trace.recorder import Recorder, Span

    class Event:
        def __init__(self, ms: float) -> None:
            self.ms, self.waited = ms, False

        def synchronize(self) -> None:
            self.waited = True

    def elapsed(mark: Event, event: Event) -> float:
        assert event.waited, "an event's time is read after waiting for it"
        return event.ms - mark.ms

    mark, begun, ended = Event(0.0), Event(2.0), Event(5.5)
    recorder = Recorder(enabled=True)
    times = GpuTime(mark, 10.0, begun, elapsed, 9.0), GpuTime(mark, 10.0, ended, elapsed, 9.5)
    recorder.record(0, lambda a, b: Span("cuda:0", "compute", "k", "compute", float(a), float(b), {}), *times)
    assert not begun.waited and not ended.waited
    (span,) = recorder.spans
    assert (span.start, span.end) == (10.002, 10.0055)

    def failed(mark: Event, event: Event) -> float:
        raise RuntimeError("cudaErrorLaunchFailure")  # what CuPy raises after a CUDA error

    assert float(GpuTime(mark, 10.0, Event(1.0), failed, 9.25)) == 9.25  # the host's time of the act
