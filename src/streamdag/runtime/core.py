"""The runtime: turns submitted ops into backend calls and futures.

State, guarded by ``_lock`` on the submit path:

- ``_tracker``: which unfinished (or failed) ops touch which memory;
- ``_clocks``: the vector clock of every stream (what each has waited for);
- ``_busy[s]``: unfinished ops placed on stream ``s``.

Finishing (from backend threads) touches only ``_pending``, the counters and
the in-flight semaphore, under ``_done_lock``.
"""

from __future__ import annotations

import concurrent.futures
import math
import operator
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from ..backends import Backend, make_backend, make_backends
from ..backends.cpu import LANE_THREADS, HostLanes
from ..errors import BaseExceptionGroup, InvalidBuffer, RuntimeClosed, WouldBlock
from ..graph.buffers import OBJECTS, Access, Marker
from ..native import load as load_native
from ..native import load_torch
from . import ops, transfers
from .accel import DepsTracker, StreamClocks
from .held import Held, Launcher
from .lane_waits import LaneWaits
from .ops import (
    Future,
    Op,
    collect_accesses,
    deferring_callbacks,
    event_of,
    hold_identities,
    in_done_callback,
    release_frames,
    wait_for_host_inputs,
)
from .transfers import ByteBudget, PinnedPool

if TYPE_CHECKING:
    from .profiling import Profiler
    from .recorded import RecordedGraph

T = TypeVar("T")

__all__ = ["Runtime", "RuntimeStatistics"]

#: A thread that submits finishes completed ops itself every this many submits (where the
#: backend allows it): cheaper than handing the GIL to a completion thread mid-burst. Fewer ops
#: then stay pending, so fewer objects live long enough for the cycle collector to promote them,
#: which brings its full passes (``bench/finish_every.py``: 32 against 64 halved its time in the
#: tiny wide graph, submitted op by op; 16 gained no more).
FINISH_EVERY = 32
#: how often a synchronize() inside a lane op looks again for the ops queued behind it (a held op
#: released while it waits may land there)
_BEHIND_RECHECK_S = 0.05
#: worker lanes on the host beside a device, for the ops submitted with ``run_on="host"``
HOST_LANES = 2


def _no_function() -> None:
    """What ``submit`` gets where no function is given: it raises the error that says so (Python's
    own names the parameter only)."""


_NO_FUNCTION: Callable[..., Any] = _no_function

#: Test-only: drop every cross-stream event wait, to show that the race checks can fail.
_DROP_WAITS = os.environ.get("STREAMDAG_TEST_DROP_WAITS") == "1"

#: Whether runtimes made from now on submit and finish ops through the compiled code (where it
#: built; see ``streamdag.native``). False: the Python methods of :class:`Runtime` (for tests and
#: benchmarks that compare the two).
COMPILED_SUBMIT = True

_speedups = load_native()


@dataclass(frozen=True)
class RuntimeStatistics:
    """A snapshot of the runtime's counters."""

    inflight: int
    peak_inflight: int
    submitted: int
    completed: int
    failed: int
    streams: int
    max_inflight: int
    inflight_bytes: int
    peak_inflight_bytes: int


def _part(name: str) -> property:
    """A runtime attribute kept in its ``_parts``: a field the compiled submit reads in C, with no
    look-up in the runtime's ``__dict__`` per submit."""

    def put(rt: Runtime, value: Any) -> None:
        setattr(rt._parts, name, value)

    return property(operator.attrgetter(f"_parts.{name}"), put)


def _check_own_backend(device: str, streams: int | None, seed: int, default_stream_sync: bool | None) -> None:
    """A runtime given ``backend=`` takes the device, streams and stream kind that backend was made with."""
    given = [f"{name}={value!r}" for name, value, default in
             (("device", device, "cpu"), ("streams", streams, None), ("seed", seed, 0),
              ("default_stream_sync", default_stream_sync, None)) if value != default]
    if given:
        raise ValueError(f"{', '.join(given)} would be ignored: with backend= the runtime runs on the "
                         "backend's own device and streams; make the backend with them instead, or "
                         "leave backend= out")


