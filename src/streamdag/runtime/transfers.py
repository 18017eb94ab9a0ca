"""Copies between host and device as ops on the copy streams (one per direction).

- Both sides of a host<->device copy have one dtype and shape (a copy moves
  bytes; it converts nothing).
- Pinned host memory is copied directly; the runtime keeps it referenced until
  the copy has completed.
- Pageable host memory is staged through pinned buffers from a pool of
  bounded size (:class:`PinnedPool`), in chunks, so that the host copy of one
  chunk overlaps the DMA of the one before. A buffer returns to the pool only
  once the copy that reads or writes it has completed.
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
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ..graph.buffers import Region, region_of
from . import ops
from .ops import Future, all_of, in_done_callback

if TYPE_CHECKING:
    from .core import Runtime

__all__ = ["ByteBudget", "PinnedPool", "copy", "to_device", "to_host"]

CHUNK_BYTES = 8 << 20


class ByteBudget:
    """Blocks while ``limit`` bytes are in flight; one transfer larger than the limit runs alone.

    A copy's bytes come back once its future is seen done. The budget keeps the
    copies it counts (:meth:`hold`), per stream, and looks at the oldest of each
    stream (a stream finishes its copies in order): a hold gives back the bytes
    of up to two done copies at its stream's head, and an acquire that does not
    fit looks at every stream. No done-callback per copy, which cost more than
    the copy's submit. A submitter that must wait helps finish the oldest copy.
    A copy's future is held weakly: once nobody holds it, its op has finished
    (a pending op keeps its future), and the tensor it resolves to is not kept
    alive here.
    """

    def __init__(self, limit: int, on_wait: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()  # taken directly where nobody waits: a Condition's is slower
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # acquirers asleep on _cond
        self._held: dict[Any, deque[tuple[weakref.ref[Future], int]]] = {}  # per stream, oldest first
        #: called before blocking (bytes come back when ops are seen finished); None: nothing
        self.on_wait = on_wait

    def acquire(self, n: int) -> None:
        """Count ``n`` bytes, once they fit; then :meth:`hold` them with their copy, or :meth:`release`."""
        while True:
            with self._lock:
                if self.used and self.used + n > self.limit:
                    self._reclaim()
                # a done-callback's thread may be the one that brings bytes back: it goes over the limit
                if not self.used or self.used + n <= self.limit or in_done_callback():
                    self.used += n
                    if self.used > self.peak:
                        self.peak = self.used
                    return
                oldest = self._oldest()
                if oldest is None:  # counted by a submit that holds them in a moment, or releases them
                    self._waiting += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._waiting -= 1
                    continue
            if self.on_wait is not None:
                self.on_wait()
            oldest.exception()  # waits (helping finish it); its failure is the caller's to see elsewhere

    def hold(self, future: Future, n: int, stream: Any) -> None:
        """The ``n`` bytes acquired for a copy on ``stream`` come back once ``future`` is done."""
        with self._lock:
            held = self._held.get(stream)
            if held is None:
                held = self._held[stream] = deque()
            self._give_back_done(held, most=2)  # a little per copy: no long pass at a later one
            held.append((weakref.ref(future), n))
            if self._waiting:
                self._cond.notify_all()

    def release(self, n: int) -> None:
        """Give back ``n`` bytes acquired for a copy that was not made (or is known to be done)."""
        with self._lock:
            self.used -= n
            if self._waiting:
                self._cond.notify_all()

    def reclaim(self) -> int:
        """Give back the bytes of the copies seen done; returns the bytes still in flight."""
        with self._lock:
            self._reclaim()
            return self.used

    def _reclaim(self) -> None:
        for held in self._held.values():
            self._give_back_done(held)

    def _give_back_done(self, held: deque[tuple[weakref.ref[Future], int]], most: int | None = None) -> None:
        """Give back the bytes of the done copies at the head of one stream's ``held`` (at most ``most``)."""
        while held and (most is None or most > 0):
            future = held[0][0]()
            if future is not None and not future.done():
                break
            self.used -= held.popleft()[1]
            if most is not None:
                most -= 1

    def _oldest(self) -> Future | None:
        for held in self._held.values():
            if held:
                future = held[0][0]()
                if future is not None:
                    return future
        return None


