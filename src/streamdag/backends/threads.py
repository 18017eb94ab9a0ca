"""What the runtime's own threads (CPU lanes, the simulator, CUDA completion threads) share with the
runtime that drives them: the counts they update, and the done-callbacks they defer."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..native import twin

__all__ = ["callbacks_later", "deferring_callbacks", "new_counters", "report_escaped", "run_named",
           "torch_profiler_on"]

_log = logging.getLogger("streamdag")


def report_escaped(thread: str) -> None:
    """Log the exception being handled, which escaped user code run in one of the runtime's threads.

    A done-callback (or an op's function on a CPU lane) that raises
    ``SystemExit`` or another ``BaseException`` gets past the handlers meant
    for user errors. The thread must not die of it: it is the one that runs
    or finishes the later ops, whose futures would never complete. The
    affected op itself has recorded the exception as its failure.
    Call from an ``except BaseException`` block.
    """
    _log.exception("streamdag: user code raised in the runtime's thread %r; the thread goes on", thread)


#: the module whose global ``_is_profiler_enabled`` PyTorch's profilers set for every thread while they
#: run (``torch._C._autograd._profiler_enabled()`` answers for the calling thread alone)
TORCH_PROFILER = "torch.autograd.profiler"


def torch_profiler_on() -> bool:
    """Whether a PyTorch profiler (``torch.profiler.profile``) runs now: two look-ups, and nothing
    imported where torch is not."""
    module = sys.modules.get(TORCH_PROFILER)
    return module is not None and module._is_profiler_enabled


def run_named(work: Callable[[], Any]) -> None:
    """Run ``work`` (an op's ``execute``, or other work) inside ``torch.profiler.record_function``
    named after its op, so that PyTorch's profiler shows the op, around the kernels it launches.
    Called only while a profiler runs (:func:`torch_profiler_on`): the range costs microseconds."""
    name = getattr(getattr(work, "__self__", None), "name", None)
    if not isinstance(name, str):
        work()
        return
    from torch.profiler import record_function

    with record_function(name):
        work()


class _Counters:
    """A runtime's counts: ops submitted (the last op's number), completed, the most pending at once;
    its in-flight bound's slots free and submitters waiting for one (``completion.Slots``); the
    finished ops whose done-callbacks still run (``calling``). A CUDA completion thread's: ``seq``
    and ``woken`` (see ``_Completions.put``)."""

    __slots__ = ("calling", "completed", "free", "peak", "seq", "waiting", "woken")

    def __init__(self) -> None:
        self.seq = self.completed = self.peak = self.free = self.waiting = self.calling = 0
        self.woken = False


#: a runtime's counts (and a CUDA completion thread's entry count); where the compiled hot path is
#: built, fields it reads and writes in C
new_counters: Callable[[], Any] = twin("Counters", _Counters)

_LATER = threading.local()  # the done-callbacks this thread runs once it leaves ``callbacks_later``


def deferring_callbacks() -> list[Any] | None:
    """Where this thread puts done-callbacks to run later (inside ``callbacks_later``), or None."""
    return getattr(_LATER, "calls", None)


class callbacks_later:  # lower case: used like a function, ``with callbacks_later(): ...``
    """Inside, finishing a future sets its outcome and wakes its waiters; its done-callbacks
    run when the block is left.

    For a thread that finishes ops while holding a lock that waiters need in order to help:
    a callback may block (a submit that needs the runtime's lock, held by an op's function
    that waits on another future), and the waiter must still be able to finish that future.
    A class rather than a generator: a waiter enters one for every poll.
    """

    __slots__ = ("calls", "outer")

    def __enter__(self) -> None:
        self.outer: list[Any] | None = getattr(_LATER, "calls", None)
        self.calls: list[Any] = []
        _LATER.calls = self.calls

    def __exit__(self, *exc_info: Any) -> None:
        _LATER.calls = self.outer
        raised: BaseException | None = None
        for run in self.calls:  # each is owed its callbacks (and synchronize() waits for them all)
            try:
                run()
            except BaseException as exc:  # an interrupt: raise it, after the others have run
                raised = raised or exc
        if raised is not None:
            raise raised
