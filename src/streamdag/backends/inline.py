"""A backend that runs each op at once in the submitting thread and finishes it there.

No streams of its own, no events, no completion thread: what a submit costs
with it is the runtime's own work (dependencies, placement, futures,
finishing) plus the op. ``bench/overhead.py`` measures the bookkeeping with
it, and tests use it for the paths where an op's host code runs inside its
submit, as on CUDA, without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["InlineBackend"]


class _Lane:
    __slots__ = ("index", "kind")

    def __init__(self, index: int) -> None:
        self.index, self.kind = index, "compute"


class _DoneEvent:
    """Every op has finished when its submit returns: events are complete at once."""

    def record(self, stream: Any) -> None: ...
    def wait(self, stream: Any) -> None: ...
    def query(self) -> bool:
        return True
    def synchronize(self) -> None: ...


class InlineBackend:
    """``streams`` lanes of ``device`` that run nothing concurrently: each op runs in ``launch``."""

    deferred = False

    def __init__(self, device: str = "cpu", streams: int = 2) -> None:
        self.device = device
        self.streams: list[_Lane] = [_Lane(i) for i in range(streams)]

    def event(self, timing: bool = False) -> _DoneEvent:
        return _DoneEvent()

    def launch(self, stream: Any, work: Callable[[], None], after_caller: bool = True) -> None:
        work()

    def when_done(self, stream: Any, event: Any, callback: Callable[..., None]) -> None:
        callback()

    def synchronize(self) -> None: ...
    def close(self) -> None: ...
