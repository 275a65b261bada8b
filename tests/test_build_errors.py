"""Mistakes caught while building a graph: af.GraphError, with a message that starts with
the op's name, names the offending shapes (or devices, dtypes, axes), and points at the
user's line."""

from __future__ import annotations

import inspect
import re
import warnings

import numpy as np
import pytest

import actorflow as af

P = af.placeholder
ops = af.ops


def msg(op, *fragments):
    """A regex: the message starts with ``op:`` and holds ``fragments`` in that order."""
    return "^" + re.escape(f"{op}:") + "".join(".*" + re.escape(f) for f in fragments)


def on(device, shape=(2, 3), dtype="float32", name=None):
    """A placeholder on ``device``, named after it unless told."""
    return P(name or f"x_{device.replace(':', '')}_{len(shape)}", shape, dtype, device)


def cpus(n, shape=(2, 3), dtype="float32"):
    return [on(f"cpu:{k}", shape, dtype) for k in range(n)]


# Each case: (id, build, regex). ``build`` runs inside ``with af.Graph():``.
CASES = [
    # -- shapes ------------------------------------------------------------------------------
    (
        "matmul-inner",
        lambda: ops.matmul(P("a", (2, 3)), P("b", (4, 5))),
        msg("matmul", "(2, 3) @ (4, 5)", "3 != 4"),
    ),
    (
        "matmul-batch-inner",
        lambda: ops.matmul(P("a", (7, 2, 3)), P("b", (7, 2, 3))),
        msg("matmul", "(7, 2, 3) @ (7, 2, 3)"),
    ),
    (
        "matmul-1d",
        lambda: ops.matmul(P("a", (3,)), P("b", (3, 2))),
        msg("matmul", "at least 2 dims", "(3,) @ (3, 2)"),
    ),
    (
        "matmul-batch",
        lambda: ops.matmul(P("a", (2, 2, 3)), P("b", (3, 3, 2))),
        msg("matmul", "(2, 2, 3) @ (3, 3, 2)", "do not broadcast"),
    ),
    (
        "add-broadcast",
        lambda: ops.add(P("a", (2, 3)), P("b", (4,))),
        msg("add", "(2, 3)", "(4,)", "do not broadcast"),
    ),
    (
        "sub-broadcast",
        lambda: ops.sub(P("a", (2, 3, 4)), P("b", (3, 1, 2))),
        msg("sub", "(2, 3, 4)", "(3, 1, 2)"),
    ),
    ("mul-broadcast", lambda: ops.mul(P("a", (5,)), P("b", (2, 4))), msg("mul", "(5,)", "(2, 4)")),
    ("div-broadcast", lambda: ops.div(P("a", (2, 1)), P("b", (3, 3))), msg("div", "(2, 1)", "(3, 3)")),
    (
        "bias-add-trailing",
        lambda: ops.bias_add(P("x", (2, 3)), P("b", (2,))),
        msg("bias_add", "(2,)", "(2, 3)"),
    ),
    ("bias-add-scalar", lambda: ops.bias_add(P("x", (2, 3)), P("b", ())), msg("bias_add", "()", "(2, 3)")),
    (
        "bias-add-too-big",
        lambda: ops.bias_add(P("x", (3,)), P("b", (2, 3))),
        msg("bias_add", "(2, 3)", "(3,)"),
    ),
    ("reshape-size", lambda: ops.reshape(P("x", (2, 3)), (4, 2)), msg("reshape", "(2, 3) to (4, 2)")),
    (
        "reshape-two-minus-ones",
        lambda: ops.reshape(P("x", (2, 3)), (-1, -1)),
        msg("reshape", "(2, 3) to (-1, -1)"),
    ),
    ("transpose-perm", lambda: ops.transpose(P("x", (2, 3)), (0, 0)), msg("transpose", "(0, 0)", "(2, 3)")),
    (
        "transpose-perm-length",
        lambda: ops.transpose(P("x", (2, 3)), (0, 1, 2)),
        msg("transpose", "(0, 1, 2)", "(2, 3)"),
    ),
    (
        "split-equal",
        lambda: ops.split(P("x", (2, 6)), 4, axis=1),
        msg("split", "4 equal parts", "dim 1 of (2, 6)"),
    ),
    (
        "split-zero-parts",
        lambda: ops.split(P("x", (2, 6)), 0, axis=1),
        msg("split", "0 equal parts", "(2, 6)"),
    ),
    (
        "split-sizes",
        lambda: ops.split(P("x", (2, 6)), [2, 3], axis=1),
        msg("split", "[2, 3]", "dim 1 of (2, 6)"),
    ),
    ("split-negative-size", lambda: ops.split(P("x", (6,)), [7, -1]), msg("split", "[7, -1]", "(6,)")),
    (
        "slice-end",
        lambda: ops.slice(P("x", (2, 3)), (0, 1), (3, 2)),
        msg("slice", "[[0, 1], [3, 2])", "(2, 3)"),
    ),
    (
        "slice-partial-end",
        lambda: ops.slice(P("x", (2, 3, 4)), (1,), (5,)),
        msg("slice", "[[1, 0, 0], [5, 3, 4])", "(2, 3, 4)"),
    ),
    (
        "slice-negative",
        lambda: ops.slice(P("x", (2, 3)), (-1,), (2,)),
        msg("slice", "[[-1, 0], [2, 3])", "(2, 3)"),
    ),
    (
        "slice-reversed",
        lambda: ops.slice(P("x", (4, 3)), (3,), (1,)),
        msg("slice", "[[3, 0], [1, 3])", "(4, 3)"),
    ),
    (
        "slice-lengths",
        lambda: ops.slice(P("x", (2, 3)), (0, 0), (1,)),
        msg("slice", "(0, 0)", "(1,)", "(2, 3)"),
    ),
    (
        "slice-too-many-dims",
        lambda: ops.slice(P("x", (2,)), (0, 0), (1, 1)),
        msg("slice", "(0, 0)", "(1, 1)", "(2,)"),
    ),
    (
        "concat-off-axis",
        lambda: ops.concat([P("a", (2, 3)), P("b", (3, 4))], axis=0),
        msg("concat", "(2, 3)", "(3, 4)", "axis 0"),
    ),
    (
        "concat-third",
        lambda: ops.concat([P("a", (2, 3)), P("b", (5, 3)), P("c", (2, 4))]),
        msg("concat", "(2, 3)", "(2, 4)", "axis 0"),
    ),
    (
        "concat-ndim",
        lambda: ops.concat([P("a", (2, 3)), P("b", (2, 3, 1))], axis=1),
        msg("concat", "(2, 3)", "(2, 3, 1)"),
    ),
    ("concat-empty", lambda: ops.concat([], axis=0), msg("concat", "at least one tensor")),
    ("placeholder-negative-dim", lambda: P("x", (2, -1)), msg("placeholder", "'x'", "(2, -1)")),
    # -- axes --------------------------------------------------------------------------------
    ("softmax-axis", lambda: ops.softmax(P("x", (2, 3)), axis=2), msg("softmax", "axis 2", "2 dims")),
    (
        "softmax-axis-negative",
        lambda: ops.softmax(P("x", (2, 3)), axis=-3),
        msg("softmax", "axis -3", "2 dims"),
    ),
    ("softmax-axis-float", lambda: ops.softmax(P("x", (2, 3)), axis=1.0), msg("softmax", "axis 1.0")),
    ("sum-axis", lambda: ops.sum(P("x", (2, 3)), axis=2), msg("sum", "axis 2", "2 dims")),
    ("mean-axis-tuple", lambda: ops.mean(P("x", (2, 3)), axis=(0, 5)), msg("mean", "axis 5", "2 dims")),
    ("max-axis", lambda: ops.max(P("x", (4,)), axis=-2), msg("max", "axis -2", "1 dims")),
    (
        "concat-axis",
        lambda: ops.concat([P("a", (2, 3)), P("b", (2, 3))], axis=2),
        msg("concat", "axis 2", "2 dims"),
    ),
    ("split-axis", lambda: ops.split(P("x", (2, 3)), 1, axis=-3), msg("split", "axis -3", "2 dims")),
    ("all-gather-axis", lambda: ops.all_gather(cpus(2), axis=2), msg("all_gather", "axis 2", "2 dims")),
    (
        "reduce-scatter-axis",
        lambda: ops.reduce_scatter(cpus(2), axis=-3),
        msg("reduce_scatter", "axis -3", "2 dims"),
    ),
    (
        "all-to-all-split-axis",
        lambda: ops.all_to_all(cpus(2), split_axis=3),
        msg("all_to_all", "axis 3", "2 dims"),
    ),
    (
        "all-to-all-concat-axis",
        lambda: ops.all_to_all(cpus(2), concat_axis=-4),
        msg("all_to_all", "axis -4", "2 dims"),
    ),
    # -- devices -----------------------------------------------------------------------------
    (
        "add-devices",
        lambda: ops.add(on("cpu:0"), on("cpu:1")),
        msg("add", "different devices", "['cpu:0', 'cpu:1']"),
    ),
    (
        "matmul-devices",
        lambda: ops.matmul(on("cpu:0", (2, 3)), on("cpu:2", (3, 3))),
        msg("matmul", "different devices", "['cpu:0', 'cpu:2']"),
    ),
    (
        "concat-devices",
        lambda: ops.concat([on("cpu:0"), on("cpu:1")]),
        msg("concat", "different devices", "['cpu:0', 'cpu:1']"),
    ),
    (
        "bias-add-devices",
        lambda: ops.bias_add(on("cpu:0"), on("cpu:1", (3,))),
        msg("bias_add", "different devices", "cpu:1"),
    ),
    (
        "call-devices",
        lambda: ops.call(np.add, on("cpu:0"), on("cpu:3"), shape=(2, 3)),
        msg("call", "different devices", "['cpu:0', 'cpu:3']"),
    ),
    (
        "call-device-mismatch",
        lambda: ops.call(np.negative, on("cpu:0"), shape=(2, 3), device="cpu:1"),
        msg("call", "cpu:1", "cpu:0"),
    ),
    ("call-no-device", lambda: ops.call(np.ones, shape=(2,)), msg("call", "device=")),
    ("call-not-callable", lambda: ops.call(3, on("cpu:0"), shape=(2, 3)), msg("call", "3 is not callable")),
    ("placeholder-gpu", lambda: P("x", (2,), device="gpu:x"), msg("placeholder", "'gpu:x'", "cpu:N")),
    ("placeholder-no-index", lambda: P("x", (2,), device="cpu"), msg("placeholder", "'cpu'")),
    ("placeholder-negative-index", lambda: P("x", (2,), device="cpu:-1"), msg("placeholder", "'cpu:-1'")),
    ("placeholder-device-int", lambda: P("x", (2,), device=0), msg("placeholder", "not 0")),
    ("parameter-gpu", lambda: af.parameter("w", np.ones(2), device="gpu:0"), msg("parameter", "'gpu:0'")),
    ("to-device-gpu", lambda: ops.to_device(P("x", (2,)), "gpu:x"), msg("to_device", "'gpu:x'")),
    ("call-device-gpu", lambda: ops.call(np.ones, shape=(2,), device="tpu:0"), msg("call", "'tpu:0'")),
    ("broadcast-gpu", lambda: ops.broadcast(P("x", (2,)), ["cpu:1", "gpu:x"]), msg("broadcast", "'gpu:x'")),
    # -- dtypes ------------------------------------------------------------------------------
    (
        "add-dtypes",
        lambda: ops.add(P("a", (2, 3)), P("b", (2, 3), "float64")),
        msg("add", "different dtypes", "['float32', 'float64']"),
    ),
    (
        "add-parameter-float64",
        lambda: ops.add(P("a", (2,)), af.parameter("w", np.ones(2))),
        msg("add", "['float32', 'float64']"),
    ),
    (
        "matmul-dtypes",
        lambda: ops.matmul(P("a", (2, 3), "float64"), P("b", (3, 2), "int32")),
        msg("matmul", "['float64', 'int32']"),
    ),
    (
        "concat-dtypes",
        lambda: ops.concat([P("a", (2,)), P("b", (2,), "float16")]),
        msg("concat", "['float16', 'float32']"),
    ),
    ("placeholder-dtype", lambda: P("x", (2,), "float33"), msg("placeholder", "'float33'")),
    (
        "call-dtype",
        lambda: ops.call(np.negative, P("x", (2,)), shape=(2,), dtype="nope"),
        msg("call", "'nope'"),
    ),
    # -- collectives -------------------------------------------------------------------------
    (
        "all-reduce-one-device",
        lambda: ops.all_reduce([on("cpu:0", name="a"), on("cpu:0", name="b")]),
        msg("all_reduce", "one tensor per device", "['cpu:0', 'cpu:0']"),
    ),
    (
        "all-gather-one-device",
        lambda: ops.all_gather([*cpus(2), on("cpu:1", name="c")]),
        msg("all_gather", "['cpu:0', 'cpu:1', 'cpu:1']"),
    ),
    (
        "all-to-all-one-device",
        lambda: ops.all_to_all([on("cpu:2", (4,), name="a"), on("cpu:2", (4,), name="b")]),
        msg("all_to_all", "['cpu:2', 'cpu:2']"),
    ),
    (
        "reduce-scatter-one-device",
        lambda: ops.reduce_scatter([on("cpu:1", name="a"), on("cpu:1", name="b")]),
        msg("reduce_scatter", "['cpu:1', 'cpu:1']"),
    ),
    (
        "all-reduce-shapes",
        lambda: ops.all_reduce([on("cpu:0", (2, 3)), on("cpu:1", (3, 2))]),
        msg("all_reduce", "float32[2, 3] on cpu:0", "float32[3, 2] on cpu:1"),
    ),
    (
        "all-gather-shapes",
        lambda: ops.all_gather([on("cpu:0", (2, 3)), on("cpu:1", (2, 3)), on("cpu:2", (2, 4))]),
        msg("all_gather", "[2, 3] on cpu:0", "[2, 4] on cpu:2"),
    ),
    (
        "all-to-all-dtypes",
        lambda: ops.all_to_all([on("cpu:0", (2, 2)), on("cpu:1", (2, 2), "float64")]),
        msg("all_to_all", "float32[2, 2]", "float64[2, 2] on cpu:1"),
    ),
    ("all-reduce-op", lambda: ops.all_reduce(cpus(2), op="prod"), msg("all_reduce", "'prod'")),
    ("all-reduce-empty", lambda: ops.all_reduce([]), msg("all_reduce", "got none")),
    (
        "reduce-scatter-divisible",
        lambda: ops.reduce_scatter(cpus(2, (5, 3))),
        msg("reduce_scatter", "dim 0 of (5, 3)", "2 equal chunks"),
    ),
    (
        "reduce-scatter-divisible-axis1",
        lambda: ops.reduce_scatter(cpus(4, (4, 6)), axis=1),
        msg("reduce_scatter", "dim 1 of (4, 6)", "4 equal chunks"),
    ),
    (
        "all-to-all-divisible",
        lambda: ops.all_to_all(cpus(3, (4, 3)), split_axis=0),
        msg("all_to_all", "dim 0 of (4, 3)", "3 equal chunks"),
    ),
    (
        "broadcast-duplicate-targets",
        lambda: ops.broadcast(P("x", (2,)), ["cpu:1", "cpu:01"]),
        msg("broadcast", "distinct", "'cpu:01'"),
    ),
    ("broadcast-no-targets", lambda: ops.broadcast(P("x", (2,)), []), msg("broadcast", "distinct", "[]")),
    # -- names and inputs ----------------------------------------------------------------------
    ("name-used-twice-op", lambda: ops.relu(P("x", (2,)), name="x"), msg("relu", "'x'", "used twice")),
    (
        "name-used-twice-parameter",
        lambda: [af.parameter("w", 1.0), af.parameter("w", 2.0)],
        msg("parameter", "'w'", "used twice"),
    ),
    ("not-a-tensor", lambda: ops.add(P("x", (3,)), np.ones(3)), msg("add", "expected a tensor", "ndarray")),
    (
        "collective-not-a-tensor",
        lambda: ops.all_reduce([P("x", (3,)), 3.0]),
        msg("all_reduce", "expected a tensor", "float"),
    ),
]


