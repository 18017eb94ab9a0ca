"""Which memory a value occupies: the basis of every dependency streamdag infers.

A buffer is identified by the byte range it spans in an address space
(``"cpu"`` for host memory, ``"cuda:0"`` for the first GPU, ...), not by the
Python object. Views, slices, transposes and reshapes of one storage therefore
conflict with each other, and a numpy array and a torch tensor sharing memory
are the same buffer. A strided view is taken by its whole extent: that may
report a conflict that is not there, never miss one.

A buffer an op may give new memory is also identified by the Python object
itself (see :func:`with_identities`): an empty one written, the usual
placeholder of a PyTorch ``out=``, which the op resizes.

This module reads attributes of arrays and never touches a device; its one
state is the objects that pending ops may give new memory (``_RESIZING``),
which the runtime counts as those ops come and go (``runtime.arguments.hold_identities``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from ..errors import InvalidBuffer

__all__ = ["OBJECTS", "Access", "Marker", "Region", "accesses", "coalesce", "envelope",
           "needs_identities", "read", "region_of", "with_identities", "write"]


class Region(NamedTuple):
    """A half-open byte range ``[start, end)`` in one address space.

    Spaces named ``sym:*`` hold symbols rather than bytes (a traced graph's
    values and storages, before they have memory): private to one graph.
    A named tuple: made for every access of every op, and a tuple is the
    cheapest immutable record Python builds.
    """

    space: str
    start: int
    end: int

    def overlaps(self, other: Region) -> bool:
        return (
            self.space == other.space
            and self.start < other.end
            and other.start < self.end
        )

    def covers(self, other: Region) -> bool:
        return (
            self.space == other.space
            and self.start <= other.start
            and other.end <= self.end
        )

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class Access(NamedTuple):
    """One op's use of one region."""

    region: Region
    write: bool


class Marker:
    """An inline access marker: ``rt.submit(fn, sd.read(a), sd.write(b))``.

    The op receives the wrapped value itself; the marker only declares the access.
    """

    __slots__ = ("value", "write")

    def __init__(self, value: Any, write: bool) -> None:
        self.value: Any = value
        self.write: bool = write

    def __repr__(self) -> str:
        return f"{'write' if self.write else 'read'}({type(self.value).__name__})"


def read(value: Any) -> Marker:
    """Mark an argument as read by the op (inline form of ``reads=[value]``)."""
    return Marker(value, write=False)


def write(value: Any) -> Marker:
    """Mark an argument as written by the op (inline form of ``writes=[value]``).

    A write also covers reading the same buffer.
    """
    return Marker(value, write=True)


def _extent(base: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int):
    """Lowest and one-past-highest byte touched by a strided array."""
    if any(n == 0 for n in shape):
        return base, base
    lo = hi = base
    for n, s in zip(shape, strides):
        span = (n - 1) * s
        if span < 0:
            lo += span
        else:
            hi += span
    return lo, hi + itemsize


_CUDA_SPACES: dict[int, str] = {}
_new = tuple.__new__  # builds a named tuple without its Python-level ``__new__``


def _torch_region(t: Any) -> Region:
    # flags and an int, CUDA first: each call into torch costs, most between GPU launches
    if t.is_cuda:
        index = t.get_device()
        space = _CUDA_SPACES.get(index) or _CUDA_SPACES.setdefault(index, f"cuda:{index}")
    elif t.is_cpu:
        space = "cpu"
    else:
        dev = t.device
        if dev.type == "meta":
            raise InvalidBuffer(
                "a meta tensor has no memory for streamdag to track: pass it as an ordinary argument, "
                "not in reads/writes (or sd.read/sd.write), or declare a tensor with storage "
                "(e.g. torch.empty_like(t, device='cpu'))"
            )
        space = f"{dev.type}:{dev.index or 0}"
    if t.layout is not _STRIDED:
        raise InvalidBuffer(
            f"streamdag tracks strided tensors only (got layout {t.layout}); "
            "pass a dense tensor (t.to_dense()) in reads/writes"
        )
    start = t.data_ptr()
    if t.is_contiguous():  # the common case: one C call instead of a loop over dimensions
        return _new(Region, (space, start, start + t.nbytes))
    size = t.element_size()
    stride_bytes = tuple(s * size for s in t.stride())
    start, end = _extent(start, tuple(t.shape), stride_bytes, size)
    return Region(space, start, end)


