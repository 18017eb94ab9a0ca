"""Dependencies from data: which earlier ops a new op must wait for.

State (plain data): for each address space, one record per distinct byte
range accessed, ``[start, end)``, holding the last op that wrote it and the
ops that read it since. A new op that reads a range depends on the writer of
every overlapping record (read-after-write); one that writes depends on the
writers and the readers (write-after-read, write-after-write). Reads never
wait for reads. A write replaces its record's writer and readers: anything
that would depend on them depends on the write, which follows them.

Records are kept sorted by start, with the length of the longest, so that
finding the records overlapping a range bisects to the few near it. Most
ops access exactly the ranges earlier ops did (the same tensors again): a
dictionary finds that record at once, and a record that no other record
overlaps needs no search at all.

The owner may drop the ops that no longer matter (:meth:`forget`), or name a
``retired`` predicate that drops them as the records grow.

Nodes are opaque to this module; it never looks inside them. The runtime
runs a compiled twin of the tracker (its fields and ``link`` in C, the rest
the methods here), chosen in ``runtime/accel.py``; this one is the reference.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Hashable, Iterable
from itertools import islice
from typing import Any

from .buffers import Access

__all__ = ["DepsTracker", "PyDepsTracker"]


class _PyRecord:
    """One byte range: its last writer and the readers since, each as ``(node, order added)``.

    (The compiled ``Record`` has the same fields; annotations name this one for both.)
    """

    __slots__ = ("end", "last", "readers", "shared", "start", "writer")

    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self.writer: tuple[Hashable, int] | None = None
        self.readers: list[tuple[Hashable, int]] = []
        #: another record overlaps this one (or did): a look-up must search the neighbours
        self.shared = False
        #: the order of the last access to the range
        self.last = 0

    def size(self) -> int:
        return len(self.readers) + (self.writer is not None)


#: a record idle for this many accesses may be dropped; doubled while the records made are mostly
#: of dropped ranges that came back
_FIRST_HORIZON = 64
_MAX_HORIZON = 1 << 14


class _PySpaceFields:
    __slots__ = ("by_range", "came_back", "compact_at", "count", "dropped", "horizon", "longest",
                 "made", "records", "scanned", "starts")


class _SpaceMethods:
    """The records of one address space: by exact range, and sorted by start."""

    __slots__ = ()
    #: the class of its records (the compiled one goes with the compiled fields)
    record_type: Any = _PyRecord

    def __init__(self) -> None:
        self.by_range: dict[tuple[int, int], _PyRecord] = {}
        self.starts: list[int] = []
        self.records: list[_PyRecord] = []
        self.longest = 0
        self.count = 0  # writers and readers held, for compaction
        #: records looked at by searches since the last compaction: work that compaction also pays
        #: for (a wide range over many small ones, idle since, is scanned again at every access)
        self.scanned = 0
        self.compact_at = 64
        self.horizon = _FIRST_HORIZON
        #: ranges whose records were dropped, oldest first (at most ``_MAX_HORIZON`` remembered)
        self.dropped: dict[tuple[int, int], None] = {}
        self.made = 0  # records made since the last compaction
        self.came_back = 0  # of those, how many were of dropped ranges

    def overlapping(self, start: int, end: int) -> list[_PyRecord]:
        """The records overlapping ``[start, end)``."""
        starts, records = self.starts, self.records
        lo = bisect_right(starts, start - self.longest)
        hi = bisect_left(starts, end)
        return [r for r in records[lo:hi] if r.end > start]

    def record(self, start: int, end: int) -> _PyRecord:
        """The record of exactly ``[start, end)``, made (and its neighbours told) if new."""
        rec = self.by_range.get((start, end))
        if rec is not None:
            return rec
        self.made += 1
        if self.dropped.pop((start, end), 0) is None:
            self.came_back += 1
        rec = self.record_type(start, end)
        for other in self.overlapping(start, end):
            other.shared = rec.shared = True
        i = bisect_right(self.starts, start)
        self.starts.insert(i, start)
        self.records.insert(i, rec)
        self.by_range[(start, end)] = rec
        if end - start > self.longest:
            self.longest = end - start
        return rec

    def keep(self, gone: Callable[[Hashable], bool], now: int) -> None:
        """Drop the nodes that are ``gone``; and the empty records idle for ``horizon`` accesses, once
        half are.

        An empty record of a range in use costs nothing to keep and saves
        making it again for the next op on that range (the common case: the
        same tensors, op after op, reused every few ops; or a wide graph run
        again and again, each range used once per run). Records of ranges no
        longer used (fresh allocations) go once they are half of all, so the
        records stay within about twice those in use. The horizon starts
        short and doubles while at least a quarter of the records made are of
        dropped ranges that came back: it grows to the period at which the
        program reuses its memory, but not for a few recurring ranges among
        many new ones (there, keeping every new range that long would cost
        more than remaking the few).
        """
        if self.came_back and 4 * self.came_back >= self.made:
            self.horizon = min(2 * self.horizon, _MAX_HORIZON)
        self.made = self.came_back = 0
        idle_since = now - self.horizon
        count = 0
        stale: list[_PyRecord] = []
        for rec in self.records:
            if rec.writer is not None and gone(rec.writer[0]):
                rec.writer = None
            if rec.readers:
                rec.readers = [r for r in rec.readers if not gone(r[0])]
            size = len(rec.readers) + (rec.writer is not None)
            count += size
            if not size and rec.last < idle_since:
                stale.append(rec)
        self.count = count
        if stale and 2 * len(stale) >= len(self.records):
            dropped = self.dropped
            for rec in stale:
                key = (rec.start, rec.end)
                del self.by_range[key]
                dropped[key] = None
            for key in list(islice(dropped, max(0, len(dropped) - _MAX_HORIZON))):
                del dropped[key]
            self.records = [r for r in self.records if (r.start, r.end) in self.by_range]
            self.starts = [r.start for r in self.records]


class _TrackerMethods:
    """Sequentially consistent hazard tracking over byte ranges (RAW, WAR, WAW)."""

    __slots__ = ()
    #: the class of its spaces (the compiled one goes with the compiled fields)
    space_type: Any = None

    def __init__(self, retired: Callable[[Hashable], bool] | None = None) -> None:
        self._spaces: dict[str, Any] = {}
        self._retired = retired
        self._order = 0

    def __len__(self) -> int:
        """Accesses held: a writer or a reader of some range."""
        return sum(s.count for s in self._spaces.values())

    def depends_on(self, accesses: Iterable[Access]) -> list[Hashable]:
        """Earlier nodes that an op with ``accesses`` must follow, in the order they were added."""
        found: dict[Hashable, int] = {}
        for (space_name, start, end), write in accesses:
            if start == end:
                continue
            space = self._spaces.get(space_name)
            if space is None:
                continue
            rec = space.by_range.get((start, end))
            _collect((rec,) if rec is not None and not rec.shared else space.overlapping(start, end),
                     write, found)
        return _in_order(found)

    def add(self, node: Hashable, accesses: Iterable[Access]) -> None:
        """Record ``node``'s accesses; call after :meth:`depends_on` for the same node."""
        for (space_name, start, end), write in accesses:
            if start != end:
                space = self._space(space_name)
                self._enter(node, space, space.record(start, end), write)

    def _space(self, name: str) -> _PySpace:
        """The space named ``name``, made if new, compacted when due."""
        space = self._spaces.get(name)
        if space is None:
            space = self._spaces[name] = self.space_type()
        elif space.count + space.scanned >= space.compact_at:
            self._compact(space)
        return space

    def _enter(self, node: Hashable, space: Any, rec: Any, write: bool) -> None:
        """``node`` becomes the writer of ``rec`` (replacing the readers) or one more reader."""
        self._order += 1
        rec.last = self._order
        if write:
            space.count += 1 - rec.size()
            rec.writer = (node, self._order)
            rec.readers = []
        else:
            space.count += 1
            rec.readers.append((node, self._order))

    def _compact(self, space: Any) -> None:
        """Drop retired nodes: amortized, since the adds in between outnumber what it visits."""
        retired = self._retired
        if retired is not None:
            space.keep(retired, self._order)
        # the next compaction comes after at least as many adds (or records scanned) as this one visited
        space.scanned = 0
        space.compact_at = space.count + max(64, len(space.records) + space.count)

    def forget(self, finished: Callable[[Hashable], bool]) -> None:
        """Drop the entries of nodes for which ``finished(node)`` is true."""
        for name in list(self._spaces):
            space = self._spaces[name]
            space.keep(finished, self._order)
            if not space.records:
                del self._spaces[name]

    def clear(self) -> None:
        self._spaces.clear()


