"""Dependencies from data: which earlier ops a new op must wait for.

State (plain data): for each address space, the entries
``(start, end, node, write)`` of the accesses that may still matter, sorted
by start, and the length of the longest one. A new op that reads a region
depends on every earlier overlapping *write* (read-after-write); one that
writes depends on every earlier overlapping access (write-after-read,
write-after-write). Reads never wait for reads.

Look-ups bisect the sorted starts: only entries starting within the longest
entry's length before the region can overlap it, so a look-up costs the
entries near the region, not all of them.

An entry is dropped once a later write covers it entirely: that write already
depends on it, so anything that will depend on the entry depends on the write.
The owner may also drop entries of finished ops (:meth:`forget`), or name a
``retired`` predicate that drops them as the entries grow.

Nodes are opaque to this module; it never looks inside them.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Hashable, Iterable
from itertools import count

from .buffers import Access

__all__ = ["DepsTracker"]

Entry = tuple[int, int, Hashable, bool, int]  # start, end, node, write, order added


class _Space:
    """The entries of one address space, sorted by start."""

    __slots__ = ("compact_at", "entries", "longest", "starts")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.entries: list[Entry] = []
        self.longest = 0
        self.compact_at = 16

    def near(self, start: int, end: int) -> range:
        """Indices of the entries that may overlap ``[start, end)``."""
        lo = bisect_right(self.starts, start - self.longest)
        return range(lo, bisect_left(self.starts, end))

    def insert(self, entry: Entry) -> None:
        i = bisect_right(self.starts, entry[0])
        self.starts.insert(i, entry[0])
        self.entries.insert(i, entry)
        self.longest = max(self.longest, entry[1] - entry[0])

    def drop_covered(self, start: int, end: int) -> None:
        lo, hi = bisect_left(self.starts, start), bisect_left(self.starts, end)
        kept = [e for e in self.entries[lo:hi] if e[1] > end]
        if len(kept) != hi - lo:
            self.entries[lo:hi] = kept
            self.starts[lo:hi] = [e[0] for e in kept]

    def keep(self, wanted: Callable[[Entry], bool]) -> None:
        self.entries = [e for e in self.entries if wanted(e)]
        self.starts = [e[0] for e in self.entries]


class DepsTracker:
    """Sequentially consistent hazard tracking over byte ranges (RAW, WAR, WAW)."""

    def __init__(self, retired: Callable[[Hashable], bool] | None = None) -> None:
        self._spaces: dict[str, _Space] = {}
        self._retired = retired
        self._order = count()

    def __len__(self) -> int:
        return sum(len(s.entries) for s in self._spaces.values())

    def depends_on(self, accesses: Iterable[Access]) -> list[Hashable]:
        """Earlier nodes that an op with ``accesses`` must follow, in the order they were added."""
        found: dict[Hashable, int] = {}
        retired = self._retired
        for acc in accesses:
            r = acc.region
            if r.start == r.end:
                continue
            space = self._spaces.get(r.space)
            if space is None:
                continue
            if retired is not None and len(space.entries) >= space.compact_at:
                # drop what no longer matters; amortized: only once the entries have doubled
                space.keep(lambda e: not retired(e[2]))
                space.compact_at = max(16, 2 * len(space.entries))
            entries = space.entries
            for i in space.near(r.start, r.end):
                _, end, node, was_write, order = entries[i]
                if end > r.start and (acc.write or was_write) and order < found.get(node, order + 1):
                    found[node] = order
        return sorted(found, key=found.__getitem__)

    def add(self, node: Hashable, accesses: Iterable[Access]) -> None:
        """Record ``node``'s accesses; call after :meth:`depends_on` for the same node."""
        for acc in accesses:
            r = acc.region
            if r.start == r.end:
                continue
            space = self._spaces.get(r.space)
            if space is None:
                space = self._spaces[r.space] = _Space()
            if acc.write:
                space.drop_covered(r.start, r.end)
            space.insert((r.start, r.end, node, acc.write, next(self._order)))

    def forget(self, finished: Callable[[Hashable], bool]) -> None:
        """Drop the entries of nodes for which ``finished(node)`` is true."""
        for name in list(self._spaces):
            space = self._spaces[name]
            space.keep(lambda e: not finished(e[2]))
            if not space.entries:
                del self._spaces[name]

    def clear(self) -> None:
        self._spaces.clear()
