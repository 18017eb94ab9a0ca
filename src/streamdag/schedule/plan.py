"""A complete static schedule: the one entry point of the pure scheduling layer."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace

from .chains import assign_streams, chains_from_matching, match_closure, match_paths
from .dag import Preds, check_order
from .levels import critical_path, wavefront_levels
from .reduction import reduce_transitively
from .waits import Clocks, PyStreamClocks, Stamp, plan_waits

__all__ = ["CLOSURE_LIMIT", "Schedule", "build_schedule", "pin_ops"]

#: Graphs up to this many ops get their chain count reduced to the DAG's width.
CLOSURE_LIMIT = 20_000


@dataclass(frozen=True)
class Schedule:
    """Where and after what each op runs.

    ``preds`` is the transitive reduction of the dependencies; ``stream[v]`` the
    stream of op ``v``; ``waits[v]`` the ops on other streams whose events ``v``
    waits on (the fewest that keep every dependency); ``order[s]`` the ops of
    stream ``s`` in the order they run.
    """

    preds: tuple[tuple[int, ...], ...]
    levels: tuple[tuple[int, ...], ...]
    chains: int
    width: int | None
    stream: tuple[int, ...]
    order: tuple[tuple[int, ...], ...]
    waits: tuple[tuple[int, ...], ...]
    critical_path: tuple[int, ...]
    critical_cost: float
    removed_edges: int

    @property
    def num_ops(self) -> int:
        return len(self.stream)

    @property
    def num_streams(self) -> int:
        return len(self.order)

    @property
    def num_waits(self) -> int:
        return sum(len(w) for w in self.waits)

    @property
    def cross_stream_edges(self) -> int:
        return sum(1 for v, ps in enumerate(self.preds) for u in ps if self.stream[u] != self.stream[v])


def _assign(reduced: list[list[int]], reach: list[int], max_streams: int, costs: list[float],
            closure_limit: int) -> tuple[list[int], int, int | None]:
    """Streams from a minimum chain cover; returns (stream of each op, chains, width or None)."""
    n = len(reduced)
    match_l, match_r = match_paths(reduced)
    width = None
    if n <= closure_limit:
        match_closure(reach, match_l, match_r)
        width = n - sum(1 for v in match_l if v != -1)
    chains = chains_from_matching(match_l, match_r)
    return assign_streams(chains, reach, max_streams, costs), len(chains), width


def _assign_grouped(reach: list[int], groups: Sequence[int], max_streams: int, costs: list[float],
                    closure_limit: int) -> tuple[list[int], int, int | None]:
    """Chain each group's ops apart, keeping the order the whole graph imposes on them."""
    n = len(reach)
    stream = [0] * n
    chains, width = 0, 0
    for g in sorted(set(groups)):
        members = [v for v in range(n) if groups[v] == g]
        local = {v: i for i, v in enumerate(members)}
        # u precedes v within the group when v is reachable from u in the whole graph
        sub_preds: list[list[int]] = [[] for _ in members]
        for u in members:
            r = reach[u]
            for v in members:
                if v > u and (r >> v) & 1:
                    sub_preds[local[v]].append(local[u])
        sub_reduced, sub_reach = reduce_transitively(sub_preds)
        sub_stream, sub_chains, sub_width = _assign(
            sub_reduced, sub_reach, max_streams, [costs[v] for v in members], closure_limit)
        for v, s in zip(members, sub_stream):
            stream[v] = g * max_streams + s
        chains += sub_chains
        width = None if width is None or sub_width is None else width + sub_width
    return stream, chains, width


def build_schedule(
    preds: Preds,
    max_streams: int,
    costs: Sequence[float] | None = None,
    closure_limit: int = CLOSURE_LIMIT,
    groups: Sequence[int] | None = None,
    clocks: Callable[[int], Clocks] = PyStreamClocks,
) -> Schedule:
    """Schedule a DAG whose ops are numbered in a topological order (see :mod:`.dag`).

    ``groups[v]`` (optional) is the device of op ``v``: ops of group ``g`` get
    streams ``g * max_streams`` to ``g * max_streams + max_streams - 1``,
    chained within their group only; waits span groups as they must.
    ``clocks`` makes the stream clocks that plan the waits (the compiled ones
    place the same, faster: ``streamdag.build_schedule`` passes them).
    """
    check_order(preds)
    n = len(preds)
    costs = [1.0] * n if costs is None else list(costs)
    if len(costs) != n:
        raise ValueError(f"got {len(costs)} costs for {n} ops")
    reduced, reach = reduce_transitively(preds)
    if groups is None or len(set(groups)) <= 1:
        base = max_streams * (groups[0] if groups else 0)
        stream, chains, width = _assign(reduced, reach, max_streams, costs, closure_limit)
        stream = [base + s for s in stream]
    else:
        if len(groups) != n:
            raise ValueError(f"got {len(groups)} groups for {n} ops")
        stream, chains, width = _assign_grouped(reach, groups, max_streams, costs, closure_limit)
    num_streams = max(stream, default=-1) + 1
    order: list[list[int]] = [[] for _ in range(num_streams)]
    for v in range(n):
        order[stream[v]].append(v)
    placed = clocks(max(num_streams, 1))  # (no ops: no streams, and clocks for one)
    stamps: list[Stamp] = []
    waits: list[tuple[int, ...]] = []
    for v in range(n):
        deps = [u for u in reduced[v] if stream[u] != stream[v]]
        stamp, chosen = placed.place(stream[v], [stamps[u] for u in deps])
        stamps.append(stamp)
        waits.append(tuple(sorted(deps[i] for i in chosen)))
    path, cost = critical_path(reduced, costs)
    return Schedule(
        preds=tuple(tuple(p) for p in reduced),
        levels=tuple(tuple(lv) for lv in wavefront_levels(reduced)),
        chains=chains,
        width=width,
        stream=tuple(stream),
        order=tuple(tuple(o) for o in order),
        waits=tuple(waits),
        critical_path=tuple(path),
        critical_cost=cost,
        removed_edges=sum(len(set(p)) for p in preds) - sum(len(p) for p in reduced),
    )


def pin_ops(sched: Schedule, pinned: Sequence[Hashable | None],
            clocks: Callable[[int], Clocks] = PyStreamClocks) -> Schedule:
    """``sched`` with the ops that have a ``pinned[v]`` key moved to one extra stream per key.

    Copies run on copy streams (one per device and direction), not on the
    chains the schedule gave them; their streams follow the schedule's, in
    the order keys first appear, and the waits are planned anew (on ``clocks``, as
    :func:`build_schedule`).
    """
    extra: dict[Hashable, int] = {}
    stream = list(sched.stream)
    for v, key in enumerate(pinned):
        if key is not None:
            stream[v] = extra.setdefault(key, sched.num_streams + len(extra))
    if not extra:
        return sched
    order: list[list[int]] = [[] for _ in range(sched.num_streams + len(extra))]
    for v, s in enumerate(stream):
        order[s].append(v)
    waits = plan_waits(sched.preds, stream, len(order), clocks)
    return replace(sched, stream=tuple(stream), order=tuple(tuple(o) for o in order),
                   waits=tuple(tuple(w) for w in waits))
