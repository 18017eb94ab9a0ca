"""Waits inside lane ops for other lane ops of the same runtime: the one deadlock a runtime can see.

An op running on a lane (a CPU runtime's stream, or a host lane beside a
device) may submit ops and wait for them: fork and join. The submitted op
is queued on a lane and runs there in order. If lane A's op waits for an
op queued on lane B, whose op waits for an op queued on lane A, neither
can ever run, whatever other lanes are free: a lane runs its ops in order,
and the runtime cannot move a queued op elsewhere (ops after the waiting
one may depend on it). So the waits form a graph of lanes, each waiting
lane pointing at the lane of the op it waits for, and the wait that would
close a cycle in it raises instead, with what to do. Its op then fails,
its lane goes on, and the others' waits end.

Only waits without a timeout count (one with a timeout ends by itself), only
waits by this runtime's lane threads, and only for ops that a lane thread
placed on one of its lanes (the futures that :meth:`Runtime._admit` marks
with their lane): a device op finishes without any lane, and an op of
another runtime runs on that runtime's lanes.

``concurrent.futures.wait`` and ``as_completed`` are checked as they install
their waiter on such a future (:class:`WatchedWaiters`): the wait raises
where it could never end (waiting for all, one of the ops is stuck so;
waiting for the first, every pending one is). Such a wait counts in turn as
its lane waiting, for all of its ops or for the first, until its waiter is
taken off again, so a later wait of another lane that closes a cycle
through it raises too. ``await`` is not seen.

Which lanes are stuck is a fixed point rather than a walk along one chain:
supposing the new wait never ends, its lane is stuck; a waiting lane is
stuck once the op it waits for is queued on a stuck lane (waiting for all:
any of its pending ops; for the first: every one, and none done yet).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["LaneWaits", "WatchedWaiters"]


class LaneWaits:
    """The waits of a runtime's lane threads for lane ops, by thread. ``lanes``: the runtime's lane
    streams (each with ``runs_here()``); held here rather than the runtime, which futures must not
    keep alive."""

    def __init__(self, lanes: list[Any]) -> None:
        self._lanes = lanes
        self.lanes: int = len(lanes)
        #: re-entrant: a synchronize inside an op finds what it waits for and counts its wait under
        #: it in one go (see ``locked``)
        self._lock = threading.RLock()
        #: thread ident -> (the futures it waits for, whether it needs all of them, the lane it
        #: runs); None: a wait with a timeout
        self._waits: dict[int, tuple[tuple[Any, ...], bool, Any] | None] = {}
        #: the runtime's lock, taken before ``_lock``, and whether a future needs an op that cannot
        #: run before the waiting op returns (ops queued or depending on it, see ``consult``)
        self._outer_lock: Any = threading.RLock()
        self._held_up: Callable[[], Callable[[Any], bool] | None] = lambda: None
        #: the ids of the lanes whose threads wait for the runtime's lock (a submit inside an op
        #: there, see ``Runtime._wait_for_the_lock``)
        self.lock_waiters: set[int] = set()

    def consult(self, lock: Any, held_up: Callable[[], Callable[[Any], bool] | None]) -> None:
        """Have a wait also ask ``held_up()`` (a weak method of the runtime's: None once it is
        gone) whether the future needs an op that cannot run before the waiting op returns, under
        ``lock`` then this lock: a lane is held up by a queued op waiting for another's event too,
        which the waits between lanes alone do not show. ``lock`` is taken with a short timeout,
        never waited for at length: a launch holding it may itself wait for this lane's op to
        return (a device op run inside its submit); then only the waits between lanes are
        checked."""
        self._outer_lock, self._held_up = lock, held_up

    @contextmanager
    def waiting(self, future: Any, timeout: float | None) -> Iterator[None]:
        """Around a wait for ``future``: raises instead where the waiting thread is a lane of the
        runtime and the wait would close a cycle of lanes waiting for each other's queued ops."""
        mine = self.lane_here()
        if mine is None:  # not a lane of this runtime's
            yield
            return
        me = threading.get_ident()
        outer = timeout is None and self._outer_lock.acquire(timeout=0.1)
        try:
            counted_inside = self._check_and_count(future, timeout, mine, me, outer)
        finally:
            if outer:
                self._outer_lock.release()
        try:
            yield
        finally:
            with self._lock:
                self._restore(me, counted_inside)

    def _check_and_count(self, future: Any, timeout: float | None, mine: Any, me: int, outer: bool) -> Any:
        """:meth:`waiting`'s check, then its wait counted, in one go under the lock (``outer``:
        the runtime's lock is held too, and it is asked what holds the future up); returns the
        wait it is counted inside (a wait inside a done-callback run by a wait), or None."""
        with self._lock:
            if timeout is None and not future.done():
                stuck = self._stuck_lanes(mine)
                held_up = self._held_up() if outer else None
                if self._blocked(future, stuck) or (held_up is not None and held_up(future)):
                    raise RuntimeError(
                        f"waiting inside an op for op {future.op_name!r} would wait forever: it is "
                        f"queued on a lane whose op waits, in turn, for ops queued behind (or "
                        f"depending on) this one ({len(stuck)} lanes of this runtime's {self.lanes} wait "
                        "for each other), so "
                        "none of those can run. Give the runtime more lanes (streams= on a CPU runtime, "
                        "host_lanes= beside a device), or add a done-callback instead of waiting "
                        "inside the op")
            inside = self._waits.get(me)
            self._waits[me] = ((future,), True, mine) if timeout is None else None
            return inside

    def holds_the_lock(self) -> bool:
        """Whether the calling thread holds the runtime's lock: an op's function that runs inside
        its submit (a device op on CUDA), or a graph's run."""
        return self._outer_lock.is_owned()

    def check_lock_holder(self, future: Any) -> None:
        """For a thread that holds the runtime's lock and waits for ``future``, a host-lane op's:
        raises where the lane it is queued on (or runs on) waits for that lock, or waits in turn
        for ops queued on such a lane (the fixed point of :meth:`_stuck_from`). Those lanes'
        threads cannot go on before the waiting thread lets go of the lock, which it holds until
        the op it runs returns, so none ever would."""
        lane = future.__dict__.get("_lane")
        if lane is None or future.done() or not self.holds_the_lock():
            return
        with self._lock:
            if id(lane) not in self._stuck_from(set(self.lock_waiters)):
                return
        raise RuntimeError(
            f"waiting inside an op for op {future.op_name!r} would wait forever: the host lane it "
            "needs is running an op that is waiting for the runtime's lock (to submit), or waits in "
            "turn for ops queued on such a lane, and this op holds that lock while it runs inside "
            "its submit (as a device op's function does). Submit the waiting work with "
            "run_on='host' too, or add a done-callback instead of waiting")

    def lane_here(self) -> Any:
        """The lane of the runtime's that the calling thread runs, or None."""
        return next((lane for lane in self._lanes if lane.runs_here()), None)

    def locked(self) -> Any:
        """The lock of the waits, held while a synchronize inside an op finds which ops it waits
        for (by :meth:`lanes_waiting_for`) and counts its wait (:meth:`waiting_for_all`): no other
        lane's wait comes in between, unseen by it while it is unseen by that wait's check."""
        return self._lock

    @contextmanager
    def waiting_for_all(self, futures: list[tuple[Any, Any]]) -> Iterator[None]:
        """Around a wait of the calling thread for all ``futures``, given with the lane each is
        queued on (or None), for ``Runtime.synchronize`` inside an op, which leaves out the ops
        that wait for that op: where the caller is a lane of the runtime, counted as that lane
        waiting for them, so that another lane's wait that would close a cycle through it raises.
        Each such future is marked with its lane, as a lane's submit marks those it places."""
        mine = self.lane_here()
        if mine is None:
            yield
            return
        me = threading.get_ident()
        with self._lock:
            for future, lane in futures:
                if lane is not None:
                    future.__dict__["_lane"] = lane
                    future.__dict__["_lanes_of"] = self
            outer = self._waits.get(me)
            self._waits[me] = (tuple(f for f, _ in futures), True, mine)
        try:
            yield
        finally:
            with self._lock:
                self._restore(me, outer)

    def lanes_waiting_for(self, stuck: Callable[[Any], bool]) -> list[Any]:
        """The lanes whose ops wait (without a timeout) for futures that cannot finish while
        those ``stuck`` says so of cannot (waiting for all: any pending one; for the first:
        every one, none done yet)."""
        with self._lock:
            waits = [wait for wait in self._waits.values() if wait is not None]
        return [lane for futures, needs_all, lane in waits if _held_up(futures, needs_all, stuck)]

    def check_waiter(self, waiter: Any) -> None:
        """``concurrent.futures.wait`` or ``as_completed`` installs ``waiter`` on the futures it
        waits for: raises where the caller is a lane of this runtime and the wait could never end
        (no timeout, and ops it needs are queued behind the waiting op or on lanes that wait for it
        in turn). Checked once per waiter, as it is installed on the first of this runtime's lane
        ops among those futures."""
        if getattr(waiter, "_streamdag_checked", False):
            return
        waiter._streamdag_checked = True
        mine = self.lane_here()
        if mine is None:
            return
        call = waiting_call(sys._getframe(2))
        if call is None:  # not a wait we know how to read: let it be
            return
        futures, timeout = call
        if timeout is not None:
            return
        me = threading.get_ident()
        # waiting for all of them (FIRST_EXCEPTION ends early only if one fails: counted as "first")
        needs_all = type(waiter).__name__ == "_AllCompletedWaiter" and not waiter.stop_on_exception
        futures = tuple(futures)
        with self._lock:
            pending = [f for f in futures if not f.done()]
            stuck_lanes = self._stuck_lanes(mine)
            # (an op queued behind this one on its own lane is on ``mine``, which is stuck)
            stuck = [f for f in pending if self._blocked(f, stuck_lanes)]
            # waiting for the first: stuck only if every pending one is and none is done (as_completed
            # yields the done ones first, and its caller may stop there)
            if not stuck or (not needs_all and (len(stuck) < len(pending) or len(pending) < len(futures))):
                # it may wait: counted as this lane waiting until its waiter is taken off (end_waiter)
                wait = (futures, needs_all, mine)
                waiter._streamdag_wait = (me, self._waits.get(me), wait)
                self._waits[me] = wait
                return
        for f in futures:  # installed on some already: it never waits now (their conditions are held)
            waiters = getattr(f, "_waiters", None)
            if waiters is not None and waiter in waiters:
                list.remove(waiters, waiter)
        names = ", ".join(repr(f.op_name) for f in stuck)
        raise RuntimeError(
            f"waiting inside an op for op(s) {names} (concurrent.futures.wait or as_completed, no "
            "timeout) would wait forever: they are queued behind the waiting op on its lane, or on "
            "lanes whose ops wait in turn for ops queued behind it, so they run only once it has "
            "returned. Give the runtime more lanes (streams= on a CPU runtime, host_lanes= beside a "
            "device), or add done-callbacks instead of waiting inside the op")

    def end_waiter(self, waiter: Any) -> None:
        """``concurrent.futures`` takes ``waiter`` off a future again: its wait is over (or it was
        never counted), and its lane no longer waits for it."""
        registered = getattr(waiter, "_streamdag_wait", None)
        if registered is None:
            return
        del waiter._streamdag_wait  # once, whichever of its futures it is taken off first
        me, outer, counted = registered
        with self._lock:
            if self._waits.get(me) is counted:  # (else an as_completed closed late, by another thread)
                self._restore(me, outer)

    def _restore(self, me: int, outer: Any) -> None:
        """Thread ``me``'s wait is over: back to the wait it was made inside (a done-callback run by
        a wait), or to none. Holds ``_lock``."""
        if outer is None:
            self._waits.pop(me, None)
        else:
            self._waits[me] = outer

    def _blocked(self, future: Any, stuck: set[int]) -> bool:
        """Whether ``future`` needs an op queued on (or running on) one of the ``stuck`` lanes of
        this runtime's: its op; for a graph run's, any of its ops not finished (``_ops_of``, see
        ``RecordedGraph.run``). Not where it finishes without a lane (a device op, another
        runtime's op)."""
        marks = getattr(future, "__dict__", {})
        if marks.get("_lanes_of") is not self:
            return False
        ops_of = marks.get("_ops_of")
        if ops_of is not None:
            return any(self._blocked(f, stuck) for f in ops_of if not f.done())
        lane = marks.get("_lane")
        return lane is not None and id(lane) in stuck

    def _stuck_lanes(self, mine: Any) -> set[int]:
        """The ids of the lanes whose ops would never end their waits if the op on lane ``mine``
        waited forever. Holds ``_lock``."""
        return self._stuck_from({id(mine)})

    def _stuck_from(self, stuck: set[int]) -> set[int]:
        """The ids of the lanes whose ops would never end their waits if those of the ``stuck``
        lanes never did: them, then every waiting lane whose wait needs an op queued on one of
        them (waiting for all: any pending one; for the first: every one, none done yet), until
        none is added. Holds ``_lock``."""
        waits = [wait for wait in self._waits.values() if wait is not None]
        grew = True
        while grew:
            grew = False
            for futures, needs_all, lane in waits:
                if id(lane) not in stuck and _held_up(futures, needs_all, lambda f: self._blocked(f, stuck)):
                    stuck.add(id(lane))
                    grew = True
        return stuck


