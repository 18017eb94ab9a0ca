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
devices. An op that raises fails the run; the ops that fail with it are those
an eager run would fail: each that touches memory a failed op wrote (or was to
write), transitively, including a failed op of the runtime's before the run.
The others still run. The run's op fails as such an op of an eager run
would: later ops that touch memory a failed op of the graph wrote fail too,
not those that touch only what the graph's other ops did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..errors import BaseExceptionGroup, DependencyFailed
from ..graph.buffers import Access
from .accel import plan_waits
from .frames import release_frames
from .ops import Op, failed_input
from .submitting import _DROP_WAITS

__all__ = ["HostReplay", "ReplayRuntime"]


class ReplayRuntime(Protocol):
    """What a host replay needs of its runtime: its streams, and the submit path's steps for one
    op (a slot, the lock unless host-lane ops come first, a number, the links, a place, a watch for
    its completion, or a finish where it fails at launch)."""

    _lock: Any
    _slots: Any  #: ``completion.Slots``
    _tracker: Any
    _streams: list[Any]
    _member: list[Any]
    _check_open: Callable[[], None]
    _take_slot: Callable[..., bool]
    _lock_unless_after_host_ops: Callable[..., bool]
    _new_op: Callable[..., Op]
    _admit: Callable[..., tuple[int, list[Op], list[int]]]
    _watch: Callable[..., None]
    _finish: Callable[..., None]


class HostReplay:
    """The stream program of one recorded graph: streams, waits and events, planned once."""

    def __init__(self, rt: ReplayRuntime, fns: Sequence[Any], args: Sequence[tuple[Any, ...]],
                 kwargs: Sequence[dict[str, Any]],
                 names: Sequence[str], streams: Sequence[int], preds: Sequence[Sequence[int]],
                 accesses: list[Access], fail_preds: Sequence[Sequence[int]],
                 op_accesses: Sequence[list[Access]]) -> None:
        """``preds``: the ops each op follows (the schedule's); ``accesses``: the graph's memory, as
        few accesses; ``fail_preds``: the ops whose failure fails each op (see
        ``RecordedGraph._failure_preds``); ``op_accesses``: each op's own accesses."""
        self.rt = rt
        self.fns: list[Any] = list(fns)
        self.args: list[tuple[Any, ...]] = list(args)
        self.kwargs: list[dict[str, Any]] = list(kwargs)
        self.names: list[str] = list(names)
        self.streams: list[int] = list(streams)
        self.preds: list[tuple[int, ...]] = [tuple(p) for p in preds]
        self.accesses = accesses
        self.fail_preds: list[tuple[int, ...]] = [tuple(p) for p in fail_preds]
        self.op_accesses: list[list[Access]] = list(op_accesses)
        n = len(self.streams)
        self.waits: list[Any] = plan_waits(self.preds, self.streams, len(rt._streams))
        self.used: list[int] = sorted(set(self.streams))
        self.first: dict[int, int] = {s: self.streams.index(s) for s in self.used}
        self.last: dict[int, int] = {s: n - 1 - self.streams[::-1].index(s) for s in self.used}
        self.join: int = self.streams[n - 1]  # the last op's stream: its tail needs no wait
        needed = {u for w in self.waits for u in w} | {self.last[s] for s in self.used if s != self.join}
        # one event per op that another stream waits on; reused by every run (runs are ordered)
        self.events: list[Any] = [rt._member[self.streams[v]].event() if v in needed else None
                                  for v in range(n)]
        self.waits_of_join: list[int] = [self.last[s] for s in self.used if s != self.join]
        self.launched: int = 0  # runs launched (not those left to run op by op, see launch)

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
            op = rt._new_op("graph_run", None, (), {}, self.accesses)
            _, live, _ = rt._admit(op, rt._tracker.link(op, self.accesses), self.join)
            try:
                self._launch_ops(op, live)
            except BaseException as exc:  # the backend's own calls failed, or an interrupt in an op
                if op.error is None or isinstance(exc, Exception):  # (an op's: its failure is kept)
                    op.error = op.root_error = release_frames(exc, caught_here=True)
                    op.root_name = op.name
                op.deps = ()
                rt._finish(op)
                if not isinstance(exc, Exception):
                    raise
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
        fns, args, kwargs, fail_preds = self.fns, self.args, self.kwargs, self.fail_preds
        failures = _Failures(self, op)
        failed = failures.of  # each op's failure (its own error, or DependencyFailed), or None

        def work(v: int) -> None:
            if failures.before is not None and failures.from_before(v):
                return
            for u in fail_preds[v]:
                if failed[u] is not None:
                    failures.dependent(v, u)
                    return
            try:
                values[v] = fns[v](*args[v], **kwargs[v])
            except BaseException as exc:
                failures.own(v, exc)
                if not isinstance(exc, Exception):  # SystemExit, say: it goes on up too, as an eager
                    raise  # op's does (the run has failed with it first, so it finishes)

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
                op.root_name = op.name
            op.value = values
            rt._finish(op)

        rt._watch(op, self.join, done_event, finished)


