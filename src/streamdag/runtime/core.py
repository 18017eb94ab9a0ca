"""The runtime: turns submitted ops into backend calls and futures.

:class:`Runtime` is made here, with its public API. What happens per op lives in the parts it
is composed of, each a module that states the state it changes: ``submitting`` (the submit
path), ``held`` (ops held behind host-lane ops), ``completion`` (finishing, the in-flight
bound), ``lifecycle`` (waiting for all, closing); ``layout`` numbers the streams. Other modules
use a runtime through the members their ``*Runtime`` protocol lists (``tests/test_runtime_seams.py``).
``native/_submit.c`` is handed the state below, and the parts' methods, in one
``seam.SubmitterParts``; it reads no attribute of the runtime by name.

Locks: ``_lock`` (re-entrant: submits, placement, holds, recording, a graph's run) is taken
before ``_done_lock`` (finishing; backend threads take it alone), never after it.
``_held_lock`` and the lane waits' lock are taken inside either. "Changed under" a lock: reads
without it are single loads, used as hints or looked at again under it.

==========================  ====================  ==================================================
state                       changed under         invariant
==========================  ====================  ==================================================
``backends``, ``backend``,  (set once)            one backend per device; ``backend`` the first;
``device(s)``, ``_multi``                         ``_multi``: more than one
``max_inflight``            (set once)            the in-flight bound (``_slots``)
``_compute``                (set once)            ``backend``'s compute streams (``num_streams``)
``_streams``, ``_member``,  (set once)            ``layout.StreamLayout``: every stream, numbered,
``_stream_device``,                               its backend and device; each device's compute
``_compute_of``,                                  streams and copy streams; the host lanes (None
``_copy_index``, ``_host``                        on a CPU runtime)
``_spaces``                 (set once)            the address spaces ops may touch
``_can_be_lost``            (set once)            whether the backend may lose its device
``_lane_threads``           (the lanes' own)      the threads of every lane (``backends.cpu``)
``_lane_waits``             its own lock          the waits of lane ops (``LaneWaits``)
``_tracker``                ``_lock``             links each op to the earlier ops it conflicts
                                                  with; holds unfinished and failed ops' records
``_clocks``                 ``_lock``             what each stream has waited for; its tail
``_next_stream[d]``         ``_lock``             where d's round robin resumes
``_busy[i]``                ``_done_lock``        the pending ops placed on stream i
``_counts``                 ``_lock`` (``seq``),  seq: the last op's number; completed, peak; free,
                            ``_done_lock``        waiting: the in-flight bound's (``_slots``)
``_slots``                  ``_done_lock``        free + the slots held == ``max_inflight``
``_pending``                ``_done_lock``        ops submitted or held, not finished, in order
``_failed``, ``_failures``  ``_done_lock``        ops failed; root errors since synchronize()
``_failed_seen``            both                  ``_failed`` at the last synchronize()
``_counts.calling``         ``_done_lock``        finished ops whose done-callbacks still run;
                                                  0 notifies ``_callbacks_done``
``_host_ops``, ``_held``,   see ``held``          what a device stream cannot wait for by an
``_held_on``, ``_launcher``                       event; the held ops, and what holds them
``_launch_held``            (set once)            the compiled launch of a released op, or None
``_hurry_of[i]``            (set once)            what a wait on stream i's op calls (``Hurry``)
``_finish_ready``,          (set once)            what a submitting thread calls every
``_finish_every``                                 ``_finish_every`` submits to finish ops itself
``_finish_bound``           (set once)            what an op's completion calls (the compiled
                                                  finish where there is one)
``_recordings[t]``          ``_lock``             the graph thread t records into (``record()``)
``_profiler``               ``_lock``             the open ``profile()`` block's, or None
``_closed``, ``_stopped``,  see ``lifecycle``     closing; closed; who closes
``_closer``, ``_finalizer``
``_bytes``, ``_staging``    their own locks       see ``budgets``: bytes in flight; pinned pool
``_rings``                  (setdefault)          the pinned staging rings: one per direction and
                                                  device (``transfers``)
``_stream_maps``            (weak, by function)   stream_map's captured pieces (``streaming``)
``_copy_pinned``            (set once)            the compiled copy of pinned memory, or None
``_parts``                  (set once)            the fields the compiled submit reads in C:
                                                  ``_tracker``, ``_clocks``, ``_profiler``,
                                                  ``_finish_ready``, ``_finish_every``, ``_closed``
==========================  ====================  ==================================================

Where the compiled submit is built, ``submit``, ``submit_nowait``, ``_submit_on`` and ``copy`` are
its methods, set on the instance; ``close()`` takes them off again.
"""

from __future__ import annotations

import concurrent.futures
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..backends import Backend, make_backend, make_backends
from ..backends.cpu import LANE_THREADS
from ..errors import BaseExceptionGroup
from ..native import load as load_native
from ..native import twin
from . import ops, seam, transfers
from .accel import DepsTracker, StreamClocks
from .budgets import ByteBudget, PinnedPool
from .completion import Completion, Hurry, Slots, finished_ok
from .held import Holds
from .lane_waits import LaneWaits
from .layout import lay_out_streams
from .lifecycle import Lifecycle, stop_dropped
from .ops import Future, Op
from .submitting import SubmitPath