def _held_up(futures: tuple[Any, ...], needs_all: bool, stuck: Callable[[Any], bool]) -> bool:
    """Whether a wait for ``futures`` (all of them, or the first) cannot end while those that
    ``stuck`` says so of cannot finish: waiting for all, any pending one is; for the first, every
    one is, and none is done yet (a wait that has ended, or is ending, is not held up)."""
    pending = [f for f in futures if not f.done()]
    if not pending or (not needs_all and len(pending) < len(futures)):
        return False
    blocked = [stuck(f) for f in pending]
    return any(blocked) if needs_all else all(blocked)


CALLBACKS = threading.local()  # how deep this thread is in running futures' done-callbacks (``depth``)
_UNFINISHED = ("PENDING", "RUNNING")  # (concurrent.futures' states of a future not yet done)


def in_done_callback() -> bool:
    """Whether this thread is running a future's done-callbacks (user code the runtime called).

    Such a thread may be the one that finishes ops, so it must never block on
    the runtime: its submits go over the in-flight bounds instead of waiting,
    and waiting on an unfinished future without a timeout raises.
    """
    return getattr(CALLBACKS, "depth", 0) > 0


def refuse_hanging_wait(frame: Any) -> None:
    """Raise where ``frame`` is a ``concurrent.futures`` wait without a timeout, from inside a
    done-callback, for a streamdag future not finished: as ``result()`` there, it would hang."""
    if not in_done_callback():
        return
    call = waiting_call(frame)
    if call is None or call[1] is not None:
        return
    if any(getattr(type(f), "streamdag_future", False) and f._state in _UNFINISHED for f in call[0]):
        raise RuntimeError(
            "waiting on an unfinished streamdag future (concurrent.futures.wait or as_completed without "
            "a timeout) inside a done-callback would hang: the callback runs in a thread that finishes "
            "ops. Chain instead (add a done-callback to the future, or submit the follow-up as an op "
            "that reads its data), or pass a timeout")


