"""How the CUDA backend calls CUDA through PyTorch, and how it tells CUDA's errors apart.

PyTorch's own C entry points for the calls made per op (stream and device, event record and wait,
capture state), looked up once; whether an error leaves the device unusable (sticky) or is a call
refused while a CUDA graph is captured; whether PyTorch's stream sanitizer is on. No state.
"""

from __future__ import annotations

import torch

from ..errors import SubmittedInCapture

_STICKY = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "illegal instruction",
    "misaligned address",
    "an illegal",
    "launch timed out",
    "hardware stack error",
)


def _cuda_words(exc: BaseException) -> str:
    """The error itself, in lower case: the first line of its message. PyTorch appends the same
    advice to every CUDA error ("... to enable device-side assertions"), which must not count."""
    return str(exc).split("\n", 1)[0].lower()


def is_sticky(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA error after which the context is unusable."""
    text = _cuda_words(exc)
    return not isinstance(exc, torch.cuda.OutOfMemoryError) and any(s in text for s in _STICKY)


#: CUDA's words for a call refused because a CUDA graph is being captured
#: (cudaErrorStreamCaptureUnsupported): gone when the capture ends, unlike the other capture errors
_CAPTURE_REFUSALS = ("operation not permitted when stream is capturing",)


def _refuse_in_capture(device_index: int, current: int | None = None) -> None:
    """Raise if the caller's current stream on ``device_index`` is being captured into a CUDA graph:
    waiting on an event recorded there would pull the runtime's stream into that capture.
    ``current``: the current device, where the caller knows it."""
    current = _get_device() if current is None else current
    if current == device_index:
        capturing = _is_capturing()
    else:  # PyTorch asks about the current device's current stream
        _set_device(device_index)
        try:
            capturing = _is_capturing()
        finally:
            _set_device(current)
    if capturing:
        raise SubmittedInCapture()


def refused_during_capture(exc: BaseException) -> bool:
    """Whether ``exc`` is CUDA refusing a call while a CUDA graph is captured: not a fault of the
    device, and gone once the capture ends. PyTorch captures in CUDA's global mode by default,
    in which an event query is refused from any thread in global mode (the runtime queries in
    relaxed mode: see ``capture_mode``)."""
    text = _cuda_words(exc)
    return any(s in text for s in _CAPTURE_REFUSALS)


# PyTorch's own C entry points for the calls made per op: its Python wrappers around them
# (device lookups, Stream objects built per call) cost more than the calls themselves
_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream = getattr(torch._C, "_cuda_setStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_set_device = getattr(torch._C, "_cuda_setDevice", None)
_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_event_base = getattr(torch._C, "_CudaEventBase", None)  # a CPU-only build has it, without methods
_record = getattr(_event_base, "record", None)
_wait = getattr(_event_base, "wait", None)


def _sanitizer_enabled() -> bool:
    """Whether PyTorch's CUDA stream sanitizer is on (it must see the host observe each event)."""
    sanitizer = getattr(torch.cuda, "_sanitizer", None)
    return bool(sanitizer is not None and sanitizer.cuda_sanitizer.enabled)
