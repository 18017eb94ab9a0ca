"""Recorded graphs of a ray :class:`~streamdag.ray.Runtime`, run as one Ray Compiled Graph.

Leaving ``rt.record()`` finds the graph's dependencies with the project's hazard tracker and
schedules it with :func:`streamdag.build_schedule`, one group (and one stream) per worker: the
schedule's order per stream is each worker's program (the ops by level, so that a worker of two
pipeline stages runs every micro-batch's first stage before the second), and its reduced edges
between streams are what must cross workers. Each worker's program is cut into *segments*: a new
segment begins at an op that follows an op of another worker or reads a value from another worker,
and after an op that an op of another worker follows or reads from. A segment then waits for
nothing once it has begun and sends its values at its end, and becomes one task of a Ray Compiled
Graph on its worker (``Worker.run_segment``), with a channel from each segment it follows: the
values it reads (the buffers of another worker as they are after their writer, or before the run),
or only the order. A worker whose ops neither wait for nor feed another worker's is one task; a
pipeline is one task per op of each stage, so that its stages overlap. A segment's edges all come
from segments that begin earlier, so the tasks form a DAG.

``g.run()`` is one ``execute`` of the compiled graph: Ray's channels carry the values, and the
driver does no work per op. A run's ``execute`` waits for the run of the graph before it: a
compiled graph whose input is read by an actor on a node other than the driver's stalls with
several executes in flight (with 8, a hand-written one of two actors hangs; read only on the
driver's node, it runs them all), and a compiled graph's ``execute`` and ``ray.get`` must not
race from two threads (Ray's compiled graph is not thread-safe). The run's input is one
value per worker, each on a channel of its own to the worker's first segment: the run's number, the
new values of the worker's buffers that ``g.run(inputs=...)`` gives (stored before the run's first
op there) and the buffers that ``g.run(outputs=...)`` asks back, which the worker's last segment
adds to what it returns to the driver. So a run's data in and out crosses no channel but the graph's
own, as in a hand-written compiled graph fed through its ``InputNode``. A worker lost during a run
tears the compiled graph down (Ray's own monitor does): that run's ops on that worker fail with
:class:`WorkerLost`, those that read what they wrote with :class:`DependencyFailed`, and the next
run compiles the graph again on the restarted worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from ..errors import BaseExceptionGroup, DependencyFailed, InvalidBuffer, WorkerLost
from ..graph.buffers import Access, Region
from ..observe.explain import explain_schedule
from ..runtime import Future, GraphResult, OpNode
from ..runtime.accel import DepsTracker, build_schedule
from ..schedule.levels import wavefront_levels
from ..schedule.plan import Schedule
from ._worker import Incoming, OpSpec, Packed, SegmentSpec

if TYPE_CHECKING:
    from .runtime import RemoteBuffer, Runtime

__all__ = ["RayGraph", "RayGraphResult"]


@dataclass
class _Rec:
    fn: Any
    args: tuple
    kwargs: dict
    accesses: list[Access]
    writes: list[Region]
    worker: int
    remote: dict[int, RemoteBuffer]
    name: str
    ids: dict[bool, tuple[int, ...]]  # the worker's own buffers it reads (False) and writes (True)


@dataclass
class _Plan:
    """Segments of every worker, with their edges, from a schedule."""

    segments: list[SegmentSpec] = field(default_factory=list)
    start: list[int] = field(default_factory=list)  # the index of each segment's first op (or -1)
    inputs: list[list[tuple[int, int]]] = field(default_factory=list)  # (source segment, its output slot)
    seg_of: dict[int, int] = field(default_factory=dict)  # op index -> segment
    transfers: int = 0


_run_numbers = itertools.count(1)


class RayGraphResult(GraphResult):
    """A run's return values (a :class:`streamdag.GraphResult`), and ``outputs``: the values of the
    buffers ``g.run(outputs=[...])`` asked back, in that order, as arrays of the driver's own."""

    def __init__(self, values: list[Any], outputs: tuple[Any, ...] = ()) -> None:
        super().__init__(values)
        self.outputs: tuple[Any, ...] = outputs