class PinnedPool:
    """Reused pinned host buffers, at most ``limit`` bytes in all; ``take`` blocks when spent."""

    def __init__(self, limit: int, on_wait: Callable[[], None] | None = None) -> None:
        self.limit = limit
        self._free: dict[int, list[Any]] = {}
        self._held = 0
        self._cond = threading.Condition()
        #: called before blocking (buffers come back when ops are seen finished); None: nothing
        self.on_wait = on_wait

    def take(self, nbytes: int) -> Any:
        import torch

        size = 1 << max(nbytes - 1, 0).bit_length()  # size classes: powers of two
        with self._cond:
            while True:
                free = self._free.get(size)
                if free:
                    return free.pop()
                if self._held + size <= self.limit or self._held == 0 or in_done_callback():
                    self._held += size
                    break
                if not self._drop_one_free():
                    if self.on_wait is not None:
                        self.on_wait()
                    self._cond.wait()
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def _drop_one_free(self) -> bool:
        for size, bufs in self._free.items():
            if bufs:
                bufs.pop()
                self._held -= size
                return True
        return False

    def give(self, buf: Any) -> None:
        with self._cond:
            self._free.setdefault(buf.numel(), []).append(buf)
            self._cond.notify_all()


def _copy_into(dst: Any, src: Any) -> Any:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
        return dst
    return dst.copy_(src)


def _direction(src_space: str, dst_space: str) -> str | None:
    if src_space == "cpu" and dst_space != "cpu":
        return "h2d"
    if dst_space == "cpu" and src_space != "cpu":
        return "d2h"
    if src_space != dst_space:
        return "p2p"
    return None


def _as_tensor(x: Any) -> Any:
    import torch

    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _copy_async(dst: Any, src: Any, keep: Any = None) -> Any:
    """A copy op's function; ``keep`` (a staging buffer) lives as long as the op, which holds it."""
    return dst.copy_(src, non_blocking=True)


def _device_copy(rt: Runtime, dst: Any, src: Any, stream: int | None, name: str,
                 keep: Any = None, copier: Any = None, nbytes: int | None = None) -> Future:
    """One copy op on ``stream``, its bytes counted against the budget until it completes.

    ``copier``: a peer copy, done the source device's way. ``nbytes``: the source's, where known.
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


def _route(rt: Runtime, dst: Any, src: Any) -> tuple[str | None, int | None, Region, Region]:
    """A copy's direction ("h2d", "d2h", "p2p"; None within one memory), the copy stream it runs
    on (None: the runtime has none for it) and the regions of ``src`` and ``dst``. Both regions come
    from one call of the submit's own (compiled) look-up, whose cache the copy's submit then hits:
    region_of in Python costs microseconds per tensor on a GPU host."""
    read, written = ops.accesses_of((src,), (dst,))
    src_space, dst_space = read.region.space, written.region.space
    kind = _direction(src_space, dst_space)
    stream = rt._copy_index.get((kind, src_space if kind == "d2h" else dst_space))
    return kind, stream, read.region, written.region


def copy(rt: Runtime, dst: Any, src: Any, name: str | None = None) -> Future:
    """Copy ``src`` into ``dst`` after every op it conflicts with; the result is ``dst``."""
    kind, stream, src_region, dst_region = _route(rt, dst, src)
    if kind is None:
        return rt.submit(_copy_into, dst, src, reads=[src], writes=[dst], name=name or "copy")
    name = name or f"copy_{kind}"
    if kind == "p2p":
        return _peer_copy(rt, dst, src, src_region.space, dst_region.space, stream, name)
    src_t, dst_t = _as_tensor(src), _as_tensor(dst)
    _check_layouts(kind, dst_t, src_t)
    host = src_t if kind == "h2d" else dst_t
    if host.is_pinned() or rt._recording_here() is not None:
        return _device_copy(rt, dst_t, src_t, stream, name, nbytes=src_region.nbytes)
    if kind == "h2d":
        return _staged_h2d(rt, dst_t, src_t, stream, name)
    return _staged_d2h(rt, dst, dst_t, src_t, stream, name)


def copier(rt: Runtime, dst: Any, src: Any) -> Callable[[Any, Any], Future]:
    """A copy function for many copies like ``dst`` <- ``src`` (the same memories, pinnedness, dtype,
    layout): what :func:`copy` decides per call, decided once. Between pinned host memory and a
    device it submits the copy op straight on its copy stream; else it is :func:`copy`. For
    ``stream_map``'s pieces: on the H100 the checks took 4 of the 11 µs that ``rt.copy`` adds to
    PyTorch's own ``copy_`` (``bench/overhead.py``).
    """
    kind, stream, _, _ = _route(rt, dst, src)
    if kind not in ("h2d", "d2h") or stream is None:
        return partial(copy, rt)
    src_t, dst_t = _as_tensor(src), _as_tensor(dst)
    if not (src_t if kind == "h2d" else dst_t).is_pinned():
        return partial(copy, rt)
    _check_layouts(kind, dst_t, src_t)

    def pinned_copy(d: Any, s: Any, name: str | None = None) -> Future:
        return _device_copy(rt, d, s, stream, name or f"copy_{kind}", nbytes=s.numel() * s.element_size())

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


def _peer_copy(rt: Runtime, dst: Any, src: Any, src_space: str, dst_space: str, stream: int | None,
               name: str) -> Future:
    if stream is None or src_space not in rt._compute_of:
        raise ValueError(
            f"copy from {src_space} to {dst_space}: both must be devices of this runtime "
            f"({', '.join(rt.devices)}); create it with devices=[{src_space!r}, {dst_space!r}]"
        )
    source = rt.backends[rt.devices.index(src_space)]
    return _device_copy(rt, dst, src, stream, name, copier=getattr(source, "peer_copy", None))


def _chunks(dst: Any, src: Any):
    """Flat byte views of both, cut into pieces of at most CHUNK_BYTES."""
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("staged copies need contiguous tensors: call .contiguous() first")
    d, s = dst.reshape(-1).view(dtype=_uint8()), src.reshape(-1).view(dtype=_uint8())
    for lo in range(0, s.numel(), CHUNK_BYTES):
        yield d[lo : lo + CHUNK_BYTES], s[lo : lo + CHUNK_BYTES]


def _uint8() -> Any:
    import torch

    return torch.uint8


def _staged_h2d(rt: Runtime, dst: Any, src: Any, stream: int | None, name: str) -> Future:
    from ..graph.buffers import Access
    from .core import _wait_for_host_inputs

    reading = [Access(region_of(src), False)]
    with rt._lock:  # the host data must be final before we read it
        behind = bool(rt._host_ops) and bool(rt._host_deps(reading, name))
        if not behind:  # (device ops that write it: waited for on their events)
            _wait_for_host_inputs(reading, rt._tracker.depends_on(reading))
    if behind:  # host-lane ops (or ops held behind them) write it: stage on a lane after them
        return _staged_h2d_on_lanes(rt, dst, src, stream, name)
    chunks = []
    for d, s in _chunks(dst, src):
        stage = rt._staging.take(s.numel())
        view = stage[: s.numel()]
        view.copy_(s)
        chunks.append(_device_copy(rt, d, view, stream, name, keep=stage))
        chunks[-1]._on_done(lambda _f, stage=stage: rt._staging.give(stage))
    return all_of(chunks, dst, "copy")  # (a failed chunk fails the copy)


def _staged_h2d_on_lanes(rt: Runtime, dst: Any, src: Any, stream: int | None, name: str) -> Future:
    """:func:`_staged_h2d` after unfinished host-lane ops that write ``src``: each chunk is staged by
    a host-lane op, which runs after them, and copied by a device op, held behind it (see
    ``Runtime._hold``). The submit returns at once, but for the staging buffers' bound."""
    chunks = []
    for d, s in _chunks(dst, src):
        stage = rt._staging.take(s.numel())
        view = stage[: s.numel()]
        rt.submit(_copy_into, view, s, reads=[s], writes=[view], name=f"{name}_stage", run_on="host")
        chunks.append(_device_copy(rt, d, view, stream, name, keep=stage))
        chunks[-1]._on_done(lambda _f, stage=stage: rt._staging.give(stage))
    # each chunk's copy is launched once its staging is done, and two lanes stage side by side: a
    # later chunk's copy may complete before an earlier one's has even been launched
    return all_of(chunks, dst, "copy")


