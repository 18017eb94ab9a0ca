"""Backends: the only layer that touches threads and devices."""

from __future__ import annotations

from .base import Backend, Event, Stream

__all__ = ["Backend", "Event", "Stream", "make_backend"]


def make_backend(device: str, streams: int | None, seed: int = 0) -> Backend:
    """The backend for a device string: ``"cpu"``, ``"sim"``, ``"cuda"`` or ``"cuda:N"``."""
    if not isinstance(device, str):
        device = str(device)
    if streams is not None and streams < 1:
        raise ValueError(f"streams must be at least 1, got {streams}")
    if device == "cpu":
        from .cpu import CpuBackend

        return CpuBackend(streams or 4)
    if device == "sim":
        from .sim import SimBackend

        return SimBackend(streams or 4, seed=seed)
    if device == "cuda" or device.startswith("cuda:"):
        from .cuda import CudaBackend

        return CudaBackend(device, streams or 8)
    raise ValueError(
        f"unknown device {device!r}: use 'cpu', 'cuda', 'cuda:N' (a GPU), or 'sim' (a simulated "
        "device for tests)"
    )
