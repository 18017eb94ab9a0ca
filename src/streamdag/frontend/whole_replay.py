"""A captured whole call, and the CUDA calls that capture and replay it (:mod:`.whole_call` says when).

A replay (:meth:`Entry.replay`) copies the caller's tensors into the graph's
inputs, launches the graph, and hands the caller its outputs: tensors over the
memory of a set of outputs that the caller no longer holds (:mod:`.lent_outputs`),
else fresh copies. Host time before the launch adds to every call's time,
so the copies are one ``cudaMemcpyAsync`` each where the layouts allow, not
``copy_``'s dispatch: the torch extension's ``whole_launch`` compares the call's
arguments with the captured ones, copies them in and launches the graph in one
C++ call (:meth:`Entry.launch_if`), and its ``fresh_copies`` allocates and
fills the caller's outputs in another. A ``cudaMemcpyAsync`` is also the input
copy that costs the least wall time per synchronized call: on an H200, over
a launch with no copy, 9-17 µs against 16-45 for ``copy_`` and 21-33 for one
``_foreach_copy_`` (RegNetX-1.6GF at batch 1, ViT-B/16 bf16 and
EfficientNet-B0 at batch 8). The copies are
issued around the launch, not made by the graph: memcpy nodes inside it,
pointed at each call's tensors, saved 12-16 µs of host time per call but
cost 3-10 µs of wall time per synchronized call (a copy before the launch
overlaps the launch; nodes in the graph add levels to it).

**Launch first, check while the GPU runs.** A call may replay an entry only
if the global state (grad mode, autocast, ...) and the model's state (its
modules' attributes, the layouts of its tensors) are as at the capture; those
checks are most of the host time before a launch, and run cold when other work
ran between two calls. An entry that writes nothing outside its own memory (no
input written back, no parameter or buffer updated: ``speculative``) is
launched first and checked while the GPU runs it (:meth:`Entry.launch`, then
:meth:`Entry.result`); where a check fails its outputs are never read and the
call takes Dynamo's path. Such a replay may read memory the model no longer
holds (a parameter whose ``.data`` was replaced): the entry keeps the storage
of every tensor its graph reads and did not make (``held``), so the read stays
within memory that is allocated. A failed check leaves two traces: the GPU ran the graph
once for nothing, and the replay advanced the random generators' offsets.

State: an entry's inputs and outputs are shared by its replays, so
:class:`~.whole_call.WholeCall` runs one replay at a time under its lock.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..native import load_torch
from .call_key import call_key
from .candidates import capture_graph, time_replays, workspaces_in_pool
from .lent_outputs import OutputSets
from .result_objects import rebuild

__all__ = ["CudaCalls", "Entry", "copy_plan", "empty_like_input", "fill_tensors", "with_tensors_replaced"]


class CudaCalls:
    """The CUDA calls of a whole-call graph for one device (tests put a CPU stand-in in its place)."""

    def __init__(self, device: torch.device, pool: Any) -> None:
        from .candidates import _capture_stream

        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.pool = pool
        self.stream = _capture_stream(device)
        ext = load_torch()
        self._copy_into: Callable[[list[torch.Tensor], list[torch.Tensor]], bool] | None = getattr(
            ext, "copy_into", None)
        self._fresh_copies: Callable[[list[torch.Tensor]], list[torch.Tensor] | None] | None = getattr(
            ext, "fresh_copies", None)
        self._launch_plan: Callable[..., Any] | None = getattr(ext, "launch_plan", None)
        self._whole_launch: Callable[..., bool] | None = getattr(ext, "whole_launch", None)
        #: this replay follows the last one in the pool when that ran on another stream (bound once:
        #: it runs before every launch)
        self.order: Callable[[], None] = functools.partial(pool.order_current, device, self.index)

    def copy_into(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> bool:
        """Copy each of ``srcs`` into its ``dsts`` on the current stream by one ``cudaMemcpyAsync``
        each, where the torch extension is loaded and every pair has one dense layout; False (nothing
        copied) otherwise."""
        return self._copy_into is not None and self._copy_into(dsts, srcs)

    def launch_plan(self, args: Sequence[Any], kwargs: dict[str, Any], statics: list[torch.Tensor],
                    replay: Callable[[], Any], inference_mode: bool) -> Callable[..., bool] | None:
        """The torch extension's launch of a graph for calls like this one (``whole_launch``: the
        arguments compared with these, the tensors copied into ``statics``, ``replay()``), or None
        where the extension is not loaded or cannot copy one of the tensors."""
        if self._launch_plan is None or self._whole_launch is None:
            return None
        plan = self._launch_plan(tuple(args), dict(kwargs), list(statics), replay, inference_mode)
        return None if plan is None else functools.partial(self._whole_launch, plan)

    def fresh_copies(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """A new copy of each of ``tensors`` in one C++ call (the torch extension's ``fresh_copies``:
        an allocation each, and a ``cudaMemcpyAsync`` each or one ``_foreach_copy_`` for them all),
        where it is loaded and every one is dense; None otherwise."""
        return self._fresh_copies(tensors) if self._fresh_copies is not None else None

    def caller(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def on_capture_stream(self) -> Any:
        self.stream.wait_stream(self.caller())
        return torch.cuda.stream(self.stream)

    def join(self, caller: Any, outputs: Sequence[torch.Tensor]) -> None:
        """The caller's stream waits for the capture stream; ``outputs`` made there are the caller's."""
        caller.wait_stream(self.stream)
        for t in outputs:
            t.record_stream(caller)

    def capture(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                private: bool = False) -> tuple[Any, Any]:
        """``fn(*args, **kwargs)`` captured into a CUDA graph in the shared pool, or a pool of its own
        (``private``: all of it goes back when the graph is dropped): (the graph, its outputs)."""
        caller = self.caller()
        with workspaces_in_pool(self.stream):
            graph, out = capture_graph(lambda: fn(*args, **kwargs), self.stream, self.device,
                                       None if private else self.pool, error_mode="thread_local")
        caller.wait_stream(self.stream)
        return graph, out

    def capture_beside(self, graph: Any, fn: Callable[..., Any], args: Sequence[Any],
                       kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """``fn(*args, **kwargs)`` captured into the memory pool of ``graph``, one of this device's
        captures: (the graph, its outputs). The graphs of one pool replay one at a time, so their
        temporaries share memory; a pool of its own (an eager graph's) goes back when the last of
        its graphs goes."""
        caller = self.caller()
        with workspaces_in_pool(self.stream):
            again, out = capture_graph(lambda: fn(*args, **kwargs), self.stream, self.device, self.pool,
                                       error_mode="thread_local", beside=graph)
        caller.wait_stream(self.stream)
        return again, out

    def capture_own_inputs(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                           inputs: Sequence[torch.Tensor],
                           private: bool = False) -> tuple[Any, Any, list[torch.Tensor]]:
        """:meth:`capture` with each of ``inputs`` (tensors among the arguments) replaced by a tensor of
        its layout and values allocated in the graph's pool: (the graph, its outputs, those tensors).

        Allocated inside the capture, on its stream, an input shares the pool's segments with the
        graph's temporaries, as CUDA graph trees place theirs; allocated outside, an input of 1-10
        MiB would hold a 20 MiB segment of the caching allocator of its own for as long as the graph
        lives. The capture runs nothing, so the values are copied in after it. Each graph gets inputs
        of its own: a graph keeps its pool in use, and a pool that no graph uses while a tensor in it
        lives can never be captured into again."""
        made: list[torch.Tensor] = []

        def on_own_inputs() -> Any:
            made[:] = [empty_like_input(t) for t in inputs]
            own_args, own_kwargs = with_tensors_replaced(args, kwargs, inputs, made)
            return fn(*own_args, **own_kwargs)

        graph, out = self.capture(on_own_inputs, (), {}, private)
        fill_tensors(made, list(inputs))
        return graph, out, made

    def time_graphs(self, graphs: Sequence[Any], rounds: int) -> list[float]:
        """Each graph's median GPU time in ms, replayed in turn after the pool's last replay."""
        self.order()
        return time_replays(graphs, rounds, self.device)


def empty_like_input(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor with ``t``'s layout, and its ``requires_grad`` and inference-ness: as Dynamo saw
    the caller's tensor, so no guard fails on it."""
    with torch.inference_mode(t.is_inference()):
        s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return s.requires_grad_(t.requires_grad) if t.requires_grad else s


def fill_tensors(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy each of ``srcs`` into its tensor in ``dsts`` (a graph's inputs, or a lent set of outputs),
    outside autograd (an input may require grad) and in inference mode where they are inference
    tensors, which only it may write."""
    if not dsts:
        return
    inference = any(d.is_inference() for d in dsts)
    with torch.inference_mode() if inference else torch.no_grad():
        torch._foreach_copy_(dsts, srcs)


def with_tensors_replaced(args: Sequence[Any], kwargs: dict[str, Any], old: Sequence[torch.Tensor],
                          new: Sequence[torch.Tensor]) -> tuple[list[Any], dict[str, Any]]:
    """``args`` and ``kwargs`` with each of ``old`` (the very tensor object) replaced by its ``new``."""
    swap = {id(o): n for o, n in zip(old, new)}
    return ([swap.get(id(a), a) for a in args], {k: swap.get(id(v), v) for k, v in kwargs.items()})


def copy_plan(outputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor] | None, list[Any] | None] | str:
    """What a replay copies for ``outputs`` that share memory (a model returns its hidden states and
    a view of them, ``h[:, 0]``), so that the caller's copies share memory as they do: for each
    group of outputs in one storage, one 1-D span over the elements they cover, each output then a
    view of that span's copy (``views``: per output, its span and ``(size, stride, offset)``, or
    None for an output copied alone). ``(None, None)`` where no outputs share memory; why not
    where a group mixes dtypes or its span would copy more than twice the outputs' elements."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(outputs):
        ptr = t.untyped_storage().data_ptr()
        if ptr and t.numel():
            groups.setdefault(ptr, []).append(i)
    if all(len(g) == 1 for g in groups.values()):
        return None, None
    copied: list[torch.Tensor] = []
    views: list[Any] = [None] * len(outputs)
    for members in groups.values():
        if len(members) == 1:
            continue
        ts = [outputs[i] for i in members]
        if len({t.dtype for t in ts}) > 1:
            return "two outputs of different dtypes share memory: their copies could not"
        if any(t.is_conj() or t.is_neg() for t in ts):  # a lazy conjugate's view of the copy: not as_strided
            return "an output that shares memory with another is a lazy conjugate or negation"
        lo = min(t.storage_offset() for t in ts)
        hi = max(t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1 for t in ts)
        if hi - lo > 2 * sum(t.numel() for t in ts):
            return ("outputs share memory sparsely (views far apart in one tensor): copying what lies "
                    "between them would cost more than the outputs")
        span = len(copied)
        copied.append(ts[0].as_strided((hi - lo,), (1,), lo))
        for i, t in zip(members, ts):
            views[i] = (span, (tuple(t.shape), tuple(t.stride()), t.storage_offset() - lo))
    for i, t in enumerate(outputs):  # the rest copied alone, each its own span
        if views[i] is None:
            views[i] = (len(copied), None)
            copied.append(t)
    return copied, views


# -- the captured graph ---------------------------------------------------------------------------------

@dataclass
class Entry:
    """A whole call captured for one key."""

    graph: Any
    device: Any  # CudaCalls
    statics: list[torch.Tensor]  # the graph's inputs, filled by each call
    arg_index: list[int]  # where the copied tensors are among the positional arguments
    kw_names: list[str]  # and among the keyword arguments, after them
    write_back: list[int]  # statics the call writes into: copied back into the caller's tensors
    outputs: list[torch.Tensor]  # the graph's outputs (distinct tensors)
    leaves: list[Any]  # the result's leaves, with None where a tensor goes
    slots: list[int]  # for each tensor leaf, its output
    spec: Any  # the result's structure
    global_state: Any
    clone: bool = True
    inference: bool = False  # the statics are inference tensors: written in inference mode
    replays: int = 0
    objects: list[tuple[int, Any]] = field(default_factory=list)  # leaves rebuilt around fresh tensors
    speculative: bool = False  # writes nothing outside its own memory: launched before the checks
    held: list[Any] = field(default_factory=list)  # the storages its graph reads and did not make
    #: where outputs share memory (:func:`copy_plan`): what a replay copies, and each output as a view
    #: of one copy (None: each output is copied alone)
    copied: list[torch.Tensor] | None = None
    views: list[Any] | None = None
    key: Any = None  # the key of the calls it replays for
    #: the result's structure rebuilt around its leaves (.unflatten.unflattener; None: tree_unflatten)
    unflatten: Callable[[list[Any]], Any] | None = None
    native: Callable[..., bool] | None = None  # the torch extension's launch_if (CudaCalls.launch_plan)
    #: the output sets lent in turn (:mod:`.lent_outputs`); None: every replay copies its outputs
    sets: OutputSets | None = None
    lending: str = ""  # why the outputs are not lent, in words ('' where they are)
    single: bool = field(init=False)
    #: what a launch replays: the graph, or a free lent set's (``sets.replay``)
    replay_graph: Callable[[], None] = field(init=False)

    def __post_init__(self) -> None:
        self.single = self.spec.is_leaf() and len(self.outputs) == 1 and not self.objects
        self.replay_graph = self.graph.replay

    def lend_from(self, sets: OutputSets) -> None:
        """Lend the caller the outputs of ``sets`` in turn from now on."""
        self.sets = sets
        self.replay_graph = sets.replay

    def replay(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
        return self.result(self.launch(args, kwargs))

    def launch_if(self, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
        """Launch for a call whose arguments key as the captured call's (:mod:`.call_key`): True;
        False, launching nothing, for any other call. In one C++ call where the torch extension
        planned it (``native``)."""
        if self.native is not None:
            self.device.order()
            return self.native(args, kwargs)
        if torch.is_grad_enabled() or call_key(args, kwargs) != self.key:
            return False
        self.launch(args, kwargs)
        return True

    def launch(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """Copy the caller's tensors into the graph's inputs and launch it; returns those tensors."""
        tensors = [args[i] for i in self.arg_index]
        if self.kw_names:
            tensors += [kwargs[k] for k in self.kw_names]
        # first: the inputs are written only after the last replay (on any stream) has read them
        self.device.order()
        self._copy(self.statics, tensors)
        self.replay_graph()
        return tensors

    def _copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """One ``cudaMemcpyAsync`` each where the layouts allow, else one launch for them all (in
        inference mode where the statics are inference tensors, which only it may write)."""
        if not dsts or self.device.copy_into(dsts, srcs):
            return
        outside = self.inference and not torch.is_inference_mode_enabled()
        with torch.inference_mode() if outside else nullcontext():
            torch._foreach_copy_(dsts, srcs)

    def result(self, tensors: list[torch.Tensor]) -> Any:
        """The launched replay's result, in tensors that are the caller's (lent or fresh copies); the
        caller's ``tensors`` it wrote into get its writes."""
        self.replays += 1
        for i in self.write_back:
            tensors[i].copy_(self.statics[i])
        lent = self.sets.lent_now if self.sets is not None else None
        if lent is not None:
            self.sets.lent_now = None
            fresh = lent.lend()
        elif not self.clone:
            fresh = self.outputs
        else:
            sources = self.outputs if self.copied is None else self.copied
            copies = self.device.fresh_copies(sources)
            if copies is None:
                copies = [torch.empty_like(o) for o in sources]
                self._copy(copies, sources)
            fresh = copies if self.views is None else [
                copies[span] if view is None else copies[span].as_strided(*view) for span, view in self.views]
        if self.single:
            return fresh[0]
        leaves = list(self.leaves)
        for pos, slot in enumerate(self.slots):
            if slot >= 0:
                leaves[pos] = fresh[slot]
        memo: dict[int, Any] = {}  # an object held twice comes back as one
        for pos, tpl in self.objects:
            leaves[pos] = rebuild(tpl, fresh, memo)
        return pytree.tree_unflatten(leaves, self.spec) if self.unflatten is None else self.unflatten(leaves)
