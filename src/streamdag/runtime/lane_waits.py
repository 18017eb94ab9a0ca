"""Waits inside lane ops for other lane ops of the same runtime: the one deadlock a runtime can see.

An op running on a lane (a CPU runtime's stream, or a host lane beside a
device) may submit ops and wait for them: fork and join. The submitted op
is queued on a lane and runs there in order. If lane A's op waits for an
op queued on lane B, whose op waits for an op queued on lane A, neither
can ever run, whatever other lanes are free: a lane runs its ops in order,
and the runtime cannot move a queued op elsewhere (ops after the waiting
one may depend on it). So the waits form a graph of lanes, each waiting
lane pointing at the lane of the op it waits for, and the wait that would
close a cycle in it raises instead, with what to do. Its op then fails,
its lane goes on, and the others' waits end.

Only waits without a timeout count (one with a timeout ends by itself), only
waits by this runtime's lane threads, and only for ops that a lane thread
placed on one of its lanes (the futures that :meth:`Runtime._admit` marks
with their lane): a device op finishes without any lane, and an op of
another runtime runs on that runtime's lanes. A wait through
``concurrent.futures.wait`` or ``await`` is not seen.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["LaneWaits"]


class LaneWaits:
    """The waits of a runtime's lane threads for lane ops, by thread. ``lanes``: the runtime's lane
    streams (each with ``runs_here()``); held here rather than the runtime, which futures must not
    keep alive."""

    def __init__(self, lanes: list[Any]) -> None:
        self._lanes = lanes
        self.lanes = len(lanes)
        self._lock = threading.Lock()
        #: thread ident -> (the future it waits for, the lane it runs); None: a wait with a timeout
        self._waits: dict[int, tuple[Any, Any] | None] = {}

    @contextmanager
    def waiting(self, future: Any, timeout: float | None) -> Iterator[None]:
        """Around a wait for ``future``: raises instead where the waiting thread is a lane of the
        runtime and the wait would close a cycle of lanes waiting for each other's queued ops."""
        mine = next((lane for lane in self._lanes if lane.runs_here()), None)
        if mine is None:  # not a lane of this runtime's
            yield
            return
        me = threading.get_ident()
        with self._lock:
            if timeout is None and not future.done():
                cycle = self._cycle(mine, future)
                if cycle:
                    raise RuntimeError(
                        f"waiting inside an op for op {future.op_name!r} would wait forever: it is "
                        f"queued on a lane whose op waits, in turn, for ops queued behind this one "
                        f"({cycle} lanes of this runtime's {self.lanes} wait for each other), so none "
                        "of those can run. Give the runtime more lanes (streams= on a CPU runtime, "
                        "host_lanes= beside a device), or add a done-callback instead of waiting "
                        "inside the op")
            outer = self._waits.get(me)  # (a wait inside a done-callback run by a wait)
            self._waits[me] = (future, mine) if timeout is None else None
        try:
            yield
        finally:
            with self._lock:
                if outer is None:
                    self._waits.pop(me, None)
                else:
                    self._waits[me] = outer

    def _cycle(self, mine: Any, future: Any) -> int:
        """How many lanes a wait on ``mine`` for ``future`` would close a cycle of (0: none). Each
        waiting lane points at the lane its awaited op is queued on; a lane whose op does not wait
        goes on, and the chain ends there. Holds ``_lock``."""
        waiting_on = {}  # id of a lane -> the op its op waits for
        for wait in self._waits.values():
            if wait is not None and not wait[0].done():
                waiting_on[id(wait[1])] = wait[0]
        lane, seen = future.__dict__.get("_lane"), 1
        while lane is not None and seen <= self.lanes:
            if lane is mine:
                return seen
            waited = waiting_on.get(id(lane))
            if waited is None:
                return 0
            lane, seen = waited.__dict__.get("_lane"), seen + 1
        return 0