if TYPE_CHECKING:
    from .profiling import Profiler
    from .recorded import RecordedGraph

T = TypeVar("T")

__all__ = ["Runtime", "RuntimeStatistics"]

#: A thread that submits finishes completed ops itself every this many submits (where the
#: backend allows it): cheaper than handing the GIL to a completion thread mid-burst. Fewer ops
#: then stay pending, so fewer objects live long enough for the cycle collector to promote them,
#: which brings its full passes (32 against 64 halved the collector's time in the tiny wide graph
#: submitted op by op; 16 gained no more).
FINISH_EVERY = 32
#: worker lanes on the host beside a device, for the ops submitted with ``run_on="host"``
HOST_LANES = 2

def _no_function() -> None:
    """What ``submit`` gets where no function is given: it raises the error that says so (Python's
    own names the parameter only)."""


_NO_FUNCTION: Callable[..., Any] = _no_function

#: Whether runtimes made from now on submit and finish ops through the compiled code (where it
#: built; see ``streamdag.native``). False: the Python methods of :class:`Runtime` (for tests and
#: benchmarks that compare the two).
COMPILED_SUBMIT = True

_speedups = load_native() if twin("setup_submit", None) is not None else None  # the compiled submit


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


class Runtime(SubmitPath, Holds, Completion, Lifecycle):
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
        layout = lay_out_streams(members, host_lanes)
        self._streams, self._member, self._stream_device = layout.streams, layout.member, layout.device_of
        self._compute_of, self._copy_index, self._host = layout.compute_of, layout.copy_index, layout.host
        self._make_state(max_inflight)
        self._bytes = ByteBudget(max_inflight_bytes, on_wait=self._hurry_all)
        self._staging = PinnedPool(staging_bytes, on_wait=self._hurry_all)
        self._rings: dict[Any, Any] = {}
        self._stream_maps: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
        self._spaces = {"cpu"} if self.device in ("cpu", "sim") else {"cpu", *self.devices}
        #: ``copy``'s compiled case alone (pinned host memory and a device): None back where
        #: transfers.copy decides; None here where nothing is compiled (the tests' view of it)
        self._copy_pinned: Callable[[Any, Any, str | None], Future | None] | None = None
        if _speedups is not None and COMPILED_SUBMIT and not self._multi:
            seam.use_compiled_submit(self, _speedups)
        #: a runtime dropped without close() stops its threads (they hold no reference to it)
        self._finalizer = weakref.finalize(self, stop_dropped, self.backends, self._host, self._launcher)
        self._finalizer.atexit = False  # at exit the threads (daemons) end with the process

    def _make_state(self, max_inflight: int) -> None:
        """The locks, the holds, the counters and the per-stream state (see the module's table)."""
        self._make_holds()
        self._lane_threads = LANE_THREADS
        #: waits inside lane ops for lane ops they submitted (see ``LaneWaits``): streams that are
        #: lanes (threads that run their ops in order) have ``runs_here``
        self._lane_waits = LaneWaits([s for s in self._streams if getattr(s, "runs_here", None) is not None])
        n = len(self._streams)
        self._lock = ops.new_rlock()
        self._done_lock = ops.new_lock()
        # a wait inside a lane op refuses too where what it waits for depends on ops behind the caller
        self._lane_waits.consult(self._lock, weakref.WeakMethod(self._held_up_by_caller))
        #: notified when the last running done-callbacks have returned (``_counts.calling`` is 0)
        self._callbacks_done = threading.Condition(self._done_lock)
        self._counts = ops.new_counters()
        self._parts = ops.new_parts()  # (the properties above: set before any of them)
        #: the in-flight bound; its count shares ``_done_lock``, so finishing an op takes one lock
        self._slots = Slots(max_inflight, self._done_lock, self._counts)
        #: per stream: asks its backend to finish completed ops now, for one who waits (or None)
        hurries = {id(m): Hurry(self, m) for m in self.backends if hasattr(m, "hurry")}
        self._hurry_of = [hurries.get(id(m)) for m in self._member]
        #: backends whose completed ops the submitting thread finishes every ``FINISH_EVERY`` submits
        self._finish_ready = [f for m in self.backends if (f := getattr(m, "finish_ready", None))]
        self._finish_every = FINISH_EVERY
        self._finish_bound = self._finish  # made once: a pending op's callback holds one object less
        self._tracker = DepsTracker(retired=finished_ok)
        self._clocks = StreamClocks(n)
        self._busy = [0] * n
        self._next_stream = {d: 0 for d in self._compute_of}
        self._pending: dict[int, Op] = {}
        self._failures: list[BaseException] = []
        self._failed = 0
        self._failed_seen = 0  # ``_failed`` at the last synchronize
        self._closed = False
        self._stopped = False
        self._close_lock = threading.Lock()  # one close drains and stops at a time
        self._closer: threading.Thread | None = None  # a close begun where waiting could hang
        self._recordings: dict[int, Any] = {}
        self._can_be_lost = hasattr(self.backend, "lost")
        self._profiler: Any = None

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

        self._check_open()
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


def _check_count(name: str, value: Any, minimum: int, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}" + (f" ({hint})" if hint else ""))


if _speedups is not None:
    seam.setup_submit(_speedups, Op, Future)
