"""Recorded graphs: ops captured by ``rt.record()``, scheduled once, run many times."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .._diagnostics import get_logger, warn
from ..graph.buffers import Access, coalesce, envelope
from ..observe.dot import schedule_to_dot
from ..observe.explain import explain_schedule
from ..schedule.plan import Schedule
from ..schedule.reduction import reduce_transitively
from .accel import DepsTracker, build_schedule
from .declared import DeclaredBuffers
from .graph_runs import EagerRunRuntime, EagerRuns, GraphResult, OpNode
from .ops import Future, in_done_callback, then

if TYPE_CHECKING:
    from .capture import CaptureStatistics

__all__ = ["GraphResult", "GraphRuntime", "OpNode", "RecordedGraph"]

_log = get_logger(__name__)


class GraphRuntime(EagerRunRuntime, Protocol):
    """What a recorded graph needs of its runtime, beyond a run op by op's (``EagerRunRuntime``):
    whether it may run (``_check_open``, ``_recording_here``), the submits that run it as one op
    (a replay), and whether a profile wants it op by op."""

    device: str
    devices: list[str]
    backends: list[Any]
    num_streams: int
    _multi: bool
    _compute_of: dict[str, range]  #: where the schedule's streams are on the runtime
    _profiler: Any
    _check_open: Callable[[], None]
    _recording_here: Callable[[], Any]
    _submit_on: Callable[..., Any]
    _wait_all: Callable[[], None]  #: before a capture: every earlier op finished
    _quiet: Callable[[], bool]  #: and no op that could run on the host meanwhile (under ``_lock``)


_COMPILED_REPLAY_RANGES = 32  # a replay of a graph of at most this many coalesced ranges: the compiled submit


@dataclass
class _Recorded:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    accesses: list[Access]
    name: str
    stream: int | None = None  # pinned stream (copies), else the schedule's
    written: list[Any] = field(default_factory=list)
    device: str = ""


def _writes_into(writer: list[Access], accesses: list[Access]) -> bool:
    """Whether an op with accesses ``writer`` writes memory an op with ``accesses`` reads or writes:
    then a failure of the first fails the second (``ops.failed_input``'s rule)."""
    for (space, start, end), write in writer:
        if write:
            for (s, lo, hi), _ in accesses:
                if lo < end and start < hi and s == space:
                    return True
    return False


class RecordedGraph(EagerRuns):
    """A graph of ops recorded by :meth:`Runtime.record`; :meth:`run` runs it on the runtime."""

    def __init__(self, runtime: GraphRuntime, copy_out: bool = True) -> None:
        self._rt = runtime
        self.copy_out = copy_out
        self.last_run_captured: bool = False
        self._ops: list[_Recorded] = []
        self._names_used: set[str] = set()  # op names are keys (timings, explain): kept distinct
        self._preds: list[list[int]] = []
        self._tracker = DepsTracker()
        self._schedule: Schedule | None = None
        #: the ops whose failure fails each op, fewest (see ``_failure_preds``), and each op's deps in
        #: a run op by op: the schedule's preds, then those of these that the schedule's reduction left out
        self._fail_preds: list[list[int]] = []
        self._run_preds: list[list[int]] = []
        self._runs = 0
        self.first_run_host_ms: float | None = None
        self._syncing_ops: list[str] = []  # ops seen synchronizing the host in the first run
        self.capture_fallback: str | None = None
        #: time every op while capturing even when the schedule is one chain (for batching's choice)
        self.time_ops = False
        self._runner: Any = None
        self._replay_accesses: list[Access] | None = None
        self._replay_split: tuple[list[Any], list[Any]] | bool | None = None  # see _replay_regions
        self._host_replay: Any = None
        self.capture: bool = runtime.device.startswith("cuda")
        self.devices: list[str] = []  # the devices its ops run on, once finished
        self._spans_devices = False
        self._has_host_ops = False  # a run_on="host" op among its ops (see ``_parts``)
        #: with host-lane ops, on one device: the graph in parts, in the order they run, each with
        #: the indices of its ops among this graph's: a graph of device ops (captured on its own on
        #: CUDA), or None for a host-lane op (see ``_split_at_host_ops``)
        self._parts: list[tuple[RecordedGraph | None, list[int]]] | None = None
        self._calls_above = 0  # a part of a graph: the calls between the user's run() and its own
        #: (of a graph in parts) why each of its parts that gave up capturing did, in order; a
        #: part holds its graph's list (not the graph: no cycle), which warns once for all of them
        self._parts_eager: list[str] | None = None
        self._groups: list[int] = []  # the device (index in the runtime's) of each op
        self.touched_devices: list[str] = []
        self._declared: DeclaredBuffers | None = None  # checked before each run (a part's: its graph's)

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def names(self) -> list[str]:
        return [op.name for op in self._ops]

    def add(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            accesses: list[Access], name: str | None, stream: int | None = None,
            written: list[Any] | None = None, device: str | None = None) -> OpNode:
        if self._schedule is not None:
            raise RuntimeError("this graph is finished; record a new one with rt.record()")
        index = len(self._ops)
        unique = name or f"{getattr(fn, '__name__', type(fn).__name__)}#{index}"
        while unique in self._names_used:  # a name given twice (copies are all "copy_h2d"...)
            unique = f"{unique}#{index}"
        self._names_used.add(unique)
        self._preds.append(sorted(self._tracker.link(index, accesses)))
        self._ops.append(_Recorded(fn, args, kwargs, accesses, unique, stream, list(written or ()),
                                   device or self._rt.device))
        return OpNode(index, unique)

    def finish(self) -> None:
        rt = self._rt
        # a host-lane op (run_on="host") is scheduled with the first device's ops, onto a host lane
        self._groups = [rt.devices.index(op.device) if op.device != "host" else 0 for op in self._ops]
        self._schedule = build_schedule(self._preds, rt.num_streams,
                                        groups=self._groups if rt._multi else None)
        self._tracker = DepsTracker()
        if _log.isEnabledFor(logging.DEBUG):
            sched = self._schedule
            _log.debug("recorded graph of %d ops: %d chains merged onto %d of %d streams, %d waits, "
                       "%d edges removed by the transitive reduction", len(self._ops), sched.chains,
                       sched.num_streams, rt.num_streams, sum(len(w) for w in sched.waits),
                       sched.removed_edges)
        self._fail_preds = self._failure_preds()
        self._run_preds = [[*ps, *(u for u in fs if u not in ps)]
                           for ps, fs in zip(self._schedule.preds, self._fail_preds)]
        self.devices = sorted({op.device for op in self._ops} - {"host"}, key=rt.devices.index)
        device_spaces = {a.region.space for op in self._ops for a in op.accesses} & set(rt.devices)
        #: every device whose memory or streams the graph uses
        self.touched_devices = sorted(device_spaces | set(self.devices), key=rt.devices.index)
        self._spans_devices = len(self.touched_devices) > 1
        # one CUDA graph holds the work of every GPU it touches (see capture.py); else host replays
        self.capture = bool(self.devices) and all(d.startswith("cuda") for d in self.touched_devices)
        host_ops = [op.name for op in self._ops if op.device == "host"]
        self._has_host_ops = bool(host_ops)
        if not self._calls_above:
            self._declared = DeclaredBuffers(self._ops)
        if host_ops and not self._spans_devices:  # host code between kernels: the graph in parts
            self._parts = self._split_at_host_ops()
        if host_ops and self.capture:  # no one CUDA graph holds host code
            self.capture = False
            self.capture_fallback = (f"op {host_ops[0]!r} runs on a host lane (run_on='host'), which a "
                                     "CUDA graph cannot hold" + ("; its device ops run as graphs of their "
                                     "own, stage by stage" if self._parts else ""))

    def _failure_preds(self) -> list[list[int]]:
        """For each op, the fewest ops of the graph whose failure must fail it, as an eager run's would.

        Eagerly, an op fails for a dependency that failed and wrote (or was to write) memory the
        op touches; a dependency that only read it changed nothing. So a failure passes along
        those edges of the full dependency graph only, transitively: their transitive reduction
        keeps exactly when an op fails. The schedule's reduction does not: op A reads P and writes
        X, op S overwrites P, op C reads X and P; C's only reduced pred is S (A -> S -> C), which
        runs although A failed, and C must fail for A. Computed once, when the graph is finished.
        """
        ops = self._ops
        passing = [[u for u in preds if _writes_into(ops[u].accesses, ops[v].accesses)]
                   for v, preds in enumerate(self._preds)]
        return reduce_transitively(passing)[0]

    def _split_at_host_ops(self) -> list[tuple[RecordedGraph | None, list[int]]]:
        """The parts of a graph with host-lane ops, in the order they run: graphs of device ops
        (captured on CUDA from their second run) and host-lane ops (their index), by stage. A
        device op's stage is the most host-lane ops on a path of dependencies into it; a host-lane
        op's, that of the ops it follows. Stage by stage, the device ops form graphs, one per set of
        host-lane ops they follow (a part is one op of the runtime: it waits for every host-lane op
        that any of its ops follows), then the host-lane ops run: each part comes after every op it
        depends on, and a device op that follows no host-lane op joins the first graph, whatever
        its place among the ops. Run in this order as ops of the runtime, the parts keep every
        dependency between the graph's ops (each part follows the earlier parts whose memory it
        touches, as any op does)."""
        ops, n = self._ops, len(self._ops)
        on_lane = [rec.device == "host" for rec in ops]
        stage = [0] * n
        follows = [0] * n  # the host-lane ops on a path into each op, as bits
        for v in range(n):  # (preds come before their op)
            stage[v] = max((stage[u] + (on_lane[u] and not on_lane[v]) for u in self._preds[v]), default=0)
            for u in self._preds[v]:
                follows[v] |= follows[u] | (on_lane[u] << u)
        parts: list[tuple[RecordedGraph | None, list[int]]] = []
        self._parts_eager = []
        for k in range(max(stage, default=-1) + 1):
            groups: dict[int, list[int]] = {}
            for v in range(n):
                if stage[v] == k and not on_lane[v]:
                    groups.setdefault(follows[v], []).append(v)
            # an op follows every host-lane op that its preds follow: a group that another's ops
            # depend on follows fewer, so fewer first is an order that keeps their dependencies
            for _, device_ops in sorted(groups.items(), key=lambda g: (g[0].bit_count(), g[1][0])):
                parts.append((self._part_of(device_ops), device_ops))
            parts += [(None, [v]) for v in range(n) if stage[v] == k and on_lane[v]]
        return parts

    def _part_of(self, device_ops: list[int]) -> RecordedGraph:
        """A graph of these device ops of this graph (a part, see ``_split_at_host_ops``)."""
        segment = RecordedGraph(self._rt, self.copy_out)
        segment.time_ops = self.time_ops
        segment._calls_above = 3  # (run, _start_run, _run_parts)
        segment._parts_eager = self._parts_eager
        for v in device_ops:
            rec = self._ops[v]
            segment.add(rec.fn, rec.args, rec.kwargs, rec.accesses, rec.name, rec.stream, rec.written,
                        rec.device)
        segment.finish()
        return segment

    def _runtime_stream(self, v: int) -> int:
        """The runtime's stream for op ``v``: its pinned copy stream, or its scheduled compute stream."""
        rec = self._ops[v]
        if rec.stream is not None:
            return rec.stream
        rt = self._rt
        k = self.schedule.stream[v]
        per_device = rt.num_streams
        if rec.device == "host":  # the host lane of the same number (the schedule's order holds)
            lanes = rt._compute_of["host"]
            return lanes[k % len(lanes)]
        return rt._compute_of[rt.devices[k // per_device]][k % per_device]

    def _check_runnable(self) -> None:
        """Raise where a run cannot start here: the graph is still being recorded, or this thread
        records another graph (whose submits are recorded, but a run would start at once, out of
        the order of the ops around it in that graph)."""
        self.schedule  # noqa: B018 (raises while the graph is still being recorded)
        recording = self._rt._recording_here()
        if recording is not None:
            raise RuntimeError(
                "g.run() inside a `with rt.record()` block would run the graph now, not record it "
                "into the graph being recorded: run it after the block, or submit its ops inside "
                "the block to record them")

    @property
    def schedule(self) -> Schedule:
        if self._schedule is None:
            raise RuntimeError("the graph is still being recorded: leave the `with rt.record()` block")
        return self._schedule

    def run(self) -> Future[GraphResult]:
        """Run every op once, concurrently as scheduled; returns a Future of a :class:`GraphResult`.

        The graph also orders itself after earlier ops of the runtime that touch
        its buffers, and later ops after it.

        Where ops fail, the future fails with an :class:`ExceptionGroup` of the
        graph's own failures (the exceptions its ops raised); where its ops
        failed only for an op before the run, with one of their
        :class:`DependencyFailed`. The ops that fail are those an eager run of
        the same submits would fail: each that touches memory a failed op
        wrote (or was to write), transitively; the others run. An op that
        raises ``SystemExit``, ``KeyboardInterrupt`` or another exception that
        is no ``Exception`` fails the run with a :class:`BaseExceptionGroup`
        holding it, which ``except Exception`` does not catch, as it would
        not catch the exception itself.

        Called from inside an op on a lane (a CPU runtime's, a host lane), the
        run places no op behind the calling op on its lane, so that the op
        may wait for the run; a runtime of one such lane cannot, and waiting
        there raises instead of hanging. Called inside a ``with rt.record()``
        block, it raises: a run is not recorded.
        """
        return self._start_run(may_wait=True)

    def _start_run(self, may_wait: bool) -> Future[GraphResult]:
        """:meth:`run`; ``may_wait``: the caller holds no lock of the runtime, so a capture may
        wait for the earlier ops first (see :meth:`_ready_runner`)."""
        rt = self._rt
        rt._check_open()
        self._check_runnable()
        if self._declared is not None:  # its dependencies hold for the memory it was recorded with
            self._declared.check()
        self._runs += 1
        self.last_run_captured = False
        if self._parts is not None:
            return self._run_parts(may_wait)
        per_op = rt._profiler is not None and rt._profiler.per_op
        if self._replays_a_capture(self._runs, per_op):
            future = self._run_captured(may_wait)
            if future is not None:
                self.last_run_captured = True
                return future
        if self._host_replay_allowed(per_op):
            future = self._run_host_replay()
            if future is not None:
                return future
        probe = None
        if self.capture and self._runs == 1:
            from .sync_probe import probe_host_syncs as probe
        return self._run_eager(probe)


    def _host_replay_allowed(self, per_op: bool) -> bool:
        """Graphs over several devices run as host replays, unless profiled op by op.

        On GPUs, host code that touches host memory must run op by op, since it
        runs at launch and must wait on the host for its inputs.
        """
        if not self._spans_devices or per_op or self._has_host_ops:
            return False
        if self._rt.backend.deferred:
            return True
        return not any(rec.stream is None and any(a.region.space == "cpu" for a in rec.accesses)
                       for rec in self._ops)

    def _run_host_replay(self) -> Future[Any] | None:
        """A run as one host replay over several devices; None where unfinished host-lane ops (or
        ops held behind them) touch the graph's memory: the replay would wait for them in the
        submitting thread, so the caller runs the graph op by op, each op held as an eager submit is."""
        from .replay import HostReplay

        if self._host_replay is None:
            ops = self._ops
            self._host_replay = HostReplay(
                self._rt, [r.fn for r in ops], [r.args for r in ops], [r.kwargs for r in ops],
                [r.name for r in ops], [self._runtime_stream(v) for v in range(len(ops))],
                self.schedule.preds, self._graph_accesses(), self._fail_preds, [r.accesses for r in ops])
        op = self._host_replay.launch()
        return None if op is None else then(op.future, GraphResult, "graph")

    def _graph_accesses(self) -> list[Access]:
        """All the graph's memory as few, large accesses: cheap hazard checks for a whole run.

        Symbols are private to this graph, so one span per symbolic space.
        """
        if self._replay_accesses is None:
            every = [a for rec in self._ops for a in rec.accesses]
            self._replay_accesses = coalesce(
                [a for a in every if not a.region.space.startswith("sym:")]
            ) + envelope([a for a in every if a.region.space.startswith("sym:")])
        return self._replay_accesses

    def _run_captured(self, may_wait: bool) -> Future[Any] | None:
        """Replay the CUDA graph as one op of the runtime; None if the graph cannot be captured, or
        cannot be now (the run then goes op by op)."""
        rt = self._rt
        runner = self._ready_runner(may_wait)
        if runner is None:
            return None
        device = self.devices[0]
        stream = rt._compute_of[device][0]
        split = None if rt._multi else self._replay_regions()  # (several devices: untried there)
        if split is not None:  # the compiled submit, each coalesced range its own buffer
            return rt._submit_on(stream, lambda: GraphResult(runner.replay()), reads=split[0],
                                 writes=split[1], name="graph_replay")
        return rt._enqueue(lambda: GraphResult(runner.replay()), (), {}, self._graph_accesses(),
                           "graph_replay", "graph_replay", True, stream, device_ordered=True, device=device)

    def _replays_a_capture(self, run: int, per_op: bool) -> bool:
        """Whether the graph's ``run``-th run replays a CUDA graph (capturing it first where it has
        none yet): from the second run on, unless a profile times its ops one by one."""
        return self.capture and run > 1 and bool(len(self._ops)) and not per_op

    def _capture_before_run(self) -> None:
        """Capture now what the next run would replay (a part of a graph in parts, before that
        graph takes the runtime's lock for its parts' submits, under which no capture may wait)."""
        rt = self._rt
        if self._replays_a_capture(self._runs + 1, rt._profiler is not None and rt._profiler.per_op):
            self._ready_runner(may_wait=True)

    def _ready_runner(self, may_wait: bool) -> Any:
        """The graph's runner, captured (again where its tensors' layouts changed); None where the
        graph cannot be captured (then for good), or cannot be now: a capture times its candidates
        by running the graph's ops, which write its buffers and then restore them, so it waits
        until no earlier op can run on the host meanwhile and the devices are done (an op that
        ran then would see those writes), which neither a caller holding the runtime's lock nor a
        done-callback may do."""
        from .capture import CudaGraphRunner

        rt = self._rt
        if self._syncing_ops:  # a capture would fail, and a failed capture upsets PyTorch's RNG
            self._give_up_capture(f"op {self._syncing_ops[0]!r} synchronizes with the host, "
                                  "which a CUDA graph cannot hold")
            return None
        device = self.devices[0]
        member = rt.backends[rt.devices.index(device)]
        if self._runner is None:
            groups = devices = None
            if self._spans_devices:
                groups = self._groups
                devices = [b.torch_device for b in rt.backends]  # type: ignore[attr-defined]
            self._runner = CudaGraphRunner(self, member.torch_device, groups, devices)  # type: ignore[attr-defined]
        runner = self._runner
        if runner.ready():
            return runner
        if not may_wait or in_done_callback():
            return None
        import torch

        def synchronize_all() -> None:
            for b in rt.backends:
                b.synchronize()

        while True:
            rt._wait_all()
            # (the device as an int: resolving a torch.device took ~1.5 µs per run here, 6x an int)
            with rt._lock, torch.cuda.device(member.torch_device.index):  # type: ignore[attr-defined]
                if not rt._quiet():  # an op came in from another thread meanwhile
                    continue
                ok = runner.prepare(rt.num_streams, before_capture=synchronize_all)
            break
        if not ok:
            self._give_up_capture(runner.fallback_reason or "capture failed")
            return None
        return runner

    def _replay_regions(self) -> tuple[list[Any], list[Any]] | None:
        """The graph's coalesced accesses as read and written regions, for ``Runtime._submit_on``;
        None where a symbolic space is among them (no submit takes those but ``_enqueue``), or
        where there are many (the compiled submit reads each region with a Python call)."""
        if self._replay_split is None:
            accesses = self._graph_accesses()
            if len(accesses) > _COMPILED_REPLAY_RANGES or any(a.region.space.startswith("sym:")
                                                             for a in accesses):
                self._replay_split = False
            else:
                self._replay_split = ([a.region for a in accesses if not a.write],
                                      [a.region for a in accesses if a.write])
        return self._replay_split or None

    @property
    def captured(self) -> bool:
        """Whether a CUDA graph of this graph exists (runs replay it while it stays valid)."""
        return self._runner is not None and self._runner._captured is not None

    def replay_on_current_stream(self) -> None:
        """Replay the captured graph on the caller's current stream, outside the runtime's ordering.

        For owners whose graph touches only memory of its own (``streamdag.compile``).
        """
        runner = self._runner
        runner._captured.graph.replay()
        runner.stats.replays += 1

    def _give_up_capture(self, reason: str) -> None:
        self.capture = False
        self.capture_fallback = reason
        message = f"running this graph eagerly on streams, without a CUDA graph: {reason}"
        eager = self._parts_eager
        if eager is not None and self._parts is None:  # a part: its graph warns once, at the first
            eager.append(reason)
            if len(eager) > 1:
                return
            message = (f"running a part of this graph's device ops (a stage between its host-lane ops) "
                       f"eagerly on streams, without a CUDA graph: {reason}. Other parts that cannot be "
                       "captured run eagerly too, without another warning (g.explain() lists them)")
        _log.info("CUDA graph capture refused: %s", reason)
        warn(f"streamdag: {message}")

    def static_values(self) -> list[Any]:
        """The values each op returned while being captured: the graph's own, rewritten by every replay."""
        if self._runner is None or self._runner._captured is None:
            raise RuntimeError("the graph has not been captured: it captures on its second run on CUDA")
        return self._runner._captured.values

    def statistics(self) -> CaptureStatistics | None:
        """Capture statistics on CUDA (captures, replays, recaptures, fallbacks, timing of the choice)."""
        return None if self._runner is None else self._runner.stats

    def explain(self) -> str:
        """Levels, streams, waits and the critical path, as text a person reads."""
        extra = []
        stats = self.statistics()
        if stats is not None and stats.chosen_streams is not None:
            timed = ", ".join(f"{k} stream(s) {ms:.3f} ms" for k, ms in sorted(stats.choice_ms.items()))
            if stats.estimate_ms:
                est = ", ".join(f"{k}: {ms:.3f}" for k, ms in sorted(stats.estimate_ms.items()))
                extra.append(f"cost model estimate from one timed run of the ops (ms by streams): {est}")
            extra.append(f"CUDA graph: {stats.chosen_streams} stream(s) chosen by measured replay "
                         f"({timed or 'one candidate'}); {stats.captures} captures, "
                         f"{stats.recaptures} recaptures, {stats.replays} replays")
        elif self.capture_fallback:
            extra.append(f"CUDA graph: not used ({self.capture_fallback}); runs eagerly")
        if self._parts and self._parts_eager:
            device_parts = sum(1 for part, _ in self._parts if part is not None)
            extra.append(f"device parts run eagerly: {len(self._parts_eager)} of {device_parts} "
                         f"(the first: {self._parts_eager[0]})")
        rt = self._rt
        on_lanes = [op.name for op in self._ops if op.device == "host"]
        if on_lanes:
            shown = ", ".join(repr(name) for name in on_lanes[:5]) + (", ..." if len(on_lanes) > 5 else "")
            extra.append(f"host lanes: {len(on_lanes)} op(s) run on the host beside the device ({shown}; "
                         "run_on='host'), each at its stream's number among the lanes")
        if rt._multi:
            per = rt.num_streams
            spans = ", ".join(f"s{i * per}-s{i * per + per - 1} on {d}" for i, d in enumerate(rt.devices))
            copies = sum(1 for op in self._ops if op.stream is not None)
            extra.append(f"devices: {spans}; {copies} copies run on copy streams (the schedule's stream "
                         "is where they would run otherwise)")
        return explain_schedule(self.names, self.schedule, extra)

    def to_dot(self) -> str:
        """Graphviz source: ops coloured by stream, cross-stream waits dashed."""
        return schedule_to_dot(self.names, self.schedule)
