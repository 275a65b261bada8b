"""Plans over several ranks, run as real processes (mpiexec on loopback): every result
equals the one-process run of the same graph and config (float64)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import actorflow as af
import graph_strategies as gs
import ranks
from rank_train import trained

pytestmark = pytest.mark.xdist_group("mpi")  # one mpiexec at a time: two at once fail in MPI_Comm_dup

WORLD = 3


@pytest.fixture
def pool():
    """WORLD ranks for one test's examples (one mpiexec at a time, so not longer)."""
    p = ranks.Pool(WORLD)
    yield p
    p.close()


@pytest.fixture(scope="class")
def pair():
    """Two ranks, for the training cases that run on two."""
    p = ranks.Pool(2, timeout=150)
    yield p
    p.close()


@pytest.mark.timeout(240)
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,  # the pool serves every example
    ],
)
@given(data=st.data())
def test_random_graphs_over_ranks_equal_one_process(pool, data):
    recipe = data.draw(
        gs.recipes(min_devices=2, dtypes=("float64",), call_fns=("identity", "double", "add_pair")),
        label="recipe",
    )
    placement = data.draw(gs.placements(recipe.devices, WORLD), label="ranks")
    quota = data.draw(st.integers(1, 3), label="quota")
    iterations = data.draw(st.integers(1, 3), label="iterations")
    seed = data.draw(st.integers(0, 2**16), label="feed seed")
    order = data.draw(st.sampled_from(["replay", "dynamic"]), label="order")
    graph, _ = gs.build(recipe)
    expected = af.run(af.compile(graph, quota=quota, ranks=1), gs.make_feeds(recipe, iterations, seed))
    status, got = pool.run(("graph", recipe, placement, quota, iterations, seed, order))
    assert status == "ok", got
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected):
        assert mine.keys() == theirs.keys()
        for name in theirs:
            np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-12, atol=1e-12 * recipe.bound)


def train_on_ranks(n: int, config: str, tmp_path, *overrides: str) -> dict[str, np.ndarray]:
    out = tmp_path / "rank0.npz"
    status, text = ranks.launch(
        n, sys.executable, str(ranks.TESTS / "rank_train.py"), config, str(out), *overrides, timeout=150
    )
    assert status == 0, text
    with np.load(out) as saved:
        return dict(saved)


def assert_same_training(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-12, atol=0, err_msg=name)


DATA_PARALLEL = ["parallel.stages=[[cpu:0, cpu:1]]", "parallel.data_parallel=2"]
ONE_COLLECTIVE_A_STREAM = [*DATA_PARALLEL, "runtime.fusion=false", "runtime.max_ops_per_stream=1"]


@pytest.mark.timeout(300)
class TestTrainingOnTwoRanksEqualsOneProcess:
    """In one pool of two ranks: mpiexec starts once for all these cases."""

    @pytest.mark.parametrize(
        "sets",
        [
            ["train.steps=10", "parallel.schedule=gpipe"],
            ["train.steps=10", "parallel.schedule=1f1b"],
            ["train.steps=10", *DATA_PARALLEL],
            # each stream of a group has its own communicator, so collectives running at
            # once on two streams can't start in different orders
            ["train.steps=5", *ONE_COLLECTIVE_A_STREAM],
            ["train.steps=5", *ONE_COLLECTIVE_A_STREAM, "runtime.comm_reuse=-1"],
            # micro-batches: the all-gathers act once per step, the reduce-scatters once per micro-batch
            [
                "train.steps=5",
                *DATA_PARALLEL,
                "train.optimizer.shard=true",
                "train.optimizer.shard_threshold_kb=0",
            ],
            ["train.steps=5", "parallel.schedule=zb1"],
            ["train.steps=5", "parallel.recompute=true"],
            # the acts decided as the run goes, not replayed (data parallel so: the mixed-order test)
            ["train.steps=10", "runtime.order=dynamic"],
        ],
        ids=[
            "pipeline-gpipe",
            "pipeline-1f1b",
            "data-parallel",
            "a-stream-per-collective",
            "comm-reuse",
            "optimizer-shard",
            "pipeline-zb1",
            "recompute",
            "pipeline-dynamic",
        ],
    )
    def test_losses_and_parameters_match(self, pair, sets):
        sets = [*sets, "model.dtype=float64"]
        path = str(ranks.REPO / "configs/default.yaml")
        status, got = pair.run(("train", path, sets))
        assert status == "ok", got
        assert_same_training(got, trained(path, *sets))

    def test_two_devices_a_rank_match(self, pair):
        """2x2.yaml's four devices, two a rank: each rank's first compute stream rides its
        sends and receives, and the other wakes it (``program.rider``)."""
        sets = ["train.steps=10", "model.dtype=float64"]
        path = str(ranks.REPO / "configs/2x2.yaml")
        status, got = pair.run(("train", path, sets))
        assert status == "ok", got
        assert_same_training(got, trained(path, *sets))

    @pytest.mark.parametrize(
        "sets",
        [
            ["parallel.stages=[[cpu:0, cpu:1]]", "parallel.tensor_parallel=2", "parallel.micro_batches=1"],
            ["parallel.stages=[cpu:0, cpu:1]", "parallel.tensor_parallel=1", "parallel.micro_batches=2"],
        ],
        ids=["tensor-parallel", "pipeline"],
    )
    def test_the_transformer_matches(self, pair, sets):
        sets = [*sets, "train.steps=3", "model.dtype=float64"]
        path = str(ranks.REPO / "configs/transformer.yaml")
        status, got = pair.run(("train", path, sets))
        assert status == "ok", got
        assert_same_training(got, trained(path, *sets))


