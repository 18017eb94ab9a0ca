"""A streamdag runtime over a Ray cluster: devices are Ray worker actors, buffers live on them.

The same rules as the local runtime, one level up. An op's dependencies come from the memory it
reads and writes, found by the project's own hazard tracker (``DepsTracker``) over the buffers'
byte ranges: each worker is an address space (``"ray:0"``, ``"ray:1"``, ...) and each buffer a range
in it. An op runs on the worker whose memory it writes, else whose memory it reads, else where
``run_on`` says, else on the least busy one. A buffer of another worker that it reads arrives as a
transfer: the owner returns its value into Ray's object store (ordered after its writers, since a
worker runs its calls in order) and the op's worker fetches it before running the op.

So every dependency between ops of different workers is a transfer, or is kept by the order of
one worker's calls: a write after a read on another worker follows that read's transfer, which the
owner ran first. Nothing waits on the driver: ``submit`` returns a streamdag :class:`Future` at once.

Failures are the local runtime's: an op that raises fails its future; an op that depends on what
a failed op wrote fails with :class:`DependencyFailed` (the worker remembers its failed ops, and a
transfer of a buffer whose writer failed carries the failure); a worker that dies fails its
unfinished ops with :class:`WorkerLost` and their dependents in turn; Ray restarts it
(``max_restarts``), and the runtime stays usable.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import ray

from ..errors import BaseExceptionGroup, DependencyFailed, InvalidBuffer, RuntimeClosed, WorkerLost
from ..graph.buffers import Access, Marker, Region
from ..observe.timeline import Span, Timeline
from ..runtime import Future
from ..runtime.accel import DepsTracker
from ._functions import Functions, pickled_by_name
from ._reports import Reports
from ._worker import Buf, Incoming, Store, Worker

__all__ = ["RemoteBuffer", "Runtime"]

_buffer_ids = itertools.count(1)


class RemoteBuffer:
    """An array that lives on a worker of a :class:`Runtime`: a handle naming the worker.

    Pass it to ``submit`` (``sd.read(buf)``, ``sd.write(buf)``) as a local array; read its value
    with ``rt.get(buf)``. It spans ``region`` in its worker's address space, so that the hazard
    tracker orders the ops on it as it orders ops on local memory. Whole buffers only: slices of
    a remote buffer are not tracked.
    """

    __slots__ = ("__weakref__", "dtype", "freed", "id", "region", "shape", "worker")

    def __init__(self, worker: int, shape: tuple[int, ...], dtype: np.dtype, start: int) -> None:
        self.worker: int = worker
        self.shape: tuple[int, ...] = shape
        self.dtype: np.dtype[Any] = dtype
        self.id: int = next(_buffer_ids)
        self.freed: bool = False
        nbytes = max(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, 1)
        self.region: Region = Region(f"ray:{worker}", start, start + nbytes)

    @property
    def device(self) -> str:
        return self.region.space

    @property
    def nbytes(self) -> int:
        return self.region.end - self.region.start

    def __repr__(self) -> str:
        return f"RemoteBuffer({self.device}, shape={self.shape}, dtype={self.dtype})"


class _Op:
    """The driver's record of an eager op: the tracker's node."""

    __slots__ = ("deps", "done", "failed", "future", "name", "seq", "worker", "writes")

    def __init__(self, seq: int, name: str, worker: int, writes: list[Region], future: Future) -> None:
        self.seq = seq
        self.name = name
        self.worker = worker
        self.writes = writes
        self.future = future
        self.done = self.failed = False
        self.deps: tuple[int, ...] = ()


def _unmark(value: Any, reads: list[Any], writes: list[Any]) -> Any:
    """``value`` with its ``sd.read``/``sd.write`` markers taken off (into ``reads``/``writes``)."""
    kind = type(value)
    if kind is Marker:
        (writes if value.write else reads).append(value.value)
        return value.value
    if kind is tuple:  # a list built then made a tuple: a generator costs more for the few items
        return tuple([_unmark(v, reads, writes) for v in value])
    if kind is list:
        return [_unmark(v, reads, writes) for v in value]
    if kind is dict:
        return {k: _unmark(v, reads, writes) for k, v in value.items()}
    return value


_PLAIN = frozenset({int, float, bool, str, bytes, complex, type(None), slice})


def _swap(value: Any, worker: int, remote: dict[int, RemoteBuffer], found: list[int | None]) -> Any:
    """``value`` with each buffer named for the worker: its own as :class:`Buf`, another's as the
    :class:`Incoming` value of a transfer (collected in ``remote``). ``found`` gets each buffer's
    number, and None for a value that the standard pickle may not send as cloudpickle does."""
    kind = type(value)
    if kind is RemoteBuffer:
        found.append(value.id)
        if value.worker == worker:
            return Buf(value.id)
        remote[value.id] = value
        return Incoming(value.id)
    if kind is tuple:
        return tuple([_swap(v, worker, remote, found) for v in value])
    if kind is list:
        return [_swap(v, worker, remote, found) for v in value]
    if kind is dict:
        return {k: _swap(v, worker, remote, found) for k, v in value.items()}
    if kind not in _PLAIN and not ((kind is np.ndarray or isinstance(value, np.generic))
                                   and not value.dtype.hasobject):
        found.append(None)
    return value


class Runtime:
    """Run streamdag ops on the workers of a Ray cluster: ``submit``, ``record``, ``profile``.

    ``workers`` worker actors are made, each with ``num_cpus`` CPUs and ``num_gpus`` GPUs (a GPU
    worker runs its ops on ``cuda``; its buffers are torch tensors), spread over the cluster's nodes
    (``worker_options[i]`` adds Ray options for worker ``i``: resources, a node's scheduling
    strategy). Connects to a running Ray (``ray.init`` first, or ``address``), else starts one.
    ``timeout_s`` bounds every wait on a worker: a hung transfer or run fails instead of hanging.
    """

    def __init__(self, workers: int = 2, *, num_cpus: float = 1, num_gpus: float = 0,
                 worker_options: Sequence[dict[str, Any]] | None = None, address: str | None = None,
                 timeout_s: float = 300.0, max_restarts: int = -1) -> None:
        if workers < 1:
            raise ValueError(f"a ray Runtime needs at least one worker, got workers={workers}")
        if worker_options is not None and len(worker_options) != workers:
            raise ValueError(f"worker_options has {len(worker_options)} entries for {workers} workers: "
                             "give one dict per worker")
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        self.timeout_s: float = float(timeout_s)
        device = "cuda:0" if num_gpus else "cpu"  # Ray makes a GPU worker's own GPUs visible from 0
        actor = ray.remote(Worker)
        self._workers = []
        for i in range(workers):
            options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus,
                                       "max_restarts": max_restarts, "max_task_retries": 0,
                                       "scheduling_strategy": "SPREAD"}
            options.update(worker_options[i] if worker_options else {})
            self._workers.append(actor.options(**options).remote(f"ray:{i}", device))
        self.devices: list[str] = [f"ray:{i}" for i in range(workers)]
        self.device_kind = device
        self._lock = threading.RLock()
        self._tracker = DepsTracker(lambda op: op.done and not op.failed)
        self._seq = itertools.count()
        self._next_start = [0] * workers
        self._pending = [0] * workers
        self._inflight: set[_Op] = set()
        self._failures: list[BaseException] = []
        self._exports: dict[int, Any] = {}  # buffer id -> the transfer of its value, until it is written
        self._buffers: weakref.WeakValueDictionary[int, RemoteBuffer] = weakref.WeakValueDictionary()
        self._recording: dict[int, Any] = {}
        self._graphs: list[Any] = []  # recorded graphs, to tear their compiled graphs down on close
        self._profile: dict[str, Any] | None = None
        self._functions = Functions(workers)  # each function goes to each worker once
        self._idle = threading.Condition(self._lock)
        self._closed = False
        try:
            where = ray.get([h.where.remote() for h in self._workers], timeout=self.timeout_s)
            self.nodes: list[str] = [w[2] for w in where]  # each worker's Ray node id
            self._tokens = [w[3] for w in where]
        except Exception:
            self.close()
            raise
        self._reports = Reports(self._workers, self._lock, self._tokens, self._finish_all)

    # --- buffers -------------------------------------------------------------------------------
    def empty(self, shape: int | Sequence[int], dtype: Any = np.float64, on: str | int = 0) -> RemoteBuffer:
        """A new uninitialized buffer on worker ``on`` (``"ray:1"`` or ``1``)."""
        self._check_open()
        w = self._worker_index(on)
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        with self._lock:
            buf = RemoteBuffer(w, shape, np.dtype(dtype), self._next_start[w])
            self._next_start[w] = buf.region.end
            self._buffers[buf.id] = buf
        self._workers[w].alloc.remote(buf.id, shape, str(buf.dtype))
        return buf

    def put(self, value: Any, on: str | int = 0, out: RemoteBuffer | None = None) -> RemoteBuffer:
        """``value`` (an array on the driver) copied into ``out``, or into a new buffer on ``on``.

        An op that writes the buffer: ordered after the ops that read or wrote it before, and
        returning at once. It also makes the buffer again on a worker restarted since.
        """
        value = np.asarray(value)
        if out is None:
            out = self.empty(value.shape, value.dtype, on)
        elif out.shape != value.shape:
            raise ValueError(f"put: value of shape {value.shape} into {out!r}: the shapes must match")
        self.submit(Store(out.id), value.astype(out.dtype, copy=False), writes=[out],
                    name=f"put->{out.device}")
        return out

    def get(self, buf: RemoteBuffer) -> Future[Any]:
        """A future of a copy of ``buf``'s value on the driver, once the ops before that write it are done."""
        return self.submit(_copy_of, buf, reads=[buf], name=f"get<-{buf.device}")

    def free(self, *bufs: RemoteBuffer) -> None:
        """Let the workers drop these buffers (after the ops submitted so far that use them); a later
        submit that names one is refused."""
        for b in bufs:
            b.freed = True
        for w in {b.worker for b in bufs}:
            self._workers[w].free.remote([b.id for b in bufs if b.worker == w])

    # --- submit --------------------------------------------------------------------------------
    def submit(self, fn: Any, *args: Any, reads: Sequence[Any] = (), writes: Sequence[Any] = (),
               run_on: str | int | None = None, name: str | None = None, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on a worker; returns a :class:`streamdag.Future` at once.

        The buffers it reads and writes are declared as on the local runtime (``reads=``/``writes=``
        or ``sd.read``/``sd.write`` around arguments). A buffer of another worker among its
        arguments arrives as a copy; driver arrays are sent by value (as they are at the submit).
        Inside ``rt.record()`` it records instead and returns an :class:`streamdag.OpNode`.
        """
        self._check_open()
        if not callable(fn) and type(fn) is not Store:
            raise TypeError(f"submit takes the function to run first, got a {type(fn).__name__}: "
                            "rt.submit(fn, *args)")
        name = name or getattr(fn, "__name__", "op")
        reads_l, writes_l = list(reads), list(writes)
        args = _unmark(args, reads_l, writes_l)
        if kwargs:
            kwargs = _unmark(kwargs, reads_l, writes_l)
        accesses, write_regions = self._accesses(reads_l, writes_l, name)
        written = [b.id for b in writes_l]  # every one a RemoteBuffer (checked)
        worker = self._place(reads_l, writes_l, run_on)
        for b in writes_l:
            if b.worker != worker:
                raise InvalidBuffer(f"op {name!r} runs on ray:{worker} but writes {b!r}: run it there "
                                    f"(run_on={b.device!r}), or write into a buffer on ray:{worker}")
        remote: dict[int, RemoteBuffer] = {}
        found: list[int | None] = []
        args = _swap(args, worker, remote, found)
        if kwargs:
            kwargs = _swap(kwargs, worker, remote, found)
        undeclared = set(found).difference(written, [b.id for b in reads_l if type(b) is RemoteBuffer])
        undeclared.discard(None)
        if undeclared:
            raise InvalidBuffer(f"op {name!r} takes a RemoteBuffer it does not declare: mark it "
                                "sd.read(buf)/sd.write(buf), or list it in reads=/writes=, so that its "
                                "order with the other ops on it is known")
        with self._lock:
            graph = self._recording.get(threading.get_ident())
            if graph is not None:
                mine = [(b, False) for b in reads_l] + [(b, True) for b in writes_l]
                ids = {w: tuple(b.id for b, wr in mine if isinstance(b, RemoteBuffer) and b.worker == worker
                                and wr == w) for w in (False, True)}
                return graph._add(fn, args, kwargs, accesses, write_regions, worker, remote, name, ids)
            return self._submit_eager(fn, args, kwargs, accesses, write_regions, worker, remote, name,
                                      written, None not in found)

    def _submit_eager(self, fn: Any, args: tuple, kwargs: dict, accesses: list[Access],
                      write_regions: list[Region], worker: int, remote: dict[int, RemoteBuffer],
                      name: str, written: list[int], plain: bool) -> Future:
        self._wait_graphs(worker, remote)
        future = Future()
        future.op_name = name
        op = _Op(next(self._seq), name, worker, write_regions, future)
        deps = self._tracker.link(op, accesses)
        if self._profile is not None:  # the timeline's arrows
            op.deps = tuple(d.seq for d in deps)
        fail_if = [d.seq for d in deps if d.worker == worker and _writes_any(d, accesses)]
        incoming = [(b.id, self._export(b, deps), b.device) for b in remote.values()]
        for bid in written:  # a transfer of it made before this op is not of its new value
            self._exports.pop(bid, None)
        self._inflight.add(op)
        self._pending[worker] += 1
        spec = self._functions.spec(fn, worker)
        call = (op.seq, name, spec, args, kwargs, fail_if, self.timeout_s, self._profile is not None)
        # pickled here: Ray passes bytes on at less cost than it pickles a tuple itself, and the
        # standard pickle costs less than cloudpickle where it sends the same bytes (a function
        # goes as a number, or as the bytes cloudpickle made of it once)
        by_name = spec is not fn or type(fn) is Store or pickled_by_name(fn)
        call = pickle.dumps(call, 5) if plain and by_name else ray.cloudpickle.dumps(call)
        # the transfers' refs stay Ray's to serialize (it tracks who holds them), in the one argument:
        # Ray's cost grows with a call's arguments
        self._reports.send(worker, op, call, incoming)
        return future

    def _export(self, buf: RemoteBuffer, deps: list[_Op]) -> Any:
        """The transfer of ``buf``'s value as it is after the ops submitted so far (one per version)."""
        cached = self._exports.get(buf.id)
        if cached is not None:
            return cached
        fail_if = [d.seq for d in deps if d.worker == buf.worker
                   and any(r.overlaps(buf.region) for r in d.writes)]
        ref = self._workers[buf.worker].export.remote(buf.id, fail_if, f"transfer of {buf!r}")
        self._exports[buf.id] = ref
        return ref

    def _finish_all(self, answered: list[tuple[_Op, Any]]) -> None:
        """Settle the futures of ops from their workers' answers, or the errors Ray gives instead (a
        Ray callback thread). The runtime's lock is taken once for them all: the submitting thread
        holds it through each submit, and taking it per op made the two threads trade it op by op."""
        outcomes = [_outcome(op, done) for op, done in answered]
        with self._lock:
            prof = self._profile
            for (op, done), (status, a, _b, t0, t_in, t1) in zip(answered, outcomes):
                if type(done) not in _WORKER_ANSWERS or (status == "err" and isinstance(a, WorkerLost)):
                    self._functions.lost(op.worker)  # restarted, or the call did not run: a function
                    # it brought may not be there
                op.done = True
                op.failed = status != "ok"
                self._inflight.discard(op)
                self._pending[op.worker] -= 1
                if status == "err":
                    self._failures.append(a)
                if prof is not None and t0 is not None:  # not an op sent before rt.profile() began
                    self._add_spans(prof, op, t0, t_in, t1, op.failed)
            self._idle.notify_all()
        for (op, _), (status, a, b, *_times) in zip(answered, outcomes):
            if status == "ok":
                op.future.set_result(self._handle(a, op))
            elif status == "err":
                op.future.set_exception(a)
            else:
                op.future.set_exception(DependencyFailed(op.name, a, b))

    def _handle(self, value: Any, op: _Op) -> Any:
        """An op's return value for the driver: a buffer it returned becomes its handle."""
        return self._buffers.get(value.id, value) if type(value) is Buf else value

    # --- waiting, profiling, recording ---------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every op submitted so far; raise an ``ExceptionGroup`` of the ops that failed first
        (not their dependents) since the last call. Later ops no longer inherit those failures."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._inflight)} op(s) still running after timeout_s="
                                       f"{self.timeout_s} s (the first: {next(iter(self._inflight)).name!r})")
                self._idle.wait(left)
            failures, self._failures = self._failures, []
            if failures:
                self._tracker.forget(lambda op: op.done)
        for g in list(self._graphs):
            g._wait_runs(self.timeout_s)
        if failures:
            raise BaseExceptionGroup(f"{len(failures)} streamdag op(s) failed", failures)

    @contextmanager
    def profile(self) -> Iterator[Any]:
        """Time every op run inside the block, on every worker: ``prof.timeline`` once it is left.

        The timeline is the local runtime's (:class:`streamdag.Timeline`): a process per worker
        (``device`` ``ray:N``), its ops on stream 0, the wait for an eager op's inputs from other
        workers as a ``copy`` span on stream 1, and a recorded graph's ops as they ran in its
        compiled graph.
        """
        prof = _Profile()
        with self._lock:
            if self._profile is not None:
                raise RuntimeError("rt.profile() is already active on this runtime: nest no second one")
            self._profile = {"t0": time.time(), "spans": prof.spans}
        try:
            yield prof
            self.synchronize()
        finally:
            with self._lock:
                self._profile = None
            prof.timeline = Timeline(sorted(prof.spans, key=lambda s: s.start))

    def _reserve(self, n: int) -> int:
        """The first of ``n`` op numbers of their own (a graph run's ops, on the timeline)."""
        with self._lock:
            first = next(self._seq)
            for _ in range(n - 1):
                next(self._seq)
        return first

    def _add_spans(self, prof: dict[str, Any], op: Any, t0: float, t_in: float, t1: float,
                   failed: bool, deps: Sequence[int] | None = None) -> None:
        base = prof["t0"]
        device = f"ray:{op.worker}"
        if t_in - t0 > 1e-6:  # the wait for its inputs from other workers: a track of its own
            prof["spans"].append(Span(-1 - op.seq, f"transfer_for_{op.name}", device, 1, "copy",
                                      (t0 - base) * 1e3, (t_in - base) * 1e3))
        prof["spans"].append(Span(op.seq, op.name, device, 0, "compute", (t_in - base) * 1e3,
                                  (t1 - base) * 1e3, tuple(op.deps if deps is None else deps), failed))

    @contextmanager
    def record(self) -> Iterator[Any]:
        """Record the submits of this thread into a graph that runs as one Ray Compiled Graph."""
        from .compiled import RayGraph

        self._check_open()
        me = threading.get_ident()
        graph = RayGraph(self)
        with self._lock:
            if me in self._recording:
                raise RuntimeError("rt.record() blocks do not nest: leave the first before the second")
            self._recording[me] = graph
        try:
            yield graph
        finally:
            with self._lock:
                del self._recording[me]
        graph._finish_recording()
        self._graphs.append(graph)

    def wait_for_workers(self) -> list[str]:
        """Wait until every worker answers (Ray restarts a lost one); returns the restarted ones.

        Ops submitted to a worker while Ray restarts it fail with :class:`WorkerLost`: call this
        first where that matters. Raises ``TimeoutError`` after ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        restarted = []
        for i, h in enumerate(self._workers):
            while True:
                try:
                    token = ray.get(h.where.remote(), timeout=max(deadline - time.monotonic(), 0.1))[3]
                    break
                except ray.exceptions.GetTimeoutError:
                    raise TimeoutError(f"worker ray:{i} did not answer within timeout_s={self.timeout_s} s") \
                        from None
                except ray.exceptions.RayActorError:  # restarting: ask again
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"worker ray:{i} did not come back within timeout_s="
                                           f"{self.timeout_s} s") from None
                    time.sleep(0.05)
            if token != self._tokens[i]:
                restarted.append(f"ray:{i}")
                self._restarted(i, token)
        return restarted

    def _restarted(self, worker: int, token: str) -> None:
        """``worker`` answered as a new incarnation (``token``): it has lost its state."""
        with self._lock:
            self._tokens[worker] = token
            self._functions.lost(worker)

    def worker(self, device: str | int) -> Any:
        """The Ray actor handle of a worker (to call it, or ``ray.kill`` it in a test of failures)."""
        return self._workers[self._worker_index(device)]

    def close(self) -> None:
        """Tear the compiled graphs down and end the workers (waiting for the ops in flight first)."""
        if self._closed:
            return
        try:
            if getattr(self, "_inflight", None):
                self.synchronize()
        except BaseException:  # close still ends the workers; failures were reported
            pass
        finally:
            self._closed = True
            if hasattr(self, "_reports"):
                self._reports.close()
            for g in getattr(self, "_graphs", []):
                g._teardown()
            for h in self._workers:
                ray.kill(h)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- helpers -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeClosed("this ray Runtime was closed: make a new one")

    def _worker_index(self, on: str | int) -> int:
        i = int(on.split(":", 1)[1]) if isinstance(on, str) and on.startswith("ray:") else on
        if not isinstance(i, int) or not 0 <= i < len(self._workers):
            raise ValueError(f"{on!r} is not a worker of this runtime: one of {', '.join(self.devices)} "
                             f"(or its number)")
        return i

    def _accesses(self, reads: list[Any], writes: list[Any], name: str) -> tuple[list[Access], list[Region]]:
        """The op's accesses (its reads, then its writes) and the regions it writes."""
        out: list[Access] = []
        written: list[Region] = []
        for values, write in ((reads, False), (writes, True)):
            for value in values:
                if type(value) is RemoteBuffer:
                    if value.freed:
                        raise InvalidBuffer(f"op {name!r} uses {value!r}, which rt.free() let go: make a "
                                            "new buffer (rt.empty / rt.put)")
                    out.append(Access(value.region, write))
                    if write:
                        written.append(value.region)
                elif write:
                    raise InvalidBuffer(
                        f"op {name!r} writes a {type(value).__name__} of the driver: a worker cannot write "
                        "driver memory; write into a buffer on a worker (rt.empty / rt.put) and read it "
                        "back with rt.get(buf).result()")
                elif not (isinstance(value, np.ndarray) or hasattr(value, "__array_interface__")
                          or hasattr(value, "untyped_storage")):
                    raise InvalidBuffer(f"op {name!r} reads a {type(value).__name__}: declare "
                                        "RemoteBuffers or arrays; plain values need no declaration")
                # a driver array is sent by value, as it is at the submit: nothing to order
        return out, written

    def _place(self, reads: list[Any], writes: list[Any], run_on: str | int | None) -> int:
        """Where the op runs: ``run_on``, else where the first buffer it writes lives, else where the
        first it reads lives, else the worker with the fewest ops in flight."""
        if run_on is not None:
            return self._worker_index(run_on)
        for values in (writes, reads):
            for b in values:
                if type(b) is RemoteBuffer:
                    return b.worker
        return min(range(len(self._workers)), key=self._pending.__getitem__)

    def _wait_eager(self, workers: set[int]) -> None:
        """A graph run waits for the eager ops in flight on its workers (see :meth:`_wait_graphs`)."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while any(self._pending[w] for w in workers):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"eager ops on workers {sorted(workers)} still running after "
                                       f"timeout_s={self.timeout_s} s")
                self._idle.wait(left)

    def _wait_graphs(self, worker: int, remote: dict[int, RemoteBuffer]) -> None:
        """An eager op on a worker waits for runs of recorded graphs in flight there (they run on the
        worker's compiled-graph thread, beside its eager calls)."""
        if not self._graphs:
            return
        workers = {worker, *(b.worker for b in remote.values())}
        for g in self._graphs:
            if g._runs_in_flight and workers & g._workers_used:
                g._wait_runs(self.timeout_s)


def _outcome(op: _Op, done: Any) -> tuple[str, Any, Any, Any, Any, Any]:
    """``(status, value or error, failed dependency, start, inputs in, end)`` of a worker's answer to
    ``op``, or of the error Ray gives instead."""
    if done is None:  # ended well, returned None, not timed (see Worker.run_op)
        return "ok", None, None, None, None, None
    if type(done) is tuple:
        return done
    now = time.time()
    if isinstance(done, ray.exceptions.RayActorError):  # the worker died (or Ray cannot reach it)
        return "err", WorkerLost(f"ray:{op.worker}", type(done).__name__), None, now, now, now
    # anything else Ray raises (say, the function cannot be unpickled there: its module is not on
    # the worker) fails this op, visibly
    if isinstance(done, ray.exceptions.RayTaskError):
        done = done.as_instanceof_cause()
    return "err", done, None, now, now, now


_WORKER_ANSWERS = (tuple, type(None))  # what Worker.run_op answers, where it ran


def _writes_any(op: _Op, accesses: list[Access]) -> bool:
    for r in op.writes:  # loops, not a generator in any(): this runs for every dependency of a submit
        for a in accesses:
            if r.overlaps(a.region):
                return True
    return False


def _copy_of(x: Any) -> Any:
    return x.detach().cpu().numpy().copy() if hasattr(x, "detach") else np.array(x, copy=True)


class _Profile:
    """What ``rt.profile()`` yields: ``timeline`` once the block is left."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.timeline: Timeline | None = None
