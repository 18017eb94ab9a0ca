"""The bounds of transfers: the bytes of copies in flight (:class:`ByteBudget`) and the pool of
pinned buffers small pageable copies are staged through (:class:`PinnedPool`).

Both hold their bytes or buffers for each copy until its future is seen done, per stream, oldest
first (a stream's copies complete in order). Their state:

==========================  ================  ====================================================
state                       changed under     invariant
==========================  ================  ====================================================
``ByteBudget._counts``      ``_lock``         ``used``: bytes acquired, not yet seen done;
                                              ``used`` <= ``limit`` but for one copy alone, or
                                              one acquired in a done-callback; ``peak``; acquirers
                                              asleep (``waiting``). The compiled ``rt.copy`` reads
                                              and writes them in C, under the same lock (handed
                                              over by ``compiled_parts``)
``ByteBudget._held[s]``     ``_lock``         stream s's copies holding bytes, oldest first
``PinnedPool._held``        ``_cond``         bytes of buffers made, <= ``limit`` likewise
``PinnedPool._free[size]``  ``_cond``         buffers free to take, by size class
``PinnedPool._lent[s]``     ``_cond``         buffers lent to stream s's copies, oldest first
``PinnedPool._views[b]``    (its taker)       typed views of buffer b, made by whoever holds b;
                                              dropped under ``_cond`` with b
==========================  ================  ====================================================
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..backends.capture_mode import relaxed
from ..native import twin
from .ops import Future, in_done_callback, new_lock

__all__ = ["ByteBudget", "PinnedPool"]


class _BudgetCounts:
    """A byte budget's counts: its limit, the bytes in flight (``used``), the most at once
    (``peak``), and acquirers asleep (``waiting``)."""

    __slots__ = ("limit", "peak", "used", "waiting")

    def __init__(self) -> None:
        self.limit = self.peak = self.used = self.waiting = 0


#: a budget's counts; where the compiled hot path is built, fields the compiled ``rt.copy`` reads and
#: writes in C under the budget's lock (``native/_submit.c``: ``budget_take``, ``budget_hold``)
new_budget_counts: Callable[[], Any] = twin("BudgetCounts", _BudgetCounts)


class ByteBudget:
    """Blocks while ``limit`` bytes are in flight; one transfer larger than the limit runs alone.

    A copy's bytes come back once its future is seen done. The budget keeps the
    copies it counts (:meth:`hold`), per stream, and looks at the oldest of each
    stream (a stream finishes its copies in order): a hold gives back the bytes
    of up to two done copies at its stream's head, and an acquire that does not
    fit looks at every stream. No done-callback per copy, which cost more than
    the copy's submit. A submitter that must wait helps finish the oldest copy.
    A copy's future is held weakly: once nobody holds it, its op has finished
    (a pending op keeps its future), and the tensor it resolves to is not kept
    alive here. The compiled ``rt.copy`` makes the common case of
    :meth:`acquire` and :meth:`hold` itself, in C, on the same counts, lock and
    held copies (on the H100 these methods cost a 1 KiB copy ~2.6 µs).
    """

    def __init__(self, limit: int, on_wait: Callable[[], None] | None = None) -> None:
        self._counts = new_budget_counts()
        self._counts.limit = limit
        self._lock = new_lock()  # taken directly where nobody waits: a Condition's is slower
        self._cond = threading.Condition(self._lock)
        self._held: dict[Any, deque[tuple[weakref.ref[Future], int]]] = {}  # per stream, oldest first
        #: called before blocking (bytes come back when ops are seen finished); None: nothing
        self.on_wait = on_wait

    def compiled_parts(self) -> tuple[Any, Any, dict[Any, Any]]:
        """What the compiled ``rt.copy`` counts a copy's bytes in (``Submitter.setup_copies``): the
        counts (``used``, ``peak``, ``limit``, ``waiting``), the lock they change under, and the
        copies holding bytes by stream (changed under that lock too)."""
        return self._counts, self._lock, self._held

    @property
    def limit(self) -> int:
        """Bytes in flight before :meth:`acquire` waits (one larger transfer runs alone)."""
        return self._counts.limit

    @property
    def used(self) -> int:
        """Bytes in flight: acquired, and not yet seen done."""
        return self._counts.used

    @property
    def peak(self) -> int:
        """The most bytes in flight at once."""
        return self._counts.peak

    def acquire(self, n: int) -> None:
        """Count ``n`` bytes, once they fit; then :meth:`hold` them with their copy, or :meth:`release`."""
        counts = self._counts
        while True:
            with self._lock:
                if counts.used and counts.used + n > counts.limit:
                    self._reclaim()
                # a done-callback's thread may be the one that brings bytes back: it goes over the limit
                if not counts.used or counts.used + n <= counts.limit or in_done_callback():
                    counts.used += n
                    if counts.used > counts.peak:
                        counts.peak = counts.used
                    return
                oldest = self._oldest()
                if oldest is None:  # counted by a submit that holds them in a moment, or releases them
                    counts.waiting += 1
                    try:
                        self._cond.wait()
                    finally:
                        counts.waiting -= 1
                    continue
            if self.on_wait is not None:
                self.on_wait()
            oldest.exception()  # waits (helping finish it); its failure is the caller's to see elsewhere

    def hold(self, future: Future[Any], n: int, stream: Any) -> None:
        """The ``n`` bytes acquired for a copy on ``stream`` come back once ``future`` is done."""
        with self._lock:
            held = self._held.get(stream)
            if held is None:
                held = self._held[stream] = deque()
            self._give_back_done(held, most=2)  # a little per copy: no long pass at a later one
            held.append((weakref.ref(future), n))
            if self._counts.waiting:
                self._cond.notify_all()

    def release(self, n: int) -> None:
        """Give back ``n`` bytes acquired for a copy that was not made (or is known to be done)."""
        with self._lock:
            self._counts.used -= n
            if self._counts.waiting:
                self._cond.notify_all()

    def reclaim(self) -> int:
        """Give back the bytes of the copies seen done; returns the bytes still in flight."""
        with self._lock:
            self._reclaim()
            return self._counts.used

    def _reclaim(self) -> None:
        for held in self._held.values():
            self._give_back_done(held)

    def _give_back_done(self, held: deque[tuple[weakref.ref[Future], int]], most: int | None = None) -> None:
        """Give back the bytes of the done copies at the head of one stream's ``held`` (at most ``most``)."""
        while held and (most is None or most > 0):
            future = held[0][0]()
            if future is not None and not future.done():
                break
            self._counts.used -= held.popleft()[1]
            if most is not None:
                most -= 1

    def _oldest(self) -> Future | None:
        for held in self._held.values():
            if held:
                future = held[0][0]()
                if future is not None:
                    return future
        return None


