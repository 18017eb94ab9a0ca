"""Timing a training graph's candidates at its first call on one CUDA device (see
:mod:`.training`): captured, for a graph under Inductor's CUDA graph trees, else uncaptured.

Either way the timing runs repeat the graph on the call's own inputs: the inputs a run may write
(batch norm's running statistics, a backward's donated buffers) are put back after each run and
the random number generators' states after the last (:func:`_put_back`), so the call that follows
computes what a call without the timing would.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .candidates import Candidate, CapturedGraph, SharedPool, pick, time_replays

__all__ = ["time_captured", "time_uncaptured"]


@contextlib.contextmanager
def _put_back(args: list[Any], written: Sequence[int], device: torch.device) -> Iterator[Callable[[], None]]:
    """Inside, a function that writes ``args[i]`` back for each ``i`` in ``written``, as on entry;
    at exit those inputs and the CPU's and ``device``'s generators are as on entry."""
    saved = [args[i].clone() for i in written]
    rng = (torch.get_rng_state(), torch.cuda.get_rng_state(device))

    def restore() -> None:
        for i, t in zip(written, saved):
            args[i].copy_(t)

    try:
        yield restore
    finally:
        restore()
        torch.set_rng_state(rng[0])
        torch.cuda.set_rng_state(rng[1], device)


def time_uncaptured(cands: list[Candidate], args: list[Any], device: torch.device, written: Sequence[int],
                    options: Any) -> int:
    """Each candidate run ``options.rounds`` times, interleaved, timed by CUDA events on the caller's
    stream, its peak read from an untimed run; the index :func:`pick` keeps."""
    from .inductor_backend import _held_mib

    with _put_back(args, written, device) as restore:
        torch.cuda.synchronize(device)
        for c in cands:  # an untimed run (first-launch costs) gives its peak
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            c.run(list(args))  # the outputs (activations, gradients) are dropped at once
            restore()
            c.peak_mib = (torch.cuda.max_memory_allocated(device) - before) / 2**20
        times: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = [[] for _ in cands]
        for r in range(options.rounds):
            k = r % len(cands)
            for i in list(range(k, len(cands))) + list(range(k)):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                cands[i].run(list(args))
                end.record()
                restore()
                times[i].append((start, end))
        torch.cuda.synchronize(device)
    for c, ts in zip(cands, times):
        c.ms = statistics.median(a.elapsed_time(b) for a, b in ts)
    # peaks in allocated bytes hold no segments of their own: no per-stream allowance
    return pick(cands, options.tie, options.memory_ratio, base_mib=_held_mib(args), segments_mib=0.0)


def _trees_capture_lock() -> Any:
    """The lock Inductor's trees hold while they record or warm up a graph (a plain lock where this
    PyTorch has none)."""
    from torch._inductor import cudagraph_trees

    return getattr(cudagraph_trees, "graph_capture_lock", None) or threading.Lock()


def time_captured(cands: list[Candidate], args: list[Any], device: torch.device,
                  written: Sequence[int], options: Any) -> int:
    """For a graph under the trees: each candidate captured into a CUDA graph of its own pool over
    this call's inputs (none copied: the graphs are dropped once timed), its replays timed in
    rounds; the index :func:`pick` keeps. A candidate that cannot be captured is not kept (its
    error is in ``explain()``): one that can is kept untimed where it is the only one, the first
    (Inductor's whole graph) where none can. The captures take the trees' capture lock, and
    another thread's CUDA calls during one do not end it (the trees' capture mode)."""
    from .inductor_backend import _held_mib

    static = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    lock = _trees_capture_lock()
    pool = SharedPool()  # (each capture takes a pool of its own, released with its graph)
    with _put_back(args, written, device) as restore:
        graphs: list[tuple[int, CapturedGraph]] = []
        for i, c in enumerate(cands):
            try:
                with lock:
                    graphs.append((i, CapturedGraph(c, args, static, (), pool, device, private=True,
                                                    error_mode="thread_local")))
            except Exception as exc:  # the others are still compared
                c.error = f"not captured: {type(exc).__name__}: {str(exc)[:200]}"
            restore()  # the warm-up runs wrote them
        if len(graphs) > 1:
            for (i, g), ms in zip(graphs, time_replays([g for _, g in graphs], options.rounds, device)):
                cands[i].ms, cands[i].peak_mib = ms, g.peak_bytes / 2**20
        captured = [i for i, _ in graphs]
        del graphs  # (their pools go back before the call goes on)
    if len(captured) < 2:
        return captured[0] if captured else 0
    return captured[pick([cands[i] for i in captured], options.tie, options.memory_ratio,
                         base_mib=_held_mib(args))]