class WatchedWaiters(list[Any]):
    """The waiter list of a future (``Future._waiters``): the waits of ``concurrent.futures``
    install their waiter here before they block. ``refuse_hang(frame)`` (``frame``: the caller
    of ``append``) raises for one that would never end, before it is installed; where a lane op
    submitted the future to a lane (``lanes``), the lane waits check it too
    (:meth:`LaneWaits.check_waiter`)."""

    __slots__ = ("_lanes", "_refuse_hang")

    def __init__(self, refuse_hang: Callable[[Any], None], lanes: LaneWaits | None = None) -> None:
        super().__init__()
        self._refuse_hang = refuse_hang
        self._lanes = lanes

    def append(self, waiter: Any) -> None:
        self._refuse_hang(sys._getframe(1))
        if self._lanes is not None:
            self._lanes.check_waiter(waiter)
        super().append(waiter)

    def remove(self, waiter: Any) -> None:
        super().remove(waiter)
        if self._lanes is not None:
            self._lanes.end_waiter(waiter)


#: where ``concurrent.futures`` waits (its futures are ``fs`` there, its timeout ``timeout``)
_WAITING_CALLS = frozenset({"wait", "as_completed"})


def waiting_call(frame: Any) -> tuple[Any, Any] | None:
    """The futures and timeout of the ``concurrent.futures.wait`` or ``as_completed`` call that
    installs a waiter, read from its frame (``frame`` is the one that appends, or a caller of it),
    or None where the append comes from anywhere else."""
    for _ in range(3):
        if frame is None:
            return None
        waits_here = frame.f_code.co_name in _WAITING_CALLS
        if waits_here and frame.f_globals.get("__name__") == "concurrent.futures._base":
            local = frame.f_locals
            if "fs" in local and "timeout" in local:
                return local["fs"], local["timeout"]
            return None
        frame = frame.f_back
    return None
