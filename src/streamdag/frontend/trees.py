"""How a training graph goes under Inductor's CUDA graph trees, as ``torch.compile(mode=
"reduce-overhead")`` puts it there, and how its outputs come out of the trees' pool.

Inductor puts a compiled graph under the trees in one place: its post-compile step calls
``torch._inductor.compile_fx.cudagraphify`` with the graph's code, its static inputs and what the
trees need to know of the graph (device, placeholders, stack traces, inputs it mutates).
:func:`seen_by_trees` sees that call while a graph compiles; the :class:`TreesCall` it keeps puts
another function of the same inputs (the graph's regions on several streams) under the trees the
same way, in the same tree of graphs as the forward or backward it stands for.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["MULTIPLIED", "TreesCall", "copies", "refusal", "seen_by_trees", "start_step_if_idle",
           "trees_config"]


class TreesCall:
    """How Inductor put a graph's code under its CUDA graph trees: its call of
    ``compile_fx.cudagraphify`` (the static inputs, the device, the graph's placeholders...), to
    put another function of the same inputs there the same way."""

    def __init__(self, cudagraphify: Callable[..., Any], static_input_idxs: Sequence[int],
                 kwargs: dict[str, Any]) -> None:
        self.cudagraphify = cudagraphify
        self.static_input_idxs = tuple(static_input_idxs)
        self.kwargs = kwargs

    def wrap(self, fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        return self.cudagraphify(fn, static_input_idxs=self.static_input_idxs, **self.kwargs)


@contextlib.contextmanager
def seen_by_trees() -> Iterator[list[tuple[Any, TreesCall]]]:
    """Inductor's calls of ``compile_fx.cudagraphify`` from this thread while a graph compiles, each
    as (the code it puts under the trees, a :class:`TreesCall`); each call goes on to the trees.
    (Inductor imports that name at the call, the one place that puts a graph under the trees.)"""
    from torch._inductor import compile_fx

    real = compile_fx.cudagraphify
    me = threading.get_ident()
    seen: list[tuple[Any, TreesCall]] = []

    def cudagraphify(model: Any, static_input_idxs: Sequence[int] = (), **kwargs: Any) -> Any:
        if threading.get_ident() == me:
            seen.append((model, TreesCall(real, static_input_idxs, kwargs)))
        return real(model, static_input_idxs=static_input_idxs, **kwargs)

    compile_fx.cudagraphify = cudagraphify
    try:
        yield seen
    finally:
        compile_fx.cudagraphify = real


def trees_config(on: bool, partitions: bool = True) -> Any:
    """Inductor's configuration for a graph under its cudagraph trees, as ``mode="reduce-overhead"``
    sets it; without ``partitions``, a graph goes under the trees whole or not at all (with them,
    where Inductor lays graphs out in partitions, it puts each partition there and runs what
    cannot be captured between them)."""
    if not on:
        return contextlib.nullcontext()
    from torch._inductor import config

    changes: dict[str, Any] = {"triton.cudagraphs": True, "triton.cudagraph_trees": True}
    if not partitions and hasattr(config, "graph_partition"):
        changes["graph_partition"] = False
    return config.patch(changes)


def refusal(whole: Any) -> str:
    """Inductor's reason for not putting a compiled graph under the trees, on one line (its
    stack trace cut: ``TORCH_LOGS=cudagraphs`` logs it whole)."""
    reason = getattr(whole, "disabled_cudagraphs_reason", None)
    info = getattr(whole, "cudagraph_info", None)
    fails = getattr(info, "cudagraph_fail_reasons", None) if info is not None else None
    text = " ".join(str(reason or "; ".join(str(f) for f in fails or ())).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return text or "no part of the graph can be captured"


def copies(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``ts`` with their strides: one ``_foreach_mul`` by 1 (exact) for floating tensors,
    so that a backward's hundred gradients cost one call, not a hundred."""
    if not ts:
        return []
    if all(t.dtype in MULTIPLIED for t in ts):
        return list(torch._foreach_mul(ts, 1))
    return [t.clone() for t in ts]


#: the dtypes :func:`_copies` copies by a multiplication (float8 has no ``mul`` kernel)
MULTIPLIED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                         torch.complex128})


def start_step_if_idle(device_index: int) -> bool:
    """Tells the trees of ``device_index`` that a new step begins
    (``torch.compiler.cudagraph_mark_step_begin()``, as a ``reduce-overhead`` training loop calls
    it), unless a forward under them still awaits its backward: its saved activations live in
    the pool that a new step overwrites. Whether one does is the trees' own record
    (``running_forwards_with_pending_backwards``). Called before a training forward whose
    outputs are copies out of the pool: on a step of googlenet (batch 8, fp32, one H200) the
    mark takes the step from 6.9 ms to 4.9 ms, the time of ``reduce-overhead`` with the mark.
    Whether a step was marked is returned."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    if manager is None or manager.running_forwards_with_pending_backwards:
        return False
    cudagraph_trees.mark_step_begin()
    return True
