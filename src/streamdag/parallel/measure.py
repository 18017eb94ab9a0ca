"""Measured inputs of the tensor-parallel cost model, on GPUs: layer times and the peer link."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .plan import LayerCost, LinkCost

__all__ = ["measure_costs", "measure_link"]

#: Allowance for the cross-device event wait in front of each peer copy in a run.
WAIT_MS = 0.010


def _gpu_ms(fn: Callable[[], Any], device: torch.device, reps: int = 10) -> float:
    """GPU time per call of ``fn``, launched back to back on the current stream of ``device``."""
    with torch.cuda.device(device):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps


def measure_costs(weights: Sequence[Any], rows: int, dtype: Any, devices: Sequence[str]
                  ) -> tuple[list[LayerCost], LinkCost]:
    """Time each distinct layer shape on the first device, whole and as one of ``k * k`` blocks."""
    dev = torch.device(devices[0])
    k = len(devices)
    seen: dict[tuple[int, ...], LayerCost] = {}
    layers = []
    for w in weights:
        shape = tuple(w.shape)
        if shape not in seen:
            din, dout = shape
            x = torch.randn(rows, din, dtype=dtype, device=dev)
            wf = w.to(dev, dtype)
            out = torch.empty(rows, dout, dtype=dtype, device=dev)
            xb, wb = x[:, : din // k].contiguous(), wf[: din // k, : dout // k].contiguous()
            ob = torch.empty(rows, dout // k, dtype=dtype, device=dev)
            single = _gpu_ms(lambda x=x, wf=wf, out=out: torch.mm(x, wf, out=out).relu_(), dev)
            block = _gpu_ms(lambda xb=xb, wb=wb, ob=ob: torch.mm(xb, wb, out=ob), dev)
            size = torch.tensor([], dtype=dtype).element_size()
            seen[shape] = LayerCost(single, block, rows * din * size / 1e6, rows * dout * size / 1e6)
        layers.append(seen[shape])
    return layers, measure_link(devices[1], devices[0])


def measure_link(src: str, dst: str) -> LinkCost:
    """Latency (small copies back to back) and time per MB (64 MB copies) from ``src`` to ``dst``."""
    s, d = torch.device(src), torch.device(dst)
    small_src, small_dst = torch.empty(1 << 16, dtype=torch.uint8, device=s), \
        torch.empty(1 << 16, dtype=torch.uint8, device=d)
    big_src, big_dst = torch.empty(64 << 20, dtype=torch.uint8, device=s), \
        torch.empty(64 << 20, dtype=torch.uint8, device=d)
    small = _gpu_ms(lambda: small_dst.copy_(small_src, non_blocking=True), s)
    big = _gpu_ms(lambda: big_dst.copy_(big_src, non_blocking=True), s, reps=5)
    mb = (64 << 20) / 1e6
    return LinkCost(latency_ms=small + WAIT_MS, ms_per_mb=max(big - small, 1e-6) / mb)
