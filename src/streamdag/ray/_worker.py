"""What runs inside each Ray worker actor: its buffers, eager ops, transfers out, and graph segments.

The driver (``runtime.py``) decides everything: where an op runs, which earlier ops' failures it
inherits (``fail_if``), which values arrive from other workers. A worker only runs what it is sent,
in the order it is sent (a Ray actor runs one caller's calls in order), and remembers which of its
ops failed, so that a later op that inherits a failure fails without running. Arguments name the
worker's buffers by number (:class:`Buf`) and transferred values by position (:class:`Incoming`).

Every result goes back as a plain tuple ``(status, a, b, t0, t_in, t1)``: ``("ok", value, None, ...)``,
``("err", exception, None, ...)`` or ``("dep", root op name, root exception, ...)``; ``t0`` when the
worker took the op, ``t_in`` when its inputs from other workers had arrived, ``t1`` when it ended, in
seconds of ``time.time()`` (one clock for every worker of a host, and NTP's across hosts). A failure
is data, never a Ray task error that would hide which op failed.
"""

from __future__ import annotations

import copyreg
import os
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..errors import WorkerLost
from ._captured import CapturedSegment

__all__ = ["Buf", "Failed", "FnDef", "Incoming", "OpSpec", "Packed", "SegmentSpec", "Store", "Worker"]


class Buf(NamedTuple):
    """An argument that is the worker's buffer number ``id``."""

    id: int


class Incoming(NamedTuple):
    """An argument that is the value transferred in under ``key``."""

    key: Any


# Every eager call pickles these: a NamedTuple pickles through Python-level ``__reduce_ex__`` and
# ``__getnewargs__``, a reducer of its own in one call (a call naming two buffers: 1.7 µs to
# pickle, against 2.7).
copyreg.pickle(Buf, lambda b: (Buf, (b[0],)))
copyreg.pickle(Incoming, lambda i: (Incoming, (i[0],)))


class Store(NamedTuple):
    """The function of ``rt.put``: its one argument becomes buffer ``buf`` (made again if the worker
    was restarted since)."""

    buf: int


class FnDef(NamedTuple):
    """An eager op's function, sent to the worker once: held under ``number`` for later calls, which
    name it by that number alone. ``forget`` lists numbers the driver let go; ``reset`` drops all."""

    number: int
    data: bytes  # cloudpickle's
    forget: tuple[int, ...]
    reset: bool


class _Unloadable(NamedTuple):
    """A function the worker could not unpickle (its module is not there): each call fails with why."""

    error: BaseException


class Packed(NamedTuple):
    """A graph op's return value, pickled in band: unpickled on the driver into memory of its own.

    Values that come out of a compiled graph's channel are views of the channel's buffer, which
    the next run cannot write while they live: a result kept by the caller would block it."""

    data: bytes


def _pack(value: Any) -> Any:
    if value is None or type(value) in (Buf, bool, int, float, str):
        return value
    import ray

    return Packed(ray.cloudpickle.dumps(value))


class Failed(NamedTuple):
    """A transferred value that does not exist: the op that was to write it failed."""

    root_name: str
    root_error: BaseException


@dataclass
class OpSpec:
    """One op of a recorded graph, as its worker runs it."""

    index: int
    name: str
    fn: Any
    args: tuple
    kwargs: dict
    fail_if: tuple[int, ...]  # graph ops on this worker whose failure this op inherits
    incoming: tuple[Any, ...] = ()  # the keys of the values it reads from other workers
    snapshots: tuple[Any, ...] = ()  # export keys whose buffer must be copied right after this op
    reads: tuple[int, ...] = ()  # the worker's buffers it declares it reads
    writes: tuple[int, ...] = ()  # and writes (a GPU worker records them into a local graph)


@dataclass
class SegmentSpec:
    """A run of one worker's ops that waits for nothing from another worker once it has begun.

    ``first`` segments of a worker take the run's input; the others the carry of the one before.
    The ``last`` segment of a worker returns, beside the carry, the buffers the run asks back.
    ``exports[i]`` lists the keys ``(buffer, writer op or -1, buffer number)`` its ``i``-th
    consumer segment reads; ``start_snapshots`` are taken before its first op.
    """

    worker: int
    ops: list[OpSpec] = field(default_factory=list)
    exports: list[list[tuple]] = field(default_factory=list)
    start_snapshots: list[tuple] = field(default_factory=list)
    first: bool = False
    last: bool = False


