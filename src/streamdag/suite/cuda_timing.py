"""Timing helpers for the GPU benchmarks: wall time around synchronize, and one-stream graphs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["graph_of", "wall_ms"]


def wall_ms(fn: Callable[[], Any], iters: int = 50, warmup: int = 3,
            devices: Sequence[int] | None = None) -> float:
    """Median wall time of ``fn()`` in ms, each call between ``torch.cuda.synchronize()`` calls.

    ``devices`` lists the GPUs to synchronize (default: the current one).
    """
    def sync() -> None:
        for d in devices if devices is not None else [None]:
            torch.cuda.synchronize(d)

    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_of(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn`` captured by hand into a CUDA graph, after the side-stream warm-up PyTorch advises."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
