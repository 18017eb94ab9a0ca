"""DAGs as plain data: node ``i`` is the ``i``-th op, ``preds[i]`` the ops it follows.

Submission order is a topological order (an op can only depend on ops
submitted before it), so every scheduling function here takes graphs whose
edges point from a lower index to a higher one. :func:`from_edges` brings any
other DAG into that form, or says where its cycle is.
"""

from __future__ import annotations

import graphlib
import heapq
import itertools
from collections.abc import Hashable, Iterable, Sequence

from ..errors import CycleError

__all__ = ["Preds", "check_order", "from_edges", "successors"]

Preds = Sequence[Sequence[int]]


def check_order(preds: Preds) -> None:
    """Raise :class:`CycleError` (or ValueError) unless every edge points forward."""
    for v, ps in enumerate(preds):
        for u in ps:
            if not 0 <= u < len(preds):
                raise ValueError(f"op {v} depends on op {u}, which does not exist")
            if u >= v:
                raise CycleError([u, v]) if u == v else ValueError(
                    f"op {v} depends on op {u}, which comes later: number ops in a "
                    "topological order, or build the graph with streamdag.schedule.from_edges"
                )


def from_edges(
    nodes: Iterable[Hashable], edges: Iterable[tuple[Hashable, Hashable]]
) -> tuple[list[Hashable], list[list[int]]]:
    """Number an arbitrary DAG topologically: returns ``(order, preds)``.

    ``order[i]`` is the node that became op ``i``; among the nodes ready at each step the one whose
    ``str`` sorts first comes first, so the numbering does not depend on the order of ``nodes`` and
    ``edges``. An edge may name a node not in ``nodes``. A cycle raises :class:`CycleError` naming it.
    """
    sorter: graphlib.TopologicalSorter[Hashable] = graphlib.TopologicalSorter()
    preds_of: dict[Hashable, set[Hashable]] = {}
    for n in nodes:
        sorter.add(n)
        preds_of.setdefault(n, set())
    for u, v in edges:
        sorter.add(v, u)
        preds_of.setdefault(u, set())
        preds_of.setdefault(v, set()).add(u)
    try:
        sorter.prepare()
    except graphlib.CycleError as exc:
        cycle = list(exc.args[1])  # each node a predecessor of the next, the first repeated last
        raise CycleError(cycle[:-1]) from None
    ready: list[tuple[str, int, Hashable]] = []
    tie = itertools.count()  # nodes whose str is equal keep their first-seen order
    order: list[Hashable] = []
    while sorter.is_active():
        for n in sorter.get_ready():
            heapq.heappush(ready, (str(n), next(tie), n))
        n = heapq.heappop(ready)[2]
        order.append(n)
        sorter.done(n)
    index = {n: i for i, n in enumerate(order)}
    preds = [sorted(index[p] for p in preds_of[n]) for n in order]
    return order, preds


def successors(preds: Preds) -> list[list[int]]:
    succ: list[list[int]] = [[] for _ in preds]
    for v, ps in enumerate(preds):
        for u in ps:
            succ[u].append(v)
    return succ
