"""An op's arguments: the accesses they declare (``reads=``/``writes=``, inline markers), and the
objects an op may give new memory.

``collect_accesses`` runs for every op the Python submit takes; ``native/_submit.c`` mirrors it
for the markers it unwraps itself. ``accesses_of`` is the compiled range reader where it builds
(the tests' Python path swaps it for the Python one).

State: ``buffers._RESIZING`` (object id -> pending ops that may give it new memory), changed
under ``_RESIZING_LOCK`` by ``hold_identities`` and the done-callback it returns. Invariant: an
id is there exactly while such an op is pending (a count, never 0).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..graph.buffers import _RESIZING, Access, Marker, needs_identities, region_of, with_identities
from .accel import accesses as accesses_of

__all__ = ["accesses_of", "collect_accesses", "hold_identities"]

_new = tuple.__new__  # builds a named tuple without its Python-level ``__new__``


def _unwrap(value: Any, found: list[Marker], seen: dict[int, Any]) -> Any:
    """``value`` with the inline markers in it replaced by their values, which go to ``found``: a
    marker itself, or one in a list, tuple or dict, at any depth (a container with a marker is
    copied, others are kept as they are). ``seen``: each container met, by id, unwrapped (one met
    inside itself is kept as it is)."""
    kind = type(value)
    if kind is Marker:
        found.append(value)
        return value.value
    if kind is not list and kind is not tuple and kind is not dict:
        return value
    key = id(value)
    if key in seen:
        return seen[key]
    seen[key] = value
    # walked over a copy: an op running meanwhile may change the container (a results dict that
    # ops fill in), and a dict that changes size under its iterator raises. dict.copy() and
    # list.copy() copy in one step of C (list(d.items()) does not: a thread may switch inside it)
    if kind is dict:
        pairs = value.copy()
        items = {k: _unwrap(v, found, seen) for k, v in pairs.items()}
        changed = any(items[k] is not v for k, v in pairs.items())
    else:
        before = value.copy() if kind is list else value
        items = [_unwrap(v, found, seen) for v in before]
        changed = any(new is not old for new, old in zip(items, before))
    if changed:
        seen[key] = items if kind is not tuple else tuple(items)
    return seen[key]


def collect_accesses(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    reads: Iterable[Any],
    writes: Iterable[Any],
) -> tuple[tuple[Any, ...], dict[str, Any], list[Access], Sequence[Any]]:
    """Accesses declared by ``reads``/``writes`` and by inline markers; markers are unwrapped,
    in lists, tuples and dicts among the arguments too.

    Also returns the objects written, for graphs that must save and restore them.
    Runs for every submitted op: the common case (tensors, no markers, no containers)
    takes the fewest Python steps.
    """
    if type(reads) is not list and type(reads) is not tuple:
        reads = _as_list(reads, "reads=[a, b]")
    if type(writes) is not list and type(writes) is not tuple:
        writes = _as_list(writes, "writes=[c]")
    accesses = accesses_of(reads, writes)
    for v in args:
        kind = type(v)
        if kind is Marker or kind is list or kind is tuple or kind is dict:
            break
    else:
        for v in kwargs.values():
            kind = type(v)
            if kind is Marker or kind is list or kind is tuple or kind is dict:
                break
        else:
            if needs_identities(accesses):
                accesses = with_identities(accesses, [*reads, *writes])
            return args, kwargs, accesses, writes
    found: list[Marker] = []
    seen: dict[int, Any] = {}
    unwrapped = tuple(_unwrap(a, found, seen) for a in args)
    unwrapped_kwargs = {k: _unwrap(v, found, seen) for k, v in kwargs.items()}
    if found:
        args, kwargs = unwrapped, unwrapped_kwargs  # (else containers without markers, as they are)
        accesses += [_new(Access, (region_of(m.value), m.write)) for m in found]
    if needs_identities(accesses):
        accesses = with_identities(accesses, [*reads, *writes, *(m.value for m in found)])
    return args, kwargs, accesses, [*writes, *(m.value for m in found if m.write)] if found else writes


def _as_list(value: Any, example: str) -> list[Any]:
    if type(value) is list or type(value) is tuple:  # the common case, checked cheaply
        return list(value)
    if isinstance(value, Marker) or not isinstance(value, Iterable) or _is_buffer(value):
        raise TypeError(f"{example.split('=')[0]}= takes a list of buffers, e.g. {example}")
    if isinstance(value, Mapping):  # (listed, it would be its keys)
        keyword = example.split("=")[0]
        raise TypeError(f"{keyword}= takes a list of buffers, not a dict: e.g. {example}, "
                        f"or {keyword}=list(d.values()) for the buffers of a dict d")
    return list(value)


def _is_buffer(value: Any) -> bool:
    return hasattr(value, "__array_interface__") or hasattr(value, "untyped_storage")


_RESIZING_LOCK = threading.Lock()  # orders the counts of ``_RESIZING`` (ops finish on other threads)


def hold_identities(keys: list[int]) -> Callable[[Any], None]:
    """Count the objects of ids ``keys`` as given new memory by a pending op (see ``buffers._RESIZING``)
    until the function returned is called (the op's done-callback)."""
    with _RESIZING_LOCK:
        for key in keys:
            _RESIZING[key] = _RESIZING.get(key, 0) + 1

    def done(_: Any = None) -> None:
        with _RESIZING_LOCK:
            for key in keys:
                left = _RESIZING.pop(key) - 1
                if left:
                    _RESIZING[key] = left

    return done
