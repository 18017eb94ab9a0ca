"""The CUDA backend's streams and events: PyTorch objects that know their place in a runtime.

``CudaStream`` and ``CudaEvent`` are PyTorch's own types, so that events record and wait in C.
``_OwnStreams`` keeps the pool of CUDA streams made for runtimes alone (its state: the free
addresses per device and kind, under its re-entrant lock).
"""

from __future__ import annotations

import threading
from typing import ClassVar

import torch

from ..native import load_torch
from .cuda_calls import (
    _event_base,
    _get_device,
    _get_stream,
    _sanitizer_enabled,
    _set_device,
    _set_stream,
    _wait,
)

__all__ = ["CudaEvent", "CudaStream", "copy_on"]


def copy_on(stream: CudaStream, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)`` with ``stream`` current (and its device), the caller's
    stream and device restored after, through PyTorch's C entry points: ``with
    torch.cuda.stream(stream)`` costs 30-45 µs per call, which a staged copy would pay for every
    chunk (``transfers.StagingRing``)."""
    device = _get_device()
    prev = _get_stream(stream.device_index)
    _set_stream(*stream.ids)  # (PyTorch makes the stream's device current too)
    try:
        dst.copy_(src, non_blocking=True)
    finally:
        _set_stream(*prev)
        if device != stream.device_index:
            _set_device(device)


class CudaStream(torch.cuda.Stream):
    """One of the runtime's streams on the current device, which knows its place among them
    (``index``, ``kind``). A PyTorch stream itself, so that events record on it and wait for it in
    C, with no Python call in between: that runs for every op.

    ``address``: a CUDA stream of the runtime's own (see :class:`_OwnStreams`), wrapped as PyTorch
    wraps an external one; None: one from PyTorch's pool. ``blocking``: that stream is a CUDA
    blocking stream, which CUDA orders after the legacy default stream's work.
    """

    def __new__(cls, index: int, kind: str, address: int | None = None, blocking: bool = False) -> CudaStream:
        self = super().__new__(cls) if address is None else super().__new__(cls, stream_ptr=address)
        self.index: int = index
        self.kind: str = kind
        self.blocking: bool = blocking and address is not None
        self.ids: tuple[int, int, int] = (self.stream_id, self.device_index, self.device_type)
        return self


class _OwnStreams:
    """CUDA streams made for runtimes alone, reused from one closed runtime to the next.

    PyTorch hands out its streams from a pool of 32 per device, round robin: every
    ``torch.cuda.Stream()`` (a second runtime's, a CUDA graph capture's side streams, the user's
    own) may be one of a runtime's twelve. Their work then runs in one queue, in turn, and a
    CUDA call onto a stream from a thread other than the one capturing on it ends that capture
    in an error. Made by the torch extension (``new_stream``); without it, PyTorch's pool.
    """

    #: re-entrant: a gone graph runner gives its streams back from a finalizer, which the
    #: collector may run in a thread that is in ``take``
    _lock = threading.RLock()
    _free: ClassVar[dict[tuple[int, bool], list[int]]] = {}  # per device, non-blocking or blocking

    @classmethod
    def take(cls, device: int, n: int, blocking: bool = False) -> list[int] | None:
        """``n`` stream addresses on ``device``, free ones first; None without the torch extension.

        ``blocking``: streams that CUDA orders after the legacy default stream's work (and that
        stream's later work after theirs): the streams a runtime launches ops onto, which then need
        no event to follow a caller on the default stream. Never for a capture: any use of the
        default stream during it would end it in an error.
        """
        ext = load_torch()
        make = getattr(ext, "new_stream", None)
        if make is None:
            return None
        with cls._lock:
            free = cls._free.setdefault((device, blocking), [])
            taken = [free.pop() for _ in range(min(n, len(free)))]
        return taken + [make(device, blocking) for _ in range(n - len(taken))]

    @classmethod
    def give_back(cls, device: int, addresses: list[int], blocking: bool = False) -> None:
        """For the next runtime: the work queued on them stays ordered before its own."""
        with cls._lock:
            cls._free.setdefault((device, blocking), []).extend(addresses)


class CudaEvent(_event_base if _event_base is not None else object):  # type: ignore[misc]
    """A PyTorch CUDA event. ``record``, ``wait``, ``query`` and ``synchronize`` are PyTorch's own,
    in C: an op's event is recorded for every op.

    Not a blocking-sync event (whose host wait sleeps until an interrupt): recording one after
    each launch adds 1.20 µs per launch, a plain one 0.23, timed from C++. So
    a host wait on it (``synchronize``) spins or yields as CUDA's scheduling flags say, and the
    completion thread polls (see ``_Completions``) rather than sleeping in it.
    """

    def __new__(cls, timing: bool = False, device: torch.device | None = None) -> CudaEvent:
        if timing and cls is CudaEvent:  # so that an event of this exact type never times (see below)
            cls = _TimingCudaEvent
        self = super().__new__(cls, enable_timing=timing, blocking=False)  # type: ignore[call-arg]
        self.timing, self.home = timing, device  # (PyTorch's ``device`` is where it was recorded)
        return self

    def caller_waits(self) -> None:
        """Make the caller's current stream on this event's device wait for it; the host goes on."""
        _wait(self, torch.cuda.current_stream(self.home))

    def elapsed_ms(self, end: CudaEvent) -> float:
        return self.elapsed_time(end)  # type: ignore[attr-defined]


class _TimingCudaEvent(CudaEvent):
    """A CUDA event that times (``CudaEvent(timing=True)``): never back in the event pool. Its own
    type, so the compiled completion pass tells a pool event by its type, without an attribute
    look-up per op (``native/_submit.c``: ``finish_head``)."""


def _ordered_by_cuda(caller: tuple[int, int, int], stream: CudaStream) -> bool:
    """Whether CUDA itself orders work on ``stream`` after the caller's earlier work: the caller's
    stream (its ids) is the legacy default stream (id 0) and ``stream`` is blocking. Not under a
    stream sanitizer, which models events only. (The same rule in C++: ``ordered_by_cuda``.)"""
    return caller[0] == 0 and stream.blocking and not _sanitizer_enabled()
