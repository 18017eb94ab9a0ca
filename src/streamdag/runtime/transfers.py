"""Copies between host and device as ops on the copy streams (one per direction).

- Both sides of a host<->device copy have one dtype and shape (a copy moves
  bytes; it converts nothing).
- Pinned host memory is copied directly; the runtime keeps it referenced until
  the copy has completed.
- Pageable host memory is staged through pinned buffers. A copy of more than
  ``LANE_STAGING_BYTES`` (one chunk) is one op on a host lane, through a
  fixed ring of pinned buffers per device and direction (:class:`StagingRing`),
  in chunks, the host copy of one chunk overlapping the DMA of another: the
  submit returns at once. A smaller one is staged in the submitting thread
  (its host copy in; out, a host op unstages it), through a pool of bounded
  size (:class:`PinnedPool`), whose buffers return to the pool only once the
  ops that use them have completed.
- ``max_inflight_bytes`` bounds the bytes of transfers in flight: a copy that
  would pass it blocks the submitter until earlier copies complete (except in
  a done-callback, whose thread may be the one that finishes them).
- Between two devices, the copy is an op on the destination's peer copy
  stream, done by the source backend's ``peer_copy`` (PyTorch runs it on a
  stream of the source device, fenced both ways with the destination's).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Protocol

import numpy as np

from ..backends.capture_mode import relaxed
from ..graph.buffers import Access, Region, region_of
from ..native import load_torch
from . import arguments
from .ops import Future, all_of

__all__ = ["CopyRuntime", "copy", "to_device", "to_host"]


class CopyRuntime(Protocol):
    """What copies need of their runtime: its public calls, its copy streams and host lanes, the
    transfer bounds it owns (``budgets``), the submits onto a given stream, and whether host-lane
    ops write a copy's source (``held``)."""

    device: str
    devices: list[str]
    backends: list[Any]
    submit: Callable[..., Any]
    copy: Callable[..., Future]
    _compute_of: dict[str, range]
    _copy_index: dict[tuple[str, str], int]
    _host: Any  #: the host lanes (None on a CPU runtime)
    _bytes: Any  #: ``budgets.ByteBudget``
    _staging: Any  #: ``budgets.PinnedPool``
    _rings: dict[Any, Any]  #: the staging rings, by direction and device (made here)
    _copy_pinned: Any  #: the compiled copy of pinned memory, or None
    _submit: Callable[..., Any]
    _submit_on: Callable[..., Any]
    _recording_here: Callable[[], Any]
    _host_lane_for: Callable[[int | None], int]
    _host_data_written_on_lanes: Callable[..., bool]

CHUNK_BYTES = 8 << 20
#: pageable copies of more than this many bytes are staged on a host lane through a ring of pinned
#: buffers (the submit returns at once); smaller ones in the submitting thread, through the pool.
#: One chunk: up to there the lane's hand-offs cost more than the host copy holds the submitter (on
#: the H100, 2-8 MiB in: 0.2-0.3 ms slower through the lane, whose submit returns 0.1-0.25 ms sooner)
LANE_STAGING_BYTES = CHUNK_BYTES
#: a pageable copy out of at most this many bytes (one chunk) is unstaged by a copy that its copy
#: stream runs (a host function, over the torch extension's helper threads): on the H100, 1-8 MiB took
#: 0.19-0.48 ms this way against 0.25-0.63 through a host lane (0.25-0.27 ms against 0.39-0.43 at 2
#: MiB, where PyTorch's pageable copy took 0.22-0.27; then over PyTorch's threads, the helpers came
#: after). In one thread, the driver's, it had lost from 4 MiB on
STREAM_UNSTAGING_BYTES = CHUNK_BYTES
#: the ring's buffers (of CHUNK_BYTES) per device and direction: a chunk's copy on the host overlaps
#: the DMAs of the chunks before it
RING_DEPTH = 3


def _copy_into(dst: Any, src: Any) -> Any:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
        return dst
    return dst.copy_(_as_tensor(src))


def _direction(src_space: str, dst_space: str) -> str | None:
    if src_space == "cpu" and dst_space != "cpu":
        return "h2d"
    if dst_space == "cpu" and src_space != "cpu":
        return "d2h"
    if src_space != dst_space:
        return "p2p"
    return None