def _resolve(value: Any, buffers: dict[int, Any], incoming: dict[Any, Any], worker: str) -> Any:
    kind = type(value)
    if kind is Buf:
        try:
            return buffers[value.id]
        except KeyError:
            raise WorkerLost(worker, f"buffer {value.id} is not on it: it was restarted since the "
                                     "buffer was written") from None
    if kind is Incoming:
        return incoming[value.key]
    if kind in (list, tuple):
        return kind(_resolve(v, buffers, incoming, worker) for v in value)
    if kind is dict:
        return {k: _resolve(v, buffers, incoming, worker) for k, v in value.items()}
    return value


def _result(value: Any, buffers: dict[int, Any]) -> Any:
    """What goes back for an op's return value: a buffer of the worker goes back as its number."""
    if isinstance(value, np.ndarray) or hasattr(value, "untyped_storage"):
        for key, buf in buffers.items():
            if buf is value:
                return Buf(key)
    return value


# an op's answer in a report where the driver reads the op's own answer instead: the op raised to
# Ray, or its answer is large (a report stays small enough for Ray to send it inside its reply:
# a larger one goes through the object store, and between nodes it took up to 2 s to arrive)
READ_OWN = "read own"
_REPORTED_AT_MOST = 256  # answers told in one report; the others are READ_OWN
_SMALL = frozenset({type(None), bool, int, float, complex, Buf})


def _small(answer: tuple) -> bool:
    """Whether ``answer`` (an op's outcome, not None) is small to send: failures, and the values of
    a few bytes."""
    if answer[0] != "ok":
        return True
    value = answer[1]
    kind = type(value)
    return kind in _SMALL or (kind in (str, bytes) and len(value) <= 256) or (
        kind is np.ndarray and value.nbytes <= 256)


