"""A thread's CUDA stream-capture mode, set through the CUDA driver.

PyTorch captures a CUDA graph in CUDA's global mode by default. While such a
capture runs, CUDA refuses an event query from any thread whose own capture
mode is global (every thread's, unless changed), and the refusal ends the
capture in an error. The runtime queries its ops' events from its completion
thread, from a thread that submits (between submits), and from a thread that
waits on a future: a user's capture in another thread must not be broken by
them. A thread in relaxed mode may query; PyTorch has no Python call that
sets it, so this module calls the driver's ``cuThreadExchangeStreamCaptureMode``.
Where the driver library cannot be opened by its usual name, it warns once
and leaves the modes alone: queries are then refused during such a capture
(and end it), but are not taken for a lost device.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .._diagnostics import warn

__all__ = ["RELAXED", "exchange", "relaxed"]

#: CUstreamCaptureMode: CU_STREAM_CAPTURE_MODE_GLOBAL = 0, THREAD_LOCAL = 1, RELAXED = 2
RELAXED = 2

_exchange_fn = None  # the driver's function; False: not to be had here
_thread = threading.local()  # ``relaxed``: this thread is in relaxed mode by this module's doing


def _driver_exchange():  # -> the driver's function (loaded once), or False
    global _exchange_fn
    if _exchange_fn is None:
        name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
        try:
            fn = ctypes.CDLL(name).cuThreadExchangeStreamCaptureMode
        except (OSError, AttributeError) as exc:
            warn(f"streamdag cannot set a thread's CUDA capture mode ({exc}): a CUDA graph you "
                 "capture in PyTorch's default (global) mode while a runtime has ops pending "
                 "may fail; capture with capture_error_mode='relaxed' or 'thread_local'")
            _exchange_fn = False
            return False
        fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
        _exchange_fn = fn
    return _exchange_fn


def exchange(mode: int) -> int | None:
    """Set the calling thread's capture mode to ``mode``; returns the mode it had (None: the driver's
    function is not to be had here, nothing changed)."""
    driver = _driver_exchange()
    if not driver:
        return None
    value = ctypes.c_int(mode)
    status = driver(ctypes.byref(value))
    if status != 0:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode failed with CUDA driver error {status}")
    _thread.relaxed = mode == RELAXED
    return value.value


@contextmanager
def relaxed() -> Iterator[None]:
    """The calling thread in relaxed capture mode for the block, then back to its own mode (nothing
    to do in a block of this kind already, or in a thread set relaxed with ``exchange``)."""
    if getattr(_thread, "relaxed", False):
        yield
        return
    previous = exchange(RELAXED)
    try:
        yield
    finally:
        if previous is not None:
            exchange(previous)
