"""CUDA backend through PyTorch: streams, events, copy streams, completion watchers.

``launch`` runs the op's host code at once with its stream current, so every
kernel it enqueues lands on that stream; nothing on this path synchronizes
the host. Completion is observed by one thread that polls each stream's
events in order (events of one stream complete in order, so a FIFO per
stream is exact), polling less often the longer nothing completes.

A sticky CUDA error (illegal address, device-side assert, launch failure)
makes every later call on the device fail; the backend then marks itself
lost and the runtime fails every pending and later op with
:class:`~streamdag.DeviceLost`.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from operator import itemgetter
from typing import Any, ClassVar

import torch

from .._diagnostics import warn
from ..errors import DeviceLost, SubmittedInCapture
from ..native import load as load_native
from ..native import load_torch
from . import capture_mode
from .threads import callbacks_later, new_counters, report_escaped, run_named, torch_profiler_on

__all__ = ["CudaBackend", "CudaEvent", "is_sticky"]

_STICKY = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "illegal instruction",
    "misaligned address",
    "an illegal",
    "launch timed out",
    "hardware stack error",
)


def _cuda_words(exc: BaseException) -> str:
    """The error itself, in lower case: the first line of its message. PyTorch appends the same
    advice to every CUDA error ("... to enable device-side assertions"), which must not count."""
    return str(exc).split("\n", 1)[0].lower()


def is_sticky(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA error after which the context is unusable."""
    text = _cuda_words(exc)
    return not isinstance(exc, torch.cuda.OutOfMemoryError) and any(s in text for s in _STICKY)


#: CUDA's words for a call refused because a CUDA graph is being captured
#: (cudaErrorStreamCaptureUnsupported): gone when the capture ends, unlike the other capture errors
_CAPTURE_REFUSALS = ("operation not permitted when stream is capturing",)


def _refuse_in_capture(device_index: int, current: int | None = None) -> None:
    """Raise if the caller's current stream on ``device_index`` is being captured into a CUDA graph:
    waiting on an event recorded there would pull the runtime's stream into that capture.
    ``current``: the current device, where the caller knows it."""
    current = _get_device() if current is None else current
    if current == device_index:
        capturing = _is_capturing()
    else:  # PyTorch asks about the current device's current stream
        _set_device(device_index)
        try:
            capturing = _is_capturing()
        finally:
            _set_device(current)
    if capturing:
        raise SubmittedInCapture()


def refused_during_capture(exc: BaseException) -> bool:
    """Whether ``exc`` is CUDA refusing a call while a CUDA graph is captured: not a fault of the
    device, and gone once the capture ends. PyTorch captures in CUDA's global mode by default,
    in which an event query is refused from any thread in global mode (the runtime queries in
    relaxed mode: see ``capture_mode``)."""
    text = _cuda_words(exc)
    return any(s in text for s in _CAPTURE_REFUSALS)


