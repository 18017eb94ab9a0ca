"""Several devices: where an op runs, and peer copies of the inputs it reads from other devices.

An op runs on the device of the memory it writes, else of the memory it
reads, else on the runtime's first device, unless ``run_on=`` names one. A
read of memory on another device becomes a peer copy into a new buffer on the
op's device (on that device's peer copy stream, after an event wait on the
producer); the op gets the copy in place of the original and waits on the
copy's event only. Writes to another device's memory are refused: the op
should run there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..errors import InvalidBuffer
from ..graph.buffers import Access, region_of

__all__ = ["PlacementRuntime", "bring_inputs", "empty_on", "empty_tensor", "place"]


class PlacementRuntime(Protocol):
    """What placement over several devices needs of the runtime: its devices and streams, and its
    copies."""

    device: str
    devices: list[str]
    copy: Callable[..., Any]
    _compute_of: dict[str, range]
    _stream_device: list[str]


def place(rt: PlacementRuntime, accesses: list[Access], run_on: str | None, stream: int | None,
          name: str) -> str:
    """The device an op runs on."""
    if stream is not None:
        return rt._stream_device[stream]
    if run_on == "host":  # on a host lane (a runtime of devices has them)
        return "host"
    if run_on is not None:
        run_on = _normalize(run_on)
        if run_on not in rt._compute_of:
            raise ValueError(f"op {name!r}: run_on={run_on!r} is not a device of this runtime "
                             f"({', '.join(rt.devices)})")
        return run_on
    for want_write in (True, False):
        for a in accesses:
            if a.write == want_write and a.region.space in rt._compute_of:
                return a.region.space
    return rt.device


def _normalize(device: Any) -> str:
    text = str(device)
    return "cuda:0" if text == "cuda" else text


def bring_inputs(rt: PlacementRuntime, args: tuple[Any, ...], kwargs: dict[str, Any], accesses: list[Access],
                 device: str, name: str) -> tuple[tuple[Any, ...], dict[str, Any], list[Access]]:
    """Swap every argument on another device for a peer copy on ``device``; accesses follow."""
    remote = [a for a in accesses if a.region.space != device and a.region.space in rt._compute_of]
    if not remote:
        return args, kwargs, accesses
    for a in remote:
        if a.write:
            raise InvalidBuffer(
                f"op {name!r} runs on {device} but writes memory on {a.region.space}: run it there "
                f"(run_on={a.region.space!r}), or write into a buffer on {device} and copy it with rt.copy"
            )
    copies: dict[int, Any] = {}

    def swap(value: Any) -> Any:
        if type(value) in (list, tuple):
            return type(value)(swap(v) for v in value)
        if not _is_device_buffer(value):
            return value
        space = region_of(value).space
        if space == device or space not in rt._compute_of:
            return value
        local = copies.get(id(value))
        if local is None:
            local = copies[id(value)] = (value, empty_on(value, device))
            rt.copy(local[1], value, name=f"peer_copy_for_{name}")
        return local[1]

    args = tuple(swap(a) for a in args)
    kwargs = {k: swap(v) for k, v in kwargs.items()}
    moved = [region_of(src) for src, _ in copies.values()]
    for a in remote:
        if not any(m.covers(a.region) for m in moved):
            raise InvalidBuffer(
                f"op {name!r} runs on {device} and reads memory on {a.region.space} that is not one of "
                "its arguments, so streamdag cannot hand it a copy: pass that tensor as an argument, "
                f"or copy it first with rt.copy into a buffer on {device}"
            )
    kept = [a for a in accesses if a not in remote]
    return args, kwargs, kept + [Access(region_of(dst), False) for _, dst in copies.values()]


def _is_device_buffer(value: Any) -> bool:
    return hasattr(value, "streamdag_space") or (
        hasattr(value, "untyped_storage") and getattr(value, "is_cuda", False))


def empty_on(value: Any, device: str) -> Any:
    """A new buffer like ``value`` (dense, same shape and dtype) on ``device``."""
    if hasattr(value, "empty_on"):
        return value.empty_on(device)
    return empty_tensor(tuple(value.shape), value.dtype, device)


def empty_tensor(shape: tuple[int, ...], dtype: Any, device: str) -> Any:
    """A new torch tensor, allocated with ``device`` current.

    PyTorch's allocator hands out memory for that device's current stream, and
    tools that model streams (the CUDA stream sanitizer) then see the
    allocation on that same stream.
    """
    import torch

    if not str(device).startswith("cuda"):
        return torch.empty(shape, dtype=dtype, device=device)
    with torch.cuda.device(device):
        return torch.empty(shape, dtype=dtype, device=device)