def _as_tensor(x: Any) -> Any:
    if isinstance(x, np.ndarray):  # (torch imported here only: a function-level import costs each call)
        import torch

        return torch.from_numpy(x)
    return x


def _copy_async(dst: Any, src: Any, keep: Any = None) -> Any:
    """A copy op's function; ``keep`` (a staging buffer) lives as long as the op, which holds it."""
    return dst.copy_(src, non_blocking=True)


def _device_copy(rt: CopyRuntime, dst: Any, src: Any, stream: int | None, name: str,
                 keep: Any = None, copier: Any = None, nbytes: int | None = None) -> Future:
    """One copy op on ``stream``, its bytes counted against the budget until it completes.

    ``copier``: the op's function in place of ``copy_`` (a peer copy done the source device's way,
    a small pageable copy out). ``nbytes``: the source's, where known.
    """
    if nbytes is None:
        nbytes = region_of(src).nbytes
    budget = rt._bytes
    budget.acquire(nbytes)
    # (no copy stream, on a backend without them: the Python path places it on a compute stream)
    submit_on = rt._submit_on if stream is not None else partial(type(rt)._submit_on, rt)
    try:
        if copier is not None:
            future = submit_on(stream, copier, dst, src, reads=[src], writes=[dst], name=name)
        elif keep is None:
            future = submit_on(stream, _copy_async, dst, src, reads=[src], writes=[dst], name=name)
        else:
            future = submit_on(stream, _copy_async, dst, src, keep, reads=[src], writes=[dst], name=name)
    except BaseException:
        budget.release(nbytes)
        raise
    if isinstance(future, Future):
        budget.hold(future, nbytes, stream)
    else:  # recorded: counted when the graph runs, not now
        budget.release(nbytes)
    return future


def _route(rt: CopyRuntime, dst: Any, src: Any) -> tuple[str | None, int | None, Region, Region]:
    """A copy's direction ("h2d", "d2h", "p2p"; None within one memory), the copy stream it runs
    on (None: the runtime has none for it) and the regions of ``src`` and ``dst``. Both regions come
    from one call of the submit's own (compiled) look-up, whose cache the copy's submit then hits:
    region_of in Python costs microseconds per tensor on a GPU host."""
    read, written = arguments.accesses_of((src,), (dst,))
    src_space, dst_space = read.region.space, written.region.space
    kind = _direction(src_space, dst_space)
    stream = rt._copy_index.get((kind, src_space if kind == "d2h" else dst_space))
    return kind, stream, read.region, written.region


#: a copy op's name where the caller gives none, by direction
_COPY_NAMES = {"h2d": "copy_h2d", "d2h": "copy_d2h", "p2p": "copy_p2p"}


def copy(rt: CopyRuntime, dst: Any, src: Any, name: str | None = None) -> Future[Any]:
    """Copy ``src`` into ``dst`` after every op it conflicts with; the result is ``dst``."""
    kind, stream, src_region, dst_region = _route(rt, dst, src)
    if kind is None:
        return rt.submit(_copy_into, dst, src, reads=[src], writes=[dst], name=name or "copy")
    name = name or _COPY_NAMES[kind]
    if kind == "p2p":
        return _peer_copy(rt, dst, src, src_region.space, dst_region.space, stream, name)
    src_t, dst_t = _as_tensor(src), _as_tensor(dst)
    _check_layouts(kind, dst_t, src_t)
    host = src_t if kind == "h2d" else dst_t
    if host.is_pinned() or rt._recording_here() is not None:
        return _device_copy(rt, dst_t, src_t, stream, name, nbytes=src_region.nbytes)
    ring = _ring(rt, kind, dst_t if kind == "h2d" else src_t)
    if ring is not None and src_region.nbytes > LANE_STAGING_BYTES:
        if kind == "h2d":
            return _staged_on_a_lane(rt, ring, _copy_in_through, dst_t, src_t, dst_t, name)
        return _staged_on_a_lane(rt, ring, _copy_out_through, dst_t, src_t, dst, name)
    if kind == "h2d":
        return _staged_h2d(rt, ring, dst_t, src_t, src_region, stream, name)
    return _staged_d2h(rt, dst, dst_t, src_t, src_region, stream, name)


