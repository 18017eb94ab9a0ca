"""A whole call's outputs lent to the caller in turn, instead of copied at each replay.

A whole-call replay hands the caller tensors that are the caller's: values no
later call changes. Copying the graph's outputs into fresh tensors does that
at a cost per call: an allocation and a copy each, 6-15 µs of host time per
replay on single-output models. Instead, the call is captured
:data:`LENT_SETS` more times, each graph writing its outputs into memory of
its own (a *set*); a replay runs the graph of a set that nothing outside holds
and lends the caller new tensors over that set's memory (``detach()``: the
same storage, no copy).

A set is free when nothing but the set refers to its memory: each storage's
use count and its Python object's reference count are as they were when only
the set held them. A tensor the caller holds, any view of it, and the storage
object (``y.untyped_storage()``) add to one of them, so a held set is never
written, as the caching allocator never reuses a held block. A set lent on one stream
and replayed into on another waits for the first: the caller may still read
its last result there. A set replayed on a stream other than the one its memory
was allocated on is marked with ``record_stream`` for that stream, once, so that
its memory, freed with the entry, is reused only after that stream's work.
What the count cannot see is a result dropped after ``record_stream`` handed it
to another stream: a lent result read on another stream must be held until
that stream is done with it. Inside a CUDA graph
capture of the caller's own, no set is lent (the caller's graph would write the
set at each of its replays): the outputs are copied.

The usual loop ``y = model(x)`` still holds the previous call's set while the
next call runs, so two sets in turn serve it with no copy. A caller that
holds every set (keeping each result in a list) gets the copy path: the
entry's own graph, whose outputs are never lent, copied as before.

Each lent graph copies its outputs into its set at its end (the set lies
outside the graphs' memory pool, see ``WholeCall._lend``), so the copy kernel
stays and the host's allocation and copy launch go. Lending holds the two sets
(against the copy each call makes, which the caller holds) and may grow the
pool by the lent captures' own outputs, so outputs are lent only up to
:data:`LEND_BYTES` in all; larger ones (a language model's logits and cache)
are copied, where they would add tens of MiB to a graph pool of about as much.

State: :attr:`OutputSets.lent_now` is the set the last launch replayed into,
read by the result that follows it; :attr:`OutputSets.turn` the set tried
first next; :attr:`LentSet.stream` the stream it was last replayed on; all
under the whole call's lock, one replay at a time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["LEND_BYTES", "LENT_SETS", "LentSet", "OutputSets", "lend_refusal"]

#: the sets lent in turn: the caller of ``y = model(x)`` holds one while the next call runs
LENT_SETS = 2
#: the most bytes of outputs lent (lending holds two more copies of them than copying does)
LEND_BYTES = 8 * 2**20

_use_count: Callable[[int], int] = torch._C._storage_Use_Count


class LentSet:
    """One graph of the call and the tensors it copies its outputs into, lent while nothing outside
    holds them.

    ``_storages``: each distinct storage of the tensors, as its one Python object; ``_counts``:
    its use count (the tensors and views on it, and the storage object where PyTorch keeps
    that alive with it) and ``_refs`` the Python references to that object, both taken when
    only the set refers to it. A caller's tensor or view adds to the first, a caller's storage
    object (``y.untyped_storage()`` is that same object) to the second. ``_ptrs``: each tensor's
    address, which a caller's ``resize_`` of a lent tensor would move (the set is then
    ``spoiled``: never lent again).
    """

    __slots__ = ("_cdatas", "_counts", "_ptrs", "_refs", "_storages", "graph", "outputs", "recorded",
                 "spoiled", "stream", "stream_raw")

    def __init__(self, graph: Any, outputs: list[torch.Tensor]) -> None:
        self.graph = graph
        self.outputs = outputs
        on_each: dict[int, int] = {}  # each storage: the set's tensors on it
        for t in outputs:
            c = t.untyped_storage()._cdata
            on_each[c] = on_each.get(c, 0) + 1
        self._cdatas = list(on_each)
        self._storages = [next(t.untyped_storage() for t in outputs if t.untyped_storage()._cdata == c)
                          for c in self._cdatas]
        self._counts = [_use_count(c) for c in self._cdatas]
        self._refs = self._refs_now()  # (counted as free() counts them)
        self._ptrs = [t.data_ptr() for t in outputs]
        # (a count below the set's own tensors would let a caller's reference pass unseen)
        self.spoiled = any(n < on_each[c] for c, n in zip(self._cdatas, self._counts))
        self.stream: Any = None  # the stream of its last replay (a torch.cuda.Stream), None before
        self.stream_raw = -1  # (no stream yet: 0 is the default stream)
        self.recorded: set[int] = set()  # the streams (raw) its tensors were record_stream'ed for

    def free(self) -> bool:
        """Whether nothing outside the set refers to its tensors' memory."""
        if self.spoiled:
            return False
        for c, n in zip(self._cdatas, self._counts):
            if _use_count(c) != n:
                return False
        if self._refs_now() != self._refs:
            return False
        if [t.data_ptr() for t in self.outputs] != self._ptrs:
            self.spoiled = True
            return False
        return True

    def _refs_now(self) -> list[int]:
        return [sys.getrefcount(st) for st in self._storages]

    def lend(self) -> list[torch.Tensor]:
        """New tensors over the set's memory, for the caller."""
        return [t.detach() for t in self.outputs]


