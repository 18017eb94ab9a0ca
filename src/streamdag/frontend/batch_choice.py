"""Per group, batching or streams: the cost model's estimate from measured op times.

The unbatched graph's members of a group are estimated running side by side
on the streams its schedule has (:func:`~streamdag.schedule.cost.simulate`,
processor sharing); the batched graph's ops for the group are measured. A
group pays when its batched ops take less than its members on streams;
groups whose members read each other's results are decided together. The
estimate ignores what else runs beside a group, which is why the variant
finally run is still chosen by timing whole replays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..runtime.accel import build_schedule
from ..schedule.cost import simulate
from .batching import BatchGroup

__all__ = ["GroupEstimate", "estimate_groups", "linked_sets", "paying_groups"]


@dataclass(frozen=True)
class GroupEstimate:
    group: BatchGroup
    streams_ms: float  # the members side by side on the streams, by the cost model
    serial_ms: float  # the members one after another, measured
    batched_ms: float  # the batched op(s), measured

    @property
    def pays(self) -> bool:
        return self.batched_ms < self.streams_ms

    def __str__(self) -> str:
        g = self.group
        names = ", ".join(g.members[:3]) + (f", ... +{len(g.members) - 3}" if len(g.members) > 3 else "")
        verdict = "batch" if self.pays else "keep on streams"
        return (f"{g.kind} x{len(g.members)} ({names}): on streams ~{self.streams_ms:.4f} ms "
                f"({self.serial_ms:.4f} one after another), batched {self.batched_ms:.4f} ms: {verdict}")


def estimate_groups(
    groups: Sequence[BatchGroup],
    streams_op_ms: Mapping[str, float],
    batched_op_ms: Mapping[str, float],
    streams: int,
) -> list[GroupEstimate]:
    """An estimate for every group whose members and ops were all timed; the others are left out."""
    out = []
    for g in groups:
        if not all(m in streams_op_ms for m in g.members) or not all(o in batched_op_ms for o in g.ops):
            continue
        durations = [streams_op_ms[m] for m in g.members]
        side_by_side = build_schedule([[] for _ in durations], max(1, min(streams, len(durations))))
        out.append(GroupEstimate(g, simulate(side_by_side, durations), sum(durations),
                                 sum(batched_op_ms[o] for o in g.ops)))
    return out


def linked_sets(groups: Sequence[BatchGroup], inputs_of: Mapping[str, Sequence[str]]) -> list[list[int]]:
    """Groups joined when one's members read another's results, as lists of indices.

    Batching one of two linked groups but not the other costs a stack (a copy)
    or slices between them that neither estimate sees, so linked groups are
    decided together.
    """
    owner = {m: i for i, g in enumerate(groups) for m in g.members}
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for j, g in enumerate(groups):
        for m in g.members:
            for src in inputs_of.get(m, ()):
                i = owner.get(src)
                if i is not None:
                    parent[root(i)] = root(j)
    sets: dict[int, list[int]] = {}
    for i in range(len(groups)):
        sets.setdefault(root(i), []).append(i)
    return list(sets.values())


def paying_groups(
    estimates: Sequence[GroupEstimate], groups: Sequence[BatchGroup],
    inputs_of: Mapping[str, Sequence[str]] | None = None,
) -> frozenset[frozenset[str]] | None:
    """Keys of the groups worth batching, or None when that is all of them or none (no new variant).

    Linked groups (:func:`linked_sets`) are batched together when their
    batched ops take less in total than their members on streams.
    """
    if len(estimates) != len(groups):  # a group without an estimate: no basis for a mixed variant
        return None
    by_key = {e.group.key: e for e in estimates}
    paying: set[frozenset[str]] = set()
    for members in linked_sets(groups, inputs_of or {}):
        ests = [by_key[groups[i].key] for i in members]
        if sum(e.batched_ms for e in ests) < sum(e.streams_ms for e in ests):
            paying.update(e.group.key for e in ests)
    return frozenset(paying) if 0 < len(paying) < len(groups) else None
