"""Ops held until the host-lane ops they depend on have finished (device ops; host-lane ops
after held ones, until those launch).

A device stream cannot wait for a host lane: a device op after an unfinished
host-lane op (or after a held op) is kept here, and its submit returns at once.
When the last op holding it has finished (or launched), the launcher thread
launches it. Not the host lane itself: the lane would wait for the runtime's
lock, which a thread may hold while it waits for the lane's next op.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..backends.threads import report_escaped
from ..graph.buffers import Access
from .ops import Op, wait_for_host_inputs

__all__ = ["Held", "Holds", "Launcher"]


class Held:
    """A held op waiting for ``waiting`` ops, and how to launch it once they are done."""

    __slots__ = ("deps", "device", "fence", "host_inputs", "op", "stream", "waiting")

    def __init__(self, op: Any, deps: list[Any], stream: int | None, device: str | None,
                 host_inputs: bool, fence: Any, waiting: int) -> None:
        self.op: Any = op
        self.deps: list[Any] = deps
        self.stream: int | None = stream
        self.device: str | None = device
        self.host_inputs: bool = host_inputs
        #: an event marking what its submitter had enqueued on its own stream (or None)
        self.fence: Any = fence
        self.waiting: int = waiting


class Launcher:
    """A thread, started at its first use, that calls ``release(seq)`` for each number it is given:
    the launch of the ops that op ``seq`` held last. ``release`` is a method of the runtime, which
    the thread holds weakly: a runtime dropped without close() is then collected (and stops it)."""

    def __init__(self, release: Callable[[int], None]) -> None:
        self._release: weakref.WeakMethod[Callable[[int], None]] | None = weakref.WeakMethod(release)
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def put(self, seq: int) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="streamdag-launcher", daemon=True)
                    self._thread.start()
        self._queue.put(seq)

    def _loop(self) -> None:
        while True:
            seq = self._queue.get()
            owner = self._release
            release = owner() if owner is not None else None
            if seq is None or release is None:
                return
            try:
                release(seq)
            except BaseException:  # an interrupt a held op's function raised: its op failed with it
                report_escaped("streamdag-launcher")
            release = None  # (idle, the thread must not hold the runtime)

    def stop(self) -> None:
        """Stop the thread once it has launched what it was given; drop the runtime."""
        with self._start_lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        self._release = None


class Holds:
    """Holding ops behind host-lane ops, and releasing them (a part of :class:`~.core.Runtime`).

    State it owns:

    ================  ===============  =============================================================
    state             changed under    invariant
    ================  ===============  =============================================================
    ``_host_ops``     ``_lock``        host-lane ops not finished, and held ops not launched, by
                                       number: what a device stream cannot wait for by an event
                                       (a host-lane op's finish takes its own entry out without
                                       the lock: one dict pop, after the op is done)
    ``_held``         ``_lock``        the held ops by number; each is in ``_pending`` too
    ``_held_on[s]``   ``_held_lock``   the held ops that op s holds; s is unfinished (a host-lane
                                       op) or held, or its finish has queued s to the launcher
    ``Held.waiting``  ``_lock``        how many holders of it have not finished (or launched)
    ``_launcher``     (its queue)      the thread that releases the ops a finished host-lane op
                                       held: not that lane, which must not wait for ``_lock``
    ================  ===============  =============================================================

    ``_held_lock`` orders a hold on a host-lane op with that op's finish, which takes no
    ``_lock``: a hold made after the finish sees the op done and does not hold.
    """

    __slots__ = ()

    def _make_holds(self) -> None:
        """The state of the table above, empty; the launcher thread starts at its first use."""
        #: what a device stream cannot wait for by an event, by number: host-lane ops not finished
        #: yet, and device ops held until those finish (see ``_hold``). A device op that depends on
        #: one is held too; a graph's host replay after them runs op by op instead (see
        #: ``_lock_unless_after_host_ops``). The compiled submit leaves every op that may follow one
        #: of them to :meth:`_hold` (and asks ``_lane_threads`` first whether it runs on a lane).
        self._host_ops: dict[int, Any] = {}
        self._held: dict[int, Held] = {}
        self._held_on: dict[int, list[Held]] = {}
        self._held_lock = threading.Lock()
        self._launcher = Launcher(self._release_held_locking)
        #: a released held op's launch on the runtime's device: compiled, with the compiled submit
        self._launch_held: Callable[..., None] | None = None

    def _add_host_op(self, op: Op) -> None:
        """Count ``op``, a host-lane op linked just now, among ``_host_ops``: a device op that
        follows it is held until it has finished (caller holds ``_lock``)."""
        self._host_ops[op.seq] = op

    def _host_data_written_on_lanes(self, reading: list[Access], name: str) -> bool:
        """Whether ops of ``_host_ops`` write host memory of ``reading`` (then a copy from it must
        run on a host lane after them); else wait until every op that writes it has, so that the
        host data is final (the device ops that write it: on their events). For a copy staged in
        the submitting thread."""
        with self._lock:
            if self._host_ops and self._host_deps(reading, name):
                return True
            wait_for_host_inputs(reading, self._tracker.depends_on(reading))
            return False

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
