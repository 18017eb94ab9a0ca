"""Waiting for the runtime's work, who runs it, and closing.

``_wait_all`` is what synchronize(), profile() and close() wait with. Inside
an op it leaves out the ops that cannot finish before that op returns
(``_ops_behind_the_caller``): the ops behind it on its lane, their
dependents, and the ops of lanes that wait for them (``LaneWaits``).

State it owns:

================  ==================  ==============================================================
state             guarded by          invariant
================  ==================  ==============================================================
``_closed``       (a flag: set once)  True once close() began: only the runtime's own work submits
``_stopped``      ``_lock`` and       True once drained: no op pending, no callback running; every
                  ``_done_lock``      submit is refused from then on
``_closer``       (close's thread)    the thread finishing a close begun inside the runtime's work
``_close_lock``   itself              one close drains and stops at a time
``_finalizer``    (set once)          stops the threads of a runtime dropped without close()
================  ==================  ==============================================================

It reads ``_pending`` and ``_counts.calling`` under ``_done_lock`` (see ``completion``) and the
held ops under ``_lock`` (see ``held``).
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings
from contextlib import ExitStack, suppress
from typing import Any

from ..backends import Backend
from ..backends.cpu import HostLanes
from ..errors import RuntimeClosed
from .held import Launcher
from .ops import Op, in_done_callback

__all__ = ["Lifecycle", "stop_dropped", "stop_threads"]

#: how often a synchronize() inside a lane op looks again for the ops queued behind it (a held op
#: released while it waits may land there)
_BEHIND_RECHECK_S = 0.05


class Lifecycle:
    """Waiting for all, the ops behind a caller inside an op, and closing (a part of
    :class:`~.core.Runtime`)."""

    __slots__ = ()

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
                calling = self._counts.calling
            if newest is None:
                if not calling or inside:
                    return
                with self._callbacks_done:  # a future is done; its done-callbacks (may submit) still run
                    self._callbacks_done.wait_for(lambda: not self._counts.calling)
                continue
            # the newest first: once it is done, so are the ops before it on its stream, and one pass
            # finishes them together; waiting on each in turn cost a waiter's help per op (on the H100,
            # rt.synchronize() after 64 ops that one result() had left took 0.12-0.23 ms)
            newest.future.exception()
            if self._pending:  # (read without the lock: the loop looks again under it)
                for finish_ready in self._finish_ready:
                    finish_ready()

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
                        calling = self._counts.calling
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
                self._callbacks_done.wait_for(lambda: not self._counts.calling)

    def _quiet(self) -> bool:
        """Whether no op can run on the host meanwhile but this thread's (caller holds ``_lock``):
        every unfinished host-lane op and every held op is one that cannot start before the
        calling op returns. Device ops launched before then are the device's to finish."""
        lane = self._lane_here()
        behind = self._ops_behind_the_caller(lane) if lane is not None or self._launching_here() else set()
        return all(seq in behind for seq in self._host_ops) and all(seq in behind for seq in self._held)

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
        if not self._lock.is_owned():
            return []
        with self._done_lock:
            return [op for op in self._pending.values() if op.stamp is not None and op.event is None]

    def _runs_own_work_here(self) -> bool:
        """Whether the calling thread runs this runtime's own work now: an op on one of its lanes,
        an op's function inside its launch (or a graph's run: the lock held), a done-callback.
        There, waiting for the runtime's pending work could wait for the caller itself."""
        return (in_done_callback() or self._lane_here() is not None
                or self._lock.is_owned()
                or self._simulator_here())

    def _simulator_here(self) -> bool:
        """Whether the calling thread is a simulated device's, which runs all its streams."""
        return any(b.runs_here() for b in self.backends if hasattr(b, "runs_here"))

    def _check_open(self) -> None:
        """Raise :class:`RuntimeClosed` once the runtime is closed; while it closes (see
        :meth:`close`), for all but its own work."""
        if self._closed and (self._stopped or not self._runs_own_work_here()):
            raise RuntimeClosed(
                "this streamdag.Runtime is closed; create a new one, or submit inside its `with` block"
            )

    def _close_now(self) -> None:
        """:meth:`close`, in a thread that may wait for the pending work."""
        with self._close_lock:
            if self._stopped:
                return
            self._drain()
            with self._done_lock:  # (dropped, as documented: a later synchronize() raises none of them)
                self._failures = []
            self._finalizer.detach()
            stop_threads(self.backends, self._host, self._launcher)
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
                if drained or not (self._pending or self._counts.calling):
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


def stop_threads(backends: list[Backend], host: HostLanes | None, launcher: Launcher) -> None:
    """Stop a runtime's threads: its launcher's, its backends', its host lanes'."""
    launcher.stop()
    for m in backends:
        m.close()
    if host is not None:
        host.close()


def stop_dropped(backends: list[Backend], host: HostLanes | None, launcher: Launcher) -> None:
    """A runtime collected without close(): stop its threads, and warn, as an unclosed file does.

    They are stopped from a thread of their own: the runtime may be dropped in one of them,
    which cannot join itself, or in whatever thread the collector runs, which must not wait.
    """
    with suppress(RuntimeError):  # (no thread starts at interpreter shutdown: the daemons end with it)
        threading.Thread(target=stop_threads, args=(backends, host, launcher), name="streamdag-close",
                         daemon=True).start()
    warnings.warn("a streamdag.Runtime was dropped without close(); its threads are stopped now. Close it "
                  "when done (rt.close() or a `with` block; a streamdag.compile function's close() closes "
                  "the runtimes it made)", ResourceWarning, stacklevel=2)