@pytest.mark.parametrize("build,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_build_error(build, pattern):
    with af.Graph():
        with pytest.raises(af.GraphError, match=pattern) as info:
            build()
    message = str(info.value)
    assert "test_build_errors.py:" in message, message  # points at the user's line
    assert isinstance(info.value, ValueError)  # GraphError is also a ValueError


def test_error_points_at_the_exact_line():
    with af.Graph():
        x = P("x", (2, 3))
        line = inspect.currentframe().f_lineno + 2
        with pytest.raises(af.GraphError) as info:
            ops.matmul(x, x)
    assert str(info.value).endswith(f"test_build_errors.py:{line})"), str(info.value)


def test_graph_is_still_usable_after_an_error():
    """A failed op adds nothing: the graph compiles and runs what was built before and after."""
    with af.Graph() as g:
        x = P("x", (2, 3))
        with pytest.raises(af.GraphError):
            ops.add(x, P("bad", (3, 2)))
        with pytest.raises(af.GraphError):
            ops.relu(x, name="x")
        af.output("y", ops.relu(x))
    n_nodes = len(g.nodes)
    # "bad" was declared before the failing add, so it is a placeholder like any other
    feeds = {"x": np.array([[-1, 2, -3], [4, -5, 6]], np.float32), "bad": np.zeros((3, 2), np.float32)}
    out = af.run(af.compile(g), feeds)
    np.testing.assert_array_equal(out["y"], [[0, 2, 0], [4, 0, 6]])
    assert n_nodes == len(g.nodes)


# -- names --------------------------------------------------------------------------------------


def test_duplicate_placeholder_names():
    with af.Graph():
        P("x", (2,))
        with pytest.raises(af.GraphError, match=r"'x' is used twice.*test_build_errors\.py:"):
            P("x", (3,))


def test_duplicate_output_names():
    with af.Graph():
        x = P("x", (2,))
        af.output("y", x)
        with pytest.raises(af.GraphError, match=r"'y' is used twice"):
            af.output("y", ops.relu(x))


def test_tensor_and_output_names_share_one_namespace():
    with af.Graph():
        x = P("x", (2,))
        with pytest.raises(af.GraphError, match=r"'x' is used twice"):
            af.output("x", x)


@pytest.mark.parametrize("which", ["placeholder", "output"])
def test_duplicate_name_error_names_the_user_facing_op(which):
    with af.Graph():
        x = P("x", (2,))
        with pytest.raises(af.GraphError, match=rf"^{which}: .*'x' is used twice"):
            if which == "placeholder":
                P("x", (2,))
            else:
                af.output("x", x)


def test_generated_names_never_collide_with_user_names():
    with af.Graph():
        x = P("relu_1", (2,))  # node 0
        y = ops.relu(x)  # node 1: its generated name would be relu_1
        assert x.name != y.name


# -- graphs: outside one, across two ---------------------------------------------------------------


def test_placeholder_outside_a_graph():
    with pytest.raises(af.GraphError, match=r"no graph is being built.*with af\.Graph\(\)"):
        P("x", (2,))


@pytest.mark.parametrize(
    "build",
    [
        lambda x: ops.relu(x),
        lambda x: ops.matmul(x, x),
        lambda x: ops.all_reduce([x]),
        lambda x: ops.to_device(x, "cpu:1"),
        lambda x: af.output("y", x),
        lambda x: af.parameter("w", np.ones(2)),
    ],
    ids=["relu", "matmul", "all_reduce", "to_device", "output", "parameter"],
)
def test_ops_outside_a_graph(build):
    with af.Graph():
        x = P("x", (2, 2))
    with pytest.raises(af.GraphError, match=r"no graph is being built.*with af\.Graph\(\)"):
        build(x)


def test_op_outside_a_graph_names_the_op():
    with af.Graph():
        x = P("x", (2, 2))
    with pytest.raises(af.GraphError, match=r"^matmul:"):
        ops.matmul(x, x)


def test_tensor_from_another_graph():
    with af.Graph():
        x = P("x", (2,))
    with af.Graph():
        y = P("y", (2,))
        with pytest.raises(af.GraphError, match=msg("add", "'x'", "another graph")):
            ops.add(y, x)
        with pytest.raises(af.GraphError, match=msg("all_gather", "'x'", "another graph")):
            ops.all_gather([y, x])


def test_nested_graphs_restore_the_outer_one():
    with af.Graph() as outer:
        x = P("x", (2,))
        with af.Graph() as inner:
            z = P("z", (2,))
        y = ops.relu(x)  # lands in outer again
        with pytest.raises(af.GraphError, match=msg("relu", "'z'", "another graph")):
            ops.relu(z)
    assert y.graph is outer and z.graph is inner
    assert [n.name for n in inner.nodes] == ["z"]


# -- bugs: 0-d tensors, non-int collective axes --------------------------------------------------


@pytest.mark.parametrize("op", ["split", "concat", "sum", "mean", "max"])
def test_axis_on_a_0d_tensor_is_a_build_error(op):
    with af.Graph():
        x = P("x", ())
        with pytest.raises(af.GraphError, match=rf"^{op}: .*axis"):
            if op == "split":
                ops.split(x, 1, axis=0)
            elif op == "concat":
                ops.concat([x, x], axis=0)
            else:
                af.output("y", getattr(ops, op)(x, axis=0))


def test_reduce_over_all_axes_of_a_0d_tensor_is_fine():
    with af.Graph() as g:
        x = P("x", (), "float64")
        af.output("s", ops.sum(x))
        af.output("m", ops.max(x, keepdims=True))
    out = af.run(af.compile(g), {"x": np.array(2.5)})
    assert out["s"] == 2.5 and out["m"].shape == ()


def test_collective_float_axis_is_a_graph_error():
    with af.Graph():
        with pytest.raises(af.GraphError, match=msg("all_gather", "axis 1.0")):
            ops.all_gather(cpus(2), axis=1.0)


@pytest.mark.parametrize("dtype", [object, "U3", [("a", "f4")]])
def test_non_numeric_dtypes_are_refused(dtype):
    with af.Graph():
        with pytest.raises(af.GraphError, match="placeholder: .*not numeric"):
            af.placeholder("x", (2,), dtype)
        with pytest.raises(af.GraphError, match="parameter: .*not numeric"):
            af.parameter("w", np.zeros(2, dtype=dtype))


def test_an_empty_graph_compiles_with_a_warning_pointing_at_the_call():
    with af.Graph() as g:
        pass
    with pytest.warns(UserWarning, match="the graph is empty") as record:
        plan = af.compile(g)
    assert record[0].filename == __file__
    assert af.run(plan, {}) == {}


def test_a_graph_without_outputs_or_updates_compiles_with_a_warning():
    with af.Graph() as g:
        x = af.placeholder("x", (2,), "float32", "cpu:0")
        af.ops.relu(x)
    with pytest.warns(UserWarning, match="no outputs and updates no parameter"):
        af.compile(g)


def test_a_graph_that_only_trains_compiles_without_a_warning():
    with af.Graph() as g:
        x = af.placeholder("x", (4, 3), "float32", "cpu:0")
        w = af.parameter("w", np.ones((3, 2), np.float32), "cpu:0")
        af.minimize(af.ops.reduce_sum(af.ops.matmul(x, w)), af.optim.SGD(lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = af.compile(g)
    with af.Session(plan) as s:
        s.run({"x": np.ones((4, 3), np.float32)})
        np.testing.assert_allclose(s.parameters()["w"], np.ones((3, 2)) - 0.1 * 4)
