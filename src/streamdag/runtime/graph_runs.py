"""A recorded graph's runs op by op: eagerly (each op linked, placed and launched as a submit is),
or in parts around its host-lane ops; :class:`OpNode`, what a recorded submit returns, and
:class:`GraphResult`, the values of a run.

:class:`EagerRuns` is a part of :class:`~.recorded.RecordedGraph`. A run takes the runtime's lock
for all its launches (another thread's op comes before or after them all) and a slot per op; it
changes the runtime's state only through the submit path's calls (``_take_slot``,
``_launch_or_hold``, ``_enqueue``) and the tracker, as a submit does. Its own state: the ops
launched by the run (``launched``, cleared as the run settles, so that no cycle is left).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, overload

from ..errors import BaseExceptionGroup, DependencyFailed
from .ops import Future, Op, after_all

__all__ = ["EagerRunRuntime", "EagerRuns", "GraphResult", "OpNode"]

_run_ids = itertools.count(1)


class EagerRunRuntime(Protocol):
    """What a run op by op needs of its runtime (``core.Runtime`` and its parts provide it): the
    submit path's steps, called under ``_lock`` as ``_enqueue`` calls them, and where the calling
    thread runs (a lane: see ``SubmitPath._lane_instead``). Nothing else of it is read or written here."""

    backend: Any
    _lock: Any  #: held for all of a run's launches
    _slots: Any  #: ``completion.Slots``: a slot given back where a launch is refused
    _tracker: Any  #: links each op of the run to the earlier ops it conflicts with
    _host_ops: dict[int, Op]  #: read: whether any op may be held (see ``held``)
    _stream_device: list[str]
    _take_slot: Callable[..., bool]
    _new_op: Callable[..., Op]
    _add_host_op: Callable[[Op], None]
    _caller_fence: Callable[[str | None], Any]
    _host_deps: Callable[..., list[Op]]
    _launch_or_hold: Callable[..., None]
    _enqueue: Callable[..., Future]
    _hurry_all: Callable[..., None]
    _lane_instead: Callable[[], tuple[int, int]]
    _free_lane: Callable[[int, int, int], int]
    _mark_run_from_a_lane: Callable[[Future, list[Any], bool], None]


@dataclass(frozen=True)
class OpNode:
    """The handle ``submit`` returns while recording: index a :class:`GraphResult` with it."""

    index: int
    name: str

    def result(self, timeout: float | None = None) -> NoReturn:
        raise RuntimeError(
            f"op {self.name!r} was recorded, not run: call g.run() and read its result, "
            "e.g. g.run().result()[node]"
        )


class GraphResult(Sequence[Any]):
    """The return values of one run of a recorded graph, in submission order."""

    def __init__(self, values: list[Any]) -> None:
        self._values = values

    @overload
    def __getitem__(self, key: int | OpNode) -> Any: ...
    @overload
    def __getitem__(self, key: slice) -> list[Any]: ...
    def __getitem__(self, key: int | OpNode | slice) -> Any:
        if isinstance(key, OpNode):
            key = key.index
        return self._values[key]

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"GraphResult({self._values!r})"


class EagerRuns:
    """Runs of a recorded graph op by op (a part of :class:`~.recorded.RecordedGraph`)."""

    __slots__ = ()
    first_run_host_ms: float | None  #: declared here for type checkers; set by ``RecordedGraph``
    last_run_captured: bool

    def _run_eager(self, probe: Any) -> Future:
        """:meth:`run` op by op: each op launched as an eager submit is (or held), in order, under
        the runtime's lock; ``probe`` wraps each op's function during a first run (``sync_probe``)."""
        rt = self._rt
        result = Future()
        result.op_name = "graph"
        n = len(self._ops)
        if n == 0:
            result.set_result(GraphResult([]))
            return result
        run_id = next(_run_ids)
        launched: list[Op] = []

        def settle() -> None:
            ops = launched[:]
            launched.clear()  # each op's future holds this function: no cycle left to the collector
            result.__dict__.pop("_ops_of", None)  # (nor through SubmitPath._mark_run_from_a_lane's)
            failed = [op for op in ops if op.error is not None]
            # the graph's own root failures; else ops failed for a failure before the graph
            roots = [op.error for op in failed if op.root_error is op.error]
            roots = roots or [op.error for op in failed[:1]]
            if roots:  # (an ExceptionGroup, unless an op raised SystemExit, say: see run())
                result.set_exception(BaseExceptionGroup(f"{len(roots)} op(s) of the graph failed", roots))
            else:
                result.set_result(GraphResult([op.future.result() for op in ops]))

        rt._lock.acquire()  # ops after unfinished host-lane ops are held (see Runtime._hold)
        try:
            if rt._host_ops:  # refuses a run from the host lane of an op it follows
                rt._host_deps(self._graph_accesses(), "graph")
        except BaseException:
            rt._lock.release()
            raise
        t0 = time.perf_counter()
        try:
            behind = self._launch_ops(rt, run_id, probe, launched)
        finally:
            rt._lock.release()
        if self._runs == 1:  # how long the host takes to launch the graph once, op by op
            self.first_run_host_ms = (time.perf_counter() - t0) * 1e3
        result._hurry = rt._hurry_all  # waiting on the graph hurries the finishing of its ops
        rt._mark_run_from_a_lane(result, [op.future for op in launched], behind)
        one_done = after_all(n, settle)
        for op in launched:
            op.future._on_done(one_done)
        return result

    def _launch_ops(self, rt: EagerRunRuntime, run_id: int, probe: Any, launched: list[Op]) -> bool:
        """Launch every op of one eager run, in order; caller holds the runtime's lock. Whether an
        op is queued behind the calling op on its lane (run from inside an op there, see
        ``SubmitPath._lane_instead``)."""
        run_preds = self._run_preds
        here, instead = rt._lane_instead()
        behind = False
        for v, rec in enumerate(self._ops):
            rt._take_slot()  # (at the bound the lock is let go meanwhile: other submits may come in)
            stream = self._runtime_stream(v)
            if here != -1:
                stream = rt._free_lane(stream, here, instead)
            device = rt._stream_device[stream]
            on_lane = device == "host"
            try:  # (before the op is linked: it raises inside the caller's capture)
                fence = rt._caller_fence(device) if rt._host_ops and not on_lane else None
            except BaseException:
                rt._slots.release()
                raise
            fn = rec.fn if probe is None else probe(rec.fn, rec.name, self._syncing_ops)
            op = rt._new_op(rec.name, fn, rec.args, rec.kwargs, rec.accesses)
            op.run_id = run_id
            outside = [d for d in rt._tracker.link(op, rec.accesses) if d.run_id != run_id]
            deps = outside + [launched[u] for u in run_preds[v]]
            if on_lane:  # a host-lane op of the graph: what follows it is held until it has finished
                rt._add_host_op(op)
            # host code runs now: its host inputs must be final (but on a lane, which waits for them
            # itself). Held behind the unfinished host-lane ops it follows (of this run, or one that
            # came in while this thread waited for a slot)
            host_inputs = rec.stream is None and not on_lane and not rt.backend.deferred
            rt._launch_or_hold(op, deps, stream, device, host_inputs, fence)
            launched.append(op)
            # queued where it runs only once the calling op returns (see Runtime._mark_lane_submit)
            behind = behind or op.future.__dict__.get("_behind") == threading.get_ident()
        return behind

    def _run_parts(self, may_wait: bool) -> Future:
        """One run of a graph in parts (see ``_split_at_host_ops``): each part submitted in order,
        the host-lane ops onto the host lanes; one Future of the values of every op, as ``run``'s.
        A part due to be captured is captured first (``may_wait``), before the lock is taken for
        the parts' submits: a capture waits for the earlier ops, and under the lock it could not."""
        rt = self._rt
        parts = self._parts or []
        if may_wait:
            for graph, _ in parts:
                if graph is not None:
                    graph._capture_before_run()
        result = Future()
        result.op_name = "graph"
        futures: list[Any] = []
        # what settle() needs, and no more: the parts' futures keep it as a done-callback, and
        # the graph, its parts or the futures list (cleared once read) would make a reference cycle
        n_ops, places = len(self._ops), [(graph is not None, indices) for graph, indices in parts]

        def settle() -> None:
            values: list[Any] = [None] * n_ops
            errors: list[BaseException] = []
            settled, futures[:] = futures[:], []
            result.__dict__.pop("_ops_of", None)  # (see SubmitPath._mark_run_from_a_lane)
            for (is_graph, indices), f in zip(places, settled):
                error = f.exception()
                if error is None:
                    got = f.result() if is_graph else [f.result()]
                    for v, value in zip(indices, got):
                        values[v] = value
                else:
                    errors.extend(error.exceptions if isinstance(error, BaseExceptionGroup) else [error])
            if not errors:
                result.set_result(GraphResult(values))
                return
            # the graph's own root failures, as a run in one piece reports them; else the first
            own = [e for e in errors if not isinstance(e, DependencyFailed)]
            roots = own or errors[:1]
            result.set_exception(BaseExceptionGroup(f"{len(roots)} op(s) of the graph failed", roots))

        with rt._lock:  # one run's parts in a row: another thread's op comes before or after them all
            for graph, indices in parts:
                if graph is not None:
                    futures.append(graph._start_run(may_wait=False))
                else:
                    rec = self._ops[indices[0]]
                    futures.append(rt._enqueue(rec.fn, rec.args, rec.kwargs, rec.accesses, rec.name, rec.name,
                                               blocking=True, stream=None, device="host"))
        graphs = [graph for graph, _ in parts if graph is not None]
        self.last_run_captured = bool(graphs) and all(g.last_run_captured for g in graphs)
        result._hurry = rt._hurry_all  # waiting on the graph hurries the finishing of its ops
        me = threading.get_ident()
        rt._mark_run_from_a_lane(result, futures, any(f.__dict__.get("_behind") == me for f in futures))
        one_done = after_all(len(futures), settle)
        for f in futures:
            f._on_done(one_done)
        return result
