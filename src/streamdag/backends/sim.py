"""A simulated device for tests: streams and events with CUDA's meaning, one thread.

One executor thread runs the commands of all streams in a random order that
respects stream order and event waits (seeded, so a failing interleaving can
be replayed). It finds ordering bugs that real lanes would show only by
luck: an op that is not ordered after its producer will, for some seed, run
before it.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Callable

from .host import Command, HostEvent

__all__ = ["SimBackend"]


class _SimStream:
    def __init__(self, index: int, owner: SimBackend) -> None:
        self.index = index
        self.kind = "compute"
        self._owner = owner
        self.queue: deque[Command] = deque()

    def enqueue(self, command: Command) -> None:
        with self._owner._cond:
            self.queue.append(command)
            self._owner._cond.notify()


class SimBackend:
    """``streams`` simulated streams executed in a seeded random interleaving."""

    deferred = True

    def __init__(self, streams: int, seed: int = 0, device: str = "sim") -> None:
        self.device = device
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._streams = [_SimStream(i, self) for i in range(streams)]
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="streamdag-sim", daemon=True)
        self._thread.start()

    @property
    def streams(self) -> list[_SimStream]:
        return self._streams

    def event(self, timing: bool = False) -> HostEvent:
        return HostEvent()

    def launch(self, stream: _SimStream, work: Callable[[], None]) -> None:
        stream.enqueue(("run", work))

    def when_done(self, stream: _SimStream, event: HostEvent, callback: Callable[[], None]) -> None:
        stream.enqueue(("run", callback))

    def _runnable(self) -> list[_SimStream]:
        ready = []
        for s in self._streams:
            if s.queue:
                kind, payload = s.queue[0]
                if kind == "run" or payload.is_set():  # type: ignore[union-attr]
                    ready.append(s)
        return ready

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    ready = self._runnable()
                    if ready:
                        break
                    self._cond.wait()
                stream = self._rng.choice(ready)
                kind, payload = stream.queue.popleft()
            if kind == "run":
                payload()  # type: ignore[operator]

    def synchronize(self) -> None:
        events = []
        for s in self._streams:
            ev = HostEvent()
            ev.record(s)
            events.append(ev)
        for ev in events:
            ev.synchronize()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
