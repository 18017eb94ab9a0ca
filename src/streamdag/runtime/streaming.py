"""Stream host data through a device function in pieces, so copies in, compute and copies out overlap.

A program that copies a batch in, computes on it and copies it out cannot
finish sooner than its first batch in and its last batch out, which no other
work can overlap: with eight batches of 64 MiB that is two batches' copies on
top of the link's time (about 1.15x of it on an H100). When the function maps
rows one to one (``fn(x)[i]`` depends on ``x[i]`` only), the runtime may cut
every batch into pieces of a few MiB: the unoverlapped head and tail shrink
with the piece, while the host still submits far ahead of the device.

The pieces are copied into a ring of ``buffers`` device buffers, reused: the
runtime orders a piece's copy into a buffer after the compute that read the
buffer's previous piece, by an event (a dependency inferred from the buffer, as
for any op). Each compute writes a new device tensor, which the runtime keeps
until its copy out completes; the submitter waits before it has more than
``2 * buffers`` of them. So device memory stays at ``3 * buffers`` pieces
whatever the input's size, and a piece that fails fails only its own input:
a later piece reuses the buffer it read (a failed reader changed nothing), not
one it wrote. Captured (``capture=True``), a full piece's compute is a
recorded graph per buffer, writing a ring of output buffers too; the ring and
its graphs are kept for the next call with the same function, which has them
to itself (a concurrent call makes its own).

Without ``out``, the first piece's result tells the outputs' shape and dtype.
Where ops run inside their submit (CUDA), that piece's op makes the outputs
and copies its result out itself, so the call does not wait for the device;
on the CPU lanes the call waits for that piece. A captured call remembers
what it made, and the next call with inputs of the same kinds makes its
outputs at once.

Inside ``rt.record()`` (with ``out``) the pieces' ops are recorded, not run:
each run of the graph copies, computes and copies out every piece, and on
CUDA the whole call is one captured graph, with no host work per piece
(``capture`` is moot there: the recording is captured).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from ..graph.buffers import region_of
from .ops import Future, all_of
from .transfers import copier

__all__ = ["StreamMapRuntime", "stream_map"]


class StreamMapRuntime(Protocol):
    """What ``stream_map`` needs of the runtime: its public calls, whether this thread records, and
    where it keeps the captured pieces of each function."""

    device: str
    backend: Any
    submit: Callable[..., Any]
    copy: Callable[..., Any]
    record: Callable[[], Any]
    _recording_here: Callable[[], Any]
    _stream_maps: Any  #: a weak dictionary, by function: dropped with it

# A piece's copies must take longer than the host's submit of the piece, or the host sets the pace:
# on an H100, the 14 kernels of bench/overlap.py's compute took 0.45 ms of host time per piece,
# the link 0.17 ms per 8 MiB. Captured, the compute is one graph launch: 16 MiB pieces (0.33 ms).
PIECE_BYTES = 32 << 20
CAPTURED_PIECE_BYTES = 16 << 20
# From or into pageable memory, each piece's copy of more than 8 MiB is a host-lane op staged through
# a ring of pinned buffers, and each such op costs ~0.5 ms that overlaps nothing (its first chunk's
# host copy, its last DMA): on an H100 the 8 x 64 MiB copy/compute case took 55-59 ms in 16 MiB pieces,
# 35-38 in 64 MiB ones. Pieces of at most 1/MIN_PAGEABLE_PIECES of the data (the head and tail that
# nothing overlaps: one piece's copy in, one's copy out).
PAGEABLE_PIECE_BYTES = 64 << 20
MIN_PAGEABLE_PIECES = 8
WINDOW = 2  # the submitter waits before more than WINDOW * buffers pieces await their copy out
MIN_PIECES = 16  # a small input is still cut into this many pieces, down to
MIN_PIECE_BYTES = 256 << 10  # pieces this small, below which per-copy costs dominate


def stream_map(rt: StreamMapRuntime, fn: Callable[[Any], Any], inputs: Any, out: Any = None, *,
               piece_bytes: int | None = None, buffers: int = 4, reads: Iterable[Any] = (),
               capture: bool = False, name: str = "stream_map") -> Any:
    """Futures of ``fn`` applied to host tensors on the runtime's device, piece by piece.

    See :meth:`Runtime.stream_map`.
    """
    import torch

    single = isinstance(inputs, torch.Tensor) or _is_array(inputs)
    batches = [_host_tensor(x, "input") for x in ([inputs] if single else inputs)]
    if out is None:
        outs: list[Any] | None = None
    else:
        outs = [_host_tensor(o, "out") for o in ([out] if single else out)]
        _check_outs(batches, outs)
    if not batches:
        return []
    if buffers < 2:
        raise ValueError(f"buffers must be at least 2 (a piece computes while the next copies in), "
                         f"got {buffers}")
    extra_reads = list(reads)
    device = rt.device if rt.device not in ("cpu", "sim") else "cpu"
    if rt._recording_here() is not None:  # the pieces' ops go into the graph: its capture is one CUDA graph
        if outs is None:
            raise RuntimeError(
                "stream_map inside `with rt.record()` needs `out` (host tensors, pinned for the fastest "
                "copies): without it the first piece's result tells the outputs' shape, which a recording "
                "does not run; or call it outside `with rt.record()`")
        rows = _rows_per_piece(batches, piece_bytes, CAPTURED_PIECE_BYTES)
        _submit_pieces(rt, fn, batches, outs, rows, _Ring(device, buffers), extra_reads, name, single,
                       recording=True)
        return outs[0] if single else outs
    pageable = device != "cpu" and not all(t.is_pinned() for t in [*batches, *(outs or [])])
    default = PAGEABLE_PIECE_BYTES if pageable else CAPTURED_PIECE_BYTES if capture else PIECE_BYTES
    rows = _rows_per_piece(batches, piece_bytes, default, MIN_PAGEABLE_PIECES if pageable else MIN_PIECES)
    if not capture:
        return _submit_pieces(rt, fn, batches, outs, rows, _Ring(device, buffers), extra_reads, name, single)
    kept, key = _kept_rings(rt, fn, device, buffers, extra_reads)
    # a call has its ring to itself: two calls sharing buffers would interleave their pieces' copies
    ring = kept.pop(key, None) if kept is not None else None
    ring = ring or _Ring(device, buffers)
    try:
        return _submit_pieces(rt, fn, batches, outs, rows, ring, extra_reads, name, single, capture=True)
    finally:
        if kept is not None:
            kept[key] = ring


def _submit_pieces(rt: StreamMapRuntime, fn: Callable[[Any], Any], batches: list[Any], outs: list[Any] | None,
                   rows: int, ring: _Ring, extra_reads: list[Any], name: str, single: bool,
                   capture: bool = False, recording: bool = False) -> Any:
    """stream_map's submits, through ``ring``'s buffers: a Future per input (one if ``single``).

    ``recording``: into the graph this thread records (``outs`` given); each piece's compute writes
    the ring's output buffer, and nothing waits (no op runs until the graph does); returns None.
    """
    import torch

    device = ring.device
    pinned = device != "cpu"  # outputs made here: pinned where they are copied from a device
    buffers = ring.count
    ring.restart()
    # the kinds of the inputs, where a captured call makes its outputs (see ``_Ring.out_kinds``)
    kinds = tuple((tuple(x.shape[1:]), x.dtype) for x in batches) if outs is None and capture else None
    if kinds is not None and kinds in ring.out_kinds:  # a captured fn keeps its shapes: as last time
        trailing, dtype = ring.out_kinds[kinds]
        outs = [torch.empty((x.shape[0], *trailing), dtype=dtype, pin_memory=pinned) for x in batches]
    copies_of: list[list[Future[Any]]] = []
    unfinished: deque[Future[Any]] = deque()
    name_in, name_out = f"{name}_in", f"{name}_out"
    for b, x in enumerate(batches):
        copies: list[Future[Any]] = []
        copies_of.append(copies)
        copy_in = copy_out = None  # rt.copy's decisions, made once per input and output
        for lo in range(0, x.shape[0], rows):
            n = min(rows, x.shape[0] - lo)
            slot = ring.next_slot()
            dev_in = ring.buffer(slot, "in", (rows, *x.shape[1:]), x.dtype)
            piece = dev_in if n == rows else dev_in[:n]  # (a slice costs microseconds on a GPU host)
            host_piece = x[lo : lo + n]
            copy_in = copy_in or copier(rt, piece, host_piece)
            copy_in(piece, host_piece, name_in)
            if outs is None:  # the first piece tells the output's shape and dtype
                if not rt.backend.deferred:  # fn runs inside its submit (CUDA): no wait for the device
                    made: list[Any] = []
                    first = rt.submit(_first_piece, fn, piece, n, batches, b, lo, pinned, made,
                                      reads=[piece, *extra_reads], name=name)
                    if not made:  # fn failed (this raises it), or did not run yet
                        first.result()
                    outs = made[0]
                    copies.append(first)
                    continue
                y = rt.submit(fn, piece, reads=[piece, *extra_reads], name=name).result()
                outs = _new_outs(y, n, batches, pinned)
                copies.append(rt.copy(outs[b][lo : lo + n], y, name=name_out))
                continue
            o = outs[b]
            while len(unfinished) >= WINDOW * buffers:  # bound the pieces awaiting their copy out
                unfinished.popleft().exception()
            if capture and n == rows:  # one graph per buffer, on fixed input and output buffers
                dev_out = ring.buffer(slot, "out", (rows, *o.shape[1:]), o.dtype)
                ring.graph(rt, slot, fn, dev_in, dev_out, extra_reads, name).run()
            elif recording:  # the ring's output buffers too: the graph's memory stays 2 * buffers pieces
                dev_out = ring.buffer(slot, "out", (rows, *o.shape[1:]), o.dtype)[:n]
                rt.submit(_apply_into, fn, piece, dev_out, reads=[piece, *extra_reads], writes=[dev_out],
                          name=name)
            else:  # a new output tensor: a failed piece leaves no buffer that a later one writes
                dev_out = torch.empty((n, *o.shape[1:]), dtype=o.dtype, device=device)
                rt.submit(_apply_into, fn, piece, dev_out, reads=[piece, *extra_reads],
                          writes=[dev_out], name=name)
            host_piece = o[lo : lo + n]
            copy_out = copy_out or copier(rt, host_piece, dev_out)
            copies.append(copy_out(host_piece, dev_out, name_out))
            if not recording:  # (a recorded op runs with the graph: nothing to wait for here)
                unfinished.append(copies[-1])
    if recording:
        return None
    # (outs is None only where every input is empty: fn never ran, nothing tells its shape)
    if kinds is not None and outs is not None:
        ring.out_kinds[kinds] = (tuple(outs[0].shape[1:]), outs[0].dtype)
    results = [all_of(copies, outs[b] if outs is not None else batches[b][:0], name)
               for b, copies in enumerate(copies_of)]
    return results[0] if single else results


def _new_outs(y: Any, n: int, batches: list[Any], pinned: bool) -> list[Any]:
    """A host output per input, of the shape and dtype that ``fn`` gave the first piece (``y``)."""
    import torch

    _check_rows(y, n)
    return [torch.empty((x.shape[0], *y.shape[1:]), dtype=y.dtype, pin_memory=pinned) for x in batches]


def _first_piece(fn: Callable[[Any], Any], x: Any, n: int, batches: list[Any], b: int, lo: int,
                 pinned: bool, made: list[Any]) -> Any:
    """The first piece's op where it runs inside its submit: ``fn``, then the outputs made from its
    result (handed back through ``made`` before the device has run a kernel of it) and its copy
    out on the op's own stream, after ``fn``'s kernels. Returns ``fn``'s result, which the runtime
    keeps until the op completes."""
    y = fn(x)
    outs = _new_outs(y, n, batches, pinned)
    outs[b][lo : lo + n].copy_(y, non_blocking=pinned)
    made.append(outs)
    return y


def _apply_into(fn: Callable[[Any], Any], x: Any, out: Any) -> None:
    y = fn(x)
    if getattr(y, "shape", None) != out.shape:
        raise ValueError(
            f"stream_map: fn returned {_describe(y)} for a piece of shape {tuple(x.shape)}, where the output "
            f"piece is {tuple(out.shape)}: fn must map rows one to one (keep dim 0) and return the trailing "
            "shape of `out`; pass out=None to take fn's own shape and dtype")
    out.copy_(y)


def _check_rows(y: Any, n: int) -> None:
    shape = getattr(y, "shape", None)
    if shape is None or len(shape) == 0 or shape[0] != n:
        raise ValueError(
            f"stream_map: fn returned {_describe(y)} for a piece of {n} rows: fn must map rows one to one "
            "(its result has the piece's dim 0), since the input is cut into pieces along dim 0")


def _describe(y: Any) -> str:
    shape = getattr(y, "shape", None)
    return f"shape {tuple(shape)}" if shape is not None else f"a {type(y).__name__}"


def _is_array(x: Any) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "__array_interface__")


def _host_tensor(x: Any, what: str) -> Any:
    import torch

    if _is_array(x):
        x = torch.from_numpy(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"stream_map: each {what} must be a host tensor or numpy array, "
                        f"not {type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"stream_map: {what} is on {x.device}; it streams host data: pass a CPU tensor "
                         "(pinned for the fastest copies), or call fn directly on device data")
    if x.dim() == 0:
        raise ValueError(f"stream_map: {what} has no dims; pieces are cut along dim 0: reshape it to (1,)")
    return x


def _check_outs(batches: Sequence[Any], outs: Sequence[Any]) -> None:
    if len(outs) != len(batches):
        raise ValueError(f"stream_map: {len(outs)} outputs for {len(batches)} inputs: give one out per input")
    for i, (x, o) in enumerate(zip(batches, outs)):
        if o.shape[0] != x.shape[0]:
            raise ValueError(f"stream_map: out[{i}] has {o.shape[0]} rows, input {i} has {x.shape[0]}: fn "
                             "maps rows one to one, so both need the same dim 0")


def _rows_per_piece(batches: Sequence[Any], piece_bytes: int | None, default: int,
                    min_pieces: int = MIN_PIECES) -> int:
    """Rows in a piece: ``piece_bytes`` of the widest input's rows (default: see the module's constants)."""
    row_bytes = max(max(1, math.prod(x.shape[1:]) * x.element_size()) for x in batches)
    if piece_bytes is None:
        total = sum(x.numel() * x.element_size() for x in batches)
        piece_bytes = max(MIN_PIECE_BYTES, min(default, total // min_pieces))
    elif piece_bytes < 1:
        raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
    return max(1, piece_bytes // row_bytes)


class _Ring:
    """``count`` slots of device buffers, each made on first use for a role, shape and dtype; and
    with ``capture``, a recorded graph per slot and its buffers."""

    def __init__(self, device: str, count: int) -> None:
        self.device, self.count = device, count
        self._at = -1
        self._buffers: dict[tuple[Any, ...], Any] = {}
        self._graphs: dict[tuple[Any, ...], Any] = {}
        #: per kind of inputs (trailing shape and dtype of each), what a captured call without ``out``
        #: made its outputs of: the next such call makes them at once, and its first piece replays too
        self.out_kinds: dict[tuple[Any, ...], tuple[tuple[int, ...], Any]] = {}

    def restart(self) -> None:
        """The first slot next: a call's pieces take the slots in the same order each time."""
        self._at = -1

    def next_slot(self) -> int:
        self._at = (self._at + 1) % self.count
        return self._at

    def buffer(self, slot: int, role: str, shape: tuple[int, ...], dtype: Any) -> Any:
        import torch

        key = (slot, role, shape, dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    def graph(self, rt: StreamMapRuntime, slot: int, fn: Callable[[Any], Any], dev_in: Any, dev_out: Any,
              extra_reads: list[Any], name: str) -> Any:
        key = (slot, dev_in.shape, dev_in.dtype, dev_out.shape, dev_out.dtype)
        graph = self._graphs.get(key)
        if graph is None:
            with rt.record() as graph:
                rt.submit(_apply_into, fn, dev_in, dev_out, reads=[dev_in, *extra_reads], writes=[dev_out],
                          name=name)
            self._graphs[key] = graph
        return graph


def _kept_rings(rt: StreamMapRuntime, fn: Callable[[Any], Any], device: str, buffers: int,
                extra_reads: list[Any]) -> tuple[dict[Any, _Ring] | None, Any]:
    """Where the rings of earlier captured calls with ``fn`` are kept, and the key of this call's
    (the same device, buffers and extra reads): their graphs are captured already, on the ring's
    buffers. Dropped with the function or the runtime; None for a function that takes no weak
    reference."""
    try:
        kept = rt._stream_maps.setdefault(fn, {})
    except TypeError:
        return None, None
    return kept, (device, buffers, tuple(region_of(t) for t in extra_reads))  # the graphs' declared reads
