"""CPU backend: each stream is a worker lane, a thread that runs its queue in order.

Work that releases the GIL (numpy, torch CPU kernels) runs truly in parallel
across lanes. Lanes order each other only through events. A GPU runtime has
host lanes too (:class:`HostLanes`), for the ops submitted with
``run_on="host"``.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

from .host import Command, HostEvent
from .threads import TORCH_PROFILER, report_escaped, run_named

__all__ = ["LANE_THREADS", "CpuBackend", "HostLanes"]

#: the idents of the lane threads running now (of every runtime): where an op may be submitted
#: from inside another op, which ``Runtime._host_deps`` checks (the compiled submit asks here first)
LANE_THREADS: set[int] = set()


class _Lane:
    """A worker thread and its queue; ``lazy``: the thread starts at the first command."""

    def __init__(self, index: int, kind: str, name: str, lazy: bool = False) -> None:
        self.index = index
        self.kind = kind
        self._queue: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None  # made at the start: no cycle with it before
        self._start_lock = threading.Lock()
        self._started = False
        if not lazy:
            self._start()

    def enqueue(self, command: Command) -> None:
        if not self._started:
            self._start()
        self._queue.put(command)

    def _start(self) -> None:
        with self._start_lock:
            if not self._started:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
                self._started = True

    def runs_here(self) -> bool:
        """Whether the calling thread is this lane's (an op running on it calls)."""
        return threading.current_thread() is self._thread

    def _loop(self) -> None:
        ident = threading.get_ident()
        LANE_THREADS.add(ident)
        try:
            self._run_commands()
        finally:
            LANE_THREADS.discard(ident)

    @property
    def native_id(self) -> int | None:
        """The lane thread's id in the operating system (as profilers name threads), once started."""
        return self._thread.native_id if self._thread is not None else None

    def _run_commands(self) -> None:
        modules = sys.modules
        while True:
            command = self._queue.get()
            if command is None:
                return
            kind, payload = command
            command = None  # (idle, the lane must hold no op's finish: it leads to the runtime)
            if kind == "wait":
                payload.wait()  # type: ignore[union-attr]
                continue
            try:
                profiler = modules.get(TORCH_PROFILER)  # (an op names itself while torch profiles)
                if profiler is not None and profiler._is_profiler_enabled:
                    run_named(payload)  # type: ignore[arg-type]
                else:
                    payload()  # type: ignore[operator]
            except BaseException:  # a user's SystemExit, say: the ops queued after it still run
                report_escaped(self._name)
            payload = None  # a runtime dropped without close() is collected, and stops its lanes

    def stop(self) -> None:
        with self._start_lock:
            if not self._started:  # never started: nothing to stop
                return
        self._queue.put(None)
        self._thread.join()  # type: ignore[union-attr]


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

    def clock_base(self) -> HostEvent:
        """The profiler's base for these lanes: the host's clock now, not when a lane gets to it
        (a lane may start later, or run the op that profiles, see ``Runtime.profile``)."""
        return HostEvent.now()

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


class _Finished:
    """A lane's wait for an op of another backend: until the thread that finishes the op sets a
    flag. Meanwhile it asks that backend, every ``HURRY_EVERY`` seconds, to finish completed ops
    promptly (a GPU's completion thread otherwise pauses while a submitting thread finishes ops
    as it goes); it does not finish ops itself, which would run other ops' done-callbacks on
    the lane, ahead of the host ops queued there."""

    HURRY_EVERY = 10e-3

    __slots__ = ("_flag", "_hurry")

    def __init__(self, future: Any) -> None:
        self._flag = flag = threading.Event()
        self._hurry = getattr(future, "_hurry", None)
        future._on_done(lambda _f: flag.set())

    def wait(self) -> None:
        while not self._flag.is_set():
            if self._hurry is not None:
                self._hurry()
            self._flag.wait(self.HURRY_EVERY)


class HostLanes(CpuBackend):
    """Worker lanes on the host beside a GPU (or simulated device): where ``run_on="host"`` ops run.

    On a GPU an op's function runs inside its submit, so a host function that
    needs unfinished device work would block the submitting thread; on a lane
    it waits there instead. The lanes' threads start at their first op.
    """

    lost = None  # the host is never lost with a device

    def __init__(self, streams: int, first_index: int) -> None:
        self.device = "host"
        self._lanes = [_Lane(first_index + i, "host", f"streamdag-host-{i}", lazy=True)
                       for i in range(streams)]

    def wait_for_op(self, stream: _Lane, op: Any) -> None:
        """Run what ``stream`` gets next only once ``op``, of another backend, has finished.

        Finished, not just complete on the device: a failure it had there is then known when
        the waiting op checks its inputs (see :class:`_Finished`).
        """
        stream.enqueue(("wait", _Finished(op.future)))