class _Failures:
    """The failures of one run of a :class:`HostReplay`, as its ops meet them.

    The run's op gets its error as soon as one of its ops fails, not once the
    run is over: an op of the runtime after the run may start as soon as the
    run's last event completes, before the run's op is finished, and it checks
    that error then. Its ``accesses`` become what the failed ops were to write:
    an op after the run fails for memory that a failed op of the graph wrote, as
    it would after an eager run, not for what the graph's other ops touched.
    """

    __slots__ = ("before", "of", "op", "own_errors", "replay", "written")

    def __init__(self, replay: HostReplay, op: Op) -> None:
        self.replay, self.op = replay, op
        self.of: list[BaseException | None] = [None] * len(replay.fns)
        self.own_errors: list[BaseException] = []
        self.written: list[Access] = []
        #: the runtime's ops before the run that it follows and that may have failed (None: none),
        #: all finished by the time its first op runs: every stream of the run waits for them
        self.before: list[Op] | None = list(op.deps) or None

    def from_before(self, v: int) -> bool:
        """Fail op ``v`` where a failed op before the run wrote memory it touches; whether it did.
        The first op to run keeps only those that failed (``before`` None where none did)."""
        before = self.before
        if before is None:
            return False
        failed = [d for d in before if d.error is not None]
        if len(failed) < len(before):
            self.before = before = failed or None
            if before is None:
                return False
        dep = failed_input(self.replay.op_accesses[v], before)
        if dep is None:
            return False
        self._fail(v, DependencyFailed(self.replay.names[v], dep.root_name, dep.root_error))
        return True

    def dependent(self, v: int, u: int) -> None:
        """Op ``v`` fails for op ``u`` of the run, which failed and wrote memory ``v`` touches."""
        error = self.of[u]
        if isinstance(error, DependencyFailed):
            root_name, root_error = error.root_name, error.root_error
        else:
            root_name, root_error = self.replay.names[u], error
        self._fail(v, DependencyFailed(self.replay.names[v], root_name, root_error))  # type: ignore[arg-type]

    def own(self, v: int, exc: BaseException) -> None:
        """Op ``v``'s function raised ``exc``."""
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised by streamdag op {self.replay.names[v]!r} of a graph run")
        # (an interrupt keeps its frames, as an eager op's does: it is raised again at once)
        error = release_frames(exc, caught_here=True) if isinstance(exc, Exception) else exc
        self.own_errors.append(error)
        self._fail(v, error)

    def _fail(self, v: int, error: BaseException) -> None:
        """Op ``v`` failed with ``error``: the run's op fails with the graph's own failures so far
        (else, failed for an op before the run, with the first op's DependencyFailed, as an eager
        run's future does), and counts as writing what the failed ops were to write."""
        self.of[v] = error
        self.written += [a for a in self.replay.op_accesses[v] if a.write]
        op = self.op
        if self.own_errors:
            roots = self.own_errors
            op.error = op.root_error = BaseExceptionGroup(f"{len(roots)} op(s) of the graph failed", roots)
            op.root_name = op.name
        elif op.error is None:
            op.error = BaseExceptionGroup("1 op(s) of the graph failed", [error])
            op.root_name, op.root_error = error.root_name, error.root_error  # type: ignore[attr-defined]
        op.accesses = self.written
