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
from collections.abc import Callable
from typing import Any

from ..backends.threads import report_escaped

__all__ = ["Held", "Launcher"]


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