class OutputSets:
    """The entry's graph (outputs copied) and the sets lent in turn (see the module docstring).

    ``device``: the CUDA device the graphs replay on (None: no streams to order, as on the
    CPU stand-ins of the tests)."""

    __slots__ = ("_alloc_raw", "_index", "copied", "device", "graph", "lent_now", "sets", "turn")

    def __init__(self, graph: Any, sets: list[LentSet], device: torch.device | None) -> None:
        self.graph = graph  # the entry's graph: its outputs are never lent
        self.sets = sets
        self.device = device if device is not None and device.type == "cuda" else None
        self._index = -1 if self.device is None else (
            self.device.index if self.device.index is not None else torch.cuda.current_device())
        # the stream the sets' memory was allocated on (made just before, on the caller's stream)
        self._alloc_raw = 0 if self.device is None else torch._C._cuda_getCurrentRawStream(self._index)
        self.turn = 0
        self.lent_now: LentSet | None = None
        self.copied = 0  # replays that found every set held, or ran inside a capture of the caller's

    def replay(self) -> None:
        """Replay the graph of a free set, the one after the last lent first; else the entry's own."""
        if self.device is None or not torch._C._cuda_isCurrentStreamCapturing():
            sets = self.sets
            n = len(sets)
            for k in range(n):
                s = sets[(self.turn + k) % n]
                if s.free():
                    self._on_stream(s)
                    s.graph.replay()
                    self.lent_now = s
                    self.turn = (self.turn + k + 1) % n
                    return
        self.lent_now = None
        self.copied += 1
        self.graph.replay()

    def _on_stream(self, s: LentSet) -> None:
        """The current stream waits for the stream ``s`` was last lent on, where another: the caller
        may have read its last result there after that replay. On a stream other than the one the
        set's memory was allocated on, its tensors are marked for it (once): the entry, dropped
        while this replay still runs, frees that memory to the allocation stream. A set's first
        replay waits for nothing: the captures after its allocation synchronized the device."""
        if self.device is None:
            return
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        if raw != s.stream_raw:
            current = torch.cuda.current_stream(self.device)
            if s.stream is not None:
                current.wait_stream(s.stream)
            s.stream, s.stream_raw = current, raw
            if raw != self._alloc_raw and raw not in s.recorded:
                for t in s.outputs:
                    t.record_stream(current)
                s.recorded.add(raw)


def lend_refusal(outputs: Sequence[torch.Tensor], clone: bool) -> str:
    """Why a whole call's outputs are copied at each replay, not lent ('' where they are lent)."""
    if not clone:
        return "outputs handed out as they are (clone_outputs=False)"
    if not outputs:
        return ""
    if not all(map(_dense, outputs)):
        return "outputs copied at each replay: one of them is not dense (a broadcast or a slice)"
    size = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in outputs}.values())
    if size > LEND_BYTES:
        return (f"outputs copied at each replay: their {size / 2**20:.0f} MiB are over the "
                f"{LEND_BYTES / 2**20:.0f} MiB lent in turn")
    return ""


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one span of memory, each once, in some order of its dimensions
    (a copy of its layout is then a plain copy)."""
    return dense_strides(t.shape, t.stride())


def dense_strides(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` lays a tensor of ``shape`` out with no gap and no overlap, in some order of
    its dimensions."""
    expected = 1
    for st, n in sorted((int(st), int(n)) for n, st in zip(shape, stride) if int(n) != 1):
        if st != expected:
            return False
        expected *= n
    return True