class Worker:
    """The state of one worker: its buffers by number and its failed ops (with their root)."""

    def __init__(self, name: str, device: str) -> None:
        self.name = name
        self.device = device
        self.buffers: dict[int, Any] = {}
        self.failed: dict[int, tuple[str, BaseException]] = {}
        self.functions: dict[int, Any] = {}  # the eager ops' functions by number (see _functions.py)
        self.graph_failed: dict[int, tuple[str, BaseException]] = {}
        self.token = uuid.uuid4().hex
        # the eager ops run by this incarnation, and (position, answer) of each since the last report
        # that did not answer None (a plain success): a report tells the driver of many ops at once
        self.ran = 0
        self.unreported: list[tuple[int, Any]] = []
        self.local: Any = None  # a GPU worker's local streamdag runtime (see _captured.py)
        self.captured: list[CapturedSegment] = []
        self.graph_run = 0
        self.graph_results: dict[int, tuple] = {}
        self.graph_outputs: tuple[int, ...] = ()  # the buffers the current run asks back

    # --- plain calls -------------------------------------------------------------------------
    def where(self) -> tuple[int, str, str, str]:
        """The worker's process, host, Ray node, and a token of this incarnation (a restarted worker
        has lost its buffers: the driver tells it by the token)."""
        import ray

        return os.getpid(), socket.gethostname(), ray.get_runtime_context().get_node_id(), self.token

    def alloc(self, buf: int, shape: tuple[int, ...], dtype: str) -> None:
        if self.device.startswith("cuda"):
            import torch

            self.buffers[buf] = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
        else:
            self.buffers[buf] = np.empty(shape, dtype=dtype)

    def free(self, bufs: Sequence[int]) -> None:
        for b in bufs:
            self.buffers.pop(b, None)

    def captured_statistics(self) -> list[tuple[int, int]]:
        """``(captures, replays)`` of each segment this GPU worker runs as a local recorded graph."""
        return [(stats.captures, stats.replays) for seg in self.captured
                if seg.graph is not None and (stats := seg.graph.statistics()) is not None]

    def graph_outcome(self, run: int) -> dict[int, tuple]:
        """The results of the ops of compiled run ``run`` that ran here (asked after a lost worker
        tore the compiled graph down)."""
        return dict(self.graph_results) if self.graph_run == run else {}

    def forget_failures(self) -> None:
        self.failed.clear()

    def export(self, buf: int, fail_if: Sequence[int], name: str) -> Any:
        """The value of buffer ``buf`` now, for another worker (Ray copies it as it returns)."""
        for u in fail_if:
            root = self.failed.get(u)
            if root is not None:
                return Failed(*root)
        value = _resolve(Buf(buf), self.buffers, {}, self.name)
        return value.detach().cpu().numpy() if hasattr(value, "detach") else value

    def run_op(self, call: bytes | tuple) -> Any:
        """Run one eager op (see :meth:`_run_op`) and answer its outcome. ``call`` is the op's pickle,
        or that, its incoming values, and whether to report: then the answer is ``("report",
        outcome, *self.report())``, the outcomes of the ops before it too (see :meth:`report`)."""
        self.ran += 1
        at = self.ran
        try:
            answer = self._run_op(call)
        except BaseException:  # Ray answers it (say, its call could not be unpickled here)
            self.unreported.append((at, READ_OWN))
            raise
        if type(call) is tuple and len(call) > 2:  # asked to report
            return ("report", answer, *self.report())
        if answer is not None:
            small = len(self.unreported) < _REPORTED_AT_MOST and _small(answer)
            self.unreported.append((at, answer if small else READ_OWN))
        return answer

    def report(self) -> tuple[str, int, list[tuple[int, Any]]]:
        """``(token, ops run, [(position, answer)])``: the answers since the last report that are not
        None, by their op's position among the eager ops this incarnation ran (``READ_OWN`` where the
        driver is to read the op's own answer). The driver reads this one answer, not each op's own."""
        told, self.unreported = self.unreported, []
        return self.token, self.ran, told

    def _run_op(self, call: bytes | tuple) -> tuple | None:
        """Run one eager op, after the values it reads from other workers have arrived.

        ``call`` is the pickle of ``(op number, name, fn, args, kwargs, fail_if, timeout, timed)``, or
        that and ``incoming`` (and more, see :meth:`run_op`): ``(key, transfer ref, owner)`` of each
        value from another worker. One argument: Ray's cost grows with a call's arguments. A ref
        inside an argument is not fetched by Ray before the call, so that a failed transfer fails
        this op here, as data. An op that ends well and returns None answers None where the driver
        does not profile (``timed``).
        """
        import ray

        call, incoming = (call, ()) if type(call) is bytes else call[:2]
        op, name, fn, args, kwargs, fail_if, timeout, timed = ray.cloudpickle.loads(call)

        t0 = time.time()
        fn = self._function(fn)  # first: a function sent with an op that does not run is still kept
        root = next((self.failed[u] for u in fail_if if u in self.failed), None)
        values: dict[Any, Any] = {}
        for key, ref, owner in incoming:
            if root is not None:
                break
            try:
                got = ray.get(ref, timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                root = (name, TimeoutError(f"op {name!r}: its input from another worker did not "
                                           f"arrive within {timeout} s (the runtime's timeout_s)"))
                self.failed[op] = root
                now = time.time()
                return ("err", root[1], None, t0, now, now)
            except ray.exceptions.RayActorError as e:  # the owner died before sending it
                root = (f"transfer from {owner}", WorkerLost(owner, type(e).__name__))
                break
            if type(got) is Failed:
                root = (got.root_name, got.root_error)
            else:
                values[key] = self._arrive(got)
        t_in = time.time()
        if root is not None:
            self.failed[op] = root
            return ("dep", root[0], root[1], t0, t_in, t_in)
        try:
            result = self._call(fn, args, kwargs, values)
        except Exception as e:  # the op's own failure: data for the driver
            e = e.with_traceback(None)
            self.failed[op] = (name, e)
            return ("err", e, None, t0, t_in, time.time())
        if result is None and not timed:  # the common answer, in the fewest bytes to pickle and send
            return None
        return ("ok", _result(result, self.buffers), None, t0, t_in, time.time())

    def _function(self, spec: Any) -> Any:
        """The function a call names: by number, sent now (:class:`FnDef`), or itself."""
        kind = type(spec)
        if kind is int:
            return self.functions.get(spec, spec)  # a number it lacks fails in _call
        if kind is FnDef:
            if spec.reset:
                self.functions.clear()
            for n in spec.forget:
                self.functions.pop(n, None)
            import ray

            try:
                fn = ray.cloudpickle.loads(spec.data)
            except Exception as e:  # kept: every later call naming it fails the same way
                fn = _Unloadable(e.with_traceback(None))
            self.functions[spec.number] = fn
            return fn
        return spec

    def _call(self, fn: Any, args: tuple, kwargs: dict, values: dict[Any, Any]) -> Any:
        kind = type(fn)
        if kind is int:
            raise WorkerLost(self.name, f"function {fn} is not on it: it was restarted since the "
                                        "function was sent")
        if kind is _Unloadable:
            raise fn.error
        if kind is Store:
            self._store(fn.buf, _resolve(args[0], {}, values, self.name))
            return None
        result = fn(*_resolve(args, self.buffers, values, self.name),
                    **_resolve(kwargs, self.buffers, values, self.name))
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
        return result

    def _store(self, buf: int, value: Any) -> None:
        """``value`` copied into buffer ``buf`` (made again where the worker was restarted since)."""
        have = self.buffers.get(buf)
        if have is None:  # a copy: Ray hands values over as read-only views of its store
            self.buffers[buf] = self._arrive(np.array(value))
        elif hasattr(have, "copy_"):  # in place: a captured CUDA graph keeps its addresses
            have.copy_(self._arrive(value))
            import torch

            torch.cuda.synchronize(self.device)  # before a graph on other streams reads it
        else:
            np.copyto(have, value)

    def _arrive(self, value: Any) -> Any:
        """A value from another worker, on this worker's device."""
        if self.device.startswith("cuda") and isinstance(value, np.ndarray):
            import torch

            return torch.as_tensor(value).to(self.device, non_blocking=False)
        return value

    # --- compiled graphs ---------------------------------------------------------------------
    def run_segment(self, spec: SegmentSpec, head: Any, *incoming: dict) -> Any:
        """Run one segment of a recorded graph (a task of its Ray Compiled Graph).

        ``head`` is the run's input for a worker's first segment: ``(run number, {buffer: new
        value}, buffers to send back)``, the values stored before any op of the run here; else the
        carry of the segment before: ``{op index: result tuple}`` of this run so far on this worker.
        Returns the carry (the last segment adds ``{buffer: value}`` of the buffers asked back under
        key -1), then one dict of transferred values per consumer segment.
        """
        if spec.first:
            carry: dict[int, tuple] = {}
            self.graph_failed.clear()
            self.graph_run, values, self.graph_outputs = head
            for buf, value in values.items():
                self._store(buf, value)
        else:
            carry = head
        self.graph_results = carry  # what ran of this run, for the driver if the graph is torn down
        arrived: dict[Any, Any] = {}
        for values in incoming:
            for key, value in values.items():
                arrived[key] = value if type(value) is Failed else self._arrive(value)
        snaps: dict[Any, Any] = {}
        for key in spec.start_snapshots:
            snaps[key] = self._snapshot(key, copy=bool(spec.ops))
        ran = None
        if self.device.startswith("cuda") and CapturedSegment.fits(spec):
            captured = spec.__dict__.get("_captured")  # one per compile: the spec is bound once
            if captured is None:
                captured = spec.__dict__["_captured"] = CapturedSegment(self, spec)
                self.captured.append(captured)
            ran = captured.run(arrived)
        if ran is not None:
            for op, result in zip(spec.ops, ran):
                carry[op.index] = result
        else:
            for op in spec.ops:
                carry[op.index] = self._run_graph_op(op, arrived)
                for key in op.snapshots:
                    snaps[key] = self._snapshot(key, copy=True)
        outs = [{key: snaps[key] if key in snaps else self._snapshot(key, copy=False) for key in keys}
                for keys in spec.exports]
        if spec.last and self.graph_outputs:  # copied as Ray writes them into the output channel
            carry = {**carry, -1: {b: self._snapshot((b, -1), copy=False) for b in self.graph_outputs}}
        return (carry, *outs) if outs else carry

    def _run_graph_op(self, op: OpSpec, arrived: dict[Any, Any]) -> tuple:
        t0 = time.time()
        root = next((self.graph_failed[u] for u in op.fail_if if u in self.graph_failed), None)
        if root is None:
            for key in op.incoming:
                got = arrived[key]
                if type(got) is Failed:
                    root = (got.root_name, got.root_error)
                    break
        if root is not None:
            self.graph_failed[op.index] = root
            return ("dep", root[0], _pack(root[1]), t0, t0, t0)
        try:
            result = self._call(op.fn, op.args, op.kwargs, arrived)
        except Exception as e:  # its traceback would hold the op's inputs: views of Ray's channels
            e = e.with_traceback(None)
            self.graph_failed[op.index] = (op.name, e)
            return ("err", _pack(e), None, t0, t0, time.time())
        return ("ok", _pack(_result(result, self.buffers)), None, t0, t0, time.time())

    def _snapshot(self, key: tuple, copy: bool) -> Any:
        """The value a consumer reads under ``key`` = (buffer, writer op or -1)."""
        buf, writer = key
        if writer >= 0 and writer in self.graph_failed:
            return Failed(*self.graph_failed[writer])
        value = _resolve(Buf(buf), self.buffers, {}, self.name)
        if hasattr(value, "detach"):
            return value.detach().cpu().numpy()
        return value.copy() if copy else value

