"""What ran where and when: spans of ops on streams, their summary, and a Chrome/Perfetto trace.

Pure data and arithmetic; times are milliseconds from the start of profiling.
The trace follows the conventions of PyTorch's profiler (Kineto), so that the two
traces of one run, opened together or merged, line up: a lane's ops on the
process and its thread's id, a CUDA stream's on the device ordinal and the
stream's handle; timestamps in µs of the Unix clock after ``baseTimeNanoseconds``
(Kineto's base: the start of the current 7,889,238-second period). Ops are
complete events (``"ph": "X"``), and each dependency between ops on different
streams is a flow arrow (``"s"``/``"f"``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Span", "Summary", "Timeline"]


@dataclass(frozen=True)
class Span:
    """One op: where it ran (device, stream and its kind), when, and the ops it depended on."""

    seq: int
    name: str
    device: str
    stream: int
    kind: str
    start: float
    end: float
    deps: tuple[int, ...] = ()
    failed: bool = False
    #: the process and thread ids PyTorch's profiler gives this stream's work (see the module's
    #: docstring); None: none known (a hand-made span, the simulated device)
    pid: int | None = None
    tid: int | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Summary:
    makespan_ms: float
    busy_ms: float
    concurrency: float
    critical_path_ms: float
    critical_path: tuple[str, ...]
    copy_compute_overlap_ms: float
    idle_ms_per_stream: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        idle = ", ".join(f"{k} {v:.3f}" for k, v in self.idle_ms_per_stream.items())
        path = " -> ".join(self.critical_path[:12]) + (" -> ..." if len(self.critical_path) > 12 else "")
        return (
            f"makespan {self.makespan_ms:.3f} ms, busy {self.busy_ms:.3f} ms summed over streams, "
            f"achieved concurrency {self.concurrency:.2f}\n"
            f"critical path {self.critical_path_ms:.3f} ms: {path}\n"
            f"copies overlapping compute {self.copy_compute_overlap_ms:.3f} ms\n"
            f"idle gaps per stream (ms): {idle or 'none'}"
        )


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi <= end:
            continue
        total += hi - max(lo, end)
        end = hi
    return total


def _intersection_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of time covered by both interval sets."""
    return _union_length(a) + _union_length(b) - _union_length(a + b)


#: Kineto's trace base: the Unix time rounded down to a multiple of this many seconds (about three
#: months), which keeps the µs timestamps small enough for a double's precision
KINETO_BASE_PERIOD_S = 7_889_238


