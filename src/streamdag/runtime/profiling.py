"""Profiling mode: a timing event before and after every op, on the op's own stream.

It adds events, never waits, so the schedule stays what it would have been.
On the CPU the events are timestamps taken by the lanes; on CUDA they are
CUDA timing events, read once profiling ends. On several devices each device
has its own base event, each mapped to the wall clock (below), so the times of
different devices line up.
Lanes on the host (a CPU runtime's, host lanes beside a device) take their base
as the host's clock at that moment (``CpuBackend.clock_base``), not when a lane
thread gets to it.

Each base is paired with the wall clock (``time.time_ns``): the timeline's origin is
a Unix time, the clock PyTorch's profiler (Kineto) writes its CPU events on, so that the two
traces of one run line up. Each stream is named as Kineto names it: a lane by its thread (the
process id, the thread's id in the operating system), a CUDA stream by its device ordinal and its
``cudaStream_t``. A device's base event runs behind whatever its stream had queued when the
profile began (or, on a shared GPU, behind other processes' work), later than the wall clock read
beside its record; so where the backend can time an event against a mark of its clock
(``wall_of``: an event on an idle stream and the wall clock at the moment it ran), the profile's
end maps the base through a mark.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..observe.timeline import Span, Timeline

if TYPE_CHECKING:
    from .ops import Op

__all__ = ["Profiler"]


class Profiler:
    """What ``with rt.profile() as prof:`` gives: once the block is left, ``prof.timeline``."""

    def __init__(self, members: list[Any], streams: list[Any], per_op: bool, nvtx: bool) -> None:
        self.members = members  # the backend of each stream
        self.streams = streams
        self.per_op = per_op
        self.nvtx: bool = nvtx and not members[0].deferred
        self.records: list[tuple[Op, Any, Any, int, tuple[int, ...]]] = []
        self.bases: dict[int, Any] = {}  # per backend, on its first stream
        self.walls: dict[int, int] = {}  # per backend, the wall clock (ns) beside its base
        for i, m in enumerate(members):
            if id(m) not in self.bases:
                clock_base = getattr(m, "clock_base", None)
                if clock_base is not None:
                    self.bases[id(m)] = clock_base()
                else:
                    self.bases[id(m)] = m.event(timing=True)
                    self.bases[id(m)].record(streams[i])
                self.walls[id(m)] = time.time_ns()
        self._timeline: Timeline | None = None

    @property
    def timeline(self) -> Timeline:
        """The ops timed inside the ``with rt.profile()`` block, once it is left."""
        if self._timeline is None:
            raise RuntimeError("the profile is still running: read prof.timeline after its "
                               "`with rt.profile() as prof:` block")
        return self._timeline

    def start(self, op: Op, stream: int, deps: list[Op]) -> tuple[Any, Any]:
        ev = self.members[stream].event(timing=True)
        ev.record(self.streams[stream])
        if self.nvtx:
            import torch

            torch.cuda.nvtx.range_push(op.name)
        return ev, tuple(d.seq for d in deps)

    def end(self, op: Op, stream: int, started: tuple[Any, Any]) -> None:
        if self.nvtx:
            import torch

            torch.cuda.nvtx.range_pop()
        ev = self.members[stream].event(timing=True)
        ev.record(self.streams[stream])
        self.records.append((op, started[0], ev, stream, started[1]))

    def finish(self) -> Timeline:
        """Read the events (after the runtime has synchronized) into a :class:`Timeline`. An op
        not finished by then is left out: its end would be waited for (inside an op, the ops
        that wait for it are not waited for, see ``Runtime.synchronize``)."""
        self._calibrate()
        spans = []
        wall0 = min(self.walls.values())
        tracks: dict[int, tuple[int | None, int | None]] = {}
        for op, start, end, stream, deps in self.records:
            if not op.done:
                continue
            member = self.members[stream]
            base = self.bases[id(member)]
            skew = (self.walls[id(member)] - wall0) / 1e6  # this base's moment after the first's (ms)
            if stream not in tracks:
                tracks[stream] = _kineto_track(member.device, self.streams[stream])
            spans.append(Span(
                seq=op.seq, name=op.name, device=member.device, stream=stream,
                kind=self.streams[stream].kind, start=base.elapsed_ms(start) + skew,
                end=base.elapsed_ms(end) + skew, deps=deps, failed=op.error is not None,
                pid=tracks[stream][0], tid=tracks[stream][1],
            ))
        # the base event need not be the earliest (another stream may start first): shift to 0
        origin = min((sp.start for sp in spans), default=0.0)
        self._timeline = Timeline([replace(sp, start=sp.start - origin, end=sp.end - origin)
                                   for sp in spans], origin_ns=wall0 + round(origin * 1e6))
        return self._timeline

    def _calibrate(self) -> None:
        """Each base's wall clock, timed against a mark of its backend's clock taken now, where the
        backend can (``wall_of``); the wall clock read beside the base's record elsewhere, and
        where the base never ran (the wait at the profile's end failed)."""
        for m in {id(m): m for m in self.members}.values():
            wall_of = getattr(m, "wall_of", None)
            wall = wall_of(self.bases[id(m)]) if wall_of is not None else None
            if wall is not None:
                self.walls[id(m)] = wall


def _kineto_track(device: str, stream: Any) -> tuple[int | None, int | None]:
    """The (pid, tid) PyTorch's profiler gives the work of ``stream``: a lane's, the process and its
    thread's id in the operating system; a CUDA stream's, the device ordinal and the stream's handle
    (``cudaStream_t``: CUPTI's own stream numbers are not to be had outside it). (None, None)
    elsewhere (the simulated device)."""
    if device.startswith("cuda"):
        handle = getattr(stream, "cuda_stream", None)
        return (int(device.partition(":")[2] or 0), handle) if handle is not None else (None, None)
    native_id = getattr(stream, "native_id", None)
    return (os.getpid(), native_id) if native_id is not None else (None, None)
