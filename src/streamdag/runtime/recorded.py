"""Recorded graphs: ops captured by ``rt.record()``, scheduled once, run many times."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ExceptionGroup
from ..graph.buffers import Access
from ..graph.hazards import DepsTracker
from ..observe.dot import schedule_to_dot
from ..observe.explain import explain_schedule
from ..schedule.plan import Schedule, build_schedule
from .ops import Future, Op

if TYPE_CHECKING:
    from .core import Runtime

__all__ = ["GraphResult", "OpNode", "RecordedGraph"]

_run_ids = itertools.count(1)


@dataclass(frozen=True)
class OpNode:
    """The handle ``submit`` returns while recording: index a :class:`GraphResult` with it."""

    index: int
    name: str

    def result(self, timeout: float | None = None) -> Any:
        raise RuntimeError(
            f"op {self.name!r} was recorded, not run: call g.run() and read its result, "
            "e.g. g.run().result()[node]"
        )


class GraphResult(Sequence):
    """The return values of one run of a recorded graph, in submission order."""

    def __init__(self, values: list[Any]) -> None:
        self._values = values

    def __getitem__(self, key):  # type: ignore[override]
        if isinstance(key, OpNode):
            key = key.index
        return self._values[key]

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"GraphResult({self._values!r})"


@dataclass
class _Recorded:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    accesses: list[Access]
    name: str


class RecordedGraph:
    """A graph of ops recorded by :meth:`Runtime.record`; :meth:`run` runs it on the runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._ops: list[_Recorded] = []
        self._preds: list[list[int]] = []
        self._tracker = DepsTracker()
        self._schedule: Schedule | None = None

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def names(self) -> list[str]:
        return [op.name for op in self._ops]

    def add(self, fn, args, kwargs, accesses, name: str | None) -> OpNode:
        if self._schedule is not None:
            raise RuntimeError("this graph is finished; record a new one with rt.record()")
        index = len(self._ops)
        unique = name or f"{getattr(fn, '__name__', type(fn).__name__)}#{index}"
        self._preds.append(sorted(self._tracker.depends_on(accesses)))
        self._tracker.add(index, accesses)
        self._ops.append(_Recorded(fn, args, kwargs, accesses, unique))
        return OpNode(index, unique)

    def finish(self) -> None:
        self._schedule = build_schedule(self._preds, self._rt.num_streams)
        self._tracker = DepsTracker()

    @property
    def schedule(self) -> Schedule:
        if self._schedule is None:
            raise RuntimeError("the graph is still being recorded: leave the `with rt.record()` block")
        return self._schedule

    def run(self) -> Future:
        """Run every op once, concurrently as scheduled; returns a Future of a :class:`GraphResult`.

        The graph also orders itself after earlier ops of the runtime that touch
        its buffers, and later ops after it.
        """
        rt = self._rt
        rt._check_open()
        sched = self.schedule
        result = Future()
        result.op_name = "graph"
        n = len(self._ops)
        if n == 0:
            result.set_result(GraphResult([]))
            return result
        run_id = next(_run_ids)
        launched: list[Op] = []
        remaining = [n]
        lock = threading.Lock()

        def one_done(_f: Any) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            roots = [op.error for op in launched if op.error is not None and op.root_error is op.error]
            if roots:
                result.set_exception(ExceptionGroup(f"{len(roots)} op(s) of the graph failed", roots))
            else:
                result.set_result(GraphResult([op.future.result() for op in launched]))

        with rt._lock:
            for v, rec in enumerate(self._ops):
                rt._slots.acquire()
                rt._seq += 1
                op = Op(rt._seq, rec.name, rec.fn, rec.args, rec.kwargs, rec.accesses)
                op.run_id = run_id
                outside = [d for d in rt._tracker.depends_on(rec.accesses) if d.run_id != run_id]
                rt._launch(op, outside + [launched[u] for u in sched.preds[v]], sched.stream[v])
                launched.append(op)
        for op in launched:
            op.future.add_done_callback(one_done)
        return result

    def explain(self) -> str:
        """Levels, streams, waits and the critical path, as text a person reads."""
        return explain_schedule(self.names, self.schedule)

    def to_dot(self) -> str:
        """Graphviz source: ops coloured by stream, cross-stream waits dashed."""
        return schedule_to_dot(self.names, self.schedule)
