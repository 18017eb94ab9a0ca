"""Waits inside lane ops for other lane ops of the same runtime: the one deadlock a runtime can see.

An op running on a lane (a CPU runtime's stream, or a host lane beside a
device) may submit ops and wait for them: fork and join. The submitted op
needs a lane to run. If every lane's op waits so, none of those ops can
ever run: each waits for a lane that only a finished wait would free. The
runtime cannot run such an op elsewhere (a lane runs its ops in order, and
ops after the waiting one may depend on it), but it can see the state: the
wait that would make every lane of the runtime wait, each for a lane op not
done, raises instead, with what to do. Its op then fails, its lane goes on,
and the others' waits end.

Only waits without a timeout count (one with a timeout ends by itself), only
waits by this runtime's lane threads, and only for ops that a lane thread
placed on one of its lanes (the futures that :meth:`Runtime._admit` marks):
a device op finishes without any lane, and an op of another runtime runs on
that runtime's lanes. A wait through ``concurrent.futures.wait`` or
``await`` is not seen.
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
        self._waits: dict[int, Any] = {}  # thread ident -> the future it waits for (None: with a timeout)

    @contextmanager
    def waiting(self, future: Any, timeout: float | None) -> Iterator[None]:
        """Around a wait for ``future``: raises instead where the waiting thread is a lane of the
        runtime and every lane would then wait."""
        if not any(lane.runs_here() for lane in self._lanes):  # not a lane of this runtime's
            yield
            return
        me = threading.get_ident()
        with self._lock:
            if timeout is None and not future.done():
                stuck = [f for t, f in self._waits.items() if t != me and f is not None and not f.done()]
                if len(stuck) + 1 >= self.lanes:
                    raise RuntimeError(
                        f"waiting inside an op for op {future.op_name!r} would wait forever: every lane "
                        f"of this runtime ({self.lanes}) is running an op that waits for another lane "
                        "op, so none of those can run. Give the runtime more lanes (streams= on a CPU "
                        "runtime, host_lanes= beside a device), or add a done-callback instead of "
                        "waiting inside the op")
            outer = self._waits.get(me)  # (a wait inside a done-callback run by a wait)
            self._waits[me] = future if timeout is None else None
        try:
            yield
        finally:
            with self._lock:
                if outer is None:
                    self._waits.pop(me, None)
                else:
                    self._waits[me] = outer
