"""Transitive reduction and reachability, with Python ints as bit sets.

``reach[v]`` has bit ``w`` set when ``w`` can be reached from ``v``. Nodes are
visited in reverse topological order; a child of ``v`` is redundant when another
child already reaches it. For 10,000 ops and 50,000 edges this takes a fraction
of a second, and the reach sets are reused by chain cover and stream merging.
"""

from __future__ import annotations

from .dag import Preds, successors

__all__ = ["reduce_transitively"]


def reduce_transitively(preds: Preds) -> tuple[list[list[int]], list[int]]:
    """Return ``(reduced_preds, reach)``: the fewest edges with the same order, and reach sets."""
    n = len(preds)
    succ = successors(preds)
    reach = [0] * n
    kept_succ: list[list[int]] = [[] for _ in range(n)]
    for v in range(n - 1, -1, -1):
        acc = 0
        kept = kept_succ[v]
        for c in sorted(set(succ[v])):
            if (acc >> c) & 1:
                continue
            kept.append(c)
            acc |= reach[c] | (1 << c)
        reach[v] = acc
    reduced: list[list[int]] = [[] for _ in range(n)]
    for u in range(n):
        for c in kept_succ[u]:
            reduced[c].append(u)
    return reduced, reach
