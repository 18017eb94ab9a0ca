"""The tests' one seam into a runtime's internals.

A test goes through the public API wherever the behaviour it checks is reachable that way. The
few contracts that are not (where an op is queued, which code made a copy) are reached here, each
entry saying what it reaches and why the public API cannot, so that a change of the internals
changes this file, not the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import streamdag as sd


def submit_to_lane(rt: sd.Runtime, lane: int, fn: Callable[..., Any], *args: Any, name: str) -> sd.Future:
    """``fn(*args)`` queued on ``lane`` (``Runtime._submit``). The public submit picks the lane
    itself, and from inside an op never that op's own lane; the tests of waits inside ops need
    ops queued behind given ones."""
    return rt._submit(fn, args, {}, (), (), name, True, lane)


def lane_waits(rt: sd.Runtime) -> dict[int, Any]:
    """The waits that lane threads are inside now, by thread (None: a wait with a timeout), read
    under their lock (``LaneWaits``): whether a wait is registered, and taken off again, shows only
    in how the runtime answers the next wait."""
    waits = rt._lane_waits
    with waits._lock:
        return dict(waits._waits)


def choose_stream(rt: sd.Runtime, device: str) -> int:
    """The Python submit's choice of stream for an op with no dependencies (``Runtime._choose_stream``),
    for the test of a finish that races with it, which no public call can time."""
    return rt._choose_stream([], device)


def submit_on(rt: sd.Runtime, stream: int, fn: Callable[..., Any], *args: Any, reads: list[Any],
              writes: list[Any], name: str | None = None) -> Any:
    """``fn(*args)`` on a given (copy) stream, ordered after its dependencies on the device only
    (``Runtime._submit_on``): the transfers' submit, compiled where the module builds. Publicly
    only a copy between pinned host memory and a GPU reaches its compiled form."""
    return rt._submit_on(stream, fn, *args, reads=reads, writes=writes, name=name)


def copy_stream(rt: sd.Runtime, kind: str, device: str) -> int:
    """The number of ``device``'s copy stream of ``kind`` ("h2d", "d2h", "p2p")."""
    return rt._copy_index[(kind, device)]


def stream_count(rt: sd.Runtime) -> int:
    """How many streams the runtime has: compute, copy and host lanes (one past the last)."""
    return len(rt._streams)


def copies_compiled(rt: sd.Runtime) -> bool:
    """Whether the runtime makes its copies between pinned host memory and a GPU in C."""
    return rt._copy_pinned is not None


def copy_pinned(rt: sd.Runtime, dst: Any, src: Any) -> sd.Future | None:
    """The compiled copy between pinned host memory and a GPU (``Runtime._copy_pinned``), or None
    where it leaves the copy to the Python code. ``rt.copy`` gives the same future either way:
    which code made it shows only here."""
    return rt._copy_pinned(dst, src, None)
