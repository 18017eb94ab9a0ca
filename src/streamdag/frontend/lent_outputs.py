"""A whole call's outputs lent to the caller in turn, instead of copied at each replay.

A whole-call replay hands the caller tensors that are the caller's: values no
later call changes. Copying the graph's outputs into fresh tensors does that
at a cost per call: an allocation and a copy each, 6-15 µs of host time per
replay on single-output models. Instead, the call is captured
:data:`LENT_SETS` more times, each graph writing its outputs into memory of
its own (a *set*); a replay runs the graph of a set that nothing outside holds
and lends the caller new tensors over that set's memory (``detach()``: the
same storage, no copy).

A set is free when no tensor but the entry's own refers to its memory: each
storage's use count is what the entry's references make it (its output
tensors, and the storage object it keeps to read the count). A tensor the
caller holds, or any view of it, adds to the count, so a held set is never
written, exactly as the caching allocator never reuses a held block.

The usual loop ``y = model(x)`` still holds the previous call's set while the
next call runs, so two sets in turn serve it with no copy. A caller that
holds every set (keeping each result in a list) gets the copy path: the
entry's own graph, whose outputs are never lent, copied as before.

Each lent graph copies its outputs into its set at its end (the set lies
outside the graphs' memory pool, see ``WholeCall._lend``), so the copy kernel
stays and the host's allocation and copy launch go. Lending holds two more
copies of the outputs than copying does (two sets and the lent captures' own
outputs in the pool, against the fresh copy of each call), so outputs are lent
only up to :data:`LEND_BYTES` in all; larger ones (a language model's logits
and cache) are copied, where they would add tens of MiB to a graph pool of
about as much.

State: :attr:`OutputSets.lent_now` is the set the last launch replayed into,
read by the result that follows it; :attr:`OutputSets.turn` the set tried
first next; both under the whole call's lock, one replay at a time.
"""

from __future__ import annotations

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
    """One graph of the call and its outputs, lent while nothing outside holds them.

    ``_cdatas``: each distinct storage of the outputs (kept alive by ``_storages``);
    ``_counts``: its use count when only this set refers to it (one per output tensor on it, one
    for the kept storage object); ``_ptrs``: its memory's address, which a caller's
    ``resize_`` of a lent tensor would move (the set is then never lent again).
    """

    __slots__ = ("_cdatas", "_counts", "_ptrs", "_storages", "graph", "outputs", "spoiled")

    def __init__(self, graph: Any, outputs: list[torch.Tensor]) -> None:
        self.graph = graph
        self.outputs = outputs
        storages: dict[int, Any] = {}
        counts: dict[int, int] = {}
        for t in outputs:
            st = t.untyped_storage()
            storages.setdefault(st._cdata, st)
            counts[st._cdata] = counts.get(st._cdata, 1) + 1
        self._storages = list(storages.values())
        self._cdatas = list(storages)
        self._counts = [counts[c] for c in self._cdatas]
        self._ptrs = [st.data_ptr() for st in self._storages]
        #: a count below the set's own references: something let go of a reference this set
        #: counts on, so a caller's could pass unseen; never lent
        self.spoiled = any(_use_count(c) < n for c, n in zip(self._cdatas, self._counts))

    def free(self) -> bool:
        """Whether nothing outside the set refers to its outputs' memory."""
        if self.spoiled:
            return False
        for c, n in zip(self._cdatas, self._counts):
            if _use_count(c) != n:
                return False
        if any(st.data_ptr() != p for st, p in zip(self._storages, self._ptrs)):
            self.spoiled = True
            return False
        return True

    def lend(self) -> list[torch.Tensor]:
        """New tensors over the outputs' memory, for the caller."""
        return [t.detach() for t in self.outputs]


class OutputSets:
    """The entry's own graph (outputs copied) and the sets lent in turn (see the module docstring)."""

    __slots__ = ("copied", "lent_now", "own", "sets", "turn")

    def __init__(self, own: Any, sets: list[LentSet]) -> None:
        self.own = own  # the entry's graph: its outputs are never lent
        self.sets = sets
        self.turn = 0
        self.lent_now: LentSet | None = None
        self.copied = 0  # replays that found every set held

    def replay(self) -> None:
        """Replay the graph of a free set, the one after the last lent first; else the entry's own."""
        sets = self.sets
        n = len(sets)
        for k in range(n):
            s = sets[(self.turn + k) % n]
            if s.free():
                s.graph.replay()
                self.lent_now = s
                self.turn = (self.turn + k + 1) % n
                return
        self.lent_now = None
        self.copied += 1
        self.own.replay()


def lend_refusal(outputs: Sequence[torch.Tensor], clone: bool) -> str:
    """Why a whole call's outputs are copied at each replay, not lent ('' where they are lent)."""
    if not clone:
        return "outputs handed out as they are (clone_outputs=False)"
    if not outputs:
        return ""
    if not all(map(_dense, outputs)):
        return "outputs copied at each replay: one of them is not dense (a broadcast or a slice)"
    storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in outputs}
    size = sum(st.nbytes() for st in storages.values())
    if size > LEND_BYTES:
        return (f"outputs copied at each replay: their {size / 2**20:.0f} MiB are over the "
                f"{LEND_BYTES / 2**20:.0f} MiB lent in turn")
    return ""


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one span of memory, each once, in some order of its dimensions
    (a copy of its layout is then a plain copy)."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
