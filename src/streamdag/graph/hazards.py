"""Dependencies from data: which earlier ops a new op must wait for.

State (plain data): for each address space, a list of entries
``(start, end, node, write)`` for the accesses that may still matter. A new
op that reads a region depends on every earlier overlapping *write*
(read-after-write); one that writes depends on every earlier overlapping
access (write-after-read, write-after-write). Reads never wait for reads.

An entry is dropped once a later write covers it entirely: that write already
depends on it, so anything that will depend on the entry depends on the write.
The owner may also drop entries of finished ops (:meth:`forget`), or name a
``retired`` predicate that drops them during every look-up.

Nodes are opaque to this module; it never looks inside them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

from .buffers import Access

__all__ = ["DepsTracker"]


class DepsTracker:
    """Sequentially consistent hazard tracking over byte ranges (RAW, WAR, WAW)."""

    def __init__(self, retired: Callable[[Hashable], bool] | None = None) -> None:
        self._entries: dict[str, list[tuple[int, int, Hashable, bool]]] = {}
        self._retired = retired
        self._compact_at: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def depends_on(self, accesses: Iterable[Access]) -> list[Hashable]:
        """Earlier nodes that an op with ``accesses`` must follow, in the order they were added."""
        found: dict[Hashable, None] = {}
        retired = self._retired
        for acc in accesses:
            r = acc.region
            if r.start == r.end:
                continue
            entries = self._entries.get(r.space)
            if not entries:
                continue
            if retired is not None and len(entries) >= self._compact_at.get(r.space, 16):
                # drop what no longer matters; amortized: only once the list has doubled
                entries[:] = [e for e in entries if not retired(e[2])]
                self._compact_at[r.space] = max(16, 2 * len(entries))
            for start, end, node, was_write in entries:
                if start < r.end and r.start < end and (acc.write or was_write):
                    found[node] = None
        return list(found)

    def add(self, node: Hashable, accesses: Iterable[Access]) -> None:
        """Record ``node``'s accesses; call after :meth:`depends_on` for the same node."""
        for acc in accesses:
            r = acc.region
            if r.start == r.end:
                continue
            entries = self._entries.setdefault(r.space, [])
            if acc.write:
                entries[:] = [
                    e for e in entries if not (r.start <= e[0] and e[1] <= r.end)
                ]
            entries.append((r.start, r.end, node, acc.write))

    def forget(self, finished: Callable[[Hashable], bool]) -> None:
        """Drop the entries of nodes for which ``finished(node)`` is true."""
        for space in list(self._entries):
            kept = [e for e in self._entries[space] if not finished(e[2])]
            if kept:
                self._entries[space] = kept
            else:
                del self._entries[space]

    def clear(self) -> None:
        self._entries.clear()
