"""Backends: the only layer that touches threads and devices."""

from __future__ import annotations

from .base import Backend, Event, Stream

__all__ = ["Backend", "Event", "Stream", "make_backend", "make_backends"]


def make_backend(device: str, streams: int | None, seed: int = 0,
                 default_stream_sync: bool = True) -> Backend:
    """The backend for a device string: ``"cpu"``, ``"sim"``, ``"cuda"`` or ``"cuda:N"``.

    ``streams`` (or None for the backend's default) is checked by the runtime;
    ``default_stream_sync`` is the runtime's (GPUs only).
    """
    if not isinstance(device, str):
        device = str(device)
    if device == "cpu":
        from .cpu import CpuBackend

        return CpuBackend(streams or 4)
    if device == "sim":
        from .sim import SimBackend

        return SimBackend(streams or 4, seed=seed)
    if device == "cuda" or device.startswith("cuda:"):
        from .cuda import CudaBackend

        return CudaBackend(device, streams or 8, default_stream_sync)
    raise ValueError(
        f"unknown device {device!r}: use 'cpu', 'cuda', 'cuda:N' (a GPU), or 'sim' (a simulated "
        "device for tests)"
    )


def make_backends(devices: list[str], streams: int | None, seed: int = 0,
                  default_stream_sync: bool = True) -> list[Backend]:
    """One backend per device of a runtime that spans several: GPUs, or simulated devices ``"sim:N"``."""
    names = [str(d) for d in devices]
    if not names:
        raise ValueError("devices= needs at least one device, e.g. devices=['cuda:0', 'cuda:1']")
    if len(set(names)) != len(names):
        raise ValueError(f"devices= lists a device twice: {names}")
    backends: list[Backend] = []
    executor = None
    for name in names:
        if name.startswith("sim:") and name[4:].isdigit():
            from .sim import SimBackend, SimExecutor

            executor = executor or SimExecutor(seed)
            backends.append(SimBackend(streams or 4, device=name, copy_kinds=("p2p",), executor=executor))
        elif name.startswith("cuda:") and name[5:].isdigit():
            backends.append(make_backend(name, streams, seed, default_stream_sync))
        else:
            for b in backends:
                b.close()
            raise ValueError(
                f"devices= takes GPUs 'cuda:N' or simulated devices 'sim:N' (for tests), got {name!r}; "
                "for one device use device= instead"
            )
    if len({b.device.split(":")[0] for b in backends}) > 1:
        for b in backends:
            b.close()
        raise ValueError(f"devices= mixes GPUs and simulated devices: {names}")
    return backends