def _unpack(value: Any) -> Any:
    return ray.cloudpickle.loads(value.data) if type(value) is Packed else value


class RayGraph:
    """A recorded graph of a ray runtime: ``run()``, ``explain()``, ``schedule``."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        self._ops: list[_Rec] = []
        self._schedule: Schedule | None = None  # the ops numbered as recorded
        # from leaving rt.record() on, the ops (_ops, and the indices of everything run) are in the
        # order the workers run them: op v of the run is the op recorded as _recorded[v]
        self._run_schedule: Schedule | None = None
        self._recorded: list[int] = []
        self._plan: _Plan | None = None
        self._compiled: Any = None
        self._outputs: list[int] = []  # the worker of each output of the compiled graph
        self._lock = threading.Lock()
        self._runs_in_flight: list[tuple[Any, Future]] = []
        self._workers_used: set[int] = set()
        self._used: set[int] = set()  # the buffers its ops read or write
        self._written: set[int] = set()  # and those they write
        self._heads: list[int] = []  # the worker of each input of the compiled graph
        self.compiles: int = 0

    # --- recording -----------------------------------------------------------------------------
    def _add(self, fn: Any, args: tuple, kwargs: dict, accesses: list[Access], writes: list[Region],
             worker: int, remote: dict[int, RemoteBuffer], name: str,
             ids: dict[bool, tuple[int, ...]]) -> OpNode:
        if self._schedule is not None:
            raise RuntimeError("this graph was recorded already: record a new one")
        self._ops.append(_Rec(fn, args, kwargs, accesses, writes, worker, dict(remote), name, ids))
        return OpNode(len(self._ops) - 1, name)

    @property
    def names(self) -> list[str]:
        """The ops' names, in the order they were recorded."""
        names = [""] * len(self._ops)
        for v, op in enumerate(self._ops):
            names[self._recorded[v] if self._recorded else v] = op.name
        return names

    @property
    def schedule(self) -> Schedule:
        """Where and after what each op runs, the ops numbered as they were recorded; ``order[w]`` is
        worker ``w``'s program, in the order it runs them."""
        if self._schedule is None:
            raise RuntimeError("the graph is still being recorded: leave the `with rt.record()` block")
        return self._schedule

    def _finish_recording(self) -> None:
        tracker = DepsTracker()
        deps: list[list[int]] = []
        for v, op in enumerate(self._ops):
            deps.append(sorted(tracker.link(v, op.accesses)))
        # each worker runs its ops by wavefront level, ties in recording order: a pipeline whose last
        # stage is on its first stage's worker runs every micro-batch's first stage before the last
        # stages (recording order would wait for micro-batch 0 to go round the pipeline before
        # micro-batch 1 begins). Levels rise along every edge, so the ops renumbered in this order
        # are still in a topological order.
        self._recorded = [v for level in wavefront_levels(deps) for v in level]
        at = {v: i for i, v in enumerate(self._recorded)}
        self._ops = [self._ops[v] for v in self._recorded]
        deps = [sorted(at[u] for u in deps[v]) for v in self._recorded]
        groups = [op.worker for op in self._ops]
        self._run_schedule = build_schedule(deps, 1, groups=groups) if self._ops else build_schedule([], 1)
        self._schedule = _in_recording_order(self._run_schedule, self._recorded)
        self._plan = _segments(self._ops, deps, self._run_schedule)
        # every worker with a task in the compiled graph: one that only sends a buffer's value too
        self._workers_used = {seg.worker for seg in self._plan.segments}
        self._written = {b for op in self._ops for b in op.ids[True]}
        self._used = self._written | {b for op in self._ops for b in (*op.ids[False], *op.remote)}

    # --- running -------------------------------------------------------------------------------
    def run(self, inputs: Mapping[RemoteBuffer, Any] | None = None,
            outputs: Sequence[RemoteBuffer] = ()) -> Future[RayGraphResult]:
        """Run every op once, as one execute of the graph's Ray Compiled Graph.

        ``inputs`` gives buffers of the graph new values before the run (``{buf: array}``, of the
        buffer's shape and dtype), and ``outputs`` lists buffers whose values after the run come
        back in its result's ``outputs``: both travel through the compiled graph's own channels, in
        the same execute, instead of an ``rt.put`` before the run and an ``rt.get`` after it.

        Returns a :class:`streamdag.Future` of a :class:`RayGraphResult` (the ops' return values in
        submission order, and ``outputs``). Where ops fail, the future fails with an
        ``ExceptionGroup`` of the graph's own failures (an op's exception, or :class:`WorkerLost`);
        their dependents fail with :class:`DependencyFailed`, and the other ops run. The run follows
        the eager ops submitted before it on its workers, and eager ops submitted after it follow
        the run.
        """
        rt = self._rt
        rt._check_open()
        self.schedule  # noqa: B018 (raises while recording)
        values, wanted = self._check_io(inputs, outputs)
        future = Future()
        future.op_name = "graph run"
        if not self._ops:
            future.set_result(RayGraphResult([]))
            return future
        rt._wait_eager(self._workers_used)
        with rt._lock:  # an eager transfer of a buffer made before this run is not of its new value
            for bid in (*self._written, *values):
                rt._exports.pop(bid, None)
        while True:
            # one execute in flight: with two, Ray's channels between nodes hang (see the module's
            # docstring), and execute and ray.get must not race from two threads. Waited for
            # outside the lock, which the run's settling takes.
            self._wait_runs(rt.timeout_s)
            with self._lock:
                if not self._runs_in_flight:
                    ref, run_no = self._execute(values, wanted, future)
                    break
        threading.Thread(target=self._settle, args=(ref, future, run_no, outputs), daemon=True,
                         name="streamdag-ray-run").start()
        return future

    def _execute(self, values: dict[int, Any], wanted: list[RemoteBuffer], future: Future) -> tuple[Any, int]:
        """Start a run (under the graph's lock): its compiled graph's ``execute``."""
        rt = self._rt
        for other in rt._graphs:  # one compiled graph per worker at a time runs
            if other is not self and other._workers_used & self._workers_used:
                other._wait_runs(rt.timeout_s)
                if other._compiled is not None and not other._runs_in_flight:
                    other._teardown()
        if self._compiled is None:
            self._compile()
        run_no = next(_run_numbers)  # the workers keep the outcome of their latest run by it
        try:
            ref = self._compiled.execute(*self._heads_of(run_no, values, wanted))
        except Exception:  # torn down meanwhile (a worker was lost): set up again
            self._teardown()
            self._compile()
            ref = self._compiled.execute(*self._heads_of(run_no, values, wanted))
        self._runs_in_flight.append((ref, future))
        return ref, run_no

    def _check_io(self, inputs: Mapping[RemoteBuffer, Any] | None,
                  outputs: Sequence[RemoteBuffer]) -> tuple[dict[int, Any], list[RemoteBuffer]]:
        """``inputs`` as ``{buffer id: array}``, checked against their buffers; ``outputs`` checked."""
        from .runtime import RemoteBuffer

        values: dict[int, Any] = {}
        for buf, value in (inputs or {}).items():
            if not isinstance(buf, RemoteBuffer):
                raise TypeError(f"g.run(inputs=...) takes {{RemoteBuffer: array}}, got a key of type "
                                f"{type(buf).__name__}: key each value by the buffer it fills")
            if buf.freed or buf.id not in self._used:
                raise InvalidBuffer(f"g.run(inputs=...): {buf!r} is not a buffer of this graph's ops "
                                    "(or rt.free() let it go): give inputs only for the buffers the "
                                    "graph reads, and fill others with rt.put(value, out=buf)")
            values[buf.id] = _input_value(buf, value)
        if isinstance(outputs, RemoteBuffer):
            raise TypeError("g.run(outputs=...) takes a list of RemoteBuffers: write outputs=[buf]")
        for buf in outputs:
            if not isinstance(buf, RemoteBuffer) or buf.freed or buf.worker not in self._workers_used:
                raise InvalidBuffer(f"g.run(outputs=...): {buf!r} is not a live buffer on a worker of "
                                    "this graph: ask back the graph's buffers, or read another with "
                                    "rt.get(buf) after the run")
        return values, list(outputs)

    def _heads_of(self, run_no: int, values: dict[int, Any], wanted: list[RemoteBuffer]) -> list[tuple]:
        """The compiled graph's input for each worker: its part of the run's inputs and outputs."""
        buffers = self._rt._buffers
        return [(run_no, {b: v for b, v in values.items() if buffers[b].worker == w},
                 tuple(b.id for b in wanted if b.worker == w)) for w in self._heads]

    def _settle(self, ref: Any, future: Future, run_no: int, outputs: Sequence[RemoteBuffer]) -> None:
        try:
            carries = ray.get(ref, timeout=self._rt.timeout_s)
        except Exception as e:  # a lost worker, a timeout: mapped to the ops below
            carries = None
            cause = e
        with self._lock:
            self._runs_in_flight = [(r, f) for r, f in self._runs_in_flight if f is not future]
            if carries is None:
                self._teardown()
        got: dict[int, Any] = {}
        if carries is None:
            results = self._lost(cause, run_no)
        else:
            results = {}
            for carry in carries:
                # copies: the values read from a channel are views of its buffer, which the next
                # run cannot write while they live
                got.update((b, np.array(v, copy=True)) for b, v in carry.pop(-1, {}).items())
                results.update(carry)
        self._deliver(results, future, outputs, got)

    def _deliver(self, results: dict[int, tuple], future: Future, outputs: Sequence[RemoteBuffer] = (),
                 got: dict[int, Any] | None = None) -> None:
        rt = self._rt
        values: list[Any] = []
        failures: list[BaseException] = []
        first_dep: BaseException | None = None
        prof = rt._profile
        first = rt._reserve(len(self._ops)) if prof is not None else 0  # the run's ops' numbers
        for v, op in enumerate(self._ops):
            status, a, b, t0, t_in, t1 = results[v]
            a, b = _unpack(a), _unpack(b)
            if status == "ok":
                values.append(rt._handle(a, None))
            elif status == "err":
                values.append(None)
                failures.append(a)
            else:
                values.append(None)
                first_dep = first_dep or DependencyFailed(op.name, a, b)
            if prof is not None and t0 is not None:
                rt._add_spans(prof, _SpanOp(first + v, op), t0, t_in, t1, status != "ok",
                              [first + u for u in self._run_schedule.preds[v]])
        got = got or {}
        missing = next((b for b in outputs if b.id not in got), None)
        if missing is not None and not failures:  # the run's end on that worker never came back
            failures.append(WorkerLost(missing.device, f"the run's value of {missing!r} did not arrive"))
        if failures:
            future.set_exception(BaseExceptionGroup(f"{len(failures)} op(s) of the graph failed", failures))
        elif first_dep is not None:
            future.set_exception(first_dep)
        else:
            in_recording_order: list[Any] = [None] * len(values)
            for v, value in enumerate(values):
                in_recording_order[self._recorded[v]] = value
            future.set_result(RayGraphResult(in_recording_order, tuple(got[b.id] for b in outputs)))

    def _lost(self, cause: BaseException, run_no: int) -> dict[int, tuple]:
        """The outcome of each op of a run whose compiled graph failed: what the workers that kept
        their state ran, as they report it; the dead workers' other ops fail with WorkerLost, and
        the ops that depend on one with DependencyFailed. An op that did not run for neither (it
        waited behind one on its worker when Ray tore the graph down) fails with WorkerLost too."""
        rt = self._rt
        alive = _alive(rt, self._workers_used)
        ran: dict[int, tuple] = {}
        refs = [rt._workers[w].graph_outcome.remote(run_no) for w in alive]
        for ref in refs:
            with contextlib.suppress(Exception):  # lost meanwhile: its ops count as not run
                ran.update(ray.get(ref, timeout=min(rt.timeout_s, 60)))
        results: dict[int, tuple] = {}
        roots: dict[int, tuple[str, BaseException]] = {}
        for v, op in enumerate(self._ops):
            if v in ran:
                results[v] = ran[v]
                if ran[v][0] != "ok":
                    a, b = (_unpack(x) for x in ran[v][1:3])
                    roots[v] = (op.name, a) if ran[v][0] == "err" else (a, b)
                continue
            if op.worker not in alive:
                err = WorkerLost(f"ray:{op.worker}", type(cause).__name__)
                results[v] = ("err", err, None, None, None, None)
                roots[v] = (op.name, err)
                continue
            root = next((roots[u] for u in self._preds_full[v] if u in roots), None)
            if root is not None:
                results[v] = ("dep", root[0], root[1], None, None, None)
                roots[v] = root
            else:  # the compiled graph was torn down before this op's outcome reached the driver
                err = WorkerLost(f"ray:{op.worker}", f"the run was torn down ({type(cause).__name__}: "
                                                     f"{cause}); this op may not have run")
                results[v] = ("err", err, None, None, None, None)
        return results

    @property
    def _preds_full(self) -> tuple[tuple[int, ...], ...]:
        return self._run_schedule.preds

    def _compile(self) -> None:
        from ray.dag import InputNode, MultiOutputNode

        plan = self._plan
        assert plan is not None
        workers = self._rt._workers
        outs: list[Any] = []
        last: dict[int, Any] = {}
        self._heads = [seg.worker for seg in plan.segments if seg.first]
        with InputNode() as inp:
            for s, seg in enumerate(plan.segments):
                # each worker's input on a channel of its own: it carries that worker's inputs only
                head = inp[self._heads.index(seg.worker)] if seg.first else last[seg.worker]
                ins = [outs[src][slot] for src, slot in plan.inputs[s]]
                n = 1 + len(seg.exports)
                node = workers[seg.worker].run_segment.options(num_returns=n).bind(seg, head, *ins)
                nodes = list(node) if n > 1 else [node]
                outs.append(nodes)  # slot 0: the carry, for the worker's next segment; then the exports
                last[seg.worker] = nodes[0]
            dag = MultiOutputNode([last[w] for w in sorted(last)])
        self._outputs = sorted(last)
        self._compiled = dag.experimental_compile(_submit_timeout=self._rt.timeout_s)
        self.compiles += 1

    def release(self) -> None:
        """Tear the graph's Ray Compiled Graph down once its runs in flight end; the next run sets it
        up again (a compile). While it is set up, each of its workers polls its channels, which keeps
        a CPU core busy even between runs (Ray's compiled graphs wait so); release a graph that will
        not run for a while on a machine whose cores the eager work needs."""
        while True:
            self._wait_runs(self._rt.timeout_s)
            with self._lock:
                if not self._runs_in_flight:  # (none began since)
                    self._teardown()
                    return

    def _wait_runs(self, timeout: float) -> None:
        for _, f in list(self._runs_in_flight):
            with contextlib.suppress(Exception):  # its outcome is its own future's
                f.exception(timeout=timeout)

    def _teardown(self) -> None:
        compiled, self._compiled = self._compiled, None
        if compiled is not None:
            with contextlib.suppress(Exception):  # a torn-down graph (a lost worker) needs no more
                compiled.teardown()

    # --- reading -------------------------------------------------------------------------------
    def explain(self) -> str:
        """Levels, workers, cross-worker edges and the compiled graph's tasks, as text."""
        plan = self._plan
        assert plan is not None
        per = {}
        for seg in plan.segments:
            per[seg.worker] = per.get(seg.worker, 0) + 1
        tasks = ", ".join(f"ray:{w} {n}" for w, n in sorted(per.items()))
        extra = [
            f"workers: stream sN is worker ray:N; a Ray Compiled Graph of {len(plan.segments)} task(s) "
            f"({tasks}) and {sum(len(i) for i in plan.inputs)} channel(s) between workers, "
            f"{plan.transfers} buffer transfer(s) per run; compiled {self.compiles} time(s)",
        ]
        return explain_schedule(self.names, self.schedule, extra)