@pytest.mark.timeout(300)
def test_training_2x2_on_four_ranks_launched_equals_one_process(tmp_path):
    """Started as ``actorflow launch`` users start it, one mpiexec for the run."""
    sets = ["train.steps=10", "model.dtype=float64"]
    expected = trained(str(ranks.REPO / "configs/2x2.yaml"), *sets)
    assert_same_training(train_on_ranks(4, "configs/2x2.yaml", tmp_path, *sets), expected)


HOP_THREADS = """
import threading
import numpy as np
import actorflow as af
from actorflow.world import this_rank

with af.Graph() as g:
    x = af.placeholder("x", (3,), "float64", "cpu:0")
    y = af.ops.relu(af.ops.to_device(x, "cpu:1"))
    af.output("y", af.ops.to_device(af.ops.mul(y, y), "cpu:0"))
plan = af.compile(g, ranks=2)
feeds = [{"x": np.array([-1.0, 2.0, float(k)])} for k in range(5)]
with af.Session(plan) as session:
    got = session.run(feeds)
    names = sorted(t.name for t in threading.enumerate())
rank = this_rank()
comm = next(s.name for s in plan.streams if s.kind == "comm" and plan.rank_of(s.device) == rank)
print("comm", comm, "threads", names)
assert comm not in names and f"rank{rank}/transport" in names, names
if rank == 0:
    for f, out in zip(feeds, got):
        assert np.array_equal(out["y"], np.maximum(f["x"], 0) ** 2), (f, out)
print("ok")
"""


@pytest.mark.timeout(60)
def test_the_communication_stream_runs_on_the_transport_thread():
    """A rank's sends and receives are driven by its transport's thread (no thread of the
    communication stream's own), and the hops they make still carry every iteration."""
    status, out = ranks.python(2, HOP_THREADS)
    assert status == 0, out
    assert out.count("ok") == 2, out


ALL_REDUCE = """
import numpy as np
import actorflow as af
from actorflow.world import this_rank

devices = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
cases = [
    (shape, dtype, op)
    for shape in [(7,), (2, 5), (1,)]
    for dtype, op in [("float32", "sum"), ("float64", "mean"), ("int32", "max"), ("float16", "sum")]
]
rng = np.random.default_rng(0)
values = [[(rng.standard_normal(shape) * 10).astype(dtype) for _ in devices] for shape, dtype, _ in cases]
with af.Graph() as g:
    for k, (shape, dtype, op) in enumerate(cases):
        parts = [af.parameter(f"x{k}_{d}", values[k][d], device) for d, device in enumerate(devices)]
        for d, out in enumerate(af.ops.all_reduce(parts, op=op)):
            af.output(f"y{k}_{d}", out)
plan = af.compile(g, ranks=[["cpu:0", "cpu:1"], ["cpu:2"], ["cpu:3"]])
for got in af.run(plan, [{}, {}]):
    for k, (shape, dtype, op) in enumerate(cases):
        stack = np.stack(values[k])
        want = {"sum": stack.sum(0), "mean": stack.mean(0), "max": stack.max(0)}[op].astype(dtype)
        for d in range(len(devices)):
            y = got[f"y{k}_{d}"]
            assert y.dtype == want.dtype and y.shape == want.shape, (k, d, y.dtype, y.shape)
            np.testing.assert_allclose(y, want, rtol=1e-3 if dtype == "float16" else 1e-6, err_msg=f"{k} {d}")
print("ok", this_rank())
"""


@pytest.mark.timeout(60)
def test_an_all_reduce_over_three_ranks_in_and_out_of_place():
    """Rank 0 holds two participants (it reduces in place), ranks 1 and 2 one each (out of
    place); sizes that 3 ranks' blocks don't divide evenly, down to one element; every
    dtype and op."""
    status, out = ranks.python(3, ALL_REDUCE)
    assert status == 0, out
    assert all(f"ok {rank}" in out for rank in range(3)), out


MIXED_ORDERS = """
import numpy as np
import actorflow as af
from actorflow.world import this_rank

rng = np.random.default_rng(1)
w = [rng.standard_normal((6, 6)) * 0.3 for _ in range(3)]
def build():
    with af.Graph() as g:
        x = af.placeholder("x", (8, 6), "float64", ["cpu:0", "cpu:1"], af.S(0))
        h = x
        for k, value in enumerate(w):
            h = af.ops.tanh(af.ops.matmul(h, af.parameter(f"w{k}", value, ["cpu:0", "cpu:1"], af.B)))
        loss = af.ops.mean(af.ops.mul(h, h))
        af.minimize(loss, af.optim.SGD(lr=0.1))
        af.output("loss", loss)
    return g
feeds = [{"x": rng.standard_normal((8, 6))} for _ in range(5)]
order = "dynamic" if this_rank() == 1 else "replay"
got = af.run(af.compile(build(), ranks=2, fusion=False), feeds, order=order)
want = af.run(af.compile(build(), ranks=1, fusion=False), feeds)
assert [float(o["loss"]) for o in got] == [float(o["loss"]) for o in want], (got, want)
print("ok", this_rank())
"""


@pytest.mark.timeout(60)
def test_a_replayed_rank_and_a_dynamic_one_train_together():
    """Both orders start a collective stream's collectives in the plan's collective
    order, and sends meet receives by tag whatever their order: ranks may mix them."""
    status, out = ranks.python(2, MIXED_ORDERS)
    assert status == 0, out
    assert out.count("ok") == 2, out