def _interface_region(iface: dict, space: str) -> Region:
    ptr = iface["data"][0]
    shape = tuple(iface["shape"])
    itemsize = _itemsize(iface["typestr"])
    strides = iface.get("strides")
    if strides is None:  # C-contiguous
        count = 1
        for n in shape:
            count *= n
        return Region(space, ptr, ptr + count * itemsize)
    start, end = _extent(ptr, shape, tuple(strides), itemsize)
    return Region(space, start, end)


@lru_cache(maxsize=256)
def _itemsize(typestr: str) -> int:
    """The bytes of one element of an array interface's ``typestr``: numpy reads it (the digits
    after the kind are not always bytes: ``<U3`` is 12, ``<M8[s]`` 8, ``|O`` a pointer)."""
    return np.dtype(typestr).itemsize


def _numpy_like_region(value: Any) -> Region:
    return _interface_region(value.__array_interface__, "cpu")


def _spaced_region(value: Any) -> Region:
    """Host-addressable memory that belongs to another space (a simulated device's arrays)."""
    return _interface_region(value.__array_interface__, value.streamdag_space)


def _cuda_interface_region(value: Any) -> Region:
    device_id = getattr(getattr(value, "device", None), "id", 0)
    return _interface_region(value.__cuda_array_interface__, f"cuda:{device_id}")


def _region_itself(value: Region) -> Region:
    return value


#: How to read the memory of each type seen so far: looked up once per type. A Region is its own
#: memory (a recorded graph's replay declares its coalesced accesses that way).
_HANDLERS: dict[type, Any] = {Region: _region_itself}


def _is_tensor_type(cls: type) -> bool:
    """Whether ``cls`` is ``torch.Tensor`` or a subclass, a user's too (``nn.Parameter``, a
    ``__torch_function__`` subclass): its memory is its storage's. (Torch is not imported for
    this: a tensor's type comes from an imported torch.)"""
    if cls.__module__.startswith("torch") and hasattr(cls, "untyped_storage"):
        return True
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    return isinstance(tensor, type) and issubclass(cls, tensor)


def _handler_for(cls: type) -> Any:
    if _is_tensor_type(cls):
        global _STRIDED
        import torch

        _STRIDED = torch.strided
        return _torch_region
    if hasattr(cls, "__cuda_array_interface__"):
        return _cuda_interface_region
    if hasattr(cls, "streamdag_space") and hasattr(cls, "__array_interface__"):
        return _spaced_region
    if hasattr(cls, "__array_interface__"):
        return _numpy_like_region
    return None


_STRIDED: Any = None


def region_of(value: Any) -> Region:
    """The memory ``value`` spans. Raises :class:`InvalidBuffer` with the fix if it is not memory."""
    cls = type(value)
    handler = _HANDLERS.get(cls)
    if handler is None:
        handler = _HANDLERS.setdefault(cls, _handler_for(cls) or _probe_instance)
    return handler(value)


def _py_accesses(reads: list[Any] | tuple[Any, ...], writes: list[Any] | tuple[Any, ...]) -> list[Access]:
    """The access of every buffer in ``reads``, then in ``writes`` (see :func:`region_of`)."""
    out = [_new(Access, (region_of(r), False)) for r in reads]
    if writes:
        out += [_new(Access, (region_of(w), True)) for w in writes]
    return out


#: The space of Python objects themselves: ``Region(OBJECTS, id(value), id(value) + 1)`` stands for
#: ``value`` whatever memory it has (see :func:`with_identities`).
OBJECTS = "object"

#: The objects (by id) that pending ops write while empty, each with how many such ops: an access to
#: one of them is also an access to the object (see :func:`with_identities`). Such an op holds what
#: it writes (``Op.keep``), so no other object takes the id meanwhile. Counted by the runtime
#: (``runtime.arguments.hold_identities``, under a lock: ops finish on other threads); read by the compiled
#: submit, which leaves every op to the Python code while it is not empty.
_RESIZING: dict[int, int] = {}


