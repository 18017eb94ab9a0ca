"""What a traced module's graph took from the module besides its inputs, and whether it still holds.

Tracing bakes the module into the graph: parameters and buffers by identity
(the graph reads those very tensors, so in-place updates are seen), and the
Python values the forward reads (``training``, ``self.scale``, which
submodules exist, their hooks) by value. A :class:`ModuleState` is a snapshot
of every submodule's attributes; the graph is valid while it holds.

The snapshot covers each submodule's training flag and its own attributes
(those ``nn.Module`` itself does not make), and, one level down, the
dicts, lists and sets among them and its parameters, buffers, submodules
and forward hooks. All are compared by identity, in C-level passes (every
call pays them: a few lookups and comparisons per submodule; containers
empty when the snapshot was taken only by their length). A changed
value is a new object (``m.scale = 2.0``, ``m.train()``,
``m.weight = nn.Parameter(...)``), so identity sees every replacement and
every change to the containers it covers; an attribute added or removed
changes the length of the module's ``__dict__``. What it cannot see is a
change *inside* another kind of object (a config object's field); such
attributes are named by :attr:`ModuleState.opaque` so the caller can warn
(public ones: a module's private attributes are its own business, such as
the lists of weight names ``nn.LSTM`` keeps).
"""

from __future__ import annotations

import enum
import functools
import itertools
import operator
import types
import weakref
from typing import Any

import torch

__all__ = ["ModuleState"]

#: values that cannot change inside: identity is the whole of them
_ATOMIC = (type(None), bool, int, float, complex, str, bytes, type, enum.Enum, torch.dtype,
           torch.device, torch.layout, torch.memory_format, torch.Tensor, torch.nn.Module,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial, weakref.ref)

_CONTAINERS = (dict, list, set)

#: torch's own containers whose contents the graph depends on
_MODULE_CONTAINERS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks")

_internal_names: frozenset[str] | None = None


def _internals() -> frozenset[str]:
    """Attributes every module has (hook dicts and the like): torch's, not the model's."""
    global _internal_names
    if _internal_names is None:
        _internal_names = frozenset(vars(torch.nn.Module())) | frozenset(
            vars(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())))
    return _internal_names


def _fixed(value: Any) -> bool:
    """Whether identity says all there is to know about ``value`` (tuples: of such values)."""
    if isinstance(value, tuple | frozenset):
        return all(map(_fixed, value))
    return isinstance(value, _ATOMIC)


class ModuleState:
    """A snapshot of ``root``'s submodules' attributes; :meth:`holds` says whether it still matches."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.take()

    def take(self) -> None:
        """Snapshot the module as it is now."""
        internals = _internals()
        self.sized: list[Any] = []  # every submodule's __dict__, and every container that counts
        self.sized_labels: list[str] = []
        self.getters: list[operator.itemgetter[Any]] = []  # per submodule: its training flag, own attributes
        self.getter_dicts: list[dict[str, Any]] = []
        self.names: list[str] = []  # each submodule's type name
        self.keys: list[tuple[str, ...]] = []  # what each getter gets (two or more keys: it returns a tuple)
        self.opaque: list[str] = []  # attributes whose insides are not compared
        containers: list[tuple[Any, str]] = []
        for m in self.root.modules():
            name, d = type(m).__name__, m.__dict__
            own = [k for k in d if k not in internals]
            keys = ("training" if "training" in d else "_parameters", *own)
            self.keys.append(keys if len(keys) > 1 else (*keys, *keys))
            self.getters.append(operator.itemgetter(*self.keys[-1]))
            self.getter_dicts.append(d)
            self.names.append(name)
            self.sized.append(d)
            self.sized_labels.append(f"{name} (an attribute added or removed)")
            containers += [(d[a], f"{name}.{a}") for a in (*_MODULE_CONTAINERS, *own)
                           if isinstance(d.get(a), _CONTAINERS)]
            for attr in (a for a in own if not a.startswith("_")):
                value = d[attr]
                inside = value.values() if isinstance(value, dict) else value
                if not (all(map(_fixed, inside)) if isinstance(value, _CONTAINERS) else _fixed(value)):
                    self.opaque.append(f"{name}.{attr} ({type(value).__name__})")
        self.sized += [c for c, _ in containers]
        self.sized_labels += [label for _, label in containers]
        # contents compared by identity: only of containers with any (the others' lengths say enough)
        dicts = [(c, label) for c, label in containers if isinstance(c, dict) and c]
        others = [(c, label) for c, label in containers if not isinstance(c, dict) and c]
        self.dicts: list[dict[Any, Any]] = [c for c, _ in dicts]
        self.others: list[list[Any] | set[Any]] = [c for c, _ in others]
        self.labels: list[str] = [label for _, label in dicts + others]
        self.lengths: tuple[int, ...] = tuple(map(len, self.sized))
        self.values: tuple[Any, ...] = tuple(self._values())

    def _values(self) -> Any:
        chain = itertools.chain.from_iterable
        return itertools.chain(chain(map(operator.itemgetter.__call__, self.getters, self.getter_dicts)),
                               chain(map(dict.values, self.dicts)), chain(self.others))

    def holds(self) -> bool:
        """Whether every attribute is the object it was (every container the same length, too)."""
        if tuple(map(len, self.sized)) != self.lengths:
            return False
        try:
            return all(map(operator.is_, self._values(), self.values))
        except KeyError:  # an attribute removed and another added
            return False

    def changed(self) -> str:
        """Where the module differs from the snapshot (``Type.attribute``); '' where it does not."""
        for container, length, label in zip(self.sized, self.lengths, self.sized_labels):
            if len(container) != length:
                return label
        at = 0
        for d, keys, name in zip(self.getter_dicts, self.keys, self.names):
            for key in keys:
                if d.get(key) is not self.values[at]:
                    return f"{name}.{key}"
                at += 1
        for container, label in zip([*self.dicts, *self.others], self.labels):
            now = list(container.values() if isinstance(container, dict) else container)
            if not all(map(operator.is_, now, self.values[at:at + len(now)])):
                return label
            at += len(now)
        return ""

