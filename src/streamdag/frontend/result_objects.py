"""Objects in a whole call's result, rebuilt around fresh tensors at each replay.

A model may return an object that ``torch.utils._pytree`` does not know: a
Hugging Face decoder returns its KV cache (``DynamicCache``: a list of layer
objects, each holding a key and a value tensor). A replay must hand the
caller a new such object each call, holding that call's tensors, as the
model's own call does. So at the capture the object is walked once into a
template: its tensors become outputs of the graph, its plain values stay,
and each object, list, tuple and dict in it is rebuilt at every replay: the
object by ``cls.__new__`` and its attributes set again, as ``copy.deepcopy``
rebuilds plain objects, without the per-object dispatch of ``deepcopy``.

Classes and functions are kept as they are (``deepcopy`` shares them too).
What cannot be rebuilt so is refused, with the type named: a module, a
generator or another callable object, an object whose class has a
``__new__`` of its own (a subclass of ``dict`` or of a namedtuple), an object
with neither ``__dict__`` nor ``__slots__``, a cycle, or nesting deeper than
:data:`MAX_DEPTH`.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["MAX_DEPTH", "Template", "rebuild", "template"]

#: the deepest an object's values are walked
MAX_DEPTH = 8

#: values a template keeps as they are: immutable, or shared by copies as ``copy.deepcopy`` shares them
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum,
          type, types.FunctionType, types.BuiltinFunctionType)

#: the ``__new__`` of the classes rebuilt by ``cls.__new__(cls)``: an empty object, filled by its attributes
_BARE_NEW = (object.__new__, types.SimpleNamespace.__new__)

# a template: ("t", slot) a tensor, ("v", value) a plain value, ("l" | "u", [templates], key) a list or
# tuple, ("d", [(key, template)], key) a dict, ("o", cls, attributes, [(slot name, template)], key) an
# object, its attributes (None where it has no __dict__ items) split into ({name: plain value or None,
# in order}, [(name, tensor slot)], [(name, template)]); ``key`` (the captured value's id) names a value met
# twice, rebuilt once per replay
Template = tuple


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for c in cls.__mro__:
        slots = c.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name.startswith("__") and not name.endswith("__") and c.__name__.lstrip("_"):
                name = f"_{c.__name__.lstrip('_')}{name}"  # a private slot's attribute: its mangled name
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return names


def template(value: Any, slot_of: Callable[[torch.Tensor], int]) -> Template | str:
    """``value`` as a template, its tensors given slots by ``slot_of``; or why it cannot be rebuilt."""
    return _walk(value, slot_of, 0, set())


def _walk(value: Any, slot_of: Callable[[torch.Tensor], int], depth: int, path: set[int]) -> Template | str:
    if isinstance(value, torch.Tensor):
        return ("t", slot_of(value))
    if isinstance(value, _PLAIN):
        return ("v", value)
    kind = type(value).__name__
    if depth >= MAX_DEPTH:
        return f"a {kind} nested deeper than {MAX_DEPTH} levels"
    if id(value) in path:
        return f"a {kind} that holds itself"
    if isinstance(value, (torch.nn.Module, type)) or callable(value) or hasattr(value, "__next__"):
        return f"a {kind}"
    path = path | {id(value)}
    if type(value) in (list, tuple):
        parts = [_walk(v, slot_of, depth + 1, path) for v in value]
        return _refusal(parts) or ("l" if type(value) is list else "u", parts, id(value))
    if type(value) is dict:
        items = [(k, _walk(v, slot_of, depth + 1, path)) for k, v in value.items()]
        return _refusal(p for _, p in items) or ("d", items, id(value))
    if type(value).__new__ not in _BARE_NEW:  # a builtin container's subclass keeps its items
        # outside its attributes, a namedtuple's needs its fields: cls.__new__(cls) alone is no copy
        return f"a {kind} (made by a __new__ of its own)"
    attrs = getattr(value, "__dict__", None)
    slots = _slot_names(type(value))
    if not isinstance(attrs, dict) and not slots:
        return f"a {kind}"
    items = [(k, _walk(v, slot_of, depth + 1, path)) for k, v in (attrs or {}).items()]
    slotted = [(n, _walk(getattr(value, n), slot_of, depth + 1, path)) for n in slots if hasattr(value, n)]
    reason = _refusal(p for _, p in items + slotted)
    if reason:
        return reason
    # the attributes split once: plain values copied in one dict, tensors by slot, the rest rebuilt
    plain = {k: p[1] if p[0] == "v" else None for k, p in items}  # every name, in the object's order
    tensors = [(k, p[1]) for k, p in items if p[0] == "t"]
    nested = [(k, p) for k, p in items if p[0] not in ("v", "t")]
    return ("o", type(value), (plain, tensors, nested) if items else None, slotted, id(value))


def _refusal(parts: Iterable[Template | str]) -> str:
    """The first of ``parts`` that is a reason, not a template ('' where none is)."""
    return next((p for p in parts if isinstance(p, str)), "")


def rebuild(tpl: Template, fresh: list[torch.Tensor], memo: dict[int, Any] | None = None) -> Any:
    """A new value of ``tpl``'s shape holding ``fresh``'s tensors in their slots; ``memo`` (one per
    replay, shared by the templates of one result) keeps a value held twice one value, as
    ``copy.deepcopy``'s memo does."""
    kind = tpl[0]
    if kind == "t":
        return fresh[tpl[1]]
    if kind == "v":
        return tpl[1]
    memo = {} if memo is None else memo
    key = tpl[-1]
    if key in memo:
        return memo[key]
    if kind == "l":
        memo[key] = [rebuild(p, fresh, memo) for p in tpl[1]]
    elif kind == "u":
        memo[key] = tuple([rebuild(p, fresh, memo) for p in tpl[1]])
    elif kind == "d":
        memo[key] = {k: rebuild(p, fresh, memo) for k, p in tpl[1]}
    else:
        _, cls, attrs, slotted, _ = tpl
        obj = memo[key] = cls.__new__(cls)
        if attrs is not None:  # (a call of rebuild per plain value was most of a KV cache's rebuild)
            plain, tensors, nested = attrs
            state = plain.copy()
            for k, slot in tensors:
                state[k] = fresh[slot]
            for k, p in nested:
                state[k] = rebuild(p, fresh, memo)
            obj.__dict__.update(state)
        for name, p in slotted:
            object.__setattr__(obj, name, rebuild(p, fresh, memo))
    return memo[key]
