"""The backend protocol: the only place where threads and devices are touched.

A backend has streams that run their work in order, and events that order
streams with each other, with the meaning CUDA gives them:

- ``event.record(stream)``: the event completes when all work enqueued on
  ``stream`` so far has completed;
- ``event.wait(stream)``: work enqueued on ``stream`` afterwards starts only
  after the event's latest record completed (a never-recorded event is complete);
- ``launch(stream, work, after_caller=True)``: enqueue host code that *is* the
  op (CPU) or that enqueues the op's device work (CUDA, run at once with the
  stream current, after what the caller's current stream holds unless
  ``after_caller`` is False);
- ``when_done(stream, event, callback)``: call ``callback`` from a backend
  thread once ``event``, just recorded on ``stream``, has completed. It may
  return a token that the backend's optional ``hurry(wanted=token)`` takes,
  to finish that op ahead of others for someone who waits on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["Backend", "Event", "Stream"]


@runtime_checkable
class Stream(Protocol):
    index: int
    kind: str


@runtime_checkable
class Event(Protocol):
    def record(self, stream: Stream) -> None: ...
    def wait(self, stream: Stream) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...
    def elapsed_ms(self, end: Event) -> float: ...


@runtime_checkable
class Backend(Protocol):
    device: str
    #: True when ``launch`` runs the work on a backend thread later (CPU lanes),
    #: False when it runs it at once in the caller (CUDA enqueues kernels).
    deferred: bool

    @property
    def streams(self) -> list[Stream]: ...
    def event(self, timing: bool = False) -> Event: ...
    def launch(self, stream: Stream, work: Callable[[], None], after_caller: bool = True) -> None: ...
    def when_done(self, stream: Stream, event: Event, callback: Callable[[], None]) -> object: ...
    def synchronize(self) -> None: ...
    def close(self) -> None: ...