class Timeline:
    """Spans recorded by a profiled runtime (:meth:`Runtime.profile`); ``origin_ns``: the Unix time
    (ns, ``time.time_ns``) of time 0, where known."""

    def __init__(self, spans: list[Span], origin_ns: int | None = None) -> None:
        self.spans: list[Span] = sorted(spans, key=lambda s: (s.start, s.seq))
        self.origin_ns = origin_ns

    def __len__(self) -> int:
        return len(self.spans)

    def tracks(self) -> dict[tuple[str, int], list[Span]]:
        out: dict[tuple[str, int], list[Span]] = {}
        for s in self.spans:
            out.setdefault((s.device, s.stream), []).append(s)
        return out

    def summary(self) -> Summary:
        if not self.spans:
            return Summary(0.0, 0.0, 0.0, 0.0, (), 0.0, {})
        start = min(s.start for s in self.spans)
        makespan = max(s.end for s in self.spans) - start
        busy = sum(s.duration for s in self.spans)
        by_seq = {s.seq: s for s in self.spans}
        finish: dict[int, float] = {}
        best_pred: dict[int, int | None] = {}
        for s in sorted(self.spans, key=lambda s: s.seq):  # longest chain of durations along deps
            preds = [d for d in s.deps if d in finish]
            p = max(preds, key=lambda d: finish[d], default=None)
            best_pred[s.seq] = p
            finish[s.seq] = (finish[p] if p is not None else 0.0) + s.duration
        last = max(finish, key=finish.get)  # type: ignore[arg-type]
        path = []
        node: int | None = last
        while node is not None:
            path.append(by_seq[node].name)
            node = best_pred[node]
        copies = [(s.start, s.end) for s in self.spans if s.kind in ("h2d", "d2h")]
        compute = [(s.start, s.end) for s in self.spans if s.kind not in ("h2d", "d2h")]
        idle = {}
        for (device, stream), spans in self.tracks().items():
            covered = _union_length([(s.start, s.end) for s in spans])
            idle[f"{device}/s{stream}"] = (max(s.end for s in spans) - min(s.start for s in spans)) - covered
        return Summary(
            makespan_ms=makespan,
            busy_ms=busy,
            concurrency=busy / makespan if makespan > 0 else 0.0,
            critical_path_ms=finish[last],
            critical_path=tuple(reversed(path)),
            copy_compute_overlap_ms=_intersection_length(copies, compute),
            idle_ms_per_stream=idle,
        )

    def to_chrome_trace(self) -> dict[str, Any]:
        """Chrome trace JSON (opens in Perfetto and chrome://tracing; merges with PyTorch's profiler
        trace of the same run, see the module's docstring); times in microseconds."""
        devices = sorted({s.device for s in self.spans})
        rank = {d: i for i, d in enumerate(devices)}
        base_ns = None
        offset_us = 0.0
        if self.origin_ns is not None:
            period_ns = KINETO_BASE_PERIOD_S * 1_000_000_000
            base_ns = self.origin_ns // period_ns * period_ns
            offset_us = (self.origin_ns - base_ns) / 1e3

        def track(s: Span) -> tuple[int, int]:
            if s.pid is not None and s.tid is not None:
                return s.pid, s.tid
            return rank[s.device], s.stream  # no ids known: one process per device, by rank

        def ts(ms: float) -> float:
            return round(offset_us + ms * 1e3, 3)

        events: list[dict[str, Any]] = []
        named: set[int] = set()
        for (d, stream), spans in self.tracks().items():
            pid, tid = track(spans[0])
            if pid not in named:
                named.add(pid)
                label = f"streamdag {d}" if spans[0].pid is None or d.startswith("cuda") else "streamdag host"
                events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                               "args": {"name": label}})
            lane = "lane" if d in ("cpu", "host") else "stream"
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": f"streamdag {d} {lane} {stream} ({spans[0].kind})"}})
        by_seq = {s.seq: s for s in self.spans}
        placed: dict[int, tuple[float, float]] = {}  # each slice's ts and dur, as written
        for s in self.spans:
            pid, tid = track(s)
            placed[s.seq] = start, dur = ts(s.start), round(max(s.duration, 0.0) * 1e3, 3)
            events.append({
                "ph": "X", "name": s.name, "cat": f"streamdag {s.kind}", "pid": pid, "tid": tid,
                "ts": start, "dur": dur,
                "args": {"op": s.seq, "deps": list(s.deps), "failed": s.failed, "device": s.device,
                         "stream": s.stream},
            })
        flow = 0
        for s in self.spans:
            for d in s.deps:
                src = by_seq.get(d)
                if src is None or (src.device, src.stream) == (s.device, s.stream):
                    continue
                flow += 1
                # just inside the source's slice as written (rounding the end on its own could put
                # it past the rounded slice, where a viewer binds it to no slice)
                start, dur = placed[src.seq]
                events.append({"ph": "s", "id": flow, "name": "wait", "cat": "streamdag dependency",
                               "pid": track(src)[0], "tid": track(src)[1],
                               "ts": start + (dur - min(1e-3, dur / 2))})
                events.append({"ph": "f", "bp": "e", "id": flow, "name": "wait",
                               "cat": "streamdag dependency", "pid": track(s)[0], "tid": track(s)[1],
                               "ts": ts(s.start)})
        trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
        if base_ns is not None:
            trace["baseTimeNanoseconds"] = base_ns
        return trace

    def save_trace(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome_trace()))
        return path

    def save_png(self, path: str | Path, title: str = "") -> Path:
        from .plot import timeline_png

        return timeline_png(self, path, title)
