"""CUDA backend through PyTorch: streams, events, copy streams, completion watchers.

``launch`` runs the op's host code at once with its stream current, so every
kernel it enqueues lands on that stream; nothing on this path synchronizes
the host. Completion is observed by one thread that polls each stream's
events in order (events of one stream complete in order, so a FIFO per
stream is exact), polling less often the longer nothing completes.

A sticky CUDA error (illegal address, device-side assert, launch failure)
makes every later call on the device fail; the backend then marks itself
lost and the runtime fails every pending and later op with
:class:`~streamdag.DeviceLost`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import DeviceLost
from ..native import load_torch, twin
from .cuda_calls import (
    _get_device,
    _get_stream,
    _record,
    _refuse_in_capture,
    _set_device,
    _set_stream,
    _wait,
    is_sticky,
    refused_during_capture,
)
from .cuda_completions import _Completions
from .cuda_streams import CudaEvent, CudaStream, _ordered_by_cuda, _OwnStreams, copy_on
from .threads import run_named, torch_profiler_on

__all__ = ["CudaBackend", "CudaEvent", "is_sticky"]

#: a clock mark's bracket (see ``CudaBackend.wall_of``): its midpoint is within half of it of the
#: moment the GPU ran the mark; a wider one is taken again, up to ``CLOCK_TRIES`` times
CLOCK_BRACKET_NS = 20_000
CLOCK_TRIES = 5

#: tells the compiled submit and pass that a device was lost: until then they take a
#: ``CudaBackend``'s ``lost`` to be None without looking it up (see ``CudaBackend.lost``)
_note_loss = twin("note_loss", None)


class CudaBackend:
    """``streams`` compute streams plus copy streams on one GPU: host-to-device, device-to-host, peer-in."""

    deferred = False

    def __init__(self, device: str, streams: int, default_stream_sync: bool = True) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device={device!r} needs PyTorch with CUDA and a GPU, and torch.cuda.is_available() "
                "is False here: use device='cpu'"
            )
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"{device!r}: this machine has {torch.cuda.device_count()} GPU(s)")
        self.torch_device: torch.device = torch.device("cuda", index)
        self.device: str = f"cuda:{index}"
        self._lost: DeviceLost | None = None
        #: the runtime's own CUDA streams (None: PyTorch's pool), given back at close(). Every one
        #: that ops are launched onto is blocking where ``default_stream_sync`` (see ``Runtime``):
        #: an event recorded on the caller's default stream to order one of them would wait for
        #: every blocking stream's work. ``peer_out`` is not: captures pull it in
        self._blocking = default_stream_sync
        self._own = _OwnStreams.take(index, streams + 3, blocking=default_stream_sync)
        self._own_peer = _OwnStreams.take(index, 4)  # peer_out, the two staging streams, the clock
        own = iter(self._own or [])
        side = iter(self._own_peer or [])

        def stream(i: int, kind: str) -> CudaStream:
            return CudaStream(i, kind, next(own, None), blocking=default_stream_sync)

        with torch.cuda.device(self.torch_device):
            self._streams = [stream(i, "compute") for i in range(streams)]
            self._copy = {"h2d": stream(streams, "h2d"), "d2h": stream(streams + 1, "d2h"),
                          "p2p": stream(streams + 2, "p2p")}
            #: where PyTorch runs the DMA of a peer copy out of this device (see :meth:`peer_copy`);
            #: during a capture its fences pull it in, and a capturing blocking stream would make
            #: any use of the default stream an error
            self.peer_out: CudaStream = CudaStream(-1, "peer_out", next(side, None))
            #: where a host lane's staged copy of pageable memory runs its DMAs, one per direction
            #: (see ``transfers.StagingRing``): non-blocking, since the lane's op has waited for the
            #: ops it follows before it copies, and it waits for its own DMAs itself
            self.staging_streams: dict[str, CudaStream] = {
                kind: CudaStream(-2 - i, f"staging_{kind}", next(side, None))
                for i, kind in enumerate(("h2d", "d2h"))}
            #: where :meth:`wall_of` records its marks: no op runs there, so an event recorded
            #: on it runs at once (None without the torch extension: no stream of PyTorch's pool is
            #: sure to be idle)
            self.clock_stream: CudaStream | None = (
                CudaStream(-4, "clock", self._own_peer[3]) if self._own_peer else None)
        self._all = self._streams + list(self._copy.values())
        self._free_events: list[CudaEvent] = []
        self._completions = _Completions(self, len(self._all))
        self._caller_event = torch.cuda.Event()
        self._index = index
        self._callers: dict[tuple[int, int, int], torch.cuda.Stream] = {}  # caller streams seen

    @property
    def streams(self) -> list[CudaStream]:
        return self._streams

    @property
    def copy_streams(self) -> dict[str, CudaStream]:
        return self._copy

    def event(self, timing: bool = False) -> CudaEvent:
        if not timing and self._free_events:
            return self._free_events.pop()
        return CudaEvent(timing, self.torch_device)

    def recycle(self, event: CudaEvent) -> None:
        """Take back an event whose op has finished.

        Safe to reuse: the runtime issues waits on an op's event only while the
        op is unfinished, under the same lock under which events are recorded.
        """
        if not event.timing:
            self._free_events.append(event)

    def launch(self, stream: CudaStream, work: Callable[[], None], after_caller: bool = True) -> None:
        """Run ``work`` with ``stream`` current; first order ``stream`` after the caller's stream.

        ``after_caller=False`` skips that order, for work already ordered (a graph's later ops).
        """
        caller_device = _get_device()
        prev = _get_stream(self._index)
        if after_caller and not _ordered_by_cuda(prev, stream):
            _refuse_in_capture(self._index, caller_device)
            # work the caller enqueued on its own stream (creating inputs, say) comes first;
            # a wait takes the event's state when it is issued, so one event object serves all
            _record(self._caller_event, self._caller_stream(prev))
            _wait(self._caller_event, stream)
        _set_stream(*stream.ids)
        try:
            if torch_profiler_on():  # (the compiled submit launches here while PyTorch profiles)
                run_named(work)
            else:
                work()
        finally:
            _set_stream(*prev)
            if caller_device != self._index:
                _set_device(caller_device)

    def _caller_stream(self, ids: tuple[int, int, int]) -> torch.cuda.Stream:
        """The caller's stream of these ids, made once (an event records on a Stream object)."""
        caller = self._callers.get(ids)
        if caller is None:
            caller = self._callers[ids] = torch.cuda.Stream(stream_id=ids[0], device_index=ids[1],
                                                            device_type=ids[2])
        return caller

    def caller_fence(self) -> CudaEvent | None:
        """An event recorded now on the caller's current stream, for an op that launches later from
        another thread (a held op, see ``Runtime._hold``); None where CUDA orders the op after that
        work anyway: the caller's stream is the legacy default stream, the runtime's are blocking."""
        prev = _get_stream(self._index)
        if _ordered_by_cuda(prev, self._streams[0]):  # (all of the runtime's are made alike)
            return None
        _refuse_in_capture(self._index, _get_device())
        fence = self.event()
        _record(fence, self._caller_stream(prev))
        return fence

    def launch_parts(self) -> tuple[Any, ...]:
        """What :meth:`launch` calls, for the compiled submit (``native/_submit.c``) to make the same
        calls: PyTorch's C entry points, the caller event, the caller streams seen, the event pool, and
        the completion queues (``when_done``) with what their ``put`` touches, what refuses a wait
        during a capture, and whether a PyTorch profiler runs (then :meth:`launch` names each op)."""
        return (_get_device, _get_stream, _set_stream, _set_device, _record, _wait, self._caller_event,
                self._callers, self._free_events, self._index, self._completions,
                self._completions.put_parts(), _refuse_in_capture, torch_profiler_on)

    def peer_copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``dst.copy_(src)`` from this device to another, inside an op on the destination's stream.

        PyTorch runs a cross-device copy on the source device's current stream,
        fenced both ways with the destination's current stream: the source side
        gets :attr:`peer_out`, so the copy never waits behind the caller's work.
        """
        copy_on(self.peer_out, dst, src)
        return dst

    def when_done(self, stream: CudaStream, event: CudaEvent, callback: Callable[..., None]) -> Any:
        """Call ``callback`` once ``event`` has completed; returns a token for :meth:`hurry`'s ``wanted``."""
        return self._completions.put(stream.index, event, callback)

    def finish_ready(self) -> None:
        """Finish the ops whose events have completed, in the calling thread, if no pass is under way.

        The runtime calls it every few submits. A thread that submits in a
        loop then finishes ops between its own launches, and the completion
        thread, seeing recent passes, stays asleep: the GIL does not change
        hands mid-burst. Timed in turns with and without it, it saves 0.7 µs
        per op for a chain of tiny ops, 4.4 µs with the default in-flight
        bound, 5.6 µs for independent ops, of 42-54 µs per op. A pass every
        32 submits with a 1 ms hold-off saves nothing.
        """
        self._completions.try_pass(submitting=True)

    def hurry(self, waiter: Any = None, seconds: float | None = None, wanted: Any = None) -> None:
        """Finish completed ops now rather than at the end of the completion thread's pause.

        With ``waiter`` (a future someone waits on), the calling thread also
        finishes them itself until ``waiter`` is done, for up to ``seconds``
        (at most ``SPIN_SECONDS``, see ``_Completions.help``). ``wanted``, a token from
        :meth:`when_done`: someone waits on that op without helping; the
        completion thread finishes it first.
        """
        completions = self._completions
        if wanted is not None:
            completions.want(wanted)
        elif waiter is None:
            completions.hurry()
        if waiter is not None:  # the completion thread is hurried only if the waiter stops helping
            completions.help(waiter, seconds, hurry_if_left=True)

    def help(self, waiter: Any, seconds: float) -> None:
        """Finish completed ops in the calling thread until ``waiter`` is done, for up to ``seconds``
        (0: one poll). For a waiter that only it can get finished (see ``Runtime``)."""
        self._completions.help(waiter, seconds)

    is_sticky: Callable[[BaseException], bool] = staticmethod(is_sticky)

    @property
    def lost(self) -> DeviceLost | None:
        """What every pending and later op on this device fails with once it is lost, else None."""
        return self._lost

    @lost.setter
    def lost(self, error: DeviceLost | None) -> None:
        self._lost = error
        if error is not None and _note_loss is not None:
            _note_loss()

    def mark_lost(self, exc: BaseException) -> DeviceLost | None:
        """The device is lost after ``exc``, a sticky error that an event query raised (or an op):
        returns what every pending and later op fails with. None where ``exc`` is a query refused
        during a CUDA graph capture (:func:`refused_during_capture`): nothing is lost, and the
        completion passes query that event again later."""
        if refused_during_capture(exc):
            return None
        if self.lost is None:
            self.lost = DeviceLost(self.device, exc)
        return self.lost

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def wall_of(self, event: CudaEvent) -> int | None:
        """The wall clock (``time.time_ns``) at the moment the GPU ran ``event``, a timing event:
        what maps a profile's events to the wall clock (``Profiler``). A base event recorded behind
        queued work runs after the wall clock read beside its record, by as long as that work
        takes; so ``event`` is timed against a mark taken now, an event on a stream no op uses
        whose moment is bracketed between the clock read before its record and the one when a
        query first sees it done. A bracket wider than ``CLOCK_BRACKET_NS`` (a thread switch
        between the two, or a busy GPU that ran the mark late) is taken again, up to
        ``CLOCK_TRIES`` times. Queries are made in relaxed capture mode, which a capture in another
        thread allows. None where there is no such mark (without the torch extension, on a lost
        device, with every bracket too wide) or ``event`` has not run."""
        query = getattr(load_torch(), "query_relaxed", None)
        if query is None or self.clock_stream is None or self.lost is not None or not query(event):
            return None
        for _ in range(CLOCK_TRIES):
            mark = CudaEvent(True, self.torch_device)
            before = time.time_ns()
            mark.record(self.clock_stream)
            deadline = before + 1_000_000_000
            while not query(mark):
                if time.time_ns() > deadline:
                    return None
            after = time.time_ns()
            if after - before <= CLOCK_BRACKET_NS:
                return (before + after) // 2 - round(event.elapsed_ms(mark) * 1e6)
        return None

    def close(self) -> None:
        self._completions.stop()
        if self._own:
            own, self._own = self._own, None
            _OwnStreams.give_back(self._index, own, blocking=self._blocking)
        if self._own_peer:
            own, self._own_peer = self._own_peer, None
            _OwnStreams.give_back(self._index, own)


_note_losses_of = twin("note_losses_of", None)
if _note_losses_of is not None:  # its ``lost`` notes each loss (see the property)
    _note_losses_of(CudaBackend)
