"""Host replay: a recorded graph launched as a fixed stream program, one runtime op for the whole run.

The per-op path of the runtime (hazard lookup, clocks, a future and a
completion callback per op) costs tens of microseconds per op. A recorded
graph already knows all of that, so a run only has to do what a CUDA graph
replay does, from the host: per op, the event waits the plan computed once,
the launch on the planned stream, and an event record where another stream
will wait. The run is one op of the runtime: ordered after earlier work that
touches the graph's memory (every stream it uses waits for that first), and
finished once the join of all its streams has completed.

It serves graphs that cannot be captured, such as graphs that span several
devices. An op that raises fails the run and is skipped along with every op
that depends on it; the others still run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import DependencyFailed, ExceptionGroup
from ..graph.buffers import Access
from .accel import plan_waits
from .core import _DROP_WAITS
from .ops import Op, failed_input, release_frames

if TYPE_CHECKING:
    from .core import Runtime

__all__ = ["HostReplay"]


class HostReplay:
    """The stream program of one recorded graph: streams, waits and events, planned once."""

    def __init__(self, rt: Runtime, fns: Sequence[Any], args: Sequence[tuple], kwargs: Sequence[dict],
                 names: Sequence[str], streams: Sequence[int], preds: Sequence[Sequence[int]],
                 accesses: list[Access]) -> None:
        self.rt = rt
        self.fns, self.args, self.kwargs, self.names = list(fns), list(args), list(kwargs), list(names)
        self.streams = list(streams)
        self.preds = [tuple(p) for p in preds]
        self.accesses = accesses
        n = len(self.streams)
        self.waits = plan_waits(self.preds, self.streams, len(rt._streams))
        self.used = sorted(set(self.streams))
        self.first = {s: self.streams.index(s) for s in self.used}
        self.last = {s: n - 1 - self.streams[::-1].index(s) for s in self.used}
        self.join = self.streams[n - 1]  # the last op's stream: its tail needs no wait
        needed = {u for w in self.waits for u in w} | {self.last[s] for s in self.used if s != self.join}
        # one event per op that another stream waits on; reused by every run (runs are ordered)
        self.events = [rt._member[self.streams[v]].event() if v in needed else None for v in range(n)]
        self.waits_of_join = [self.last[s] for s in self.used if s != self.join]
        self.launched = 0  # runs launched (not those left to run op by op, see launch)

    def launch(self) -> Op | None:
        """Launch one run; returns its runtime op (its future gets the list of values). Takes the
        lock. None, nothing launched, where unfinished host-lane ops (or ops held behind them) touch
        the graph's memory: a replay would wait for them here (run the graph op by op instead)."""
        rt = self.rt
        rt._check_open()
        rt._take_slot()
        try:
            locked = rt._lock_unless_after_host_ops(self.accesses, "graph_run")
        except BaseException:  # refused (from the lane of such an op): the run is not launched
            rt._slots.release()
            raise
        if not locked:
            rt._slots.release()
            return None
        self.launched += 1
        try:
            rt._counts.seq += 1
            op = Op(rt._counts.seq, "graph_run", None, (), {}, self.accesses)  # type: ignore[arg-type]
            _, live, _ = rt._admit(op, rt._tracker.link(op, self.accesses), self.join)
            failed_dep = failed_input(op.accesses, op.deps)
            if failed_dep is not None:
                op.error = DependencyFailed(op.name, failed_dep.root_name, failed_dep.root_error)
                op.root_name, op.root_error = failed_dep.root_name, failed_dep.root_error
                op.deps = ()
                rt._finish(op)
                return op
            try:
                self._launch_ops(op, live)
            except Exception as exc:  # the backend's own calls failed
                op.error = op.root_error = release_frames(exc, caught_here=True)
                op.root_name = op.name
                op.deps = ()
                rt._finish(op)
                return op
        finally:
            rt._lock.release()
        return op

    def _launch_ops(self, op: Op, live: list[Op]) -> None:
        rt = self.rt
        raw = rt._streams
        member = rt._member
        n = len(self.fns)
        values: list[Any] = [None] * n
        failed = [False] * n
        errors: list[BaseException] = []
        fns, args, kwargs, preds, names = self.fns, self.args, self.kwargs, self.preds, self.names

        def work(v: int) -> None:
            for u in preds[v]:
                if failed[u]:
                    failed[v] = True
                    return
            try:
                values[v] = fns[v](*args[v], **kwargs[v])
            except Exception as exc:
                failed[v] = True
                if hasattr(exc, "add_note"):
                    exc.add_note(f"raised by streamdag op {names[v]!r} of a graph run")
                errors.append(release_frames(exc, caught_here=True))

        for s in self.used:  # the run starts after the earlier ops it conflicts with (none on a host
            for d in live:   # lane: a run after those goes op by op, see _lock_unless_after_host_ops)
                d.event.wait(raw[s])
        events, streams = self.events, self.streams
        waits = [()] * n if _DROP_WAITS else self.waits
        for v in range(n):
            s = raw[streams[v]]
            for u in waits[v]:
                events[u].wait(s)
            member[streams[v]].launch(s, lambda v=v: work(v), after_caller=v == self.first[streams[v]])
            if events[v] is not None:
                events[v].record(s)
        join = raw[self.join]
        for u in self.waits_of_join:
            events[u].wait(join)
        done_event = member[self.join].event()
        done_event.record(join)
        op.event = done_event
        op.deps = ()

        def finished(device_error: BaseException | None = None) -> None:
            if device_error is not None:
                op.error = op.root_error = device_error
            elif errors:
                op.error = op.root_error = ExceptionGroup(f"{len(errors)} op(s) of the graph failed", errors)
            op.root_name = op.name
            op.value = values
            rt._finish(op)

        rt._watch(op, self.join, done_event, finished)
