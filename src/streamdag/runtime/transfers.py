"""Copies between host and device as ops on the copy streams (one per direction)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..graph.buffers import region_of
from .ops import Future

if TYPE_CHECKING:
    from .core import Runtime

__all__ = ["copy", "to_device", "to_host"]


def _direction(src_space: str, dst_space: str) -> str | None:
    if src_space == "cpu" and dst_space != "cpu":
        return "h2d"
    if dst_space == "cpu" and src_space != "cpu":
        return "d2h"
    return None


def _copy_fn(dst: Any, src: Any):
    if isinstance(dst, np.ndarray):
        def run() -> Any:
            np.copyto(dst, src)
            return dst
        return run

    def run_torch() -> Any:
        return dst.copy_(src, non_blocking=True)

    return run_torch


def copy(rt: Runtime, dst: Any, src: Any, name: str | None = None) -> Future:
    """Copy ``src`` into ``dst`` after every op it conflicts with; host<->device copies use copy streams.

    The runtime keeps both alive until the copy has completed.
    """
    kind = _direction(region_of(src).space, region_of(dst).space)
    stream = rt._copy_index.get(kind) if kind else None
    return rt._submit(_copy_fn(dst, src), (), {}, [src], [dst], name or f"copy_{kind or 'local'}",
                      True, stream)


def to_device(rt: Runtime, x: Any, name: str | None = None) -> Future:
    """A Future of a new device tensor holding ``x`` (a torch CPU tensor or numpy array)."""
    import torch

    src = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    dst = torch.empty(src.shape, dtype=src.dtype, device=rt.device)
    return copy(rt, dst, src, name or "to_device")


def to_host(rt: Runtime, t: Any, name: str | None = None) -> Future:
    """A Future of a pinned host tensor holding ``t``; it exists for the caller only once the copy is done."""
    import torch

    dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return copy(rt, dst, t, name or "to_host")
