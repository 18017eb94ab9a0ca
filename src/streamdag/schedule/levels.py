"""Wavefront levels and the critical path."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["critical_path", "wavefront_levels"]


def wavefront_levels(preds: Sequence[Sequence[int]]) -> list[list[int]]:
    """Ops grouped by longest distance from a source: each level can run between two barriers."""
    level = [0] * len(preds)
    for v, ps in enumerate(preds):
        if ps:
            level[v] = 1 + max(level[u] for u in ps)
    groups: list[list[int]] = [[] for _ in range(max(level, default=-1) + 1)]
    for v, lv in enumerate(level):
        groups[lv].append(v)
    return groups


def critical_path(preds: Sequence[Sequence[int]], costs: Sequence[float]) -> tuple[list[int], float]:
    """The most expensive source-to-sink path and its total cost."""
    n = len(preds)
    if n == 0:
        return [], 0.0
    dist = [0.0] * n
    best_pred = [-1] * n
    for v, ps in enumerate(preds):
        base = 0.0
        for u in ps:
            if best_pred[v] == -1 or dist[u] > base:
                base, best_pred[v] = dist[u], u
        dist[v] = base + costs[v]
    end = max(range(n), key=lambda v: dist[v])
    path = [end]
    while best_pred[path[-1]] != -1:
        path.append(best_pred[path[-1]])
    return path[::-1], dist[end]
