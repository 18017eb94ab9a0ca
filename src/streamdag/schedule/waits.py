"""The fewest event waits that keep every cross-stream dependency.

Each stream carries a vector clock: for every stream, the last position known
to be complete when the stream's next op starts. A dependency on op ``u``
(stream ``s``, position ``p``) is already implied when the clock shows
``s >= p``: stream order and earlier waits have ordered it. Otherwise the op
waits on ``u``'s event and learns ``u``'s clock. Dependencies that know most
are visited first, so one wait can imply the others.

The same planner serves static schedules and the runtime's online
placement. It is pure: positions and clocks are plain ints.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

__all__ = ["Clocks", "PyStreamClocks", "Stamp", "StreamClocks", "plan_waits"]


class Stamp(NamedTuple):
    """Where an op ran: its stream, its 1-based position there, and its vector clock.

    A named tuple: one is made per submitted op, and a frozen dataclass costs
    several times more to build.
    """

    stream: int
    pos: int
    clock: tuple[int, ...]


_new = tuple.__new__  # builds a named tuple without its Python-level ``__new__``


class PyStreamClocks:
    """Vector clocks for ``num_streams`` streams (the reference for the compiled ones)."""

    def __init__(self, num_streams: int) -> None:
        self.num_streams = num_streams
        self._known = [[0] * num_streams for _ in range(num_streams)]

    def tail(self, stream: int) -> int:
        """Position of the last op placed on ``stream`` (0 when none)."""
        return self._known[stream][stream]

    def implied(self, stream: int, dep: Stamp) -> bool:
        return self._known[stream][dep.stream] >= dep.pos

    def place(self, stream: int, deps: Sequence[Stamp]) -> tuple[Stamp, list[int]]:
        """Put the next op on ``stream``; returns its stamp and the indices of ``deps`` to wait on.

        No returned wait is implied by stream order and the other returned waits.
        """
        base = self._known[stream]
        waits: list[int] = []
        if len(deps) == 1:  # the common case, without the sort
            d = deps[0]
            if base[d.stream] < d.pos:
                waits.append(0)
                known = list(map(max, base, d.clock))
            else:
                known = list(base)
        else:
            known = list(base)
            order = sorted(range(len(deps)), key=lambda i: -sum(deps[i].clock)) if deps else ()
            for i in order:
                d = deps[i]
                if known[d.stream] < d.pos:
                    waits.append(i)
                    known = list(map(max, known, d.clock))
        if len(waits) > 1:  # a later wait may imply an earlier one: drop those
            for i in list(waits):
                others = list(base)
                for j in waits:
                    if j != i:
                        others = list(map(max, others, deps[j].clock))
                if others[deps[i].stream] >= deps[i].pos:
                    waits.remove(i)
        known[stream] += 1
        self._known[stream] = known
        return _new(Stamp, (stream, known[stream], tuple(known))), waits


class Clocks(Protocol):
    """What the planners need of stream clocks: :class:`PyStreamClocks` or its compiled twin."""

    def place(self, stream: int, deps: Sequence[Stamp]) -> tuple[Stamp, list[int]]: ...


#: the clocks of this pure layer; the runtime takes their compiled twin where it is built
#: (``runtime/accel.py`` chooses)
StreamClocks = PyStreamClocks


def plan_waits(preds: Sequence[Sequence[int]], streams: Sequence[int], num_streams: int,
               clocks: Callable[[int], Clocks] = PyStreamClocks) -> list[tuple[int, ...]]:
    """For ops in topological order placed on ``streams``: the ops each must wait on, none redundant.

    For a placement other than a schedule's own (copies moved to copy streams, say). ``clocks``
    makes the clocks for ``num_streams`` streams (the compiled ones place the same, faster).
    """
    placed = clocks(num_streams)
    stamps: list[Stamp] = []
    waits: list[tuple[int, ...]] = []
    for v, ps in enumerate(preds):
        deps = [u for u in ps if streams[u] != streams[v]]
        stamp, chosen = placed.place(streams[v], [stamps[u] for u in deps])
        stamps.append(stamp)
        waits.append(tuple(deps[i] for i in chosen))
    return waits
