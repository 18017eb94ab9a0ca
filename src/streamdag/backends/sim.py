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
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .host import Command, HostEvent
from .threads import report_escaped

__all__ = ["SimArray", "SimBackend", "SimExecutor"]


class _SimStream:
    def __init__(self, index: int, executor: SimExecutor, kind: str = "compute") -> None:
        self.index = index
        self.kind = kind
        self._executor = executor
        self.queue: deque[Command] = deque()

    def enqueue(self, command: Command) -> None:
        with self._executor.cond:
            self.queue.append(command)
            self._executor.cond.notify()


class SimExecutor:
    """The one thread that runs the streams of one or several simulated devices.

    Devices of one runtime share it, so that a stream waiting on another
    device's event is looked at again whenever any stream makes progress.
    """

    def __init__(self, seed: int) -> None:
        self.rng: random.Random = random.Random(seed)
        self.cond: threading.Condition = threading.Condition()
        self.streams: list[_SimStream] = []
        self._users = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="streamdag-sim", daemon=True)
        self._thread.start()

    def runs_here(self) -> bool:
        """Whether the calling thread is this executor's (an op, or a finish, running now)."""
        return threading.current_thread() is self._thread

    def join(self, streams: list[_SimStream]) -> None:
        with self.cond:
            self.streams += streams
            self._users += 1

    def _runnable(self) -> list[_SimStream]:
        ready = []
        for s in self.streams:
            if s.queue:
                kind, payload = s.queue[0]
                if kind == "run" or payload.is_set():  # type: ignore[union-attr]
                    ready.append(s)
        return ready

    def _loop(self) -> None:
        while True:
            with self.cond:
                while True:
                    if self._closed:
                        return
                    ready = self._runnable()
                    if ready:
                        break
                    self.cond.wait()
                stream = self.rng.choice(ready)
                kind, payload = stream.queue.popleft()
            if kind == "run":
                try:
                    payload()  # type: ignore[operator]
                except BaseException:  # a user's SystemExit, say: the ops queued after it still run
                    report_escaped(self._thread.name)
            payload = None  # (idle, the thread must hold no op's finish: it leads to the runtime)

    def leave(self) -> None:
        with self.cond:
            self._users -= 1
            if self._users > 0:
                return
            self._closed = True
            self.cond.notify()
        self._thread.join()


class SimBackend:
    """``streams`` simulated streams executed in a seeded random interleaving.

    ``copy_kinds`` adds copy streams (``"p2p"`` for a device of a group);
    devices of one group pass one shared ``executor``.
    """

    deferred = True

    def __init__(self, streams: int, seed: int = 0, device: str = "sim",
                 copy_kinds: tuple[str, ...] = (), executor: SimExecutor | None = None) -> None:
        self.device = device
        self._executor = executor if executor is not None else SimExecutor(seed)
        self._streams = [_SimStream(i, self._executor) for i in range(streams)]
        self._copy = {k: _SimStream(streams + i, self._executor, k) for i, k in enumerate(copy_kinds)}
        self._all = self._streams + list(self._copy.values())
        self._clock = _SimStream(-1, self._executor, "clock")  # no op runs there: see wall_of
        self._executor.join([*self._all, self._clock])

    @property
    def streams(self) -> list[_SimStream]:
        return self._streams

    @property
    def copy_streams(self) -> dict[str, _SimStream]:
        return self._copy

    def event(self, timing: bool = False) -> HostEvent:
        return HostEvent()

    def launch(self, stream: _SimStream, work: Callable[[], None], after_caller: bool = True) -> None:
        stream.enqueue(("run", work))

    def when_done(self, stream: _SimStream, event: HostEvent, callback: Callable[[], None]) -> None:
        stream.enqueue(("run", callback))

    def runs_here(self) -> bool:
        """Whether the calling thread runs this device's streams (inside an op or a finish)."""
        return self._executor.runs_here()

    def hurry(self, waiter: Any = None, seconds: float | None = None, wanted: Any = None) -> None:
        """What a wait on one of this device's ops calls first: inside an op (on the one thread
        that runs every stream), refuse a wait without a time limit at once, since nothing else
        runs until the op returns."""
        if seconds is None and waiter is not None and self._executor.runs_here():
            raise RuntimeError(
                f"waiting inside an op for op {getattr(waiter, 'op_name', '?')!r} on the simulated "
                "device would wait forever: one thread runs all its streams, and nothing else runs until "
                "the waiting op returns. Add a done-callback instead of waiting, or pass a timeout")

    def synchronize(self) -> None:
        events = []
        for s in self._all:
            ev = HostEvent()
            ev.record(s)
            events.append(ev)
        for ev in events:
            ev.synchronize()

    def wall_of(self, event: HostEvent) -> int | None:
        """The wall clock (``time.time_ns``) at the moment the device ran ``event``, timed against a
        mark as ``CudaBackend.wall_of`` times it: the device runs its streams' commands in its own
        time, so an event recorded behind queued work runs after the host recorded it. None where
        ``event`` has not run, or inside an op (the one thread that would run the mark is busy)."""
        if self._executor.runs_here() or not event.query():
            return None
        mark = HostEvent()
        before = time.time_ns()
        mark.record(self._clock)
        mark.synchronize()
        return (before + time.time_ns()) // 2 - round(event.elapsed_ms(mark) * 1e6)

    def close(self) -> None:
        self._executor.leave()


class SimArray:
    """An array in a simulated device's memory: host memory tagged with the device, for tests.

    Its reads and writes are tracked in the device's own address space, so an
    op on another simulated device that reads it gets a peer copy, as a GPU
    tensor would.
    """

    def __init__(self, data: Any, device: str) -> None:
        self.data: np.ndarray = np.asarray(data)
        self.device = device

    @property
    def streamdag_space(self) -> str:
        return self.device

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self.data.__array_interface__

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def empty_on(self, device: str) -> SimArray:
        return SimArray(np.empty_like(self.data), device)

    def copy_(self, src: SimArray, non_blocking: bool = False) -> SimArray:
        np.copyto(self.data, src.data)
        return self

    def __repr__(self) -> str:
        return f"SimArray({self.data!r}, device={self.device!r})"
