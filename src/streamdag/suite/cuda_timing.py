"""Timing helpers for the GPU benchmarks: wall time around synchronize, and one-stream graphs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["graph_of", "host_us", "idle_host_us", "interleaved_rounds_ms", "interleaved_wall_ms",
           "loops_table", "wall_ms"]


def wall_ms(fn: Callable[[], Any], iters: int = 50, warmup: int = 3,
            devices: Sequence[int] | None = None) -> float:
    """Median wall time of ``fn()`` in ms, each call between ``torch.cuda.synchronize()`` calls.

    ``devices`` lists the GPUs to synchronize (default: the current one).
    """
    return interleaved_wall_ms({"": fn}, iters, warmup, devices)[""]


def host_us(call: Callable[[], Any], calls: int = 20, rounds: int = 5) -> float:
    """Median host time of ``call()`` in µs, ``calls`` calls issued back to back per round (the GPU
    runs behind): what a call costs the host, set against its time with a synchronize."""
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_call)


def idle_host_us(call: Callable[[], Any], calls: int = 100) -> float:
    """Median host time of one ``call()`` in µs, each begun with the GPU idle: the host path alone.

    :func:`host_us` issues calls back to back, and once enough work is queued a launch waits for
    the GPU (a graph of a few hundred kernels a millisecond long, after some tens of calls): its
    time is then the GPU's, not the host's.
    """
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def interleaved_wall_ms(fns: dict[str, Callable[[], Any]], rounds: int = 50, warmup: int = 3,
                        devices: Sequence[int] | None = None) -> dict[str, float]:
    """:func:`wall_ms` of several variants, timed in rounds: each round runs every variant once, in
    an order that rotates from round to round. The median per variant.

    Timed one after another instead, variants would be compared across seconds of the CPU's and
    the link's drift, which moves one pipeline's time by several percent.
    """
    times = interleaved_rounds_ms(fns, rounds, warmup, devices)
    return {label: statistics.median(ts) for label, ts in times.items()}


def interleaved_rounds_ms(fns: dict[str, Callable[[], Any]], rounds: int = 50, warmup: int = 3,
                          devices: Sequence[int] | None = None) -> dict[str, list[float]]:
    """Every round's time of each variant, in ms, timed as :func:`interleaved_wall_ms` times them."""
    def sync() -> None:
        for d in devices if devices is not None else [None]:
            torch.cuda.synchronize(d)

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    items = list(fns.items())
    times: dict[str, list[float]] = {label: [] for label in fns}
    for r in range(rounds):
        k = r % len(items)
        for label, fn in items[k:] + items[:k]:
            t0 = time.perf_counter()
            fn()
            sync()
            times[label].append((time.perf_counter() - t0) * 1e3)
    return times


def loops_table(ms: dict[str, float], variants: Sequence[str], parts: Sequence[str], base: str,
                base_name: str = "PyTorch eager") -> tuple[list[str], list[list[Any]]]:
    """Headers and rows for loops whose ``parts`` were also timed alone: each variant's time, as a
    multiple of the longest part (the bound of a loop that overlaps them) and against ``base``
    (a variant, called ``base_name`` in the header)."""
    bound = max(ms[label] for label in parts)
    rows = [[label, ms[label], ms[label] / bound, ms[base] / ms[label]] for label in variants]
    rows += [[label, ms[label], "", ""] for label in parts]
    return ["ms per loop (median)", "ms", "x the longer part alone", f"x faster than {base_name}"], rows


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
