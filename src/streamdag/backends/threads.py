"""What the runtime's own threads (CPU lanes, the simulator, CUDA completion threads) share."""

from __future__ import annotations

import logging

__all__ = ["report_escaped"]

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