def _staged_d2h(rt: Runtime, user_dst: Any, dst: Any, src: Any, stream: int | None,
                name: str) -> Future:
    pieces = []
    for d, s in _chunks(dst, src):
        stage = rt._staging.take(s.numel())
        view = stage[: s.numel()]
        _device_copy(rt, view, s, stream, name, keep=stage)
        pieces.append((d, view, stage))

    def unstage() -> Any:
        for d, view, stage in pieces:
            d.copy_(view)
            rt._staging.give(stage)
        return user_dst

    # a host op, on a host lane where the runtime has them: it waits there for the copies into
    # the staging buffers, not in the submitting thread
    return rt.submit(unstage, reads=[v for _, v, _ in pieces], writes=[dst], name=f"{name}_unstage",
                     run_on="host" if rt._host is not None else None)


def to_device(rt: Runtime, x: Any, name: str | None = None, device: str | None = None) -> Future:
    """A Future of a new device tensor holding ``x`` (a torch CPU tensor or numpy array)."""
    import torch

    src = _as_tensor(x)
    dst = torch.empty(src.shape, dtype=src.dtype, device=device or rt.device)
    return copy(rt, dst, src, name or "to_device")


def to_host(rt: Runtime, t: Any, name: str | None = None) -> Future:
    """A Future of a pinned host tensor holding ``t``; it exists for the caller only once the copy is done."""
    import torch

    dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return copy(rt, dst, t, name or "to_host")
