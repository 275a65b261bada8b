"""Directed acyclic graphs as plain mappings (node -> its successors), shared by the
compiler's passes and the runtime's stall diagnosis."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

Edges = Mapping[int, Iterable[int]]


def topological_order(edges: Edges) -> list[int]:
    """Kahn's algorithm, smallest ready id first, so the order is deterministic."""
    indegree = dict.fromkeys(edges, 0)
    for successors in edges.values():
        for v in successors:
            indegree[v] += 1
    ready = [u for u, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order = []
    pop, push = heapq.heappop, heapq.heappush
    while ready:
        u = pop(ready)
        order.append(u)
        for v in edges[u]:
            left = indegree[v] - 1
            indegree[v] = left
            if not left:
                push(ready, v)
    if len(order) != len(indegree):
        raise ValueError("the graph has a cycle")
    return order


def find_cycle(edges: Edges) -> list[int] | None:
    """One cycle as a list of nodes (first == last), or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(edges, WHITE)
    for root in edges:
        if color[root] != WHITE:
            continue
        stack = [(root, iter(edges[root]))]
        path = [root]
        color[root] = GREY
        while stack:
            node, children = stack[-1]
            for child in children:
                if color.get(child, WHITE) == GREY:
                    return path[path.index(child) :] + [child]
                if color.get(child, WHITE) == WHITE:
                    color[child] = GREY
                    path.append(child)
                    stack.append((child, iter(edges.get(child, ()))))
                    break
            else:
                color[node] = BLACK
                path.pop()
                stack.pop()
    return None