class Runtime:
    """Runs ops asynchronously and concurrently on the streams of one device, or of several.

    ``device`` is ``"cpu"`` (worker lanes), ``"cuda"``/``"cuda:N"`` (CUDA streams)
    or ``"sim"`` (a simulated device that runs streams in a random interleaving,
    for tests). ``devices=["cuda:0", "cuda:1"]`` spans several GPUs (or
    simulated devices ``"sim:N"``): an op runs on the device of the memory it
    writes (else reads) unless ``run_on=`` says otherwise, and reading memory
    of another device inserts a peer copy. ``max_inflight`` bounds the ops
    submitted but not finished: :meth:`submit` blocks at the bound,
    :meth:`submit_nowait` raises :class:`WouldBlock`.

    ``default_stream_sync`` (GPUs): the streams ops run on (compute and copy) are CUDA blocking
    streams where streamdag's torch extension builds. CUDA orders them after the work on
    PyTorch's default stream, so an op submitted while that stream is current follows the
    caller's earlier work there without an event per submit; in turn, work the caller then puts
    on the default stream waits for the ops submitted before it. ``False``:
    non-blocking streams, each submit orders its op after the caller's stream with an event, and
    the caller's default-stream work runs beside the ops (choose it where that extra order could
    tie collectives of several NCCL communicators together). A caller on a stream of its own
    (``torch.cuda.stream(s)``) gets the event either way. Default ``None``: ``True``.

    ``host_lanes``: worker threads on the host beside a device, started at first use, for the
    ops submitted with ``run_on="host"`` (host functions that must not block the submitter
    while they wait for device work); a CPU runtime's lanes are the host's already.

    Transfers (GPUs): ``max_inflight_bytes`` bounds the bytes of copies in flight (a copy that
    would pass it blocks the submitter). Pageable host memory is staged through pinned buffers:
    copies of up to 8 MiB in the submitting thread, through a pool of ``staging_bytes``; larger
    ones on a host lane, through a fixed ring of three 8 MiB buffers per direction, so that the
    submit returns at once (the source must then stay as it is until the copy's future is done,
    as for any op's inputs).

    ``backend=`` runs the runtime on a backend made by the caller (its device and streams):
    ``device``, ``streams``, ``seed`` and ``default_stream_sync`` must then be left out.
    """

    _tracker = _part("tracker")
    _clocks = _part("clocks")
    _profiler = _part("profiler")
    _finish_ready = _part("finish_ready")
    _finish_every = _part("finish_every")
    _closed = _part("closed")

    def __init__(
        self,
        device: str = "cpu",
        streams: int | None = None,
        max_inflight: int = 256,
        *,
        max_inflight_bytes: int = 1 << 30,
        staging_bytes: int = 256 << 20,
        seed: int = 0,
        backend: Backend | None = None,
        devices: Sequence[str] | None = None,
        default_stream_sync: bool | None = None,
        host_lanes: int = HOST_LANES,
    ) -> None:
        if backend is not None:  # it brings its own device and streams: nothing here may configure them
            _check_own_backend(device, streams, seed, default_stream_sync)
        elif streams is not None:
            _check_count("streams", streams, 1, "or None for the default")
        if default_stream_sync is None:
            default_stream_sync = True
        _check_count("max_inflight", max_inflight, 1)
        _check_count("max_inflight_bytes", max_inflight_bytes, 0, "0 lets one transfer run at a time")
        _check_count("staging_bytes", staging_bytes, 0, "0 stages one transfer at a time")
        _check_count("host_lanes", host_lanes, 1)
        if devices is not None:
            if backend is not None:
                raise ValueError("pass devices= or backend=, not both")
            members = make_backends(list(devices), streams, seed, default_stream_sync)
        else:
            members = [backend if backend is not None
                       else make_backend(device, streams, seed, default_stream_sync)]
        #: one backend per device; ``backend`` is the first (the only one on one device)
        self.backends: list[Backend] = members
        self.backend: Backend = members[0]
        self.device: str = self.backend.device
        self.devices: list[str] = [m.device for m in members]
        self._multi = len(members) > 1
        self.max_inflight = max_inflight
        self._compute = len(self.backend.streams)
        # every stream of every device, numbered: each device's compute streams, then its copy streams
        self._streams: list[Any] = []
        self._member: list[Backend] = []  # the backend that owns each stream
        self._stream_device: list[str] = []
        self._compute_of: dict[str, range] = {}
        self._copy_index: dict[tuple[str, str], int] = {}  # (kind, device) -> stream
        for m in members:
            base = len(self._streams)
            self._compute_of[m.device] = range(base, base + len(m.streams))
            copy = getattr(m, "copy_streams", {})
            for i, kind in enumerate(copy):
                self._copy_index[(kind, m.device)] = base + len(m.streams) + i
            added = list(m.streams) + list(copy.values())
            self._streams += added
            self._member += [m] * len(added)
            self._stream_device += [m.device] * len(added)
        #: host lanes beside a device (streams after its own): where ``run_on="host"`` ops run, so
        #: that a host function waiting for device work does not block the submitting thread
        self._host: HostLanes | None = None
        if self.device != "cpu":
            self._host = HostLanes(host_lanes, len(self._streams))
            self._compute_of["host"] = range(len(self._streams), len(self._streams) + host_lanes)
            self._streams += self._host.streams
            self._member += [self._host] * host_lanes
            self._stream_device += ["host"] * host_lanes
        #: the ops that a device stream cannot wait for by an event, by number: host-lane ops not
        #: finished yet, and device ops held until those finish (see ``_hold``). A device op that
        #: depends on one is held too; a graph's host replay after them runs op by op instead
        #: (see ``_lock_unless_after_host_ops``). The compiled submit leaves every op that may
        #: follow one of them to :meth:`_hold` (and asks ``_lane_threads`` first whether it runs
        #: on a lane).
        self._host_ops: dict[int, Op] = {}
        self._lane_threads = LANE_THREADS
        #: waits inside lane ops for lane ops they submitted (see ``LaneWaits``): streams that are
        #: lanes (threads that run their ops in order) have ``runs_here``
        self._lane_waits = LaneWaits([s for s in self._streams if getattr(s, "runs_here", None) is not None])
        #: the held device ops, by number, and those held on each op (by its number; changed under
        #: ``_held_lock``, which orders a hold on a host-lane op with that op's finish)
        self._held: dict[int, Held] = {}
        self._held_on: dict[int, list[Held]] = {}
        self._held_lock = threading.Lock()
        self._launcher = Launcher(self._release_held_locking)
        #: a released held op's launch on the runtime's device: compiled, with the compiled submit
        self._launch_held: Callable[..., None] | None = None
        n = len(self._streams)
        self._lock = ops.new_rlock()
        self._done_lock = ops.new_lock()
        # a wait inside a lane op refuses too where what it waits for depends on ops behind the caller
        self._lane_waits.consult(self._lock, weakref.WeakMethod(self._held_up_by_caller))
        #: notified when the last running done-callbacks have returned (``_in_callbacks`` is 0)
        self._callbacks_done = threading.Condition(self._done_lock)
        #: seq (the last op's number), completed, peak; the in-flight bound's free and waiting
        self._counts = ops.new_counters()
        self._parts = ops.new_parts()  # (the properties above: set before any of them)
        #: the in-flight bound; its count shares ``_done_lock``, so finishing an op takes one lock
        self._slots = _Slots(max_inflight, self._done_lock, self._counts)
        #: per stream: asks its backend to finish completed ops now, for one who waits (or None)
        hurries = {id(m): _Hurry(self, m) for m in members if hasattr(m, "hurry")}
        self._hurry_of = [hurries.get(id(m)) for m in self._member]
        #: backends whose completed ops the submitting thread finishes every ``FINISH_EVERY`` submits
        self._finish_ready = [f for m in members if (f := getattr(m, "finish_ready", None))]
        self._finish_every = FINISH_EVERY
        self._finish_bound = self._finish  # made once: a pending op's callback holds one object less
        self._tracker = DepsTracker(retired=_finished_ok)
        self._clocks = StreamClocks(n)
        self._busy = [0] * n
        self._next_stream = {d: 0 for d in self._compute_of}
        self._pending: dict[int, Op] = {}
        self._failures: list[BaseException] = []
        self._failed = 0
        self._failed_seen = 0  # ``_failed`` at the last synchronize
        self._in_callbacks = 0  # finished ops whose done-callbacks are running now
        #: closing: submits from outside the runtime's own work are refused (see ``close``)
        self._closed = False
        #: closed: every submit is refused; the backends are stopped or stopping
        self._stopped = False
        self._close_lock = threading.Lock()  # one close drains and stops at a time
        self._closer: threading.Thread | None = None  # a close begun where waiting could hang
        #: the graph each thread records into, inside its ``with rt.record()`` block
        self._recordings: dict[int, Any] = {}
        self._can_be_lost = hasattr(self.backend, "lost")
        self._profiler: Any = None
        self._bytes = ByteBudget(max_inflight_bytes, on_wait=self._hurry_all)
        self._staging = PinnedPool(staging_bytes, on_wait=self._hurry_all)
        #: the pinned rings of large pageable copies staged on host lanes (``transfers.StagingRing``)
        self._rings: dict[Any, Any] = {}
        #: stream_map's captured pieces, by function (see ``streaming``); dropped with the function
        self._stream_maps: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
        self._spaces = {"cpu"} if self.device in ("cpu", "sim") else {"cpu", *self.devices}
        #: ``copy``'s compiled case alone (pinned host memory and a device): None back where
        #: transfers.copy decides; None here where nothing is compiled (the tests' view of it)
        self._copy_pinned: Callable[[Any, Any, str | None], Future | None] | None = None
        if _speedups is not None and COMPILED_SUBMIT and not self._multi:
            # submit and finish in C (``native/_submit.c``); the methods below stay the reference
            # and run every case it leaves to them
            launch_parts = getattr(self.backend, "launch_parts", None)
            if launch_parts is not None:
                load_torch()  # the CUDA calls in C++, where the torch extension builds
            submitter = _speedups.Submitter(self, ops.accesses_of, _DROP_WAITS,
                                            launch_parts() if launch_parts is not None else None)
            self.submit = submitter.submit  # type: ignore[method-assign]
            self._submit_on = submitter.submit_on  # type: ignore[method-assign]
            self._launch_held = submitter.launch_held
            self.submit_nowait = submitter.submit_nowait  # type: ignore[method-assign]
            self._finish_bound = submitter.finish
            h2d, d2h = ({space: i for (k, space), i in self._copy_index.items() if k == kind}
                        for kind in ("h2d", "d2h"))
            if h2d or d2h:
                submitter.setup_copies(transfers._copy_async, h2d, d2h, self._bytes, transfers.copy)
                self.copy = submitter.copy  # type: ignore[method-assign]
                self._copy_pinned = submitter.copy_pinned
        #: a runtime dropped without close() stops its threads (they hold no reference to it)
        self._finalizer = weakref.finalize(self, _stop_dropped, self.backends, self._host, self._launcher)
        self._finalizer.atexit = False  # at exit the threads (daemons) end with the process

    # ------------------------------------------------------------------ API
    @property
    def num_streams(self) -> int:
        """Compute streams (CUDA streams or CPU lanes); copy streams come on top."""
        return self._compute

    def submit(
        self,
        fn: Callable[..., T] = _NO_FUNCTION,  # type: ignore[assignment]
        /,
        *args: Any,
        reads: Iterable[Any] = (),
        writes: Iterable[Any] = (),
        name: str | None = None,
        run_on: str | None = None,
        **kwargs: Any,
    ) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` after every earlier op it conflicts with; returns a Future at once.

        Inside ``with rt.record() as g`` the op is recorded instead and an
        :class:`OpNode` is returned (the annotation says ``Future[T]``, the eager
        case; ``typing.cast(sd.OpNode, ...)`` where a recorded node is kept);
        ``g.run()`` runs it. The arguments are typed ``Any``, not ``fn``'s
        parameters (``ParamSpec``): ``sd.read(x)``/``sd.write(x)`` markers stand in
        for them, and ``reads``/``writes``/``name``/``run_on`` sit among ``fn``'s
        keywords, which ``ParamSpec`` cannot express. ``run_on`` picks the
        device on a runtime of several (default: where its memory lives);
        ``run_on="host"`` runs ``fn`` on a host lane (see ``host_lanes``).
        Every other keyword goes to ``fn``; to pass ``fn`` a keyword named
        ``reads``, ``writes``, ``name`` or ``run_on``, bind it first with
        ``functools.partial``.
        """
        if fn is _NO_FUNCTION:  # (the compiled submit raises the same)
            raise TypeError("submit() needs the function to run first: rt.submit(fn, *args)")
        return self._submit(fn, args, kwargs, reads, writes, name, blocking=True, run_on=run_on)

    def submit_nowait(
        self,
        fn: Callable[..., T] = _NO_FUNCTION,  # type: ignore[assignment]
        /,
        *args: Any,
        reads: Iterable[Any] = (),
        writes: Iterable[Any] = (),
        name: str | None = None,
        run_on: str | None = None,
        **kwargs: Any,
    ) -> Future[T]:
        """Like :meth:`submit`, but raises :class:`WouldBlock` instead of waiting for a free slot."""
        if fn is _NO_FUNCTION:
            raise TypeError("submit_nowait() needs the function to run first: rt.submit_nowait(fn, *args)")
        return self._submit(fn, args, kwargs, reads, writes, name, blocking=False, run_on=run_on)

    def copy(self, dst: Any, src: Any, name: str | None = None) -> Future[Any]:
        """Copy ``src`` into ``dst`` as an op; host<->device copies run on the copy streams.

        Returns at once (a pageable copy of up to 8 MiB stages its source first). As for any op,
        ``src`` must stay as it is, and ``dst`` unread, until the Future is done."""
        return transfers.copy(self, dst, src, name)  # (compiled for pinned memory: see __init__)

    def to_device(self, x: Any, name: str | None = None, device: str | None = None) -> Future[Any]:
        """A Future of a tensor on ``device`` (default: the runtime's first) holding host data ``x``,
        which must stay as it is until the Future is done."""
        return transfers.to_device(self, x, name, device)

    def to_host(self, t: Any, name: str | None = None) -> Future[Any]:
        """A Future of a host copy of tensor ``t`` (pinned where ``t`` is on a device), readable once
        the Future is done."""
        return transfers.to_host(self, t, name)

    def stream_map(self, fn: Callable[[Any], Any], inputs: Any, out: Any = None, *,
                   piece_bytes: int | None = None, buffers: int = 4, reads: Iterable[Any] = (),
                   capture: bool = False, name: str = "stream_map") -> Any:
        """Apply ``fn``, which maps rows one to one, to host tensors on the device: copies overlap compute.

        ``inputs``: a host tensor (or numpy array), or a sequence of them;
        returns a Future (or a list, one per input) of the host output, which
        is ``out`` where given (one host tensor per input, same dim 0), else a
        pinned tensor of ``fn``'s shape and dtype, made from the first piece's
        result (on CUDA as ``fn``'s kernels are launched; a runtime whose ops
        run later, on its lanes, waits for that piece). Each input is cut along dim 0
        into pieces of about ``piece_bytes`` (default 32 MiB, 16 MiB with
        ``capture``, 64 MiB from or into pageable memory on a GPU, smaller for
        small inputs); each piece is copied in, ``fn``
        runs on it, and its result is copied out, through ``buffers`` reused
        device buffers. ``fn(x)[i]`` must depend on ``x[i]`` only; ``reads``:
        device tensors ``fn`` also reads.

        ``capture=True`` runs ``fn`` on a full piece as a recorded graph per
        buffer, replayed as a CUDA graph from its second run: the host then
        launches one graph per piece instead of ``fn``'s kernels, so smaller
        pieces pay. ``fn`` must then be capturable (no host syncs; its Python
        runs only at recording), and the graphs and their buffers are kept for
        the next call with the same ``fn`` and shapes, until ``fn`` is dropped
        or the runtime closes.

        Inside ``with rt.record()`` (``out`` required), the pieces' copies and
        computes are recorded: each ``g.run()`` reads the inputs as they are
        then and fills ``out``, which the call returns; on CUDA, from pinned
        memory, the whole call is one captured CUDA graph.
        """
        from . import streaming

        return streaming.stream_map(self, fn, inputs, out, piece_bytes=piece_bytes, buffers=buffers,
                                    reads=reads, capture=capture, name=name)

    def synchronize(self) -> None:
        """Wait for every op submitted so far.

        Raises an ``ExceptionGroup`` of the ops that failed first (not their
        dependents) since the last call; the runtime stays usable.

        Inside an op (on a lane of this runtime, or in an op's function where
        ops run inside their submit, as on CUDA) it waits for every op but
        those that cannot finish before the calling op returns: that op, the
        ops queued behind it on its lane, and, in turn, the ops that depend
        on one of those, the ops queued behind one of those on its lane, and
        the ops of a lane whose op waits for one of those. So an op may fork
        ops and join them all with ``rt.synchronize()``. Inside a
        done-callback it raises while ops are pending: the callback runs in a
        thread that finishes ops, and must not wait.
        """
        self._wait_all()
        with self._lock:
            with self._done_lock:
                failures, self._failures = self._failures, []
                failed_since, self._failed_seen = self._failed != self._failed_seen, self._failed
            if failed_since:  # later ops must not fail for these; finished ops that did not fail
                self._tracker.forget(lambda op: op.done)  # go at the next compaction anyway
        if failures:
            # an ExceptionGroup, unless an op's function raised SystemExit (say) in a CPU lane
            raise BaseExceptionGroup(f"{len(failures)} streamdag op(s) failed", failures)

    def current_stream_wait(self, *futures: Future[Any]) -> None:
        """Order the caller's current stream after ``futures`` (default: every op submitted so far).

        On CUDA the host does not wait: the caller's current stream on each
        op's device waits on the op's completion event, so PyTorch code the
        caller runs next on that stream sees what the ops wrote. On the CPU
        lanes and the simulated device the caller's stream is the host, so
        this waits for the ops; so it does for a future without a device
        event (a graph's first run, op by op; an op held behind a host-lane
        op). Failures are not raised here:
        they stay with the futures and :meth:`synchronize`.
        """
        for f in futures:
            if not isinstance(f, concurrent.futures.Future):
                raise TypeError(f"current_stream_wait() takes the futures of ops, got {type(f).__name__}")
        host_waits = []
        with self._lock:  # events are recorded (and reused) under this lock: each still marks its op
            if futures:
                targets = [(getattr(f, "_fence", None), f) for f in futures if not f.done()]
            else:  # each stream's last pending op: its event covers the ones before it
                with self._done_lock:
                    last = {op.stamp.stream: op for op in self._pending.values() if op.event is not None}
                targets = [(op.event, op.future) for op in last.values()]
                targets += [(None, held.op.future) for held in self._held.values()]  # no event yet
            for fence, f in targets:
                caller_waits = getattr(fence, "caller_waits", None)  # a device event: the stream waits
                if caller_waits is not None:
                    caller_waits()
                else:
                    host_waits.append(f)
        for f in host_waits:
            f.exception()

    def statistics(self) -> RuntimeStatistics:
        self._bytes.reclaim()  # the copies seen done give their bytes back
        with self._done_lock:
            return RuntimeStatistics(
                inflight=len(self._pending),
                peak_inflight=self._counts.peak,
                submitted=self._counts.seq,
                completed=self._counts.completed,
                failed=self._failed,
                streams=self.num_streams,
                max_inflight=self.max_inflight,
                inflight_bytes=self._bytes.used,
                peak_inflight_bytes=self._bytes.peak,
            )

    @contextmanager
    def profile(self, per_op: bool = True, nvtx: bool = False) -> Iterator[Profiler]:
        """Time every op run inside the block: ``with rt.profile() as prof: ...; prof.timeline``.

        On leaving, the runtime synchronizes and ``prof.timeline`` holds a
        :class:`~streamdag.Timeline` (summary, Chrome trace, PNG). Inside an op
        it waits as :meth:`synchronize` does there, and the timeline leaves
        out the ops that cannot finish before the calling op returns. ``per_op``
        runs recorded graphs op by op instead of as one CUDA-graph replay, so
        that each op is seen; ``nvtx`` names NVTX ranges after the ops, for
        Nsight Systems.
        """
        from .profiling import Profiler

        with self._lock:
            if self._profiler is not None:
                raise RuntimeError("already profiling: leave the open `with rt.profile()` block first")
            self._profiler = Profiler(self._member, self._streams, per_op, nvtx)
        prof = self._profiler
        try:
            yield prof
        finally:
            with self._lock:
                self._profiler = None
            with suppress(Exception):
                self._wait_all()
            prof.finish()

    def _wait_all(self) -> None:
        """Wait for every op submitted so far, keeping failures for the next :meth:`synchronize`.

        Also for the done-callbacks of finished ops, and what they submit: a future counts
        as done before its callbacks have run. Inside an op, for all but what waits for it
        (see :meth:`_wait_all_but_the_caller`).
        """
        inside = in_done_callback()  # then one of the callbacks running is this thread's own
        if not inside and self._simulator_here():
            raise RuntimeError(
                "waiting inside an op for the runtime's pending work on the simulated device would wait "
                "forever: one thread runs all its streams, and nothing else runs until the waiting op "
                "returns. Synchronize outside the op, or add a done-callback instead of waiting")
        if not inside and (self._lane_here() is not None or self._launching_here()):
            self._wait_all_but_the_caller()
            return
        while True:
            with self._done_lock:  # (pending ops in the order of their submits)
                newest = next(reversed(self._pending.values()), None)
                calling = self._in_callbacks
            if newest is None:
                if not calling or inside:
                    return
                with self._callbacks_done:  # a future is done; its done-callbacks (may submit) still run
                    self._callbacks_done.wait_for(lambda: not self._in_callbacks)
                continue
            # the newest first: once it is done, so are the ops before it on its stream, and one pass
            # finishes them together; waiting on each in turn cost a waiter's help per op (on the H100,
            # rt.synchronize() after 64 ops that one result() had left took 0.12-0.23 ms)
            newest.future.exception()
            if self._pending:  # (read without the lock: the loop looks again under it)
                for finish_ready in self._finish_ready:
                    finish_ready()

    @contextmanager
    def record(self) -> Iterator[RecordedGraph]:
        """Record submits into a graph instead of running them: ``with rt.record() as g: ...``.

        Only the submits of the thread inside the block are recorded; other
        threads' submits run as usual meanwhile (and may record graphs of
        their own).
        """
        from .recorded import RecordedGraph

        self._check_open()
        me = threading.get_ident()
        with self._lock:
            if me in self._recordings:
                raise RuntimeError("already recording: finish the open `with rt.record()` block first")
            graph = RecordedGraph(self)
            self._recordings[me] = graph
        try:
            yield graph
        finally:
            with self._lock:
                del self._recordings[me]
        graph.finish()

    def _wait_all_but_the_caller(self) -> None:
        """:meth:`_wait_all` inside an op: wait for every pending op but those of
        :meth:`_ops_behind_the_caller`, looked for again after each wait (ops come and go).

        On a lane, the wait counts as that lane waiting for all of them (``LaneWaits``), from
        the moment they are found, so that a lane op that then waits for an op behind the
        caller raises instead of hanging. Also for the done-callbacks running, except where this
        thread holds the runtime's lock, which a callback that submits needs.
        """
        lane = self._lane_here()
        while True:
            with ExitStack() as waiting:
                with self._lock, self._lane_waits.locked():
                    behind = self._ops_behind_the_caller(lane)
                    recheck = lane is not None and bool(self._held)
                    with self._done_lock:
                        waited = [op for op in self._pending.values() if op.seq not in behind]
                        calling = self._in_callbacks
                    if waited:
                        queued = [(op.future, self._lane_of(op)) for op in waited]
                        waiting.enter_context(self._lane_waits.waiting_for_all(queued))
                if waited:  # the newest first, as _wait_all does; on a lane with ops held, in slices:
                    # a held op released meanwhile may be queued behind the caller, and is then left out
                    with suppress(concurrent.futures.TimeoutError):
                        waited[-1].future.exception(_BEHIND_RECHECK_S if recheck else None)
                    continue
            if lane is None or not calling:
                return
            with self._callbacks_done:
                self._callbacks_done.wait_for(lambda: not self._in_callbacks)

    def _ops_behind_the_caller(self, lane: Any) -> set[int]:
        """The numbers of the pending ops that cannot finish before the op this thread runs
        returns (caller holds ``_lock``).

        First the ops on ``lane``, the lane this thread runs (the caller and those queued behind
        it); or (``lane`` None) those launching in this thread and the held ops, whose launch
        needs the lock it holds. Then, until none is added: every op that depends on one of them,
        the ops queued behind one of them on a lane, and the ops of a lane whose op waits for one
        of them (``LaneWaits``). An op queued after one on a device stream is not among them: the
        device runs it without waiting for the host.
        """
        with self._done_lock:
            pending = list(self._pending.values())
        first: dict[int, int] = {}  # lane -> the position of the first op found on it (-1: all of its)
        if lane is not None:
            first[self._streams.index(lane)] = -1
            behind: set[int] = set()
        else:
            behind = {op.seq for op in self._launching_here()} | set(self._held)
        grew = True
        while grew:
            grew = self._add_ops_behind(pending, behind, first)
            found = {id(op.future) for op in pending if op.seq in behind}
            for waiting in self._lane_waits.lanes_waiting_for(lambda f, found=found: id(f) in found):
                i = self._streams.index(waiting)
                if first.get(i) != -1:
                    first[i] = -1
                    grew = True
        return behind

    def _add_ops_behind(self, pending: list[Op], behind: set[int], first: dict[int, int]) -> bool:
        """One pass of :meth:`_ops_behind_the_caller` over ``pending``: add to ``behind`` the
        ops that depend on one in it, or are queued at or after ``first``'s position on their
        lane; whether any was added."""
        grew = False
        for op in pending:
            if op.seq in behind:
                continue
            st = op.stamp
            if st is not None:
                after = st.stream in first and st.pos >= first[st.stream]
                deps = op.deps
            else:  # a held op: placed once it launches
                held = self._held.get(op.seq)
                after, deps = False, held.deps if held is not None else ()
            if after or any(d.seq in behind for d in deps):
                behind.add(op.seq)
                grew = True
                if self._lane_of(op) is not None and not first.get(st.stream, st.pos) < st.pos:
                    first[st.stream] = st.pos
        return grew

    def _lane_of(self, op: Op) -> Any:
        """The lane ``op`` is queued on (a stream whose ops a thread runs in order), or None."""
        st = op.stamp
        stream = self._streams[st.stream] if st is not None else None
        return stream if getattr(stream, "runs_here", None) is not None else None

    def _lane_here(self) -> Any:
        """The lane of this runtime that the calling thread runs (inside an op or a done-callback
        there), or None."""
        if threading.get_ident() not in self._lane_threads:
            return None
        return self._lane_waits.lane_here()

    def _launching_here(self) -> list[Op]:
        """The ops whose functions run in this thread now, inside their launch (on a device whose
        ops run inside their submit): the ops launched and given no completion event yet, where
        this thread holds the runtime's lock, under which every launch runs."""
        if not self._lock._is_owned():  # type: ignore[attr-defined]
            return []
        with self._done_lock:
            return [op for op in self._pending.values() if op.stamp is not None and op.event is None]

    def _runs_own_work_here(self) -> bool:
        """Whether the calling thread runs this runtime's own work now: an op on one of its lanes,
        an op's function inside its launch (or a graph's run: the lock held), a done-callback.
        There, waiting for the runtime's pending work could wait for the caller itself."""
        return (in_done_callback() or self._lane_here() is not None
                or self._lock._is_owned()  # type: ignore[attr-defined]
                or self._simulator_here())

    def _simulator_here(self) -> bool:
        """Whether the calling thread is a simulated device's, which runs all its streams."""
        return any(b.runs_here() for b in self.backends if hasattr(b, "runs_here"))

    def close(self) -> None:
        """Refuse new submits, wait for the pending work, and stop the backend. Failures not yet
        raised are dropped.

        From the call on, submits from other threads raise :class:`RuntimeClosed`, and so do
        those waiting for a slot at ``max_inflight`` (they are woken). The runtime's own work may
        still submit (ops and done-callbacks that fork and join) until no op is pending and no
        done-callback runs; then every submit is refused and the lanes stop.

        Inside an op or a done-callback of this runtime, where waiting would wait for the caller
        itself, close() returns at once, and a thread of its own finishes the close once the
        pending work, the caller included, is done. A runtime dropped without close() is closed
        when it is collected, with a ``ResourceWarning``, as an unclosed file is.
        """
        self._closed = True
        self._slots.wake_all()  # the submitters waiting for a slot: refused now
        if self._runs_own_work_here():
            if self._closer is None and not self._stopped:
                self._closer = threading.Thread(target=self._close_now, name="streamdag-close", daemon=True)
                self._closer.start()
            return
        self._close_now()

    def _close_now(self) -> None:
        """:meth:`close`, in a thread that may wait for the pending work."""
        with self._close_lock:
            if self._stopped:
                return
            self._drain()
            self._finalizer.detach()
            _stop_threads(self.backends, self._host, self._launcher)
            self._let_go()

    def _drain(self) -> None:
        """Wait until no op is pending and no done-callback runs (what they submit meanwhile
        included); then mark the runtime stopped, under its lock, so that no op comes after."""
        while True:
            try:
                self._wait_all()
            except Exception:  # (failures stay with the futures) a wait that cannot end: stop now
                drained = True
            else:
                drained = False
            with self._lock, self._done_lock:
                if drained or not (self._pending or self._in_callbacks):
                    self._stopped = True
                    return

    def _let_go(self) -> None:
        """Drop the runtime's references to itself (bound methods it keeps, the compiled submit,
        the per-stream hurries, the last ops its hazard records keep, whose futures lead back to
        it): a closed runtime is then freed as soon as nothing else holds it, with its events, not
        at some later pass of the cycle collector, which may come while someone captures a CUDA
        graph (freeing a CUDA graph there ends that capture)."""
        submit = self.__dict__.pop("submit", None)  # the compiled one: the class's raises RuntimeClosed
        self.__dict__.pop("_submit_on", None)
        self.__dict__.pop("submit_nowait", None)
        self._launch_held = None
        self.__dict__.pop("copy", None)  # (the class's, closed, raises RuntimeClosed)
        self._copy_pinned = None
        if submit is not None:
            submit.__self__.let_go()
        self._tracker.clear()
        self._finish_bound = None
        self._hurry_of = [None] * len(self._hurry_of)
        self._bytes.on_wait = self._staging.on_wait = None
        self._stream_maps.clear()  # their graphs hold the runtime

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            try:
                self.synchronize()
            finally:
                self.close()
        else:
            self.close()

    # ------------------------------------------------------------- internals
    def _submit_on(self, stream: int | None, fn: Callable[..., Any], /, *args: Any, reads: Sequence[Any] = (),
                   writes: Sequence[Any] = (), name: str | None = None, **kwargs: Any) -> Any:
        """Submit ``fn`` onto ``stream`` (a copy stream), ordered after its dependencies on the device
        only: its host memory is read or written by the device in stream order, so the host does not
        wait for earlier ops that touch it. The transfers' path; compiled where the module builds.
        ``None`` (a backend without copy streams): a compute stream, chosen as for any op."""
        if stream is not None and not 0 <= stream < len(self._streams):
            raise IndexError(f"_submit_on: stream {stream} out of range "
                             f"(the runtime has {len(self._streams)})")
        return self._submit(fn, args, kwargs, reads, writes, name, True, stream, device_ordered=True)

    def _recording_here(self) -> Any:
        """The graph this thread records into, or None."""
        return self._recordings.get(threading.get_ident()) if self._recordings else None

    def _check_open(self) -> None:
        """Raise :class:`RuntimeClosed` once the runtime is closed; while it closes (see
        :meth:`close`), for all but its own work."""
        if self._closed and (self._stopped or not self._runs_own_work_here()):
            raise RuntimeClosed(
                "this streamdag.Runtime is closed; create a new one, or submit inside its `with` block"
            )

    def _check_spaces(self, accesses: list[Access], name: str) -> None:
        for acc in accesses:
            if acc.region.space not in self._spaces and acc.region.space != OBJECTS:
                raise InvalidBuffer(
                    f"op {name!r} {'writes' if acc.write else 'reads'} memory on "
                    f"{acc.region.space}, but this runtime runs on {self.device}: move the data "
                    f"there first (e.g. tensor.to({self.device!r})) or use "
                    f"streamdag.Runtime(device={acc.region.space!r})"
                )

    def _submit(self, fn, args, kwargs, reads, writes, name, blocking: bool, stream: int | None = None,
                device_ordered: bool = False, run_on: str | None = None):
        if self._closed:
            self._check_open()
        if not callable(fn):
            raise TypeError(f"submit() needs a callable first, got {type(fn).__name__}")
        args, kwargs, accesses, written = collect_accesses(args, kwargs, reads, writes)
        op_name = name or getattr(fn, "__name__", None) or type(fn).__name__
        spaces = self._spaces
        on_host = False  # an access in host memory (a host function on a GPU runtime waits for it)
        resized: list[int] | None = None  # the objects it may give new memory (see ``with_identities``)
        by_object = False  # an access to an object itself
        for acc in accesses:
            space = acc.region.space
            if space not in spaces:
                if space != OBJECTS:
                    self._check_spaces(accesses, op_name)
                by_object = True
                if acc.write:
                    resized = [*(resized or ()), acc.region.start]
            elif space == "cpu":
                on_host = True
        device = self.device
        if self._multi:
            from .peers import bring_inputs, place

            device = place(self, accesses, run_on, stream, op_name)
            # copies read remote memory by design, host functions read any device's on the host;
            # other ops get local copies
            if stream is None and device != "host":
                args, kwargs, accesses = bring_inputs(self, args, kwargs, accesses, device, op_name)
                on_host = any(a.region.space == "cpu" for a in accesses)
        elif run_on == "host":  # (with a stream: that host lane, see ``transfers._staged_on_a_lane``)
            if self._host is not None and (stream is None or self._stream_device[stream] == "host"):
                device = "host"
        elif run_on is not None and run_on != device:
            raise ValueError(f"run_on={run_on!r}, but this runtime runs on {device} only: "
                             f"create it with devices=[{device!r}, {run_on!r}]")
        recording = self._recording_here()
        if recording is not None:
            if by_object:
                raise InvalidBuffer(
                    f"op {op_name!r} writes an empty buffer, which it may give new memory (an out= of "
                    "PyTorch resizes an empty tensor), or touches one that a pending op may: a recorded "
                    "graph runs on the memory it was recorded with. Allocate the buffer at its final "
                    "size before recording (e.g. torch.empty(n) rather than torch.empty(0)), after the "
                    "ops that resize it have run (rt.synchronize())")
            return recording.add(fn, args, kwargs, accesses, name, stream, written, device)
        future = self._enqueue(fn, args, kwargs, accesses, name, op_name, blocking, stream, device_ordered,
                               device, on_host, written)
        if resized:  # until it has run, every access to those objects follows it
            future._on_done(hold_identities(resized))
        return future

    def _enqueue(self, fn, args, kwargs, accesses, name, op_name, blocking: bool, stream: int | None,
                 device_ordered: bool = False, device: str | None = None, on_host: bool = True,
                 written: Any = None):
        """Link and launch (or hold) an op; returns its future. ``written``: the buffers it declares
        written, which it holds (``Op.keep``; see ``_finish``)."""
        if not self._slots.acquire(False) and not self._take_slot(blocking):
            self._would_block()
        try:
            if not self._lock.acquire(False):
                self._wait_for_the_lock()
        except BaseException:  # an interrupt while waiting: the op is not submitted
            self._slots.release()
            raise
        try:
            if self._stopped:  # closed since this submit began: its lanes take no more ops
                self._check_open()
            holders = self._holders(accesses, op_name, device) if self._host_ops else ()
            fence = self._caller_fence(device) if holders and device != "host" else None
        except BaseException:  # refused: the op is not submitted
            self._lock.release()
            self._slots.release()
            raise
        try:
            self._counts.seq += 1
            seq = self._counts.seq
            op = Op(seq, op_name, fn, args, kwargs, accesses, numbered=not name)
            op.keep = written
            deps = self._tracker.link(op, accesses)
            host_inputs = on_host and device != "host" and not (device_ordered or self.backend.deferred)
            if device == "host":
                self._host_ops[seq] = op
            if holders:  # (found before the op was linked: its deps hold no others)
                self._launch_or_hold(op, deps, stream, device, host_inputs, fence, holders)
            else:
                self._launch(op, deps, stream, device, host_inputs=host_inputs)
        finally:
            self._lock.release()
        if self._finish_ready and not seq % self._finish_every:  # outside the lock: callbacks may submit
            for finish_ready in self._finish_ready:
                finish_ready()
        return op.future

    def _wait_for_the_lock(self) -> None:
        """Take the runtime's lock, held by another thread. A lane thread counts meanwhile as
        waiting for it (``LaneWaits.lock_waiters``): a thread that holds the lock while an op runs
        inside its submit, and waits there for an op on that lane, would wait forever, and raises
        instead (``LaneWaits.check_lock_holder``)."""
        lane = self._lane_here()
        if lane is None:
            self._lock.acquire()
            return
        waiters = self._lane_waits.lock_waiters
        waiters.add(id(lane))
        try:
            self._lock.acquire()
        finally:
            waiters.discard(id(lane))

    def _lock_unless_after_host_ops(self, accesses: Sequence[Access], op_name: str) -> bool:
        """Take the runtime's lock and return True, unless an op of ``_host_ops`` that ``accesses``
        follow is left (unfinished host-lane ops, held ops): then return False, the lock not held.

        For what must start now, with the lock held: a graph's host replay
        over several devices, which would otherwise wait for those ops in the
        submitting thread (its caller runs the graph op by op instead, each op
        held as an eager submit is). Checked under the lock, so that no
        host-lane op another thread submits can come in between.
        """
        self._lock.acquire()
        try:
            found = self._host_deps(accesses, op_name) if self._host_ops and accesses else ()
        except BaseException:
            self._lock.release()
            raise
        if found:
            self._lock.release()
            return False
        return True

    def _holders(self, accesses: list[Access], op_name: str, device: str | None) -> list[Op]:
        """The ops that hold an op with ``accesses`` on ``device`` (see ``_hold``): for a device op,
        those of :meth:`_host_deps`; for a host-lane op, the held ops among them (a lane waits
        for a device op's future, but it is placed after it: it needs the op launched)."""
        if device != "host":
            return self._host_deps(accesses, op_name)
        return [d for d in self._tracker.depends_on(accesses) if not d.done and d.seq in self._held]

    def _host_deps(self, accesses: Sequence[Access], op_name: str) -> list[Op]:
        """The ops of ``_host_ops`` (host-lane ops not finished, held ops) that an op with
        ``accesses`` must follow (caller holds ``_lock``).

        A device op can start only once the host-lane ones have finished and the
        held ones have launched: a device stream cannot wait for a host lane.
        """
        if not accesses:
            return []
        found = [d for d in self._tracker.depends_on(accesses) if not d.done and d.seq in self._host_ops]
        for dep in found:
            if dep.stamp is not None and self._streams[dep.stamp.stream].runs_here():
                raise RuntimeError(
                    f"op {op_name!r} touches the memory of host op {dep.name!r} and would wait for it, "
                    "but was submitted on the host lane that runs it (from inside it, or from a "
                    "done-callback run there before it): do that work in the host op's function "
                    "itself, or submit the op from another thread")
        return found

    def _caller_fence(self, device: str | None) -> Any:
        """An event marking what the caller has enqueued on its current stream of ``device`` (None:
        the first) so far, for an op that launches later, from another thread (None: nothing to
        mark, or CUDA orders it; see ``CudaBackend.caller_fence``). Raises inside the caller's own
        CUDA graph capture."""
        fence_of = getattr(self._backend_of(device), "caller_fence", None)
        return fence_of() if fence_of is not None else None

    def _backend_of(self, device: str | None) -> Any:
        """The backend of ``device`` (None: the first)."""
        return self.backends[self.devices.index(device)] if device in self.devices else self.backend

    def _launch_or_hold(self, op: Op, deps: list[Op], stream: int | None, device: str | None,
                        host_inputs: bool, fence: Any, holders: list[Op] | None = None) -> None:
        """:meth:`_launch` ``op``, or hold it (see :meth:`_hold`) where ``deps`` include ops of
        ``_host_ops`` that hold it (see :meth:`_holders`; ``holders``: those, where the caller
        found them already). ``fence``: from :meth:`_caller_fence`, taken before ``op`` was
        linked (it raises inside the caller's capture), or None."""
        if holders is None:
            holders = [d for d in deps if not d.done and d.seq in self._host_ops] if self._host_ops else []
            if device == "host":
                holders = [d for d in holders if d.seq in self._held]
        if holders and self._hold(op, deps, holders, stream, device, host_inputs, fence):
            return
        if fence is not None:
            self._backend_of(device).recycle(fence)
        self._launch(op, deps, stream, device, host_inputs=host_inputs)

    def _hold(self, op: Op, deps: list[Op], holders: list[Op], stream: int | None, device: str | None,
              host_inputs: bool, fence: Any) -> bool:
        """Keep ``op`` (a device op; a host-lane op after a held one) until ``holders`` (ops of
        ``_host_ops`` it depends on, see :meth:`_holders`) have finished or launched, and launch
        it then (see ``_release_held``); its submit returns at once. False where they all
        finished meanwhile: launch it now. Caller holds ``_lock`` and a slot.

        ``fence`` (see ``_caller_fence``): what the op's stream waits for first, since the caller's
        stream is not current where it launches.
        """
        with self._held_lock:  # (a host-lane op finishes without the runtime's lock)
            holders = [h for h in holders if not h.done]
            if not holders:
                return False
            held = Held(op, deps, stream, device, host_inputs, fence, len(holders))
            for h in holders:
                self._held_on.setdefault(h.seq, []).append(held)
        self._held[op.seq] = held
        self._host_ops[op.seq] = op  # an op after it is held too
        with self._done_lock:  # pending from now on: synchronize() waits for it
            self._pending[op.seq] = op
            if len(self._pending) > self._counts.peak:
                self._counts.peak = len(self._pending)
        return True

    def _release_held(self, seq: int) -> None:
        """Launch the held ops that op ``seq`` (finished, or launched on a device) held last, then
        those that these held last, and so on (a loop: a chain of held ops may be long). Caller
        holds ``_lock``."""
        ready = [seq]
        interrupt: BaseException | None = None
        while ready:
            with self._held_lock:
                released = self._held_on.pop(ready.pop(), ())
            for held in released:
                held.waiting -= 1
                if held.waiting:
                    continue
                op = held.op
                del self._held[op.seq]
                try:  # a holder that failed fails it as a dependent, in its launch
                    if self._launch_held is not None and held.device == self.device:
                        self._launch_held(op, held.deps, held.stream, held.host_inputs, held.fence)
                    else:
                        self._launch(op, held.deps, held.stream, held.device, held.host_inputs, held.fence)
                except BaseException as exc:  # an interrupt (the op failed with it): launch the rest
                    interrupt = exc
                finally:
                    if held.fence is not None:  # its wait is issued: the event may be reused
                        self._backend_of(held.device).recycle(held.fence)
                future = op.future
                if future._watched and future._hurry is not None and not future.done():
                    # someone waited before it launched (in the condition: nothing to help yet): ask
                    # for it first now, or its finish waits for the completion thread's next pause
                    future._ask_first()
                if held.device != "host":  # launched: what it holds may follow by events now
                    self._host_ops.pop(op.seq, None)
                    ready.append(op.seq)
                # (a host-lane op holds what it holds until it has finished, see _finish_host_op)
        if interrupt is not None:
            raise interrupt

    def _release_held_locking(self, seq: int) -> None:
        """:meth:`_release_held` from the launcher thread."""
        with self._lock:
            self._release_held(seq)

    def _would_block(self) -> None:
        """What ``submit_nowait`` raises at the in-flight bound (the compiled one calls it too)."""
        raise WouldBlock(
            f"{self.max_inflight} ops are in flight (max_inflight={self.max_inflight}): "
            "use submit() to wait for a slot, or create the runtime with a larger max_inflight"
        )

    def _take_slot(self, blocking: bool = True) -> bool:
        """A slot under ``max_inflight``; at the bound, finishing is hurried before waiting."""
        if self._slots.acquire(blocking=False):
            return True
        if not blocking:
            return False
        for finish_ready in self._finish_ready:  # finish what has completed here: no thread switch
            finish_ready()
        if self._slots.acquire(blocking=False):
            return True
        # in a done-callback, this thread may be the one that frees slots; inside an op (fork and
        # join), the ops in flight may all be parents waiting for what they submit: waiting could
        # hang either way, so the op goes past the bound
        if in_done_callback() or self._lane_here() is not None or self._launching_here():
            self._slots.take_over()
            return True
        self._hurry_all()
        if not self._lock._is_owned():  # type: ignore[attr-defined]
            return self._slots.acquire(check=self._check_open)  # (close() wakes it to refuse)
        # a graph's run launches its ops under the lock: let go of it while waiting, since the
        # threads that free slots run done-callbacks, and a callback that submits needs the lock.
        # (Condition does the same with these RLock methods.) Other submits may come in between
        # the graph's ops meanwhile; dependencies follow submission order either way.
        state = self._lock._release_save()  # type: ignore[attr-defined]
        try:
            return self._slots.acquire()
        finally:
            self._lock._acquire_restore(state)  # type: ignore[attr-defined]

    def _hurry_all(self, waiter: Future | None = None, seconds: float | None = None) -> None:
        """Ask every backend to finish its completed ops now: someone waits.

        On one device the waiting thread helps (see ``CudaBackend.hurry``); over
        several it would poll one device while another finishes the ops, except
        where it must (see :meth:`_help_while_holding_the_lock`).
        """
        helps = waiter is not None and len(self.backends) == 1
        started = time.perf_counter()
        for m in self.backends:
            hurry = getattr(m, "hurry", None)
            if hurry is None:
                continue
            if helps:
                hurry(waiter, seconds)
            else:
                hurry()
        if waiter is not None:
            self._help_while_holding_the_lock(waiter, self.backends, seconds, started)

    def _help_while_holding_the_lock(self, waiter: Future, backends: Sequence[Any], seconds: float | None,
                                     started: float) -> None:
        """If this thread holds the runtime's lock, finish ops itself until ``waiter`` is done.

        That thread is an op's function waiting inside its submit (on CUDA), or
        a graph's run. The threads that finish ops may be held up on the lock
        meanwhile (a done-callback that submits), so only this one is sure to
        get ``waiter`` finished, however long that takes (within ``seconds``).
        """
        if waiter.done() or not self._lock._is_owned():  # type: ignore[attr-defined]
            return
        helpers = [h for m in backends if (h := getattr(m, "help", None)) is not None]
        if not helpers:
            return
        deadline = math.inf if seconds is None else started + seconds
        while not waiter.done() and time.perf_counter() < deadline:
            for help_once in helpers:
                help_once(waiter, 0.0)
            time.sleep(0)

    def _admit(self, op: Op, deps: list[Op], stream: int | None, device: str | None = None
               ) -> tuple[int, list[Op], list[int]]:
        """Place ``op`` after ``deps`` and count it pending; returns its stream, the unfinished
        deps, and the indices of those it must wait on. Caller holds ``_lock`` and a slot.

        ``op.deps`` keeps what a failure check needs: the unfinished deps and the failed ones.
        """
        if self._stopped:  # a graph's run that began before close(): its lanes take no more ops
            self._check_open()
        live: list[Op] = []
        if deps:
            kept = []
            for d in deps:
                if not d.done:
                    live.append(d)
                    kept.append(d)
                elif d.error is not None:
                    kept.append(d)
            op.deps = kept
        nested = threading.get_ident() in self._lane_threads  # submitted from inside an op on a lane
        behind, blocked = self._behind_the_caller() if nested else ((), ())
        if stream is None:
            stream = self._choose_stream(live, device or self.device, blocked)
        if nested:
            stuck = stream in blocked or any(d.seq in behind for d in live)
            self._mark_lane_submit(op.future, stream, stuck)
        if device == "host":  # the lane it is queued on, for a wait holding the lock (see LaneWaits)
            marks = op.future.__dict__
            marks["_lane"], marks["_lock_waits"] = self._streams[stream], self._lane_waits
        op.stamp, waits = self._clocks.place(stream, [d.stamp for d in live] if live else live)
        pending = self._pending
        with self._done_lock:
            pending[op.seq] = op
            self._busy[stream] += 1
            if len(pending) > self._counts.peak:
                self._counts.peak = len(pending)
        return stream, live, waits

    def _launch(self, op: Op, deps: list[Op], stream: int | None, device: str | None = None,
                host_inputs: bool = False, fence: Any = None) -> None:
        """Place ``op`` after ``deps`` and hand it to the backend. Caller holds ``_lock`` and a slot.

        ``host_inputs``: the op's function runs now, in this thread, so the host memory it
        touches must first be final (see ``ops.wait_for_host_inputs``). ``fence``: an event its
        stream waits for first (a held op's submitter's stream, see ``_hold``).
        """
        stream, live, waits = self._admit(op, deps, stream, device)
        backend = self._member[stream]
        if self._can_be_lost and backend.lost is not None:  # the device takes no more calls: fail at once
            self._fail_lost(op, backend)
            return
        self._launch_placed(op, deps, stream, live, waits, host_inputs, fence)

    def _launch_placed(self, op: Op, deps: list[Op], stream: int, live: list[Op], waits: list[int],
                       host_inputs: bool, fence: Any = None) -> None:
        """:meth:`_launch` once ``op`` is placed on ``stream`` (see :meth:`_admit`) and its device is
        not lost. (The compiled submit calls it for what it leaves to Python: a profiler, host
        inputs to wait for, a dependency still launching.)"""
        backend = self._member[stream]
        s = self._streams[stream]
        profiler = self._profiler
        try:
            if fence is not None:
                fence.wait(s)
            if host_inputs and live:
                wait_for_host_inputs(op.accesses, live, op)
            if waits and not _DROP_WAITS:
                for i in waits:
                    dep = live[i]
                    on_lane = self._member[dep.stamp.stream] is self._host
                    if backend is self._host and not on_lane:
                        backend.wait_for_op(s, dep)  # a device's op, waited for on the lane
                    elif on_lane and backend is not self._host:
                        # a device op after an unfinished host-lane op: such an op is held until
                        # that one has finished (see ``_hold``); waiting here, under the lock,
                        # could hang, so a path that skipped the hold fails the op instead
                        raise RuntimeError(
                            f"streamdag internal error: op {op.name!r} was launched before host-lane "
                            f"op {dep.name!r} it follows had finished; please report it")
                    else:
                        event_of(dep, op).wait(s)
            if profiler is not None:
                started = profiler.start(op, stream, deps)
            backend.launch(s, op.execute)  # execute raises only an interrupt (no Exception)
            if profiler is not None:
                profiler.end(op, stream, started)
        except BaseException as exc:  # the backend's own calls failed, or an interrupt (Ctrl-C) came
            error = release_frames(exc, caught_here=True) if isinstance(exc, Exception) else exc
            op.error, op.root_name, op.root_error = error, op.name, error
            self._finish_launch(op, stream, failed=True)
            return
        self._finish_launch(op, stream)

    def _finish_launch(self, op: Op, stream: int, failed: bool = False) -> None:
        """After ``op``'s host code ran on ``stream``: record its completion event and watch it, or
        (``failed``: the launch itself failed; or a sticky device error) finish it now.

        (The compiled submit, ``native/_submit.c``, calls this where ``op`` failed.)
        """
        backend = self._member[stream]
        stop = failed
        try:
            if not stop:
                stop = op.error is not None and not backend.deferred and _is_sticky(backend, op.error)
            if not stop:
                op.event = event = backend.event()
                event.record(self._streams[stream])
        except BaseException as exc:  # the backend's own calls failed, or an interrupt (Ctrl-C) came
            error = release_frames(exc, caught_here=True) if isinstance(exc, Exception) else exc
            op.error, op.root_name, op.root_error = error, op.name, error
            stop = True
        if stop:
            if _is_sticky(backend, op.error):
                op.error = op.root_error = backend.mark_lost(op.error)  # type: ignore[attr-defined]
            op.deps = ()
            self._finish(op)
            if self._host_ops.pop(op.seq, None) is not None and op.seq in self._held_on:
                self._release_held(op.seq)
            if not isinstance(op.error, Exception):  # the op failed with it; the caller gets it too
                raise op.error  # type: ignore[misc]
            return
        if backend is self._host:
            self._watch(op, stream, event, partial(self._finish_host_op, op))
        else:
            self._watch(op, stream, event, partial(self._finish_bound, op))

    def _finish_host_op(self, op: Op) -> None:
        """Finish a host-lane op; then launch the device ops held on it (see ``_hold``)."""
        try:
            self._finish_bound(op)
        finally:
            self._host_ops.pop(op.seq, None)
            with self._held_lock:  # after it is done: a later hold sees that and holds no more on it
                holds = op.seq in self._held_on
            if holds:  # launched by the launcher thread: this lane must not wait for the runtime's lock
                self._launcher.put(op.seq)

    def _fail_lost(self, op: Op, backend: Any) -> None:
        """Fail ``op`` at once: its device is lost and takes no more calls."""
        op.deps = ()
        op.error = op.root_error = backend.lost
        op.root_name = op.name
        self._finish(op)

    def _watch(self, op: Op, stream: int, event: Any, finished: Callable[..., None]) -> None:
        """Have ``finished`` called once ``event`` (just recorded on ``stream``) completes, and
        give ``op``'s future what waiting on it uses: whom to hurry, the event, the backend's token."""
        backend = self._member[stream]
        future = op.future
        future._hurry = self._hurry_of[stream]
        future._fence = event
        future._done_token = backend.when_done(self._streams[stream], event, finished)

    def _choose_stream(self, live: list[Op], device: str, blocked: Collection[int] = ()) -> int:
        """Continue a producer's compute stream when it is that stream's last op; else the least busy one.

        Only compute streams of ``device`` are candidates. Copy streams are
        never continued: compute placed there would serialize with copies.
        """
        compute = self._compute_of[device]
        lo, n = compute.start, len(compute)
        # an op submitted from inside an op on a lane (a host lane, a CPU runtime's) goes to another
        # lane: queued behind the op that submits it, it would never run if that op waits for it;
        # nor behind ops that cannot run before that op returns (``blocked``), where a lane is free
        here = self._calling_lane(lo, n) if n > 1 else -1
        avoid = {here} | {i for i in blocked if lo <= i < lo + n}
        if len(avoid - {-1}) >= n:  # every lane is held up: waiting for the op raises (see _admit)
            avoid = {here}
        for dep in reversed(live):
            st = dep.stamp
            if (st is not None and lo <= st.stream < lo + n and self._clocks.tail(st.stream) == st.pos
                    and st.stream not in avoid):
                return st.stream
        # one reading of the counts: a finish in another thread may lower one meanwhile (it takes
        # ``_done_lock``, not ``_lock``), and a search for a count read earlier would never end
        busy = self._busy[lo:lo + n]
        least = min(b for i, b in enumerate(busy) if lo + i not in avoid)
        chosen = self._next_stream[device]  # round robin among the least busy
        while busy[chosen] != least or lo + chosen in avoid:
            chosen = (chosen + 1) % n
        self._next_stream[device] = (chosen + 1) % n
        return lo + chosen

    def _mark_lane_submit(self, future: Future, stream: int, stuck: bool = False) -> None:
        """What a wait inside the submitting op checks (see ``Future._waited_on``, ``LaneWaits``),
        for an op that a lane thread places on a lane: queued behind the submitting op itself (one
        lane) or behind ops that cannot run before it returns (``stuck``), or on a lane whose op
        may wait in turn."""
        runs_here = getattr(self._streams[stream], "runs_here", None)
        if runs_here is None:  # a device stream: its ops finish without a lane
            return
        if runs_here() or stuck:
            future.__dict__["_behind"] = threading.get_ident()
        future.__dict__["_lanes_of"] = self._lane_waits
        future.__dict__["_lane"] = self._streams[stream]  # where it is queued

    def _held_up_by_caller(self, future: Any) -> bool:
        """Whether ``future`` (an op's, or a graph run's: its ``_ops_of``) needs a pending op that
        cannot finish before the op this lane thread runs returns: one queued after it on a lane,
        depending on it, or on a lane whose op waits for it (caller holds ``_lock`` and the lane
        waits' lock, see ``LaneWaits.waiting``)."""
        futures = future.__dict__.get("_ops_of") or (future,)
        behind = self._ops_behind_the_caller(self._lane_here())
        with self._done_lock:
            ids = {id(op.future) for op in self._pending.values() if op.seq in behind}
        return any(id(f) in ids for f in futures)

    def _behind_the_caller(self) -> tuple[set[int], set[int]]:
        """For a submit from inside an op on a lane (caller holds ``_lock``): the numbers of the
        pending ops that cannot finish before that op returns (:meth:`_ops_behind_the_caller`),
        and the lanes that hold one of them, where an op queued now runs only after it returns."""
        behind = self._ops_behind_the_caller(self._lane_here())
        with self._done_lock:
            held = [op for op in self._pending.values() if op.seq in behind]
        return behind, {op.stamp.stream for op in held if self._lane_of(op) is not None}

    def _calling_lane(self, lo: int, n: int) -> int:
        """The stream among ``lo`` to ``lo + n`` that is the lane the calling thread runs (inside an
        op there), or -1."""
        if threading.get_ident() not in self._lane_threads:
            return -1
        for i in range(lo, lo + n):
            runs_here = getattr(self._streams[i], "runs_here", None)
            if runs_here is not None and runs_here():
                return i
        return -1

    def _finish(self, op: Op, device_error: BaseException | None = None) -> None:
        """Called by the backend once ``op``'s completion event has been observed."""
        if device_error is not None and op.error is None:
            op.error, op.root_name, op.root_error = device_error, op.name, device_error
        error = op.error
        op.done = True
        slots = self._slots
        future = op.future
        # a future someone waits on or has callbacks for (``_watched`` never turns back) is counted
        # as calling back in the same hold that takes it off pending: synchronize() sees it pending
        # or calling back, never neither while its done-callbacks are still to run; one nobody
        # watches costs nothing here
        counted = future._watched
        with self._done_lock:
            del self._pending[op.seq]
            if counted:
                self._in_callbacks += 1
            self._busy[op.stamp.stream] -= 1  # type: ignore[union-attr]
            slots.release_locked()
            if error is None:
                self._counts.completed += 1
            else:
                self._failed += 1
                # an interrupt in the submitting thread was raised to the caller already; one in a
                # lane of the runtime's own (SystemExit, say) was not
                if op.root_error is error and (isinstance(error, Exception) or self.backend.deferred):
                    _annotate(error, op.name)
                    self._failures.append(error)
        value = op.value
        if error is None:
            op.fn = op.args = op.kwargs = op.value = op.keep = None  # no reference to user data is kept
        else:  # what it wrote fails later ops until synchronize() (the tracker's record): what it was
            op.value = None  # given and the buffers it declared written (``keep``) stay referenced as
            # long, so that memory is not freed and handed to a new buffer, whose ops would fail for an
            # op that never touched it
        if future._settle_unobserved(value, error):  # nobody waits and no callback: done
            return
        if not counted:  # watched since: counted now
            with self._done_lock:
                self._in_callbacks += 1
        self._settle(future, value, error)

    def _settle(self, future: Future, value: Any, error: BaseException | None) -> None:
        """Give a finished op's future its outcome when someone waits on it or a callback is set.

        The op is counted in ``_in_callbacks`` already (by whoever took it out of ``_pending``): its
        done-callbacks may submit more, and synchronize() waits for them.
        """
        later = deferring_callbacks() if future._has_callbacks() else None
        if later is not None:  # this thread finishes ops under a lock: callbacks once it is let go
            try:
                kept = future._settle_keeping_callbacks(value, error)
            except BaseException:
                self._callbacks_ran()
                raise
            later.append(partial(self._run_kept_callbacks, future, kept))
            return
        try:
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)
        finally:
            self._callbacks_ran()

    def _run_kept_callbacks(self, future: Future, callbacks: list[Any]) -> None:
        try:
            future._run_callbacks(callbacks)
        finally:
            self._callbacks_ran()

    def _callbacks_ran(self) -> None:
        with self._done_lock:
            self._in_callbacks -= 1
            if not self._in_callbacks:
                self._callbacks_done.notify_all()


class _Hurry:
    """What waiting on an op's future calls (``Future._hurry``): its backend's ``hurry``, then,
    in a thread that holds the runtime's lock, the help that only that thread can give."""

    __slots__ = ("backend", "rt")

    def __init__(self, rt: Runtime, backend: Any) -> None:
        self.rt, self.backend = rt, backend

    def __call__(self, waiter: Future | None = None, seconds: float | None = None,
                 wanted: Any = None) -> None:
        started = time.perf_counter()
        self.backend.hurry(waiter, seconds, wanted)
        if waiter is not None:
            self.rt._help_while_holding_the_lock(waiter, (self.backend,), seconds, started)


class _Slots:
    """A counting semaphore for the in-flight bound.

    Uncontended, an acquire takes one plain lock, and a release none of its
    own: it runs under the lock the runtime takes to finish an op anyway
    (``threading.Semaphore`` goes through a Python-level ``Condition`` every
    time, which costs more than the rest of the bookkeeping of a small op).
    Its counts are fields of ``counts`` (the runtime's), which the compiled
    submit and finish read and write in C, with no int object per op.
    """

    __slots__ = ("_freed", "_lock", "counts")

    def __init__(self, count: int, lock: Any, counts: Any) -> None:
        self.counts = counts
        counts.free, counts.waiting = count, 0
        self._lock = lock
        self._freed = threading.Condition(self._lock)

    def acquire(self, blocking: bool = True, check: Callable[[], None] | None = None) -> bool:
        """Take a slot; at the bound, wait for one (``blocking``), calling ``check`` first and
        after each wake-up (it raises to give up: the runtime is closed), or return False."""
        counts = self.counts
        with self._lock:
            while counts.free <= 0:
                if not blocking:
                    return False
                if check is not None:
                    check()
                counts.waiting += 1
                try:
                    self._freed.wait()
                finally:
                    counts.waiting -= 1
            counts.free -= 1
            return True

    def wake_all(self) -> None:
        """Wake every waiting acquire to call its ``check`` again (the runtime closes)."""
        with self._lock:
            self._freed.notify_all()

    def take_over(self) -> None:
        """Take a slot past the bound, without waiting (later acquires wait until it is back)."""
        with self._lock:
            self.counts.free -= 1

    def release(self) -> None:
        """Give a slot back (the compiled submit, when it hands an op to the Python path)."""
        with self._lock:
            self.release_locked()

    def release_locked(self) -> None:
        """Give a slot back; the caller holds the lock."""
        counts = self.counts
        counts.free += 1
        if counts.waiting:
            self._freed.notify()


def _stop_threads(backends: list[Backend], host: HostLanes | None, launcher: Launcher) -> None:
    """Stop a runtime's threads: its launcher's, its backends', its host lanes'."""
    launcher.stop()
    for m in backends:
        m.close()
    if host is not None:
        host.close()


def _stop_dropped(backends: list[Backend], host: HostLanes | None, launcher: Launcher) -> None:
    """A runtime collected without close(): stop its threads, and warn, as an unclosed file does.

    They are stopped from a thread of their own: the runtime may be dropped in one of them,
    which cannot join itself, or in whatever thread the collector runs, which must not wait.
    """
    with suppress(RuntimeError):  # (no thread starts at interpreter shutdown: the daemons end with it)
        threading.Thread(target=_stop_threads, args=(backends, host, launcher), name="streamdag-close",
                         daemon=True).start()
    warnings.warn("a streamdag.Runtime was dropped without close(); its threads are stopped now. Close it "
                  "when done (rt.close() or a `with` block; a streamdag.compile function's close() closes "
                  "the runtimes it made)", ResourceWarning, stacklevel=2)


def _check_count(name: str, value: Any, minimum: int, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}" + (f" ({hint})" if hint else ""))


def _is_sticky(backend: Any, error: BaseException) -> bool:
    check = getattr(type(backend), "is_sticky", None)
    return bool(check and check(error))


def _finished_ok(op: Op) -> bool:
    return op.done and op.error is None


if _speedups is not None:
    _speedups.setup_submit(Op, Future, Marker, ops._LAZY, ops._PENDING, ops._FINISHED, _finished_ok,
                             ops.release_frames)


def _annotate(error: BaseException, op_name: str) -> None:
    note = f"raised by streamdag op {op_name!r}"
    if hasattr(error, "add_note") and note not in getattr(error, "__notes__", ()):
        error.add_note(note)
