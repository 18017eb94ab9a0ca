"""Memory reuse across streams while a CUDA graph is captured.

A tensor made on one stream and read on another is marked with ``record_stream``
before it is dropped. Outside a capture the caching allocator then waits on
events before it hands the memory out again; during a capture it cannot query
events, so by default it keeps such a block out of use until the capture ends,
and a capture on several streams holds every value that crossed streams at
once. PyTorch's ``graph_capture_record_stream_reuse`` allocator option reads
the captured graph's dependencies instead: the block is reused on its stream
once the graph orders that stream after every read. inception_v3 (batch 1,
fp32) captured on 4 streams held 138 MiB of its pool without it, 126 MiB with
it (2 streams: 94 and 80 MiB).

:func:`stream_reuse` turns the option on for the captures inside it and off
after the last one ends (a count, under a lock: captures of several threads may
overlap). Where the user's ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``)
names the option, theirs holds and this does nothing; a PyTorch without the
option captures as before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["stream_reuse"]

_OPTION = "graph_capture_record_stream_reuse"

# state, under _lock: _inside counts the captures inside stream_reuse(); the option is on while it
# is above zero. _usable: whether this PyTorch takes the option (None: not tried yet).
_lock = threading.Lock()
_inside = 0
_usable: bool | None = None


def _user_sets_it() -> bool:
    names = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    return any(_OPTION in os.environ.get(name, "") for name in names)


def _set(on: bool) -> bool:
    # the accelerator-wide setter where PyTorch has it (it deprecates the CUDA one)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        (setter or torch.cuda.memory._set_allocator_settings)(f"{_OPTION}:{on}")
    except (RuntimeError, AttributeError):  # a PyTorch without the option
        return False
    return True


@contextmanager
def stream_reuse() -> Iterator[None]:
    """Captures inside reuse a block read on several streams once the graph orders it free."""
    global _inside, _usable
    with _lock:
        if _usable is None:
            _usable = not _user_sets_it() and _set(False)
        if _usable and _inside == 0:
            _set(True)
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _usable and _inside == 0:
                _set(False)
