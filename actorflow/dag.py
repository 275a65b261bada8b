"""Directed acyclic graphs as plain mappings (node -> its successors), shared by the
compiler's passes and the runtime's stall diagnosis."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping

Edges = Mapping[int, Iterable[int]]


def topological_order(edges: Edges) -> list[int]:
    """Kahn's algorithm, smallest ready id first, so the order is deterministic."""
    indegree = {u: 0 for u in edges}
    for u in edges:
        for v in edges[u]:
            indegree[v] += 1
    ready = [u for u, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        u = heapq.heappop(ready)
        order.append(u)
        for v in edges[u]:
            indegree[v] -= 1
            if indegree[v] == 0:
                heapq.heappush(ready, v)
    if len(order) != len(indegree):
        raise ValueError("the graph has a cycle")
    return order
