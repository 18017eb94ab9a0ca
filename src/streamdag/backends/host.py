"""Events and commands shared by the host backends (CPU lanes and the simulator)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HostEvent", "Marker"]


class Marker:
    """One record of an event: set when the stream reaches it, with the time it did.

    A held lock is the cheapest one-shot flag: ``wait`` acquires and releases it.
    """

    __slots__ = ("_is_set", "_lock", "time")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._is_set = False
        self.time = 0.0

    def set(self) -> None:
        self.time: float = time.perf_counter()
        self._is_set = True
        self._lock.release()

    def is_set(self) -> bool:
        return self._is_set

    def wait(self) -> None:
        if not self._is_set:
            with self._lock:
                pass


class HostEvent:
    """An event for streams whose queues hold ``("run", fn)`` and ``("wait", marker)`` commands."""

    __slots__ = ("_marker",)

    def __init__(self) -> None:
        self._marker: Marker | None = None

    def record(self, stream: Any) -> None:
        marker = Marker()
        self._marker = marker
        stream.enqueue(("run", marker.set))

    @classmethod
    def now(cls) -> HostEvent:
        """An event completed at this moment (its time is the host's clock now)."""
        event = cls()
        event._marker = Marker()
        event._marker.set()
        return event

    def wait(self, stream: Any) -> None:
        if self._marker is not None:
            stream.enqueue(("wait", self._marker))

    def query(self) -> bool:
        return self._marker is None or self._marker.is_set()

    def synchronize(self) -> None:
        if self._marker is not None:
            self._marker.wait()

    def elapsed_ms(self, end: HostEvent) -> float:
        if self._marker is None or end._marker is None:
            raise RuntimeError("elapsed_ms needs both events recorded; record them first")
        self.synchronize()
        end.synchronize()
        return (end._marker.time - self._marker.time) * 1e3


Command = tuple[str, Callable[[], None] | Marker]