def _collect(records: Iterable[_PyRecord], write: bool, found: dict[Hashable, int]) -> None:
    """Add to ``found`` the nodes an access must follow in ``records``, each at its earliest order."""
    for rec in records:
        if rec.writer is not None:
            node, order = rec.writer
            if order < found.get(node, order + 1):
                found[node] = order
        if write:
            for node, order in rec.readers:
                if order < found.get(node, order + 1):
                    found[node] = order


def _in_order(found: dict[Hashable, int]) -> list[Hashable]:
    return list(found) if len(found) < 2 else sorted(found, key=found.__getitem__)


class _PyTrackerFields:
    __slots__ = ("_order", "_retired", "_spaces")

    def link(self, node: Hashable, accesses: Iterable[Access]) -> list[Hashable]:
        """:meth:`depends_on` then :meth:`add` in one pass over the records: the runtime's path."""
        found: dict[Hashable, int] = {}
        touched: list[tuple[Any, Any, bool]] = []
        spaces = self._spaces
        for (space_name, start, end), write in accesses:  # runs for every op: _collect and _enter
            if start == end:                                # are written out for the common case
                continue
            space = spaces.get(space_name)
            if space is None or space.count + space.scanned >= space.compact_at:
                space = self._space(space_name)
            rec = space.by_range.get((start, end)) or space.record(start, end)
            # used now: a compaction later in this link (at another access) must not drop it as
            # idle, which left this op's entry in a record no look-up finds
            rec.last = self._order + 1
            touched.append((space, rec, write))
            if rec.shared:
                near = space.overlapping(start, end)
                space.scanned += len(near)
                _collect(near, write, found)
                continue
            if rec.writer is not None:  # the one record of this range: _collect, inline
                dep, order = rec.writer
                if order < found.get(dep, order + 1):
                    found[dep] = order
            if write:
                for dep, order in rec.readers:
                    if order < found.get(dep, order + 1):
                        found[dep] = order
        order = self._order
        # one entry serves all of the node's accesses, at its first order: deps are sorted by order,
        # and a link's orders come after every earlier link's, so the sort is the same as with one each
        entry = (node, order + 1)
        for space, rec, write in touched:  # after the look-ups: an op never depends on itself
            order += 1
            rec.last = order
            if write:  # _enter, inline
                space.count += 1 - len(rec.readers) - (rec.writer is not None)
                rec.writer = entry
                rec.readers = []
            else:
                space.count += 1
                rec.readers.append(entry)
        self._order = order
        return list(found) if len(found) < 2 else sorted(found, key=found.__getitem__)


class _PySpace(_SpaceMethods, _PySpaceFields):
    __slots__ = ()


class PyDepsTracker(_TrackerMethods, _PyTrackerFields):
    """:class:`DepsTracker` all in Python: the reference that the compiled one is checked against."""

    space_type = _PySpace


#: the tracker of this pure layer; the runtime takes its compiled twin where that is built
#: (``runtime/accel.py`` chooses)
DepsTracker = PyDepsTracker