@dataclass
class _SpanOp:
    seq: int
    rec: _Rec

    @property
    def name(self) -> str:
        return self.rec.name

    @property
    def worker(self) -> int:
        return self.rec.worker


def _alive(rt: Runtime, workers: set[int]) -> set[int]:
    """The workers that kept their state: they answer, as the same process as before. (A restarted
    one answers too, but its ops of the run were lost with its memory.) Learns the new ones."""
    refs = {w: rt._workers[w].where.remote() for w in workers}
    alive = set()
    for w, ref in refs.items():
        try:
            token = ray.get(ref, timeout=min(rt.timeout_s, 60))[3]
        except Exception:  # dead or unreachable
            continue
        if token == rt._tokens[w]:
            alive.add(w)
        else:
            rt._restarted(w, token)
    return alive


def _segments(ops: Sequence[_Rec], deps: list[list[int]], sched: Schedule) -> _Plan:
    """Cut each worker's program where an op waits for another worker or another waits for it; plan
    the transfers."""
    n = len(ops)
    worker_of = [op.worker for op in ops]
    # the value each op reads from another worker: (buffer, its last writer before the op, or -1)
    reads: list[list[tuple[int, int]]] = []
    for v, op in enumerate(ops):
        reads.append([(b.id, max((u for u in deps[v] if worker_of[u] == b.worker
                                  and any(r.overlaps(b.region) for r in ops[u].writes)), default=-1))
                      for b in op.remote.values()])
    cut = [bool(keys) or any(worker_of[u] != worker_of[v] for u in sched.preds[v])
           for v, keys in enumerate(reads)]
    # an op another worker waits for ends its segment too: a segment sends its values at its end,
    # so that a pipeline's next stage begins after each op of the stage before, not after them all
    sends = {writer for keys in reads for _, writer in keys if writer >= 0}
    sends |= {u for v in range(n) for u in sched.preds[v] if worker_of[u] != worker_of[v]}
    order = {w: [v for v in range(n) if worker_of[v] == w] for w in sorted(set(worker_of))}
    for w_ops in order.values():
        for before, v in itertools.pairwise(w_ops):
            cut[v] = cut[v] or before in sends
    runs = _runs(ops, reads, order, cut)
    plan = _Plan()
    seen: set[int] = set()
    for start, w, members in runs:
        plan.segments.append(SegmentSpec(worker=w, first=w not in seen))
        plan.start.append(start)
        seen.add(w)
        for v in members:
            plan.seg_of[v] = len(plan.segments) - 1
    prefix_of = {plan.segments[s].worker: s for s in range(len(plan.segments)) if plan.start[s] < 0}
    edges: dict[tuple[int, int], list[tuple[int, int]]] = {}
    snaps: dict[int, list[tuple[int, int]]] = {}
    for v in range(n):
        dst = plan.seg_of[v]
        for u in sched.preds[v]:
            if worker_of[u] != worker_of[v]:
                edges.setdefault((plan.seg_of[u], dst), [])
        for b, key in zip(ops[v].remote.values(), reads[v]):
            writer = key[1]
            before = [u for u in order.get(b.worker, []) if u < v]
            after = writer if writer >= 0 else (before[-1] if before else -1)
            src = plan.seg_of[after] if after >= 0 else prefix_of[b.worker]
            keys = edges.setdefault((src, dst), [])
            if key in keys:
                continue
            keys.append(key)
            plan.transfers += 1
            # taken where valid: after ``after`` if a later op of its segment writes the buffer, else
            # at the segment's end (no copy)
            if any(plan.seg_of[u] == src and u > after and any(r.overlaps(b.region) for r in ops[u].writes)
                   for u in order.get(b.worker, [])):
                if after >= 0:
                    snaps.setdefault(after, []).append(key)
                else:
                    plan.segments[src].start_snapshots.append(key)
    for w in {seg.worker for seg in plan.segments}:
        plan.segments[max(s for s, seg in enumerate(plan.segments) if seg.worker == w)].last = True
    plan.inputs = [[] for _ in plan.segments]
    for (src, dst), keys in sorted(edges.items()):
        assert src < dst, "segment edges go forward"
        plan.segments[src].exports.append(keys)
        plan.inputs[dst].append((src, len(plan.segments[src].exports)))
    for v, op in enumerate(ops):
        ids = dict(zip(op.remote, reads[v]))
        fail_if = tuple(u for u in deps[v] if worker_of[u] == op.worker
                        and any(r.overlaps(a.region) for r in ops[u].writes for a in op.accesses))
        plan.segments[plan.seg_of[v]].ops.append(
            OpSpec(v, op.name, op.fn, _rekey(op.args, ids), _rekey(op.kwargs, ids), fail_if,
                   tuple(reads[v]), tuple(snaps.get(v, ())), op.ids[False], op.ids[True]))
    return plan