class PinnedPool:
    """Reused pinned host buffers, at most ``limit`` bytes in all; ``take`` blocks when spent.

    A taken buffer comes back by :meth:`give` (its user knows it is free) or
    by :meth:`lend` with the future of the op that uses it last: free once
    that future is done, which ``take`` looks at, oldest first per stream (a
    stream finishes its ops in order). No done-callback per copy: on the H100
    the callback and the condition it makes cost ~50 µs of a 2 MiB copy's
    submit and wait. A lent buffer's future is held weakly: once nobody holds
    it, its op has finished (a pending op keeps its future).
    """

    #: typed views kept per buffer (see :meth:`typed`)
    VIEWS_PER_BUFFER = 8

    def __init__(self, limit: int, on_wait: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self._free: dict[int, list[Any]] = {}
        self._lent: dict[Any, deque[tuple[weakref.ref[Future], Any]]] = {}  # per stream, oldest first
        self._views: dict[int, dict[tuple[Any, Any], Any]] = {}  # by id of a buffer
        self._held = 0
        self._cond = threading.Condition()
        #: called before blocking (buffers come back when ops are seen finished); None: nothing
        self.on_wait = on_wait

    def take(self, nbytes: int) -> Any:
        import torch

        size = 1 << max(nbytes - 1, 0).bit_length()  # size classes: powers of two
        while True:
            with self._cond:
                self._reclaim()
                free = self._free.get(size)
                if free:
                    return free.pop()
                if self._held + size <= self.limit or self._held == 0 or in_done_callback():
                    self._held += size
                    break
                if self._drop_one_free():
                    continue
                heads = [lent[0][0]() for lent in self._lent.values() if lent]
                if not heads:  # taken and not yet lent or given back: by a copy under way
                    if self.on_wait is not None:
                        self.on_wait()
                    self._cond.wait()
                    continue
                oldest = heads[0]
                if any(f is None or f.done() for f in heads):  # done since _reclaim looked
                    continue
            if self.on_wait is not None:
                self.on_wait()
            oldest.exception()  # waits (helping finish it); its failure is the caller's to see elsewhere
        with relaxed():  # a pinned allocation: refused during a CUDA graph capture in global mode
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    @contextmanager
    def taken(self, nbytes: int) -> Iterator[Any]:
        """:meth:`take`, given back if the block raises (before its user lends it)."""
        buf = self.take(nbytes)
        try:
            yield buf
        except BaseException:
            self.give(buf)
            raise

    def typed(self, buf: Any, dtype: Any, shape: Any) -> Any:
        """The start of ``buf`` as a contiguous tensor of ``dtype`` and ``shape``, made once per buffer
        and layout: each of the three views costs microseconds per copy on a GPU host. Only the
        buffer's taker calls it, between ``take`` and ``give`` or ``lend``."""
        views = self._views.get(id(buf))
        if views is None:
            views = self._views[id(buf)] = {}
        view = views.get((dtype, shape))
        if view is None:
            if len(views) >= self.VIEWS_PER_BUFFER:
                views.clear()
            nbytes = dtype.itemsize * math.prod(shape)
            view = views[(dtype, shape)] = buf[:nbytes].view(dtype).view(shape)
        return view

    def _drop_one_free(self) -> bool:
        for size, bufs in self._free.items():
            if bufs:
                self._views.pop(id(bufs.pop()), None)
                self._held -= size
                return True
        return False

    def give(self, buf: Any) -> None:
        with self._cond:
            self._free.setdefault(buf.numel(), []).append(buf)
            self._cond.notify_all()

    def lend(self, buf: Any, future: Future[Any], stream: Any) -> None:
        """``buf`` is free again once ``future`` is done (of the last op to use it, on ``stream``)."""
        with self._cond:
            lent = self._lent.get(stream)
            if lent is None:
                lent = self._lent[stream] = deque()
            lent.append((weakref.ref(future), buf))
            self._cond.notify_all()

    def _reclaim(self) -> None:
        """Back to the free lists: the lent buffers at each stream's head whose ops are done. Holds
        ``_cond``."""
        for lent in self._lent.values():
            while lent:
                future = lent[0][0]()
                if future is not None and not future.done():
                    break
                buf = lent.popleft()[1]
                self._free.setdefault(buf.numel(), []).append(buf)
