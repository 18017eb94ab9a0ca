"""Whether the buffers a recorded graph holds still have the memory it was recorded with.

A graph's dependencies, among its ops and with the runtime's other ops, were
inferred from the memory its ops declared at recording. A buffer resized
(``resize_``, numpy's ``resize``) or given another storage (``set_``) since
then has other memory, and a run would follow the wrong ops. Before each run
the graph checks the buffers it holds (its ops' arguments and declared
writes) whose memory its ops declared, and refuses to run if one moved,
saying what to do. A change that keeps the memory (a square ``t_()``, an
``unsqueeze_``) is no change here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidBuffer
from ..graph.buffers import Access, Region, region_of
from .accel import accesses

__all__ = ["DeclaredBuffers"]


class DeclaredBuffers:
    """The declared buffers a graph's ops hold, and their memory at recording (see the module)."""

    def __init__(self, ops: Sequence[Any]) -> None:
        """``ops``: the graph's recorded ops (``fn``, ``args``, ``kwargs``, ``written``, ``accesses``)."""
        tensors: dict[int, tuple[Any, Region, str]] = {}
        arrays: dict[int, tuple[Any, Region, str]] = {}
        tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
        for rec in ops:
            for value in _buffers_in((rec.args, rec.kwargs, rec.written), tensor_type):
                try:
                    region = region_of(value)
                except Exception:  # (a tensor without storage, say): its op declared no memory of it
                    continue
                if _declared(region, rec.accesses):
                    kept = tensors if tensor_type is not None and isinstance(value, tensor_type) else arrays
                    kept.setdefault(id(value), (value, region, rec.name))
        self._tensors = list(tensors.values())
        self._arrays = list(arrays.values())
        #: True while every tensor has its address, shape and strides of when it was last looked at:
        #: cheaper than reading their regions each run (see ``_layout_check``)
        self._unchanged: Callable[[], bool] | None = self._layout_check()

    def _layout_check(self) -> Callable[[], bool] | None:
        """The capture's check of the tensors' layouts (see ``capture._layout_check``): with a CUDA
        tensor the runtime is a GPU one, whose torch extension checks in one C++ loop (it is built,
        or was tried, as that runtime was made); else PyTorch's own C++ checks."""
        if not self._tensors:
            return None
        from .capture import _checked_by_pytorch, _layout_check

        tensors = [t for t, _, _ in self._tensors]
        return (_layout_check if any(t.is_cuda for t in tensors) else _checked_by_pytorch)(tensors)

    def check(self) -> None:
        """Raise :class:`InvalidBuffer`, saying what to do, if a buffer has memory other than at recording."""
        if self._unchanged is not None and not self._unchanged():
            _same_memory(self._tensors)
            self._unchanged = self._layout_check()  # a new layout over the same memory: from now on
        if self._arrays:
            _same_memory(self._arrays)


def _same_memory(held: list[tuple[Any, Region, str]]) -> None:
    now = accesses([value for value, _, _ in held], ())
    for (value, region, op_name), access in zip(held, now):
        if access.region != region:
            raise InvalidBuffer(
                f"op {op_name!r} of this recorded graph declared a {type(value).__name__} that has other "
                f"memory than at recording ({region.nbytes} bytes at {region.start:#x} then, "
                f"{access.region.nbytes} at {access.region.start:#x} now: resized, or given another "
                "storage): the graph's dependencies were inferred from the old memory. Record the graph "
                "again (with rt.record()) after changing the buffer, or keep its memory: copy new data "
                "into it (t.copy_(new)) rather than resize_ or set_ it")


def _declared(region: Region, declared: Sequence[Access]) -> bool:
    """Whether ``region`` lies within memory that ``declared`` names (an empty one: exactly)."""
    if region.start == region.end:
        return any(a.region == region for a in declared)
    return any(a.region.covers(region) for a in declared)


def _buffers_in(value: Any, tensor_type: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """The tensors and numpy arrays in ``value``, through lists, tuples and dicts (each once)."""
    if isinstance(value, np.ndarray) or (tensor_type is not None and isinstance(value, tensor_type)):
        yield value
    elif isinstance(value, (list, tuple, dict)):
        seen = set() if seen is None else seen
        if id(value) in seen:
            return
        seen.add(id(value))
        for v in value.values() if isinstance(value, dict) else value:
            yield from _buffers_in(v, tensor_type, seen)
