"""The compiler's reachability helpers against brute force, and the invariants the
linear-time passes rely on: events on the transitive reduction, control registers only
where no data path orders a read before its update."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import actorflow as af
import graph_strategies as gs
from actorflow.compiler.topology import data_edges, reachable, reaches_any, unit_of
from actorflow.dag import topological_order
from test_properties import SETTINGS


@st.composite
def dags(draw, most: int = 30):
    """A random DAG: edges only from lower to higher numbers, ids shuffled."""
    n = draw(st.integers(1, most))
    names = draw(st.permutations(range(n)))
    edges = {names[u]: set() for u in range(n)}
    for v in range(1, n):
        for u in draw(st.lists(st.integers(0, v - 1), max_size=3, unique=True)):
            edges[names[u]].add(names[v])
    return edges


def closure(edges) -> dict[int, set[int]]:
    """Descendants by plain search, one node at a time."""
    out = {}
    for u in edges:
        seen, stack = set(), list(edges[u])
        while stack:
            v = stack.pop()
            if v not in seen:
                seen.add(v)
                stack.extend(edges[v])
        out[u] = seen
    return out


@settings(max_examples=200, deadline=None)
@given(dags(), st.data())
def test_reachable_is_the_transitive_closure(edges, data):
    nodes = sorted(edges)
    pairs = data.draw(st.lists(st.tuples(st.sampled_from(nodes), st.sampled_from(nodes)), max_size=40))
    truth = closure(edges)
    assert reachable(edges, pairs) == {(u, v) for u, v in pairs if v in truth[u]}


@settings(max_examples=200, deadline=None)
@given(dags(), st.data())
def test_reaches_any_answers_exactly_or_gives_up(edges, data):
    nodes = sorted(edges)
    position = {u: k for k, u in enumerate(topological_order(edges))}
    start = data.draw(st.sampled_from(nodes))
    targets = set(data.draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=5)))
    bound = max(position[t] for t in targets)
    budget = data.draw(st.integers(0, 40))
    truth = bool(closure(edges)[start] & targets)
    found = reaches_any(edges, position, start, targets, bound, budget)
    assert found in (truth, None)
    assert reaches_any(edges, position, start, targets, bound, len(nodes)) == truth


@settings(max_examples=40, **SETTINGS)
@given(st.data())
def test_events_follow_the_transitive_reduction(data):
    """An input is ``implied`` only where its producer reaches another producer of the
    consumer (or it is the register's second read), and ``event`` only where none does."""
    recipe = data.draw(gs.recipes(max_ops=20), label="recipe")
    plan = af.compile(gs.build(recipe)[0])
    unit, reach = unit_of(plan), closure(data_edges(plan))
    producers: dict[int, set[int]] = {}
    for a in plan.actors:
        producers.setdefault(unit[a.id], set()).update(
            unit[plan.registers[i.register].producer]
            for i in a.inputs
            if plan.registers[i.register].producer >= 0
        )
    for a in plan.actors:
        seen = set()
        for i in a.inputs:
            p = plan.registers[i.register].producer
            if i.sync in ("event", "implied"):
                others = producers[unit[a.id]] - {unit[p]}
                assert (i.sync == "implied") == (i.register in seen or bool(reach[unit[p]] & others)), (
                    a.name,
                    i,
                )
            seen.add(i.register)


@settings(max_examples=25, **SETTINGS)
@given(
    st.integers(1, 4),
    st.sampled_from([1, 2]),
    st.lists(st.booleans(), min_size=4, max_size=4),
    st.integers(1, 3),
)
def test_every_read_of_an_updated_parameter_is_ordered_before_its_update(layers, n_dev, extra, micro_batches):
    """Each reader of a variable reaches the update through data or has exactly one control
    register into it, never both (an MLP whose weights some outputs also read)."""
    devices = [f"cpu:{k}" for k in range(n_dev)]
    with af.Graph() as g:
        h = af.placeholder("x", (4, 3), "float32", devices, af.S(0))
        for k in range(layers):
            w = af.parameter(f"w{k}", np.full((3, 3), 0.1, np.float32), devices, af.B)
            h = af.ops.tanh(af.ops.matmul(h, w))
            if extra[k]:
                af.output(f"seen{k}", af.ops.relu(w))
        loss = af.ops.sum(af.ops.mul(h, h))
        af.minimize(loss, af.optim.SGD(lr=0.1))
        af.output("loss", loss)
    plan = af.compile(
        g, micro_batches=micro_batches, fusion=False, fuse_kernels=False
    )  # fusion adds paths after the pass
    unit = unit_of(plan)
    edges = {u: set() for u in unit.values()}
    for r in plan.registers:
        if not r.is_parameter and not r.control:
            edges[unit[r.producer]].update(
                unit[c.actor] for c in r.consumers if unit[c.actor] != unit[r.producer]
            )
    reach = closure(edges)
    checked = 0
    for update in (a for a in plan.actors if a.kind == "update"):
        controls = [
            plan.registers[i.register].producer for i in update.inputs if plan.registers[i.register].control
        ]
        for c in plan.registers[update.inputs[0].register].consumers:
            if c.actor != update.id:
                through_data = unit[update.id] in reach[unit[c.actor]]
                assert controls.count(c.actor) == (0 if through_data else 1), plan.actors[c.actor].name
                checked += 1
    assert checked >= layers * n_dev
