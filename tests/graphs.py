"""Graphs that several test files build."""

import actorflow as af


def two_collective_graph() -> af.Graph:
    """ar2 consumes (through relus) the results of ar1."""
    with af.Graph() as g:
        x0 = af.placeholder("x0", shape=(2, 3), device="cpu:0")
        x1 = af.placeholder("x1", shape=(2, 3), device="cpu:1")
        a = af.ops.all_reduce([x0, x1], name="ar1")
        b = af.ops.all_reduce([af.ops.relu(a[0], name="r0"), af.ops.relu(a[1], name="r1")], name="ar2")
        af.output("y0", b[0])
        af.output("y1", b[1])
    return g
