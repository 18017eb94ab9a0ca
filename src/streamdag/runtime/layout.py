"""The streams of a runtime, numbered: each device's compute streams, then its copy streams; the
host lanes beside a device last.

Made once, when the runtime is made, and never changed: read by every part without a lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backends import Backend
from ..backends.cpu import HostLanes

__all__ = ["StreamLayout", "lay_out_streams"]


@dataclass(frozen=True)
class StreamLayout:
    """Invariant: ``streams``, ``member`` and ``device_of`` have one entry per stream, by number;
    ``compute_of[d]`` and ``copy_index`` number streams of that device (``"host"``: the lanes)."""

    streams: list[Any]
    #: the backend (or the host lanes) that owns each stream
    member: list[Any]
    #: each stream's device (``"host"``: a host lane)
    device_of: list[str]
    #: each device's compute streams (``"host"``: the host lanes, where there are)
    compute_of: dict[str, range]
    #: (kind, device) -> its copy stream of that kind ("h2d", "d2h", "p2p")
    copy_index: dict[tuple[str, str], int]
    #: host lanes beside a device (streams after its own): where ``run_on="host"`` ops run, so that
    #: a host function waiting for device work does not block the submitting thread; None on a CPU
    host: HostLanes | None


def lay_out_streams(members: list[Backend], host_lanes: int) -> StreamLayout:
    """Number every stream of ``members`` (one backend per device; the first's device decides
    whether there are host lanes: not on a CPU runtime, whose lanes are the host's already)."""
    layout = StreamLayout([], [], [], {}, {}, None)
    streams, member, device_of = layout.streams, layout.member, layout.device_of
    for m in members:
        base = len(streams)
        layout.compute_of[m.device] = range(base, base + len(m.streams))
        copy = getattr(m, "copy_streams", {})
        for i, kind in enumerate(copy):
            layout.copy_index[(kind, m.device)] = base + len(m.streams) + i
        added = list(m.streams) + list(copy.values())
        streams += added
        member += [m] * len(added)
        device_of += [m.device] * len(added)
    if members[0].device == "cpu":
        return layout
    host = HostLanes(host_lanes, len(streams))
    layout.compute_of["host"] = range(len(streams), len(streams) + host_lanes)
    streams += host.streams
    member += [host] * host_lanes
    device_of += ["host"] * host_lanes
    return StreamLayout(streams, member, device_of, layout.compute_of, layout.copy_index, host)
