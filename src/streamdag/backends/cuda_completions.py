"""The CUDA backend's completion thread: it observes each stream's events in order and finishes
their ops (see ``_Completions`` for the state it owns and the lock that guards its passes)."""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import torch

from .._diagnostics import warn
from ..native import load_torch, twin
from . import capture_mode
from .cuda_calls import _sanitizer_enabled
from .cuda_streams import CudaEvent
from .threads import callbacks_later, new_counters, report_escaped

if TYPE_CHECKING:
    from .cuda import CudaBackend

#: the completion pass's loop over entries known to have completed, compiled (``native/_submit.c``)
_compiled_pass = twin("completions_pass", None)
#: ``_Completions._finish_one`` with a relaxed query, compiled (``native/_submit.c``)
_compiled_finish_one = twin("completions_finish_one", None)
_uses_torch = twin("uses_torch", None)


def _compiled_queries_relaxed() -> bool:
    """Whether the completion pass runs compiled, querying through the torch extension, which
    queries in relaxed capture mode itself (see ``_Completions._queries_relaxed``)."""
    compiled = _compiled_pass is not None and _uses_torch is not None
    return compiled and _uses_torch() and not _sanitizer_enabled()


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
    anyway, later than a poll sees the event (a ``result()`` after a
    captured replay of the medium wide graph returns 0.06 ms after the
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
    (a ``result()`` after a tiny op takes 47-52 µs that way,
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
        #: ``seq``: the last entry's token (see ``put``); ``woken``: ``_wake`` is set and the thread
        #: has not yet cleared it. C fields the compiled submit reads and writes
        #: (``native/_submit.c``: ``completions_put``)
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
        if not counts.woken:  # setting the event takes a Python-level condition: only when needed
            counts.woken = True
            self._wake.set()
        return token

    def put_parts(self) -> tuple[list[deque[Any]], Any, threading.Event]:
        """What :meth:`put` touches: the queues, the counts (``seq``, ``woken``) and the wake-up
        event, for the compiled submit's put (``native/_submit.c``: ``completions_put``), which
        does as ``put`` does."""
        return self._queues, self._counts, self._wake

    def _finish_one(self, token: int, relaxed: bool = False) -> bool | None:
        """Finish one queued entry ahead of the ones before it, if its event has completed.

        For someone waiting on that op: finishing the whole queue first would
        make them wait for every earlier op's bookkeeping too (after 64 tiny
        ops, a ``result()`` takes 2.6x PyTorch's synchronize that way). The
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
            return _compiled_pass(self._settle, self._queues, owner, owner._free_events, CudaEvent)
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
                # loop right after a synchronize() loses ~2 µs per op that way
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
            # cleared before ``woken``: a put in between skips the set, and the drain above sees it
            self._wake.clear()
            self._counts.woken = False

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
                        _compiled_pass(self._settle, self._queues, owner, owner._free_events, CudaEvent)
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