def copier(rt: CopyRuntime, dst: Any, src: Any) -> Callable[[Any, Any], Future]:
    """A copy function for many copies like ``dst`` <- ``src`` (the same memories, pinnedness, dtype,
    layout): what :func:`copy` decides per call, decided once. Between pinned host memory and a
    device it submits the copy op straight on its copy stream (through the compiled ``rt.copy``
    where it is built, whose checks and byte count in C now cost less than this function's Python);
    else it is :func:`copy`. For ``stream_map``'s pieces.
    """
    kind, stream, _, _ = _route(rt, dst, src)
    if kind not in ("h2d", "d2h") or stream is None:
        return partial(copy, rt)
    src_t, dst_t = _as_tensor(src), _as_tensor(dst)
    if not (src_t if kind == "h2d" else dst_t).is_pinned():
        return partial(copy, rt)
    _check_layouts(kind, dst_t, src_t)
    default_name = _COPY_NAMES[kind]
    compiled = rt._copy_pinned

    def pinned_copy(d: Any, s: Any, name: str | None = None) -> Future[Any]:
        if compiled is not None:  # None back inside a recording: the Python path records it
            future = compiled(d, s, name or default_name)
            if future is not None:
                return future
        return _device_copy(rt, d, s, stream, name or default_name, nbytes=s.numel() * s.element_size())

    return pinned_copy


def _check_layouts(kind: str, dst: Any, src: Any) -> None:
    """A host<->device copy moves bytes: through staging buffers a pageable copy cannot convert a
    dtype or broadcast a shape, so no copy between the two may (else the same call would convert
    from pinned memory and reinterpret bytes from pageable memory)."""
    if dst.dtype != src.dtype or dst.shape != src.shape:
        raise ValueError(
            f"copy ({kind}) from {src.dtype} {tuple(src.shape)} into {dst.dtype} {tuple(dst.shape)}: a "
            "copy between host and device needs one dtype and shape on both sides. Convert or reshape "
            "on one side first (e.g. src.to(dst.dtype) on its own device), or use rt.to_device / "
            "rt.to_host, which make the destination")


def _peer_copy(rt: CopyRuntime, dst: Any, src: Any, src_space: str, dst_space: str, stream: int | None,
               name: str) -> Future:
    if stream is None or src_space not in rt._compute_of:
        raise ValueError(
            f"copy from {src_space} to {dst_space}: both must be devices of this runtime "
            f"({', '.join(rt.devices)}); create it with devices=[{src_space!r}, {dst_space!r}]"
        )
    source = rt.backends[rt.devices.index(src_space)]
    return _device_copy(rt, dst, src, stream, name, copier=getattr(source, "peer_copy", None))


def _copy_streaming(dst: Any, src: Any, nbytes: int) -> None:
    """Host data ``src`` into ``dst`` (contiguous both, ``nbytes``), with streaming stores over
    PyTorch's CPU threads where the torch extension is loaded (``stage_copy``), else PyTorch's copy.

    Into a staging buffer before its DMA: the DMA then reads memory, not the CPU's caches, at up
    to twice the speed (on the H100, pageable copies in of 8-64 MiB took 0.68-0.91x the time with
    PyTorch's copy). Out of one, into a large destination: no read of ``dst``'s lines before they
    are written (16-256 MiB out, 0.93-0.97x)."""
    ext = load_torch()
    if ext is None:
        dst.copy_(src)
    else:
        ext.stage_copy(dst.data_ptr(), src.data_ptr(), nbytes)


def _need_contiguous(dst: Any, src: Any) -> None:
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("staged copies need contiguous tensors: call .contiguous() first")


def _chunks(dst: Any, src: Any):
    """Flat byte views of both, cut into pieces of at most CHUNK_BYTES."""
    _need_contiguous(dst, src)
    d, s = dst.reshape(-1).view(dtype=_uint8()), src.reshape(-1).view(dtype=_uint8())
    for lo in range(0, s.numel(), CHUNK_BYTES):
        yield d[lo : lo + CHUNK_BYTES], s[lo : lo + CHUNK_BYTES]


