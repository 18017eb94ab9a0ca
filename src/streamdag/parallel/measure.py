"""Measured inputs of the tensor-parallel cost model, on GPUs: layer times and every peer link.

The links are measured per ordered pair of devices, not assumed: NVLink and
PCIe differ by an order of magnitude, and a machine of eight GPUs may link
some pairs better than others. Each pair is measured alone (nothing else
copying), once per set of devices in a process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .plan import LayerCost, LinkCost, Links, split_sizes

__all__ = ["measure_costs", "measure_link", "measure_links", "measure_stages"]

#: Allowance for the cross-device event wait in front of each peer copy in a run.
WAIT_MS = 0.010
#: Link matrices measured in this process, by the devices' names in order.
_LINKS: dict[tuple[str, ...], Links] = {}


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


def measure_costs(weights: Sequence[Any], rows: int, dtype: Any, devices: Sequence[str],
                  sizes: Sequence[int] | None = None, row_sizes: Sequence[int] | None = None
                  ) -> tuple[list[LayerCost], Links]:
    """Time each distinct layer shape on the first device: whole, its block products and its row parts.

    A block product is measured for every pair of input and output block
    counts the plan may meet: 1 (whole) and each split size in ``sizes``
    (default: 2, 4, 8 up to the device count, and the count); a row part,
    the whole layer on ``1/k`` of the rows, for each ``k`` in ``row_sizes``
    (default: as ``sizes``).
    """
    dev = torch.device(devices[0])
    n = len(devices)
    counts = sorted({1, *(split_sizes(n) if sizes is None else sizes)})
    size = torch.tensor([], dtype=dtype).element_size()
    seen: dict[tuple[int, ...], LayerCost] = {}
    layers = []
    for w in weights:
        shape = tuple(w.shape)
        if shape not in seen:
            din, dout = shape
            x = torch.randn(rows, din, dtype=dtype, device=dev)
            wf = w.to(dev, dtype)
            out = torch.empty(rows, dout, dtype=dtype, device=dev)
            single = _gpu_ms(lambda x=x, wf=wf, out=out: torch.mm(x, wf, out=out).relu_(), dev)
            products = {(p, k): _product_ms(x, wf, p, k, dev) for p in counts for k in counts
                        if (p, k) != (1, 1)}
            block = products.get((n, n)) or _product_ms(x, wf, n, n, dev)
            parts = {k: _rows_ms(x, wf, k, dev) for k in (counts[1:] if row_sizes is None else row_sizes)}
            seen[shape] = LayerCost(single, block, rows * din * size / 1e6, rows * dout * size / 1e6,
                                    products, parts)
        layers.append(seen[shape])
    return layers, measure_links(devices)


def _product_ms(x: torch.Tensor, w: torch.Tensor, p: int, k: int, dev: torch.device) -> float:
    """One product of an input column block of ``p`` by an output column block of ``k``."""
    din, dout = w.shape
    xb = x[:, : max(din // p, 1)].contiguous()
    wb = w[: max(din // p, 1), : max(dout // k, 1)].contiguous()
    ob = torch.empty(x.shape[0], wb.shape[1], dtype=x.dtype, device=dev)
    return _gpu_ms(lambda: torch.mm(xb, wb, out=ob), dev)


def _rows_ms(x: torch.Tensor, w: torch.Tensor, k: int, dev: torch.device) -> float:
    """The whole layer on ``1/k`` of the rows, its activation included."""
    xr = x[: max(x.shape[0] // k, 1)].contiguous()
    out = torch.empty(xr.shape[0], w.shape[1], dtype=x.dtype, device=dev)
    return _gpu_ms(lambda: torch.mm(xr, w, out=out).relu_(), dev)


def measure_links(devices: Sequence[str]) -> Links:
    """The peer-copy cost of every ordered pair of ``devices`` (measured once per process)."""
    key = tuple(str(d) for d in devices)
    got = _LINKS.get(key)
    if got is None:
        got = _LINKS[key] = Links([[None if s == d else measure_link(s, d) for d in key] for s in key])
    return got


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


def measure_stages(fns: Sequence[Callable[[Any], Any]], example: Any, device: str
                   ) -> tuple[list[float], list[float]]:
    """Each pipeline stage's time on ``device`` and its output's size in MB, from ``example`` through all."""
    dev = torch.device(device)
    x = example.to(dev)
    times, sizes = [], []
    for fn in fns:
        times.append(_gpu_ms(lambda fn=fn, x=x: fn(x), dev))
        with torch.cuda.device(dev):
            x = fn(x)
        sizes.append(x.numel() * x.element_size() / 1e6)
    return times, sizes
