"""What a kernel may do: read its inputs (read-only views), return exactly what the graph
declared, and, with ``grad=``, take part in the backward pass."""

from __future__ import annotations

import numpy as np
import pytest

import actorflow as af


def scale_weight_in_place(x, w):
    w *= 100
    return x + w


def try_to_scale_in_place(x, w):
    """Tries the in-place write, keeps going when it is refused."""
    try:
        w *= 100
    except ValueError:
        pass
    return x + w


def cube(x):
    return x**3


def cube_grad(x, dout):
    return (3 * x**2 * dout,)


def weighted_sum(x, k, y):
    return x * k + y


def weighted_sum_grad(x, k, y, dout):
    return (dout * k, None, dout)


def halve_in_float64(x):
    return x.astype(np.float64) / 2


def _writer_graph(fn) -> af.Graph:
    with af.Graph() as g:
        x = af.placeholder("x", (3,), "float32")
        w = af.parameter("w", np.ones(3, np.float32), "cpu:0")
        af.output("y", af.ops.call(fn, x, w, shape=(3,), dtype="float32", name="writer"))
        af.output("w_seen", af.ops.mul(w, af.ops.full((3,), 1.0)))
    return g


@pytest.mark.timeout(20)
def test_a_kernel_writing_into_an_input_raises_naming_the_kernel_the_input_and_its_register():
    plan = af.compile(_writer_graph(scale_weight_in_place))
    with pytest.raises(
        af.KernelError, match="scale_weight_in_place wrote into input 1: a kernel's inputs are read-only"
    ) as info:
        af.run(plan, {"x": np.zeros(3, np.float32)})
    (note,) = info.value.__notes__
    assert "actor 'writer'" in note and "its input 1 is register 'w'" in note
    np.testing.assert_array_equal(plan.parameters[0].value, np.ones(3))


@pytest.mark.timeout(20)
def test_a_refused_write_leaves_the_parameter_and_its_other_readers_unchanged_across_runs():
    plan = af.compile(_writer_graph(try_to_scale_in_place))
    with af.Session(plan) as s:
        for _ in range(3):
            out = s.run({"x": np.zeros(3, np.float32)})
            np.testing.assert_array_equal(out["y"], np.ones(3))
            np.testing.assert_array_equal(out["w_seen"], np.ones(3))
        np.testing.assert_array_equal(s.parameters()["w"], np.ones(3))


@pytest.mark.timeout(20)
def test_builtin_kernels_get_read_only_inputs_too():
    """The same views reach actorflow's own kernels: a fetched output is a copy the caller
    may write, the register behind it is not."""
    with af.Graph() as g:
        x = af.placeholder("x", (2, 2), "float64")
        af.output("y", af.ops.relu(x))
    out = af.run(af.compile(g), {"x": np.ones((2, 2))})
    assert out["y"].flags.writeable
    out["y"][0, 0] = 7.0


@pytest.mark.timeout(20)
def test_a_result_of_another_dtype_fails_like_another_shape():
    with af.Graph() as g:
        x = af.placeholder("x", (4,), "float32")
        af.output("y", af.ops.call(halve_in_float64, x, shape=(4,), dtype="float32", name="half"))
    with pytest.raises(
        af.KernelError, match=r"halve_in_float64 returned float64, but the graph declared float32\[4\]"
    ):
        af.run(af.compile(g), {"x": np.ones(4, np.float32)})


@pytest.mark.timeout(20)
def test_call_with_grad_is_differentiable():
    xv = np.linspace(-1.0, 1.0, 5)
    yv = np.arange(5.0)
    with af.Graph() as g:
        x = af.placeholder("x", (5,), "float64")
        y = af.placeholder("y", (5,), "float64")
        k = af.placeholder("k", (5,), "int64")
        c = af.ops.call(cube, x, shape=(5,), dtype="float64", grad=cube_grad)
        z = af.ops.call(weighted_sum, c, k, y, shape=(5,), dtype="float64", grad=weighted_sum_grad)
        dx, dy = af.gradients(af.ops.sum(af.ops.mul(z, z)), [x, y])
        af.output("dx", dx)
        af.output("dy", dy)
    out = af.run(af.compile(g), {"x": xv, "y": yv, "k": np.full(5, 3)})
    zv = xv**3 * 3 + yv
    np.testing.assert_allclose(out["dx"], 2 * zv * 3 * 3 * xv**2, rtol=1e-12)
    np.testing.assert_allclose(out["dy"], 2 * zv, rtol=1e-12)


def test_grad_must_be_callable():
    with af.Graph():
        x = af.placeholder("x", (5,), "float64")
        with pytest.raises(af.GraphError, match="grad=3 is not callable"):
            af.ops.call(cube, x, shape=(5,), dtype="float64", grad=3)


@pytest.mark.timeout(20)
def test_a_grad_function_returning_something_else_than_one_gradient_per_input_is_named():
    with af.Graph() as g:
        x = af.placeholder("x", (5,), "float64")
        y = af.placeholder("y", (5,), "float64")
        z = af.ops.call(np.add, x, y, shape=(5,), dtype="float64", grad=lambda x, y, d: (d,))
        af.output("dx", af.gradients(af.ops.sum(z), [x])[0])
    with pytest.raises(af.KernelError, match="a gradient function returns a tuple of 2 gradients"):
        af.run(af.compile(g), {"x": np.ones(5), "y": np.ones(5)})