def _uint8() -> Any:
    import torch

    return torch.uint8


class StagingRing:
    """The pinned buffers through which host lanes stage large pageable copies, for one direction of
    one device, with that device's staging stream and an event per buffer.

    A copy takes the whole ring (its lock) for as long as it runs: it copies chunk after chunk into
    the buffers in turn, each chunk's DMA running while the next chunk is copied, and waits for a
    buffer's DMA before it fills that buffer again. A fixed ring rather than the pool: a lane that
    waited on the pool for buffers held by copies that need a lane to give them back could wait
    forever. Made at the first such copy (``RING_DEPTH`` buffers of ``CHUNK_BYTES``).
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        #: its newest copy's future (weakly: once gone, its op has finished) and host lane: the next
        #: copy queues on that lane while it is pending (see :func:`_lane_for`)
        self.last: tuple[weakref.ref[Future[Any]], int] | None = None
        self.lock: threading.Lock = threading.Lock()
        self._buffers: list[Any] = []
        self._events: list[Any] = []

    @contextmanager
    def held(self) -> Iterator[tuple[list[Any], list[Any]]]:
        """The ring for one copy: its pinned buffers and their events, made at first use. Let go only
        once every DMA is done: a copy is done with its data in place, and no DMA may still read or
        write a buffer that the next copy fills (after a failure too). Relaxed capture mode: a CUDA
        graph capture in another thread must not fail at the waits."""
        import torch

        with self.lock, relaxed():
            if not self._buffers:
                self._buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
                                 for _ in range(RING_DEPTH)]
                self._events = [torch.cuda.Event() for _ in range(RING_DEPTH)]
            try:
                yield self._buffers, self._events
            finally:
                for event in self._events:
                    event.synchronize()


def _ring(rt: CopyRuntime, kind: str, device_tensor: Any) -> StagingRing | None:
    """The staging ring of ``kind`` for the device of ``device_tensor``; None where its backend has no
    staging streams (not CUDA) or the runtime no host lanes."""
    if rt._host is None:
        return None
    key = (kind, device_tensor.device)
    ring = rt._rings.get(key)
    if ring is None:
        space = region_of(device_tensor).space
        streams = getattr(rt.backends[rt.devices.index(space)], "staging_streams", None)
        if streams is None:
            return None
        ring = rt._rings.setdefault(key, StagingRing(streams[kind]))
    return ring


def _staged_on_a_lane(rt: CopyRuntime, ring: StagingRing, through: Callable[..., Any], dst: Any, src: Any,
                      result: Any, name: str) -> Future:
    """A pageable copy as one host-lane op (``through``: :func:`_copy_in_through` or
    :func:`_copy_out_through`) that reads ``src`` and writes ``dst``: it runs once the ops it follows
    have finished, and is done once the data is in place; the submit returns at once. Its bytes
    count against ``max_inflight_bytes`` until then."""
    _need_contiguous(dst, src)
    nbytes = src.numel() * src.element_size()
    budget = rt._bytes
    budget.acquire(nbytes)
    try:
        lane = _lane_for(rt, ring)
        future = rt._submit(through, (ring, dst, src, result), {}, [src], [dst], name, True, lane,
                            run_on="host")
    except BaseException:
        budget.release(nbytes)
        raise
    ring.last = (weakref.ref(future), lane)
    budget.hold(future, nbytes, ring)  # (never recorded: a recording copies op by op, see copy)
    return future


def _lane_for(rt: CopyRuntime, ring: StagingRing) -> int:
    """The host lane for a copy through ``ring``: the lane of its newest copy while that is pending,
    else the least busy one; never the calling thread's own lane (a copy queued behind the op that
    submits it would wait forever if that op waits for it).

    A burst of copies one way thus queues on one lane, in order, and leaves the other lanes to
    copies the other way, where the least busy lane for each copy had every lane but one waiting
    for the ring's lock: the 8 x 64 MiB copy/compute case from and into pageable memory, op by op, took
    49 ms that way against 42 on the H100.
    """
    last, pending = ring.last, None
    if last is not None:
        future = last[0]()
        if future is not None and not future.done():
            pending = last[1]
    return rt._host_lane_for(pending)


def _copy_in_through(ring: StagingRing, dst: Any, src: Any, result: Any) -> Any:
    """Pageable host ``src`` to device ``dst`` through ``ring``, on a host lane: each chunk copied into
    a staging buffer (:func:`_copy_streaming`), then by DMA on the staging stream."""
    from ..backends.cuda import copy_on

    stream = ring.stream
    with ring.held() as (buffers, events):
        in_flight = 0
        for k, (d, s) in enumerate(_chunks(dst, src)):
            slot = k % len(buffers)
            if in_flight == len(buffers):  # the buffer's last DMA must be done before it is refilled
                events[slot].synchronize()
                in_flight -= 1
            view = buffers[slot][: s.numel()]
            _copy_streaming(view, s, s.numel())
            copy_on(stream, d, view)
            events[slot].record(stream)
            in_flight += 1
    return result


def _copy_out_through(ring: StagingRing, dst: Any, src: Any, result: Any) -> Any:
    """Device ``src`` to pageable host ``dst`` through ``ring``, on a host lane: DMAs into the staging
    buffers on the staging stream, each buffer copied out to ``dst`` once its DMA is done, while the
    DMAs of the next chunks run."""
    from ..backends.cuda import copy_on

    stream = ring.stream
    with ring.held() as (buffers, events):
        waiting: deque[tuple[Any, Any, Any]] = deque()  # (host chunk, staged chunk, its DMA's event)

        def unstage() -> None:
            d, view, event = waiting.popleft()
            event.synchronize()
            _copy_streaming(d, view, view.numel())

        for k, (d, s) in enumerate(_chunks(dst, src)):
            slot = k % len(buffers)
            if len(waiting) == len(buffers):  # the buffer's chunk must be out before the next DMA
                unstage()
            view = buffers[slot][: s.numel()]
            copy_on(stream, view, s)
            events[slot].record(stream)
            waiting.append((d, view, events[slot]))
        while waiting:
            unstage()
    return result


def _staged_h2d(rt: CopyRuntime, ring: StagingRing | None, dst: Any, src: Any, src_region: Region,
                stream: int | None, name: str) -> Future:
    """A small pageable copy in: staged here, through the pool, unless host-lane ops write ``src``.

    A copy of one chunk or less (every copy here, where the runtime has host
    lanes) is staged whole, through one pool buffer seen as a tensor of
    ``dst``'s layout, by one DMA op whose result is ``dst``: the fewest torch
    calls, each of which costs microseconds on a GPU host.
    """
    reading = [Access(src_region, False)]
    if rt._host_data_written_on_lanes(reading, name):  # (else the host data is final now)
        # host-lane ops (or ops held behind them) write it: stage on a lane after them
        assert ring is not None  # (host-lane ops run beside a device, whose backend has the rings)
        return _staged_on_a_lane(rt, ring, _copy_in_through, dst, src, dst, name)
    pool = rt._staging
    if src_region.nbytes <= CHUNK_BYTES:
        _need_contiguous(dst, src)
        with pool.taken(src_region.nbytes) as stage:
            view = pool.typed(stage, dst.dtype, dst.shape)
            _copy_streaming(view, src, src_region.nbytes)
            future = _device_copy(rt, dst, view, stream, name, keep=stage, nbytes=src_region.nbytes)
        pool.lend(stage, future, stream)
        return future
    chunks = []
    for d, s in _chunks(dst, src):
        with pool.taken(s.numel()) as stage:
            view = stage[: s.numel()]
            _copy_streaming(view, s, s.numel())
            chunks.append(_device_copy(rt, d, view, stream, name, keep=stage, nbytes=s.numel()))
        pool.lend(stage, chunks[-1], stream)
    return all_of(chunks, dst, "copy")  # (a failed chunk fails the copy)


def _staged_d2h(rt: CopyRuntime, user_dst: Any, dst: Any, src: Any, src_region: Region, stream: int | None,
                name: str) -> Future:
    """A small pageable copy out: a DMA into a pool buffer on the copy stream, then a host op that
    unstages it, per chunk (a copy of one chunk or less through one staging tensor of ``src``'s
    layout, as in :func:`_staged_h2d`). A chunk's buffer is free once its host op is done, so that
    a copy of more chunks than the pool holds waits for its own first ones."""
    if src_region.nbytes <= CHUNK_BYTES:
        _need_contiguous(dst, src)
        return _unstaged(rt, dst, src, src_region.nbytes, True, stream, name, user_dst)
    pieces = [_unstaged(rt, d, s, s.numel(), False, stream, name, None) for d, s in _chunks(dst, src)]
    return all_of(pieces, user_dst, "copy")  # (a failed piece fails the copy)


def _unstaged(rt: CopyRuntime, dst: Any, src: Any, nbytes: int, whole: bool, stream: int | None, name: str,
              result: Any) -> Future:
    """One piece of :func:`_staged_d2h`: the future of the op that unstages it, which gives ``result``.

    Where the torch extension is loaded and the piece is a whole copy of up to
    ``STREAM_UNSTAGING_BYTES`` on a copy stream, one op there: the DMA, then a host copy that the
    stream runs once the DMA is done (:func:`_copy_out_on_stream`). Else the DMA, then a host op,
    on a host lane where the runtime has them.
    """
    pool = rt._staging
    ext = load_torch() if whole and stream is not None and nbytes <= STREAM_UNSTAGING_BYTES else None
    with pool.taken(nbytes) as stage:
        view = pool.typed(stage, src.dtype, src.shape) if whole else stage[:nbytes]
        if ext is not None:
            out = partial(_copy_out_on_stream, staged=view, keep=stage, nbytes=nbytes, result=result,
                          host_copy=ext.host_copy)
            future = _device_copy(rt, dst, src, stream, name, copier=out, nbytes=nbytes)
        else:
            dma = _device_copy(rt, view, src, stream, name, keep=stage, nbytes=nbytes)
    if ext is not None:
        pool.lend(stage, future, stream)
        return future
    # a host op, on a host lane where the runtime has them: it waits there for the DMA, not in the
    # submitting thread. The buffer is free once it is done (or failed, as after a failed DMA)
    try:
        future = rt.submit(_unstage, dst, view, result, reads=[view], writes=[dst], name=f"{name}_unstage",
                           run_on="host" if rt._host is not None else None)
    except BaseException:
        pool.lend(stage, dma, stream)
        raise
    pool.lend(stage, future, "unstage")  # (host ops: in any order, a late one holds up the rest)
    return future


def _copy_out_on_stream(dst: Any, src: Any, staged: Any, keep: Any, nbytes: int, result: Any,
                        host_copy: Callable[..., None]) -> Any:
    """A pageable copy out of one chunk as one op on the copy stream (current here): the DMA of ``src``
    into ``staged`` (of ``keep``, a pool buffer the op holds), then a copy into ``dst`` (over the
    torch extension's helper threads) that the stream runs when it gets there. The op's completion
    event follows both: no hand-off to a host lane and back."""
    staged.copy_(src, non_blocking=True)
    try:
        host_copy(dst.data_ptr(), staged.data_ptr(), nbytes)  # on the current stream
    except BaseException:
        import torch

        torch.cuda.current_stream().synchronize()  # the failed op's buffer goes back to the pool:
        raise                                        # no DMA may still write it
    return result


def _unstage(dst: Any, staged: Any, result: Any) -> Any:
    dst.copy_(staged)
    return result


def to_device(rt: CopyRuntime, x: Any, name: str | None = None, device: str | None = None) -> Future[Any]:
    """A Future of a new device tensor holding ``x`` (a torch CPU tensor or numpy array)."""
    import torch

    src = _as_tensor(x)
    dst = torch.empty(src.shape, dtype=src.dtype, device=device or rt.device)
    return rt.copy(dst, src, name or "to_device")


def to_host(rt: CopyRuntime, t: Any, name: str | None = None) -> Future[Any]:
    """A Future of a host tensor holding ``t``; it exists for the caller only once the copy is done.

    Pinned where ``t`` is on a device (its copy out runs on a copy stream); a host tensor (or
    numpy array) is copied into a new pageable tensor: pinning needs a device, and would gain nothing.
    """
    import torch

    src = _as_tensor(t)
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=not getattr(src, "is_cpu", False))
    return rt.copy(dst, src, name or "to_host")
