"""Finishing ops: counting them done, settling their futures, the in-flight bound, hurrying.

``_finish`` runs once per op, from a backend's completion thread, a lane, a
waiter that helps, or the submitting thread every ``FINISH_EVERY`` submits:
never with ``_lock`` required, only ``_done_lock`` (the compiled finish in
``native/_submit.c`` does the same, and calls ``_finish`` and ``_settle``, handed
to it in ``seam.SubmitterParts``, for what it leaves to Python).

State it owns, all changed under ``_done_lock`` (``_wait_all`` reads ``_pending`` without it, as a
hint, and looks again under it):

======================  ===========================================================================
state                   invariant
======================  ===========================================================================
``_pending``            the ops admitted or held and not finished, by number, in submission order
``_counts.completed``   ops finished without an error
``_failed``             ops finished with one (dependents included)
``_failures``           the root errors since the last synchronize(), each annotated with its op
``_counts.calling``     finished ops whose done-callbacks have not all run; 0 notifies
                        ``_callbacks_done``
``_counts.free``        ``max_inflight`` - the slots taken (ops pending, and ops being submitted);
                        below 0 only by ``Slots.take_over``
``_counts.waiting``     submitters blocked in ``Slots.acquire``
======================  ===========================================================================

A future is settled after its op has left ``_pending`` and, where someone watches it, been
counted in ``_counts.calling``: synchronize() sees every op pending or calling back until its
done-callbacks have run.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from .ops import Future, Op, deferring_callbacks

if TYPE_CHECKING:
    from .core import Runtime

__all__ = ["Completion", "Hurry", "Slots", "finished_ok"]


class Completion:
    """Finishing ops and settling their futures (a part of :class:`~.core.Runtime`)."""

    __slots__ = ()

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
                self._counts.calling += 1
            self._busy[op.stamp.stream] -= 1  # type: ignore[union-attr]
            slots.release_locked()
            if error is None:
                self._counts.completed += 1
            else:
                self._failed += 1
                # an interrupt in the submitting thread was raised to the caller already; one in a
                # lane of the runtime's own (SystemExit, say) was not
                if op.root_error is error and (isinstance(error, Exception) or self.backend.deferred):
                    annotate(error, op.name)
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
                self._counts.calling += 1
        self._settle(future, value, error)

    def _settle(self, future: Future, value: Any, error: BaseException | None) -> None:
        """Give a finished op's future its outcome when someone waits on it or a callback is set.

        The op is counted in ``_counts.calling`` already (by whoever took it out of ``_pending``): its
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
            self._counts.calling -= 1
            if not self._counts.calling:
                self._callbacks_done.notify_all()

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
        if waiter.done() or not self._lock.is_owned():
            return
        helpers = [h for m in backends if (h := getattr(m, "help", None)) is not None]
        if not helpers:
            return
        deadline = math.inf if seconds is None else started + seconds
        while not waiter.done() and time.perf_counter() < deadline:
            for help_once in helpers:
                help_once(waiter, 0.0)
            time.sleep(0)


class Hurry:
    """What waiting on an op's future calls (``Future._hurry``): its backend's ``hurry``, then,
    in a thread that holds the runtime's lock, the help that only that thread can give."""

    __slots__ = ("backend", "rt")
    rt: Runtime
    backend: Any  #: the op's backend, whichever kind

    def __init__(self, rt: Runtime, backend: Any) -> None:
        self.rt, self.backend = rt, backend

    def __call__(self, waiter: Future[Any] | None = None, seconds: float | None = None,
                 wanted: Any = None) -> None:
        started = time.perf_counter()
        self.backend.hurry(waiter, seconds, wanted)
        if waiter is not None:
            self.rt._help_while_holding_the_lock(waiter, (self.backend,), seconds, started)


class Slots:
    """A counting semaphore for the in-flight bound.

    Uncontended, an acquire takes one plain lock, and a release none of its
    own: it runs under the lock the runtime takes to finish an op anyway
    (``threading.Semaphore`` goes through a Python-level ``Condition`` every
    time, which costs more than the rest of the bookkeeping of a small op).
    Its counts are fields of ``counts`` (the runtime's), which the compiled
    submit and finish read and write in C, with no int object per op.
    """

    __slots__ = ("_freed", "_lock", "counts")
    counts: Any  #: the runtime's counters (``new_counters``: compiled, or their Python twin)

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


def finished_ok(op: Op) -> bool:
    return op.done and op.error is None


def annotate(error: BaseException, op_name: str) -> None:
    note = f"raised by streamdag op {op_name!r}"
    if hasattr(error, "add_note") and note not in getattr(error, "__notes__", ()):
        error.add_note(note)

