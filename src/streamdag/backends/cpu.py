"""CPU backend: each stream is a worker lane, a thread that runs its queue in order.

Work that releases the GIL (numpy, torch CPU kernels) runs truly in parallel
across lanes. Lanes order each other only through events.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from .host import Command, HostEvent
from .threads import report_escaped

__all__ = ["CpuBackend"]


class _Lane:
    def __init__(self, index: int, kind: str, name: str) -> None:
        self.index = index
        self.kind = kind
        self._queue: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def enqueue(self, command: Command) -> None:
        self._queue.put(command)

    def _loop(self) -> None:
        while True:
            command = self._queue.get()
            if command is None:
                return
            kind, payload = command
            if kind == "wait":
                payload.wait()  # type: ignore[union-attr]
                continue
            try:
                payload()  # type: ignore[operator]
            except BaseException:  # a user's SystemExit, say: the ops queued after it still run
                report_escaped(self._thread.name)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


class CpuBackend:
    """``streams`` worker lanes on the host."""

    deferred = True

    def __init__(self, streams: int) -> None:
        self.device = "cpu"
        self._lanes = [_Lane(i, "compute", f"streamdag-cpu-{i}") for i in range(streams)]

    @property
    def streams(self) -> list[_Lane]:
        return self._lanes

    def event(self, timing: bool = False) -> HostEvent:
        return HostEvent()

    def launch(self, stream: _Lane, work: Callable[[], None], after_caller: bool = True) -> None:
        stream.enqueue(("run", work))

    def when_done(self, stream: _Lane, event: HostEvent, callback: Callable[[], None]) -> None:
        stream.enqueue(("run", callback))

    def synchronize(self) -> None:
        events = []
        for lane in self._lanes:
            ev = HostEvent()
            ev.record(lane)
            events.append(ev)
        for ev in events:
            ev.synchronize()

    def close(self) -> None:
        for lane in self._lanes:
            lane.stop()
