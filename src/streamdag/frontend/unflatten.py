"""A result's structure rebuilt around a replay's tensors, as ``torch.utils._pytree.tree_unflatten``
rebuilds it, by a function made once per captured structure (:func:`unflattener`).

``tree_unflatten`` calls each node type's registered function at every replay. For a Hugging Face
``ModelOutput`` that is the class's constructor, whose dataclass checks cost about 14 µs a call
with two tensors (on a development machine's CPU): more than the rest of a replay's Python. A
mapping-like dataclass (a ``dict`` subclass whose state is its items and its ``__dict__``) is
rebuilt here from a bare ``cls.__new__(cls)``, its items put back in order and its attributes set
at once, in about 1 µs. Each such node is checked at the capture: rebuilt around the captured
values, it must equal the captured object (its type, its items in order and its attributes, each
the very object). A node that does not, and every node of another kind, is rebuilt by its
registered function.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["unflattener"]

Build = Callable[[Sequence[Any]], Any]


def unflattener(spec: pytree.TreeSpec, example: Any) -> Build:
    """A function of the leaves (in ``spec``'s order) that returns ``tree_unflatten(leaves, spec)``;
    ``example`` is the captured result, whose nodes decide which can be rebuilt directly."""
    build, _ = _node(spec, example, 0)
    return build


def _children_specs(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    children = getattr(spec, "children", None)
    return list(children()) if callable(children) else list(spec.children_specs)


def _node(spec: pytree.TreeSpec, example: Any, start: int) -> tuple[Build, int]:
    """The builder of the node ``spec`` whose first leaf is leaf ``start``, and the next node's."""
    if spec.is_leaf():
        return operator.itemgetter(start), start + 1
    node = pytree.SUPPORTED_NODES[spec.type]
    values, _ = node.flatten_fn(example)
    builds = []
    for child, value in zip(_children_specs(spec), values):
        build, start = _node(child, value, start)
        builds.append(build)
    kind, context = spec.type, spec.context
    if kind is list:
        return (lambda leaves: [b(leaves) for b in builds]), start
    if kind is tuple:
        return (lambda leaves: tuple([b(leaves) for b in builds])), start
    if kind is dict:
        keys = list(context)
        return (lambda leaves: dict(zip(keys, [b(leaves) for b in builds]))), start
    mapping = _mapping_dataclass(kind, context, example, values)
    if mapping is not None:
        return (lambda leaves: mapping([b(leaves) for b in builds])), start
    unflatten = node.unflatten_fn
    return (lambda leaves: unflatten([b(leaves) for b in builds], context)), start


def _mapping_dataclass(kind: type, context: Any, example: Any,
                       values: list[Any]) -> Callable[[list[Any]], Any] | None:
    """The direct rebuild of a mapping-like dataclass node (a ``ModelOutput``) whose items are
    ``context``'s keys, or None where the node is of another kind or its rebuild of ``example``
    would differ from it."""
    if not (isinstance(kind, type) and issubclass(kind, dict) and dataclasses.is_dataclass(kind)
            and type(example) is kind):
        return None
    keys = list(context) if isinstance(context, (list, tuple)) else None
    attrs = getattr(example, "__dict__", None)
    if keys is None or attrs is None or list(example.keys()) != keys or len(values) != len(keys):
        return None
    # every item also an attribute (the same object), every other attribute None
    if any(attrs.get(k, attrs) is not example[k] for k in keys) or any(
            v is not None for name, v in attrs.items() if name not in example):
        return None
    template = dict(attrs)
    new = kind.__new__
    # the mapping's own item store, not the class's (a ModelOutput's also sets the attribute)
    set_item = OrderedDict.__setitem__ if issubclass(kind, OrderedDict) else dict.__setitem__

    def rebuild(children: list[Any]) -> Any:
        obj = new(kind)
        state = dict(template)
        for key, child in zip(keys, children):
            set_item(obj, key, child)
            state[key] = child
        obj.__dict__.update(state)
        return obj

    try:
        again = rebuild(values)
    except Exception:  # a class whose __new__ needs arguments: its registered function rebuilds it
        return None
    same = (type(again) is kind and list(again.keys()) == keys and all(again[k] is example[k] for k in keys)
            and again.__dict__.keys() == attrs.keys()
            and all(again.__dict__[n] is v for n, v in attrs.items()))
    return rebuild if same else None