def needs_identities(accesses: Sequence[Access]) -> bool:
    """Whether :func:`with_identities` may add to ``accesses``: one is an empty write, or a pending
    op may give some object new memory."""
    return bool(_RESIZING) or any(write and start == end for (_, start, end), write in accesses)


def with_identities(accesses: list[Access], values: Sequence[Any]) -> list[Access]:
    """``accesses``, made for ``values`` one by one, and the access to the object itself of each
    value that an op may give new memory: an empty buffer written, or one that a pending op so writes.

    An empty write declares no bytes, and the memory the op gives the buffer (PyTorch's ``out=``
    resizes an empty tensor; numpy's ``resize`` an array) is known only once it has run: by memory,
    no later access would follow it. By the object, one does: while the op is pending (see
    ``runtime.arguments.hold_identities``), every access to that object follows it, whether the object
    is still empty or has its new memory already. A buffer that is not empty keeps its memory: an op must
    not resize it (PyTorch warns where an ``out=`` does).
    """
    extra = []
    for ((_, start, end), write), value in zip(accesses, values):
        key = id(value)
        if (write and start == end and _may_get_new_memory(value)) or key in _RESIZING:
            extra.append(_new(Access, (Region(OBJECTS, key, key + 1), write)))
    return accesses + extra if extra else accesses


def _may_get_new_memory(value: Any) -> bool:
    """Whether an op may give empty ``value`` new memory: not a numpy array that does not own its
    data (a view such as ``a[5:5]``), which numpy cannot resize and which has no bytes to conflict.
    A torch tensor may be resized even as a view (an ``out=`` regrows its storage)."""
    return not (isinstance(value, np.ndarray) and not value.flags.owndata)


def _probe_instance(value: Any) -> Region:
    """For objects that carry an array interface as an instance attribute, or none at all."""
    if hasattr(value, "__cuda_array_interface__"):
        return _cuda_interface_region(value)
    if hasattr(value, "__array_interface__"):
        return _numpy_like_region(value)
    raise InvalidBuffer(
        f"cannot track a {type(value).__name__} in reads/writes: streamdag infers dependencies "
        "from memory, so declare numpy arrays or torch tensors (e.g. numpy.asarray(x)); "
        "plain Python values need no declaration, pass them as ordinary arguments"
    )


def envelope(accesses: list[Access]) -> list[Access]:
    """One access per space spanning all of ``accesses`` there: a write if any was."""
    spans: dict[str, tuple[int, int, bool]] = {}
    for a in accesses:
        r = a.region
        lo, hi, wr = spans.get(r.space, (r.start, r.end, a.write))
        spans[r.space] = (min(lo, r.start), max(hi, r.end), wr or a.write)
    return [Access(Region(space, lo, hi), wr) for space, (lo, hi, wr) in spans.items()]


def coalesce(accesses: list[Access]) -> list[Access]:
    """Fewer, larger accesses spanning the same bytes: overlapping or touching ranges merge.

    A merged range is a write if any part was; never misses a conflict, may add one.
    """
    by_space: dict[str, list[Access]] = {}
    for a in accesses:
        if a.region.start != a.region.end:
            by_space.setdefault(a.region.space, []).append(a)
    merged: list[Access] = []
    for space, items in by_space.items():
        items.sort(key=lambda a: a.region.start)
        start, end, wr = items[0].region.start, items[0].region.end, items[0].write
        for a in items[1:]:
            if a.region.start <= end:
                end, wr = max(end, a.region.end), wr or a.write
            else:
                merged.append(Access(Region(space, start, end), wr))
                start, end, wr = a.region.start, a.region.end, a.write
        merged.append(Access(Region(space, start, end), wr))
    return merged


#: the accesses of buffers in this pure layer; the runtime takes the compiled ones where they are
#: built (``runtime/accel.py`` chooses)
accesses = _py_accesses
