"""The submit path: from ``submit``'s arguments to an op placed on a stream and handed to its backend.

The Python reference of what ``native/_submit.c`` compiles; the compiled submit
calls back into :class:`SubmitPath` (``_submit``, ``_take_slot``, ``_launch_placed``,
``_finish_launch``, ``_fail_lost``, ``_would_block``, ``_caller_fence``), handed to it
bound in ``seam.SubmitterParts``, for every case it leaves to Python.

State it changes (``_pending``, ``_counts`` and the slot count are
:class:`~.completion.Completion`'s; ``_host_ops`` is :class:`~.held.Holds`'):

=====================  ======================  ===============================================
state                  guarded by              invariant
=====================  ======================  ===============================================
``_tracker``           ``_lock``               links every op submitted, not yet forgotten
``_clocks``            ``_lock``               ``tail(s)`` is the stamp of stream s's last op
``_next_stream[d]``    ``_lock``               where the round robin over d's streams resumes
``_busy[s]``           ``_done_lock``          the pending ops placed on stream s
``_counts.seq``        ``_lock``               the number of the last op submitted
``_counts.peak``       ``_done_lock``          the most ops ever pending at once
=====================  ======================  ===============================================

Every op admitted here holds one slot of the in-flight bound until it finishes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Collection, Sequence
from functools import partial
from typing import Any

from ..errors import InvalidBuffer, WouldBlock
from ..graph.buffers import OBJECTS, Access
from .arguments import collect_accesses, hold_identities
from .frames import release_frames
from .ops import Future, Op, event_of, in_done_callback, wait_for_host_inputs

__all__ = ["SubmitPath"]

#: Test-only: drop every cross-stream event wait, to show that the race checks can fail.
_DROP_WAITS = os.environ.get("STREAMDAG_TEST_DROP_WAITS") == "1"


class SubmitPath:
    """The runtime's submit path (a part of :class:`~.core.Runtime`): check, link, place, launch.

    ``_submit`` checks and collects; ``_enqueue`` takes a slot (``_take_slot``) and ``_lock``
    (``_wait_for_the_lock``), then numbers (``_new_op``), links and launches or holds the op.
    The steps from ``_admit`` on run with both held (see each one's docstring)."""

    __slots__ = ()

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
            kind, asked = str(device).split(":")[0], str(run_on)
            if kind == "cuda" and run_on == "cpu":
                several = "run_on='host' runs a function on the host beside the GPU"
            elif kind in ("cuda", "sim") and asked.startswith(f"{kind}:"):
                several = f"for several devices, create the runtime with devices=[{device!r}, {run_on!r}]"
            else:
                several = ("for a GPU, create a runtime with device='cuda' (several: "
                           "devices=['cuda:0', 'cuda:1'])")
            raise ValueError(f"run_on={run_on!r}, but this runtime runs on {device} only: run_on takes "
                             f"None, 'host' or {device!r} here; {several}")
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
            op = self._new_op(op_name, fn, args, kwargs, accesses, numbered=not name)
            seq = op.seq
            op.keep = written
            deps = self._tracker.link(op, accesses)
            host_inputs = on_host and device != "host" and not (device_ordered or self.backend.deferred)
            if device == "host":
                self._add_host_op(op)
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

    def _new_op(self, name: str, fn: Callable[..., Any] | None, args: tuple[Any, ...], kwargs: dict[str, Any],
                accesses: list[Access], numbered: bool = False) -> Op:
        """An op numbered after every op submitted so far, not linked yet (caller holds ``_lock``:
        numbers follow submission order, which the tracker's links follow too). For the submit
        and for the runs of recorded graphs."""
        self._counts.seq += 1
        return Op(self._counts.seq, name, fn, args, kwargs, accesses, numbered=numbered)

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
        if not self._lock.is_owned():
            return self._slots.acquire(check=self._check_open)  # (close() wakes it to refuse)
        # a graph's run launches its ops under the lock: let go of it while waiting, since the
        # threads that free slots run done-callbacks, and a callback that submits needs the lock.
        # (Condition does the same with threading.RLock's.) Other submits may come in between
        # the graph's ops meanwhile; dependencies follow submission order either way.
        state = self._lock.release_all()
        try:
            return self._slots.acquire()
        finally:
            self._lock.reacquire(state)

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

    def _lane_instead(self) -> tuple[int, int]:
        """For a graph's run from inside an op on a lane (a CPU runtime's, a host lane): that lane,
        and the lane that the run's ops scheduled onto it go to instead; else ``(-1, -1)``.

        Queued on the calling op's lane, behind it, they would run only once it has returned: it
        could not wait for the run. So they go to the next lane of its kind, as a nested submit
        does (see :meth:`_choose_stream`); with ops of their own there, in the order they are
        launched, which keeps every dependency. Where the lane is the only one of its kind, they
        stay on it (and waiting for the run there raises, see ``Future._waited_on``).
        """
        if threading.get_ident() not in self._lane_threads:
            return -1, -1
        for lanes in self._compute_of.values():
            here = self._calling_lane(lanes.start, len(lanes))
            if here != -1:
                return here, lanes[(here - lanes.start + 1) % len(lanes)]
        return -1, -1

    def _free_lane(self, stream: int, here: int, instead: int) -> int:
        """Where an op of a run from inside the op on lane ``here`` goes, scheduled onto ``stream``:
        not behind the calling op (``instead``, see ``_lane_instead``), nor behind ops that cannot run
        before it returns (:meth:`_behind_the_caller`), where a lane of the kind is free of both;
        else where it was sent, and waiting for the run there raises (see ``Future._waited_on``)."""
        wanted = instead if stream == here else stream
        _, blocked = self._behind_the_caller()
        if wanted not in blocked:
            return wanted
        lanes = next((s for s in self._compute_of.values() if wanted in s), range(wanted, wanted + 1))
        return next((i for i in lanes if i != here and i not in blocked), wanted)

    def _mark_run_from_a_lane(self, result: Future, futures: list[Any], behind: bool) -> None:
        """What a wait for a run's ``result`` inside the op that started it checks, as for an op that
        a lane op submits (see ``Future._waited_on``, ``LaneWaits``): ``behind``, some of the run's
        ``futures`` are queued behind the calling op on its lane; and, from a lane of this runtime,
        that a wait for the run is a wait for ``futures``, which raises where it could never end (the
        run's settling drops them again: they keep its done-callback, which keeps ``result``)."""
        me = threading.get_ident()
        if behind:
            result.__dict__["_behind"] = me
        if me in self._lane_threads:
            result.__dict__.update(_lanes_of=self._lane_waits, _ops_of=futures)

    def _host_lane_for(self, pending: int | None) -> int:
        """A host lane for an op that goes after the op pending on lane ``pending`` (None: none):
        that lane, unless the calling thread runs it; else the least busy lane, never the calling
        thread's own (an op queued behind the op that submits it would wait forever if that op
        waits for it)."""
        lanes = self._compute_of["host"]
        here = self._calling_lane(lanes.start, len(lanes))
        if pending is not None and pending != here:
            return pending
        busy = self._busy  # (read without the lock: a hint)
        return min((i for i in lanes if i != here), key=busy.__getitem__, default=lanes.start)

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


def _is_sticky(backend: Any, error: BaseException) -> bool:
    check = getattr(type(backend), "is_sticky", None)
    return bool(check and check(error))

