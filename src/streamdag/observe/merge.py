"""One trace from several Chrome/Perfetto traces of the same run (streamdag's and PyTorch's).

Perfetto opens one trace at a time, so the traces of one run are merged into
one file. Both profilers write their times in µs after the trace's own
``baseTimeNanoseconds`` (Kineto's convention, which ``rt.profile()`` follows),
so merging shifts each trace's times onto the earliest base and keeps every
event's track (``pid``/``tid``): streamdag's lane ops land on the same thread
rows as the PyTorch ops that ran inside them, and a CUDA stream's ops on the
device's process. Pure data: JSON in, JSON out.

A CUDA stream has no number both profilers can read: streamdag names its
stream rows by the stream's handle, Kineto by the id CUPTI gives it. Kineto
draws each ``record_function`` range again on the stream that ran its kernels
(a ``gpu_user_annotation``), and streamdag wraps each device op in one named
after the op, so a streamdag stream row whose ops' ranges all lie on one
Kineto stream row moves onto it: ops, kernels and copies share one row.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["complete_events", "merge_traces", "track_names"]

#: the event fields that hold a time in µs after the trace's base
_TIME_FIELDS = ("ts",)


def _load(trace: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(trace, Mapping):
        return dict(trace)
    try:
        loaded = json.loads(Path(trace).read_text())
    except json.JSONDecodeError:
        loaded = None
    if not isinstance(loaded, dict) or "traceEvents" not in loaded:
        raise ValueError(f"{trace}: not a Chrome trace (a JSON object with 'traceEvents'): pass the file "
                         "that torch.profiler's export_chrome_trace() or Timeline.save_trace() wrote")
    return loaded


def merge_traces(*traces: Mapping[str, Any] | str | Path, out: str | Path | None = None) -> dict[str, Any]:
    """The events of every trace on one clock, in one Chrome trace (written to ``out`` if given).

    Each trace is a dict or the path of a JSON file. A trace without
    ``baseTimeNanoseconds`` cannot be placed on the clock of the others and
    is refused, unless it is the only kind given (then times are kept as they
    are). Metadata events (process and thread names) are kept once each.
    """
    if not traces:
        raise ValueError("merge_traces needs at least one trace")
    loaded = [_load(t) for t in traces]
    bases = [t.get("baseTimeNanoseconds") for t in loaded]
    if any(b is None for b in bases) and not all(b is None for b in bases):
        missing = [i for i, b in enumerate(bases) if b is None]
        raise ValueError(f"traces {missing} have no baseTimeNanoseconds, so their clock is unknown: "
                         "record them with rt.profile() and torch.profiler of this PyTorch version")
    base = min(int(b) for b in bases) if bases[0] is not None else None
    events: list[dict[str, Any]] = []
    seen_meta: set[tuple[Any, ...]] = set()
    for trace, own in zip(loaded, bases):
        shift_us = (int(own) - base) / 1e3 if base is not None and own is not None else 0.0
        for event in trace["traceEvents"]:
            if event.get("ph") == "M":
                key = (event.get("name"), event.get("pid"), event.get("tid"),
                       json.dumps(event.get("args"), sort_keys=True))
                if key in seen_meta:
                    continue
                seen_meta.add(key)
                events.append(dict(event))
                continue
            moved = dict(event)
            for name in _TIME_FIELDS:
                if name in moved and shift_us:
                    moved[name] = round(float(moved[name]) + shift_us, 3)
            events.append(moved)
    _join_stream_rows(events)
    merged: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if base is not None:
        merged["baseTimeNanoseconds"] = base
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merged))
    return merged


def _join_stream_rows(events: list[dict[str, Any]]) -> None:
    """Move each streamdag stream row onto the Kineto stream row its ops' GPU ranges lie on, where
    that is one row, taken by no other streamdag row (in place)."""
    gpu_rows: dict[tuple[Any, Any], set[Any]] = {}  # (pid, op name) -> Kineto stream tids
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation":
            gpu_rows.setdefault((e.get("pid"), e.get("name")), set()).add(e.get("tid"))
    if not gpu_rows:
        return
    targets: dict[tuple[Any, Any], set[Any]] = {}  # streamdag (pid, tid) -> Kineto tids of its ops
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).startswith("streamdag"):
            found = gpu_rows.get((e.get("pid"), e.get("name")))
            if found is not None:
                targets.setdefault((e.get("pid"), e.get("tid")), set()).update(found)
    single = {row: next(iter(tids)) for row, tids in targets.items() if len(tids) == 1}
    claimed: dict[tuple[Any, Any], int] = {}
    for (pid, _), tid in single.items():
        claimed[(pid, tid)] = claimed.get((pid, tid), 0) + 1
    moves = {row: tid for row, tid in single.items() if claimed[(row[0], tid)] == 1}
    for e in events:
        if str(e.get("cat", "")).startswith("streamdag") or e.get("ph") == "M":
            tid = moves.get((e.get("pid"), e.get("tid")))
            if tid is not None and (e.get("ph") != "M" or e.get("name") == "thread_name"):
                e["tid"] = tid


def track_names(trace: Mapping[str, Any]) -> dict[tuple[Any, Any], str]:
    """(pid, tid) -> the thread's name, from a trace's metadata events; where several traces name
    one thread, streamdag's name (its lane or stream) wins over a profiler's generic one."""
    names: dict[tuple[Any, Any], str] = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            key, name = (e.get("pid"), e.get("tid")), str(e.get("args", {}).get("name", ""))
            if key not in names or name.startswith("streamdag"):
                names[key] = name
    return names


def complete_events(trace: Mapping[str, Any]) -> Sequence[dict[str, Any]]:
    """The trace's complete events (``"ph": "X"``): the ones with a start and a duration."""
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
