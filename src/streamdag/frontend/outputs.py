"""A traced function's outputs as a flat list of tensors, and the function that rebuilds them.

The graph returns only tensors; calls rebuild the function's own output around
them: lists stay lists (not fx's ``immutable_list``), tuples, dicts and named
tuples keep their types, as do classes registered with ``torch.utils._pytree``
(``transformers``' ``ModelOutput`` and caches are, where the library registers
them) and dataclasses, rebuilt with :func:`dataclasses.replace`. Other values
(ints from shapes, strings, None) are the ones the trace returned; they depend
only on what the guard fixes. An object of another class holding tensors
cannot be rebuilt: :class:`CannotRebuild` says so and what to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["CannotRebuild", "flatten_outputs"]

Rebuild = Callable[[Iterator[torch.Tensor]], Any]


class CannotRebuild(Exception):
    """An output the compiled graph cannot produce; the message says what to change."""


def flatten_outputs(value: Any) -> tuple[list[torch.Tensor], Rebuild]:
    """``(tensors, rebuild)``: ``rebuild(iter(tensors))`` is ``value`` again, with those tensors."""
    if isinstance(value, torch.Tensor):
        return [value], next
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and \
            type(value) not in pytree.SUPPORTED_NODES:
        return _flatten_dataclass(value)
    leaves, spec = pytree.tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:  # a leaf that is not a tensor: a constant
        if _holds_tensors(value):
            name = type(value).__qualname__
            raise CannotRebuild(
                f"the output holds a {name}, an object with tensors inside that streamdag.compile "
                f"cannot rebuild: return tensors, or tuples, lists, dicts or dataclasses of them, or "
                f"register {name} with torch.utils._pytree.register_pytree_node")
        return [], lambda _: value
    parts = [flatten_outputs(leaf) for leaf in leaves]

    def rebuild(tensors: Iterator[torch.Tensor]) -> Any:
        return pytree.tree_unflatten([part(tensors) for _, part in parts], spec)

    return [t for ts, _ in parts for t in ts], rebuild


def _flatten_dataclass(value: Any) -> tuple[list[torch.Tensor], Rebuild]:
    fields = dataclasses.fields(value)
    parts = [flatten_outputs(getattr(value, f.name)) for f in fields]

    def rebuild(tensors: Iterator[torch.Tensor]) -> Any:
        values = {f.name: part(tensors) for f, (_, part) in zip(fields, parts)}
        out = dataclasses.replace(value, **{f.name: v for f, v in zip(fields, values.values()) if f.init})
        for f in fields:
            if not f.init:  # set by the class itself; the traced value's tensors are replaced
                object.__setattr__(out, f.name, values[f.name])
        return out

    return [t for ts, _ in parts for t in ts], rebuild


def _holds_tensors(value: Any) -> bool:
    inside = getattr(value, "__dict__", None)
    if inside is None:
        slots = getattr(type(value), "__slots__", ())
        inside = {s: getattr(value, s, None) for s in ([slots] if isinstance(slots, str) else slots)}
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(dict(inside)))