def _runs(ops: Sequence[_Rec], reads: list[list[tuple[int, int]]], order: dict[int, list[int]],
          cut: list[bool]) -> list[tuple[int, int, list[int]]]:
    """Each worker's program cut into segments, in the order they begin: (first op, worker, ops),
    or (-1, worker, []) for a worker whose initial values are read before its first op."""
    # an initial value read before the owner's first op comes from a segment of no ops before it
    prefix = {ops[v].remote[bid].worker for v in range(len(ops)) for bid, writer in reads[v]
              if writer < 0 and not any(u < v for u in order.get(ops[v].remote[bid].worker, []))}
    runs: list[tuple[int, int, list[int]]] = []
    for w in sorted(set(order) | prefix):
        mine: list[tuple[int, int, list[int]]] = [(-1, w, [])] if w in prefix else []
        for v in order.get(w, []):
            if not mine or cut[v]:
                mine.append((v, w, []))
            mine[-1][2].append(v)
        runs += mine
    # every edge goes from a segment that begins earlier to one that begins later: bind in that order
    runs.sort(key=lambda r: r[0])
    return runs


def _in_recording_order(sched: Schedule, recorded: Sequence[int]) -> Schedule:
    """``sched``, a schedule of ops numbered as they run, with each op numbered as it was recorded."""
    def ids(vs: Sequence[int]) -> tuple[int, ...]:
        return tuple(recorded[v] for v in vs)

    n = len(recorded)
    preds: list[tuple[int, ...]] = [()] * n
    waits: list[tuple[int, ...]] = [()] * n
    stream = [0] * n
    for v, r in enumerate(recorded):
        preds[r] = tuple(sorted(ids(sched.preds[v])))
        waits[r] = tuple(sorted(ids(sched.waits[v])))
        stream[r] = sched.stream[v]
    return dataclasses.replace(sched, preds=tuple(preds), waits=tuple(waits), stream=tuple(stream),
                               levels=tuple(tuple(sorted(ids(level))) for level in sched.levels),
                               order=tuple(ids(o) for o in sched.order),
                               critical_path=ids(sched.critical_path))


def _input_value(buf: RemoteBuffer, value: Any) -> np.ndarray:
    """``value`` as an array for ``buf``, refused where its shape or dtype is not the buffer's."""
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    value = np.asarray(value)
    if value.shape != buf.shape:
        raise ValueError(f"g.run(inputs=...): a value of shape {value.shape} for {buf!r}: give an "
                         f"array of the buffer's shape {buf.shape}")
    if value.dtype != buf.dtype:
        raise TypeError(f"g.run(inputs=...): a value of dtype {value.dtype} for {buf!r}: convert it "
                        f"first (value.astype(np.{buf.dtype})) so that no cast happens unseen")
    return value


def _rekey(value: Any, ids: dict[int, tuple[int, int]]) -> Any:
    """Recorded arguments with each transferred buffer keyed by (buffer, writer)."""
    kind = type(value)
    if kind is Incoming:
        return Incoming(ids[value.key])
    if kind in (list, tuple):
        return kind(_rekey(v, ids) for v in value)
    if kind is dict:
        return {k: _rekey(v, ids) for k, v in value.items()}
    return value
