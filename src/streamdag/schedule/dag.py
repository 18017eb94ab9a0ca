"""DAGs as plain data: node ``i`` is the ``i``-th op, ``preds[i]`` the ops it follows.

Submission order is a topological order (an op can only depend on ops
submitted before it), so every scheduling function here takes graphs whose
edges point from a lower index to a higher one. :func:`from_edges` brings any
other DAG into that form, or says where its cycle is.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import networkx as nx

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

    ``order[i]`` is the node that became op ``i``. A cycle raises
    :class:`CycleError` naming it.
    """
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    try:
        order = list(nx.lexicographical_topological_sort(g, key=str))
    except nx.NetworkXUnfeasible:
        cycle = [u for u, _ in nx.find_cycle(g)]
        raise CycleError(cycle) from None
    index = {n: i for i, n in enumerate(order)}
    preds = [sorted(index[p] for p in g.predecessors(n)) for n in order]
    return order, preds


def successors(preds: Preds) -> list[list[int]]:
    succ: list[list[int]] = [[] for _ in preds]
    for v, ps in enumerate(preds):
        for u in ps:
            succ[u].append(v)
    return succ