# PyTorch's own C entry points for the calls made per op: its Python wrappers around them
# (device lookups, Stream objects built per call) cost more than the calls themselves
_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream = getattr(torch._C, "_cuda_setStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_set_device = getattr(torch._C, "_cuda_setDevice", None)
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_event_base = getattr(torch._C, "_CudaEventBase", None)  # a CPU-only build has it, without methods
_record = getattr(_event_base, "record", None)
_wait = getattr(_event_base, "wait", None)
#: the completion pass's loop over entries known to have completed, compiled (``native/_submit.c``)
_compiled_pass = getattr(load_native(), "completions_pass", None)
#: ``_Completions._finish_one`` with a relaxed query, compiled (``native/_submit.c``)
_compiled_finish_one = getattr(load_native(), "completions_finish_one", None)
#: tells the compiled submit and pass that a device was lost: until then they take a
#: ``CudaBackend``'s ``lost`` to be None without looking it up (see ``CudaBackend.lost``)
_note_loss = getattr(load_native(), "note_loss", None)
_uses_torch = getattr(load_native(), "uses_torch", None)


def _compiled_queries_relaxed() -> bool:
    """Whether the completion pass runs compiled, querying through the torch extension, which
    queries in relaxed capture mode itself (see ``_Completions._queries_relaxed``)."""
    compiled = _compiled_pass is not None and _uses_torch is not None
    return compiled and _uses_torch() and not _sanitizer_enabled()


def copy_on(stream: CudaStream, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)`` with ``stream`` current (and its device), the caller's
    stream and device restored after, through PyTorch's C entry points: ``with
    torch.cuda.stream(stream)`` took 30-45 µs per call on the H100, which a staged copy pays for
    every chunk (``transfers.StagingRing``)."""
    device = _get_device()
    prev = _get_stream(stream.device_index)
    _set_stream(*stream.ids)  # (PyTorch makes the stream's device current too)
    try:
        dst.copy_(src, non_blocking=True)
    finally:
        _set_stream(*prev)
        if device != stream.device_index:
            _set_device(device)


class CudaStream(torch.cuda.Stream):
    """One of the runtime's streams on the current device, which knows its place among them
    (``index``, ``kind``). A PyTorch stream itself, so that events record on it and wait for it in
    C, with no Python call in between: that runs for every op.

    ``address``: a CUDA stream of the runtime's own (see :class:`_OwnStreams`), wrapped as PyTorch
    wraps an external one; None: one from PyTorch's pool. ``blocking``: that stream is a CUDA
    blocking stream, which CUDA orders after the legacy default stream's work.
    """

    def __new__(cls, index: int, kind: str, address: int | None = None, blocking: bool = False) -> CudaStream:
        self = super().__new__(cls) if address is None else super().__new__(cls, stream_ptr=address)
        self.index: int = index
        self.kind: str = kind
        self.blocking: bool = blocking and address is not None
        self.ids: tuple[int, int, int] = (self.stream_id, self.device_index, self.device_type)
        return self


class _OwnStreams:
    """CUDA streams made for runtimes alone, reused from one closed runtime to the next.

    PyTorch hands out its streams from a pool of 32 per device, round robin: every
    ``torch.cuda.Stream()`` (a second runtime's, a CUDA graph capture's side streams, the user's
    own) may be one of a runtime's twelve. Their work then runs in one queue, in turn, and a
    CUDA call onto a stream from a thread other than the one capturing on it ends that capture
    in an error. Made by the torch extension (``new_stream``); without it, PyTorch's pool.
    """

    #: re-entrant: a gone graph runner gives its streams back from a finalizer, which the
    #: collector may run in a thread that is in ``take``
    _lock = threading.RLock()
    _free: ClassVar[dict[tuple[int, bool], list[int]]] = {}  # per device, non-blocking or blocking

    @classmethod
    def take(cls, device: int, n: int, blocking: bool = False) -> list[int] | None:
        """``n`` stream addresses on ``device``, free ones first; None without the torch extension.

        ``blocking``: streams that CUDA orders after the legacy default stream's work (and that
        stream's later work after theirs): the streams a runtime launches ops onto, which then need
        no event to follow a caller on the default stream. Never for a capture: any use of the
        default stream during it would end it in an error.
        """
        ext = load_torch()
        make = getattr(ext, "new_stream", None)
        if make is None:
            return None
        with cls._lock:
            free = cls._free.setdefault((device, blocking), [])
            taken = [free.pop() for _ in range(min(n, len(free)))]
        return taken + [make(device, blocking) for _ in range(n - len(taken))]

    @classmethod
    def give_back(cls, device: int, addresses: list[int], blocking: bool = False) -> None:
        """For the next runtime: the work queued on them stays ordered before its own."""
        with cls._lock:
            cls._free.setdefault((device, blocking), []).extend(addresses)


class CudaEvent(_event_base if _event_base is not None else object):  # type: ignore[misc]
    """A PyTorch CUDA event. ``record``, ``wait``, ``query`` and ``synchronize`` are PyTorch's own,
    in C: an op's event is recorded for every op.

    Not a blocking-sync event (whose host wait sleeps until an interrupt): on the H100, recording
    one after each launch added 1.20 µs per launch, a plain one 0.23 (``bench/cuda_calls.py``). So
    a host wait on it (``synchronize``) spins or yields as CUDA's scheduling flags say, and the
    completion thread polls (see ``_Completions``) rather than sleeping in it.
    """

    def __new__(cls, timing: bool = False, device: torch.device | None = None) -> CudaEvent:
        if timing and cls is CudaEvent:  # so that an event of this exact type never times (see below)
            cls = _TimingCudaEvent
        self = super().__new__(cls, enable_timing=timing, blocking=False)  # type: ignore[call-arg]
        self.timing, self.home = timing, device  # (PyTorch's ``device`` is where it was recorded)
        return self

    def caller_waits(self) -> None:
        """Make the caller's current stream on this event's device wait for it; the host goes on."""
        _wait(self, torch.cuda.current_stream(self.home))

    def elapsed_ms(self, end: CudaEvent) -> float:
        return self.elapsed_time(end)  # type: ignore[attr-defined]


class _TimingCudaEvent(CudaEvent):
    """A CUDA event that times (``CudaEvent(timing=True)``): never back in the event pool. Its own
    type, so the compiled completion pass tells a pool event by its type, without an attribute
    look-up per op (``native/_submit.c``: ``finish_head``)."""


def _ordered_by_cuda(caller: tuple[int, int, int], stream: CudaStream) -> bool:
    """Whether CUDA itself orders work on ``stream`` after the caller's earlier work: the caller's
    stream (its ids) is the legacy default stream (id 0) and ``stream`` is blocking. Not under a
    stream sanitizer, which models events only. (The same rule in C++: ``ordered_by_cuda``.)"""
    return caller[0] == 0 and stream.blocking and not _sanitizer_enabled()


def _sanitizer_enabled() -> bool:
    """Whether PyTorch's CUDA stream sanitizer is on (it must see the host observe each event)."""
    sanitizer = getattr(torch.cuda, "_sanitizer", None)
    return bool(sanitizer is not None and sanitizer.cuda_sanitizer.enabled)


class _Completions:
    """One thread observes the completion events of every stream, in order per stream.

    It finishes every op whose event has completed in one pass, then pauses
    up to ``BATCH_SECONDS`` before the next pass, so that it takes the GIL
    from the submitting thread once per batch rather than once per op: each
    time it does, the submitter stalls on a thread switch. Someone waiting
    (a future's ``result()``, ``synchronize()``, a full in-flight bound) cuts
    the pause short through :meth:`hurry`. With nothing completed it polls:
    every ``POLL_SECONDS`` for a while after someone waited, else at an
    interval that grows while nothing completes (see :func:`_idle_poll`; GIL
    released in between). Its events are no blocking-sync events (see
    ``CudaEvent``), and a blocking wait would wake through an interrupt
    anyway, later than a poll sees the event (on the H100, a ``result()``
    after a captured replay of the medium wide graph came 0.06 ms after the
    replay with polling, 0.37 ms sleeping in a blocking event).
    Events go back to the backend's pool once their op has been finished.

    A thread that submits finishes completed ops between its submits
    (:meth:`try_pass`); while it does, this thread holds off its own passes
    for ``BACKOFF_SECONDS``, unless someone waits or has waited within
    ``POLL_AFTER_WAIT_SECONDS`` (a waiter that gives up helping sleeps on its
    future, and only this thread is left to finish it).

    A thread that waits on a future also finishes completed ops itself for a
    while (:meth:`help`), waiting on its op's event: handing the finish over
    from this thread would cost the waiter a sleep's overshoot and a wake-up
    (on the H100 a ``result()`` after a tiny op took 47-52 µs that way,
    ``torch.cuda.synchronize()`` 17-34 µs). Passes never overlap: one lock
    guards them. Done-callbacks run after the pass has let go of that lock
    (see ``callbacks_later``): a callback that blocks must not keep a
    waiter from finishing its own op.
    """

    BATCH_SECONDS = 1e-3
    #: no pass of this thread's own within this long of another thread's (unless someone waits)
    BACKOFF_SECONDS = 20e-3
    #: after someone waited, poll this often instead of blocking, for this long
    POLL_SECONDS = 20e-6
    POLL_AFTER_WAIT_SECONDS = 20e-3
    #: how long a waiting thread polls and finishes ops itself before it sleeps on its future
    HELP_SECONDS = 2e-3
    #: the same, where it waits for its op's event in ``spin_wait`` (the GIL released), in slices
    #: of SPIN_SLICE_SECONDS; a longer wait sleeps, and is seen done up to ~0.1 ms late (0.2% of it)
    SPIN_SECONDS = 50e-3
    SPIN_SLICE_SECONDS = 2e-3
    #: at most this many ops waited on without helping are finished ahead of their queues
    WANTED_MAX = 8

    def __init__(self, owner: CudaBackend, streams: int) -> None:
        self._owner = owner
        ext = load_torch()
        #: the torch extension's ``spin_wait`` (see ``help``), or None
        self._spin_wait = getattr(ext, "spin_wait", None)
        #: the torch extension's ``query_relaxed`` (see ``_finish_one``), or None
        self._query_relaxed = getattr(ext, "query_relaxed", None)
        self._queues: list[deque[tuple[int, CudaEvent, Callable[..., None]]]] = [
            deque() for _ in range(streams)
        ]
        #: ``seq``: the last entry's token (see ``put``), a C field the compiled submit reads and
        #: writes (``native/_submit.c``: ``completions_put``)
        self._counts = new_counters()
        self._wake = threading.Event()
        self._hurry = threading.Event()
        self._hurried_at = -1.0
        self._passed_at = -1.0  # when a submitting thread last began a pass (see ``try_pass``)
        self._stopping = False
        self._passing = threading.Lock()  # one pass over the queues at a time
        self._wanted: list[int] = []  # tokens of entries someone waits on (see ``want``)
        self._thread = threading.Thread(target=self._loop, name="streamdag-completions", daemon=True)
        self._thread.start()

    def put(self, stream: int, event: CudaEvent, callback: Callable[..., None]) -> int:
        """Queue ``callback`` for when ``event`` completes; returns the entry's token (see ``want``).

        The token is the entry's number times the number of queues, plus its
        queue: one int that numbers the entry, names its queue and counts the
        entries (``_counts.seq``). The runtime calls it under its lock, so a
        queue's entries are in the order of their tokens (``_position``
        bisects on that). One int: a token that held the entry (and so the
        callback, the op, its future) would make a cycle through the future
        that holds it, freed only by the cycle collector; and an int is no
        object for that collector to count at all.
        """
        n = len(self._queues)
        counts = self._counts
        token = counts.seq = (counts.seq // n + 1) * n + stream
        self._queues[stream].append((token, event, callback))
        if not self._wake.is_set():  # setting it takes a Python-level condition: only when needed
            self._wake.set()
        return token

    def _finish_one(self, token: int, relaxed: bool = False) -> bool | None:
        """Finish one queued entry ahead of the ones before it, if its event has completed.

        For someone waiting on that op: finishing the whole queue first would
        make them wait for every earlier op's bookkeeping too (after 64 tiny
        ops, a ``result()`` took 2.6x PyTorch's synchronize that way). The
        others stay queued, in order. Caller holds ``_passing``. Returns True
        if it finished the entry now, False if the entry stays queued, None
        if it had left the queue already (finished). ``relaxed``: query through
        the torch extension's ``query_relaxed`` (not under the stream sanitizer,
        which must see PyTorch's own query), else the caller made its thread
        relaxed (``_queries_relaxed``).
        """
        q = self._queues[token % len(self._queues)]
        owner = self._owner
        if relaxed and _compiled_finish_one is not None and _uses_torch is not None and _uses_torch():
            # the same, compiled: its query is the extension's, relaxed (a waiter's result() called
            # ~25 Python functions once its event was seen, 7 of them here)
            return _compiled_finish_one(self, q, token, owner, owner._free_events, CudaEvent)
        index = _position(q, token)  # only passes remove entries: it stays put while we hold the lock
        if index < 0:
            return None  # finished already
        if owner.lost is not None:  # the next pass fails everything, in order
            return False
        _, event, callback = q[index]
        try:
            if not (self._query_relaxed(event) if relaxed else event.query()):
                return False
            if not relaxed and _sanitizer_enabled():
                event.synchronize()
        except Exception as exc:  # a sticky error surfaces here (or a refusal during a capture)
            owner.mark_lost(exc)
            return False
        del q[index]  # appends meanwhile go to the other end
        self._settle(event, callback, None)
        return True

    def _settle(self, event: CudaEvent, callback: Callable[..., None], error: Any) -> None:
        """Finish a dequeued entry; its event goes back to the pool (unless the device was lost)."""
        callback(error)
        if error is None:
            self._owner.recycle(event)

    def _try_finish_one(self, token: int, relaxed: bool | None = None) -> bool | None:
        """:meth:`_finish_one` unless a pass is under way (then False); never waits. ``relaxed``:
        whether to query through the extension (None: where it is loaded, but under the sanitizer)."""
        if not self._passing.acquire(blocking=False):
            return False
        try:  # callers run it inside ``callbacks_later``: callbacks after the lock is let go
            if relaxed is None:
                relaxed = self._query_relaxed is not None and not _sanitizer_enabled()
            if relaxed:
                return self._finish_one(token, relaxed=True)
            with self._queries_relaxed():
                return self._finish_one(token)
        finally:
            self._passing.release()

    def _queries_relaxed(self, compiled_relaxed: bool = False) -> AbstractContextManager[Any]:
        """The calling thread in relaxed capture mode while it queries events, so that a CUDA graph
        capture in global mode (PyTorch's default) in another thread is neither refused nor ended
        by the queries (see ``capture_mode``). Our own thread is relaxed for good (``_loop``);
        ``compiled_relaxed``: the queries go through the torch extension, which relaxes each."""
        return nullcontext() if compiled_relaxed else capture_mode.relaxed()

    def want(self, token: int) -> None:
        """Someone waits on this entry without helping (``concurrent.futures.wait``, ``await``):
        if its event has completed, finish it here (the caller is about to wait, or an event
        loop adds its callback); else the next pass finishes it first and lets the waiter run.

        Only a few are kept (each pass looks each one up in its queue): with
        more waited on at once (``as_completed`` over many futures), the rest
        are finished in order, as before.
        """
        with callbacks_later():
            if self._try_finish_one(token):  # done already: finished here, now
                return
        if len(self._wanted) < self.WANTED_MAX:
            self._wanted.append(token)
        self.hurry()

    def _finish_wanted(self) -> bool:
        """Finish the wanted entries whose events have completed; keep the others. Holds ``_passing``."""
        with callbacks_later(), self._passing:
            wanted, self._wanted = self._wanted, []
            waiting = [t for t in wanted if self._finish_one(t) is False]
            self._wanted.extend(waiting)
            return len(waiting) < len(wanted)

    def _drain(self) -> bool:
        with callbacks_later(), self._passing:
            return self._pass()

    def _pass(self) -> bool:
        """Finish what has completed; True if anything did. Caller holds ``_passing``.

        A stream runs in order: once its newest queued event has completed, so
        have all before it, and one query covers the whole queue. Compiled
        (``completions_pass`` in ``native/_submit.c``) but under the stream
        sanitizer; this code is its reference.
        """
        owner = self._owner
        sanitized = _sanitizer_enabled()
        if _compiled_pass is not None and not sanitized:
            return _compiled_pass(self, self._queues, owner, owner._free_events, CudaEvent)
        progressed = False
        for q in self._queues:
            known_done = 0  # entries at the head of ``q`` known to have completed
            n = len(q)  # the submitting thread may append meanwhile: those are not covered
            if n and owner.lost is None:
                try:
                    if q[n - 1][1].query():
                        known_done = n
                except Exception as exc:  # a sticky error surfaces here (None: a refusal, see below)
                    owner.mark_lost(exc)
            while q:
                _, event, callback = q[0]
                error = owner.lost
                if error is None and (known_done <= 0 or sanitized):
                    try:
                        if known_done <= 0 and not event.query():
                            break
                        if sanitized:  # returns at once; tells the stream sanitizer that the host saw it
                            event.synchronize()
                    except Exception as exc:  # a sticky error surfaces here
                        error = owner.mark_lost(exc)
                        if error is None:  # refused during a capture: queried again later
                            break
                known_done -= 1
                q.popleft()
                self._settle(event, callback, error)
                progressed = True
        return progressed

    def _loop(self) -> None:
        torch.cuda.set_device(self._owner.torch_device)
        try:
            capture_mode.exchange(capture_mode.RELAXED)  # our own thread: for good
        except RuntimeError as exc:  # a driver error: the queries stay in the default mode
            warn(f"streamdag's completion thread keeps CUDA's global capture mode: {exc}")
        while True:
            try:
                return self._serve()
            except BaseException:  # a done-callback's SystemExit, say: later ops still need finishing
                report_escaped(self._thread.name)

    def _serve(self) -> None:
        idle_poll, idle_since = self.POLL_SECONDS, 0.0
        while True:
            now = time.perf_counter()
            since = now - self._passed_at
            if (since < self.BACKOFF_SECONDS and not self._hurry.is_set()
                    and now - self._hurried_at >= self.POLL_AFTER_WAIT_SECONDS):
                # the submitting thread passes as it goes (see ``CudaBackend.finish_ready``): leave it
                if not self._hurry.wait(self.BACKOFF_SECONDS - since):
                    continue
                self._hurry.clear()
            if self._wanted and self._finish_wanted():
                time.sleep(0)  # hand the GIL to the thread that waited, before finishing the rest
            if self._drain():
                idle_poll, idle_since = self.POLL_SECONDS, 0.0
                # a hurry set before the clear is served by the drain right after it
                self._hurry.wait(self.BATCH_SECONDS)
                self._hurry.clear()
                continue
            pending = any(self._queues)
            if pending and time.perf_counter() - self._hurried_at < self.POLL_AFTER_WAIT_SECONDS:
                # someone waits: poll often. Once a thread submits again after the wait (and so
                # finishes ops as it goes), poll once per batch instead: each poll takes the GIL, and
                # the submitter then waits for it in every PyTorch call (they let go of it); a submit
                # loop right after a synchronize() lost ~2 µs per op that way on the H100
                submitting = self._passed_at > self._hurried_at
                time.sleep(self.BATCH_SECONDS if submitting else self.POLL_SECONDS)
                continue
            if pending:  # nothing completed: poll again, later the longer nothing completes
                idle_since = idle_since or time.perf_counter()
                if self._hurry.wait(idle_poll):
                    self._hurry.clear()  # someone waits (``_hurried_at``): the polls above take over
                    idle_poll, idle_since = self.POLL_SECONDS, 0.0
                else:
                    idle_poll = _idle_poll(idle_poll, time.perf_counter() - idle_since)
                continue
            if self._stopping:
                return
            self._wake.wait()
            self._wake.clear()

    def hurry(self) -> None:
        """Someone waits for a finish: end the pause between passes now, and poll for a while."""
        self._hurried_at = time.perf_counter()
        self._hurry.set()

    def try_pass(self, submitting: bool = False) -> None:
        """Finish what has completed, in the calling thread, unless a pass is under way; never waits.

        ``submitting``: the caller goes on submitting and will pass again
        soon, so this thread may hold off (a waiter's passes stop when its
        future is done, or after ``HELP_SECONDS``: they must not hold it off).
        """
        if self._passing.acquire(blocking=False):
            with callbacks_later():
                if submitting:
                    self._passed_at = time.perf_counter()
                try:
                    if _compiled_queries_relaxed():  # the compiled pass of ``_pass``, called at once:
                        owner = self._owner           # a submitting thread runs this every 32 submits
                        _compiled_pass(self, self._queues, owner, owner._free_events, CudaEvent)
                    else:
                        with self._queries_relaxed():
                            self._pass()
                finally:
                    self._passing.release()

    def help(self, waiter: Any, seconds: float | None, hurry_if_left: bool = False) -> None:
        """Finish completed ops in this thread until ``waiter`` is done, for at most ``seconds``
        (None: as long as helping pays, ``SPIN_SECONDS`` or ``HELP_SECONDS``; 0: one poll).

        A waiter on one op (its future carries the token of its queue entry)
        finishes only that op, as soon as its event has completed, and leaves
        the rest to this class's thread at its own pace. Where the torch
        extension is loaded it waits for that event in ``spin_wait``, with the
        GIL released, up to ``SPIN_SECONDS``: it sees the op end within a
        query, as ``torch.cuda.synchronize()`` would, and leaves the GIL to the
        other threads meanwhile. Else it polls between ``sleep(0)`` calls, up
        to ``HELP_SECONDS``. ``hurry_if_left``: if it stops with ``waiter`` not
        done (out of time, or the device is lost), it hurries this class's
        thread, which finishes it then. Not before: a hurried thread polls,
        taking the GIL every few µs from the waiter, which finishes its own op.
        """
        if threading.current_thread() is self._thread:  # a callback of ours waits: we are busy
            return
        token = getattr(waiter, "_done_token", None)
        spin = self._spin_wait if token is not None and not _sanitizer_enabled() else None
        most = self.SPIN_SECONDS if spin is not None else self.HELP_SECONDS
        started = time.perf_counter()
        deadline = started + (most if seconds is None else min(seconds, most))
        owner = self._owner
        try:
            # the callbacks of what this thread finishes run as it stops helping
            # (spinning, every query here is made in relaxed mode by the extension: see _finish_one)
            relaxed = spin is not None and self._query_relaxed is not None
            with callbacks_later(), self._queries_relaxed(relaxed):
                while not waiter.done():
                    if token is None:
                        self.try_pass()
                    else:
                        self._try_finish_one(token, relaxed)
                    now = time.perf_counter()
                    if waiter.done() or now >= deadline or owner.lost is not None:
                        return  # (lost: a pass fails every pending op, in order)
                    event = self._event_of(token) if spin is not None else None
                    if event is not None:  # in slices: between them, signals (Ctrl-C) are seen
                        try:
                            spin(event, min(deadline - now, self.SPIN_SLICE_SECONDS))
                        except Exception as exc:  # a sticky error: the device is lost
                            owner.mark_lost(exc)
                    else:  # lets other threads run between polls; past the usual help, less often
                        time.sleep(0 if now - started < self.HELP_SECONDS else self.POLL_SECONDS)
        finally:
            if hurry_if_left and not waiter.done():
                self.hurry()

    def _event_of(self, token: int) -> CudaEvent | None:
        """The event of the queued entry ``token``; None if it has left its queue, or a pass is
        under way (which may take it out)."""
        if not self._passing.acquire(blocking=False):
            return None
        try:
            q = self._queues[token % len(self._queues)]
            index = _position(q, token)
            return q[index][1] if index >= 0 else None
        finally:
            self._passing.release()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join()


#: the completion thread's poll interval, with ops pending and none completed: it doubles up to
#: IDLE_POLL_SECONDS, then grows to a 25th of the time nothing has completed, up to LONG_IDLE_POLL_SECONDS
IDLE_POLL_SECONDS = 0.5e-3
LONG_IDLE_POLL_SECONDS = 5e-3


def _idle_poll(interval: float, idle_for: float) -> float:
    """The next poll interval after ``interval`` found nothing completed, ``idle_for`` seconds since
    the last completion: an op that runs long is seen done at most ~4% of its time late, and a GPU
    busy for seconds costs a few hundred wake-ups per second rather than thousands."""
    return min(max(min(2 * interval, IDLE_POLL_SECONDS), idle_for / 25), LONG_IDLE_POLL_SECONDS)


def _position(queue: deque[tuple[int, CudaEvent, Callable[..., None]]], token: int) -> int:
    """Where the entry ``token`` is in ``queue``, or -1 if it has left it (finished)."""
    i = bisect_left(queue, token, key=itemgetter(0))  # entries are queued in the order of their tokens
    return i if i < len(queue) and queue[i][0] == token else -1


class CudaBackend:
    """``streams`` compute streams plus copy streams on one GPU: host-to-device, device-to-host, peer-in."""

    deferred = False

    def __init__(self, device: str, streams: int, default_stream_sync: bool = True) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device={device!r} needs PyTorch with CUDA and a GPU, and torch.cuda.is_available() "
                "is False here: use device='cpu'"
            )
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"{device!r}: this machine has {torch.cuda.device_count()} GPU(s)")
        self.torch_device: torch.device = torch.device("cuda", index)
        self.device: str = f"cuda:{index}"
        self._lost: DeviceLost | None = None
        #: the runtime's own CUDA streams (None: PyTorch's pool), given back at close(). Every one
        #: that ops are launched onto is blocking where ``default_stream_sync`` (see ``Runtime``):
        #: an event recorded on the caller's default stream to order one of them would wait for
        #: every blocking stream's work. ``peer_out`` is not: captures pull it in
        self._blocking = default_stream_sync
        self._own = _OwnStreams.take(index, streams + 3, blocking=default_stream_sync)
        self._own_peer = _OwnStreams.take(index, 3)  # peer_out and the two staging streams
        own = iter(self._own or [])
        side = iter(self._own_peer or [])

        def stream(i: int, kind: str) -> CudaStream:
            return CudaStream(i, kind, next(own, None), blocking=default_stream_sync)

        with torch.cuda.device(self.torch_device):
            self._streams = [stream(i, "compute") for i in range(streams)]
            self._copy = {"h2d": stream(streams, "h2d"), "d2h": stream(streams + 1, "d2h"),
                          "p2p": stream(streams + 2, "p2p")}
            #: where PyTorch runs the DMA of a peer copy out of this device (see :meth:`peer_copy`);
            #: during a capture its fences pull it in, and a capturing blocking stream would make
            #: any use of the default stream an error
            self.peer_out: CudaStream = CudaStream(-1, "peer_out", next(side, None))
            #: where a host lane's staged copy of pageable memory runs its DMAs, one per direction
            #: (see ``transfers.StagingRing``): non-blocking, since the lane's op has waited for the
            #: ops it follows before it copies, and it waits for its own DMAs itself
            self.staging_streams: dict[str, CudaStream] = {
                kind: CudaStream(-2 - i, f"staging_{kind}", next(side, None))
                for i, kind in enumerate(("h2d", "d2h"))}
        self._all = self._streams + list(self._copy.values())
        self._free_events: list[CudaEvent] = []
        self._completions = _Completions(self, len(self._all))
        self._caller_event = torch.cuda.Event()
        self._index = index
        self._callers: dict[tuple[int, int, int], torch.cuda.Stream] = {}  # caller streams seen

    @property
    def streams(self) -> list[CudaStream]:
        return self._streams

    @property
    def copy_streams(self) -> dict[str, CudaStream]:
        return self._copy

    def event(self, timing: bool = False) -> CudaEvent:
        if not timing and self._free_events:
            return self._free_events.pop()
        return CudaEvent(timing, self.torch_device)

    def recycle(self, event: CudaEvent) -> None:
        """Take back an event whose op has finished.

        Safe to reuse: the runtime issues waits on an op's event only while the
        op is unfinished, under the same lock under which events are recorded.
        """
        if not event.timing:
            self._free_events.append(event)

    def launch(self, stream: CudaStream, work: Callable[[], None], after_caller: bool = True) -> None:
        """Run ``work`` with ``stream`` current; first order ``stream`` after the caller's stream.

        ``after_caller=False`` skips that order, for work already ordered (a graph's later ops).
        """
        caller_device = _get_device()
        prev = _get_stream(self._index)
        if after_caller and not _ordered_by_cuda(prev, stream):
            _refuse_in_capture(self._index, caller_device)
            # work the caller enqueued on its own stream (creating inputs, say) comes first;
            # a wait takes the event's state when it is issued, so one event object serves all
            _record(self._caller_event, self._caller_stream(prev))
            _wait(self._caller_event, stream)
        _set_stream(*stream.ids)
        try:
            if torch_profiler_on():  # (the compiled submit launches here while PyTorch profiles)
                run_named(work)
            else:
                work()
        finally:
            _set_stream(*prev)
            if caller_device != self._index:
                _set_device(caller_device)

    def _caller_stream(self, ids: tuple[int, int, int]) -> torch.cuda.Stream:
        """The caller's stream of these ids, made once (an event records on a Stream object)."""
        caller = self._callers.get(ids)
        if caller is None:
            caller = self._callers[ids] = torch.cuda.Stream(stream_id=ids[0], device_index=ids[1],
                                                            device_type=ids[2])
        return caller

    def caller_fence(self) -> CudaEvent | None:
        """An event recorded now on the caller's current stream, for an op that launches later from
        another thread (a held op, see ``Runtime._hold``); None where CUDA orders the op after that
        work anyway: the caller's stream is the legacy default stream, the runtime's are blocking."""
        prev = _get_stream(self._index)
        if _ordered_by_cuda(prev, self._streams[0]):  # (all of the runtime's are made alike)
            return None
        _refuse_in_capture(self._index, _get_device())
        fence = self.event()
        _record(fence, self._caller_stream(prev))
        return fence

    def launch_parts(self) -> tuple[Any, ...]:
        """What :meth:`launch` calls, for the compiled submit (``native/_submit.c``) to make the same
        calls: PyTorch's C entry points, the caller event, the caller streams seen, the event pool, and
        the completion queues (``when_done``)."""
        return (_get_device, _get_stream, _set_stream, _set_device, _record, _wait, self._caller_event,
                self._callers, self._free_events, self._index, self._completions, _refuse_in_capture)

    def peer_copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``dst.copy_(src)`` from this device to another, inside an op on the destination's stream.

        PyTorch runs a cross-device copy on the source device's current stream,
        fenced both ways with the destination's current stream: the source side
        gets :attr:`peer_out`, so the copy never waits behind the caller's work.
        """
        copy_on(self.peer_out, dst, src)
        return dst

    def when_done(self, stream: CudaStream, event: CudaEvent, callback: Callable[..., None]) -> Any:
        """Call ``callback`` once ``event`` has completed; returns a token for :meth:`hurry`'s ``wanted``."""
        return self._completions.put(stream.index, event, callback)

    def finish_ready(self) -> None:
        """Finish the ops whose events have completed, in the calling thread, if no pass is under way.

        The runtime calls it every few submits. A thread that submits in a
        loop then finishes ops between its own launches, and the completion
        thread, seeing recent passes, stays asleep: the GIL does not change
        hands mid-burst. On the H100, 15 rounds in turns with and without it
        (paired medians): -0.7 µs per op for a chain of tiny ops, -4.4 µs with
        the default in-flight bound, -5.6 µs for independent ops, against
        42-54 µs per op. Every 32 submits with a 1 ms hold-off gained nothing.
        """
        self._completions.try_pass(submitting=True)

    def hurry(self, waiter: Any = None, seconds: float | None = None, wanted: Any = None) -> None:
        """Finish completed ops now rather than at the end of the completion thread's pause.

        With ``waiter`` (a future someone waits on), the calling thread also
        finishes them itself until ``waiter`` is done, for up to ``seconds``
        (at most ``SPIN_SECONDS``, see ``_Completions.help``). ``wanted``, a token from
        :meth:`when_done`: someone waits on that op without helping; the
        completion thread finishes it first.
        """
        completions = self._completions
        if wanted is not None:
            completions.want(wanted)
        elif waiter is None:
            completions.hurry()
        if waiter is not None:  # the completion thread is hurried only if the waiter stops helping
            completions.help(waiter, seconds, hurry_if_left=True)

    def help(self, waiter: Any, seconds: float) -> None:
        """Finish completed ops in the calling thread until ``waiter`` is done, for up to ``seconds``
        (0: one poll). For a waiter that only it can get finished (see ``Runtime``)."""
        self._completions.help(waiter, seconds)

    is_sticky: Callable[[BaseException], bool] = staticmethod(is_sticky)

    @property
    def lost(self) -> DeviceLost | None:
        """What every pending and later op on this device fails with once it is lost, else None."""
        return self._lost

    @lost.setter
    def lost(self, error: DeviceLost | None) -> None:
        self._lost = error
        if error is not None and _note_loss is not None:
            _note_loss()

    def mark_lost(self, exc: BaseException) -> DeviceLost | None:
        """The device is lost after ``exc``, a sticky error that an event query raised (or an op):
        returns what every pending and later op fails with. None where ``exc`` is a query refused
        during a CUDA graph capture (:func:`refused_during_capture`): nothing is lost, and the
        completion passes query that event again later."""
        if refused_during_capture(exc):
            return None
        if self.lost is None:
            self.lost = DeviceLost(self.device, exc)
        return self.lost

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def close(self) -> None:
        self._completions.stop()
        if self._own:
            own, self._own = self._own, None
            _OwnStreams.give_back(self._index, own, blocking=self._blocking)
        if self._own_peer:
            own, self._own_peer = self._own_peer, None
            _OwnStreams.give_back(self._index, own)


if load_native() is not None:  # its ``lost`` notes each loss (see the property)
    load_native().note_losses_of(CudaBackend)
