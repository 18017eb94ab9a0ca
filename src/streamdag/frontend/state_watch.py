"""Whether a model's state is as it was when a whole-call graph was captured (:class:`StateWatch`).

A replay of a whole call runs no Python, so anything the forward would read
differently must send the call back to Dynamo's path: the modules' attributes,
parameters, buffers, submodules and hooks, the globals and closure the forward
reads, the config-like objects the modules hold, and the address, shape and
strides of every tensor among them. The check runs on every call, so it
compares dict version tags and identities first (compiled where the torch
extension builds) and values only where a tag moved.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .module_state import ModuleState

__all__ = ["StateWatch"]

_native_tags: Any = None  # the compiled dict-version tags, once looked for
_native_checked = False
_native_watch: Any = None  # the compiled dict watcher, once looked for
_watch_checked = False
#: whether the tags (or the watcher) see an object's attribute stores only once its dict is its own
#: (:func:`_own_dict`): CPython 3.13's inline attribute values
_tags_need_own_dicts = False
_watch_needs_own_dicts = False
_native_items: Any = None  # the compiled module with its comparison of containers' items, once looked for
_items_checked = False


def items_check() -> Any:
    """The compiled module's ``same_items`` (the lists and sets compared item by item in one C
    loop), or None where it is not built."""
    global _native_items, _items_checked
    if not _items_checked:
        _items_checked = True
        from ..native import load

        module = load()
        _native_items = module if hasattr(module, "same_items") else None
    return _native_items.same_items if _native_items is not None else None


def _own_dict(obj: Any) -> bool:
    """Give ``obj`` its ``__dict__`` as a dict of its own, the same dict object: from CPython 3.13 a
    new object keeps its attributes in an inline array that its dict only views, and a store into
    the array moves neither the dict's version tag nor its watchers. Setting ``__dict__`` to itself
    moves the values into the dict. False where the object's dict cannot be set."""
    try:
        object.__setattr__(obj, "__dict__", object.__getattribute__(obj, "__dict__"))
    except (AttributeError, TypeError):
        return False
    return True


def _sees_stores(snapshot: Any, unchanged: Any, own: bool) -> bool:
    """Whether a check sees a module's attribute set and added (``own``: once its dict is its own):
    ``snapshot(dicts)`` takes a state, ``unchanged(dicts, state)`` compares with it."""
    probe = torch.nn.Module()
    if own and not _own_dict(probe):
        return False
    dicts = [probe.__dict__]
    state = snapshot(dicts)
    probe.training = not probe.training
    if unchanged(dicts, state):
        return False
    state = snapshot(dicts)
    probe.added = 1
    return not unchanged(dicts, state)


def _probed(name: str, check: Callable[[Any], tuple[Any, Any]]) -> tuple[Any, bool]:
    """The compiled module where the check ``check(module)`` makes (its snapshot and comparison) sees
    attribute stores, as it is or once each object's dict is its own, and whether it needs that;
    (None, False) where the module lacks ``name`` or the check misses stores either way."""
    from ..native import load

    module = load()
    if module is None or not hasattr(module, name):
        return None, False
    snapshot, unchanged = check(module)
    try:
        for own in (False, True):
            if _sees_stores(snapshot, unchanged, own):
                return module, own
    except RuntimeError:  # the process's eight dict watchers all taken (by other libraries)
        pass
    return None, False


def dict_tags() -> Any:
    """The compiled module's dict version tags, where they follow every change of an attribute
    (from CPython 3.13: once each object's dict is its own); a probe finds out, and otherwise (as
    where the compiled module is missing) the Python comparison runs alone."""
    global _native_tags, _native_checked, _tags_need_own_dicts
    if not _native_checked:
        _native_checked = True
        _native_tags, _tags_need_own_dicts = _probed(
            "dict_versions", lambda m: (m.dict_versions, m.same_dict_versions))
    return _native_tags


def _dict_watcher() -> Any:
    """The compiled module's dict watcher (CPython 3.12 on), where its change count moves with
    every change of an attribute: a probe finds out, as for :func:`dict_tags`."""
    global _native_watch, _watch_checked, _watch_needs_own_dicts
    if not _watch_checked:
        _watch_checked = True
        _native_watch, _watch_needs_own_dicts = _probed(
            "watch_dicts", lambda m: (m.watch_dicts, lambda dicts, count: m.no_dict_change_since(count)))
    return _native_watch


def root_module(fn: Any) -> torch.nn.Module | None:
    """The module ``fn`` is, or whose bound method it is; None otherwise."""
    if isinstance(fn, torch.nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _code_of(fn: Any) -> Any:
    """The Python function whose globals and closure a call reads first: ``forward``, or ``fn``."""
    root = root_module(fn)
    target = getattr(type(root), "forward", None) if root is fn else fn
    target = getattr(target, "__func__", target)
    return target if hasattr(target, "__code__") and hasattr(target, "__globals__") else None


class StateWatch:
    """Whether a model's state is as it was: its modules' attributes, the globals and closure its
    forward reads, and the address and layout of every tensor among them (see the module docstring).

    The fast check asks whether any dict that holds the state changed: by the change count of
    a dict watcher where CPython has one (no loop), else by comparing their version tags
    (compiled, a few microseconds for a few hundred submodules); and it compares the tensors'
    layouts (the torch extension's one loop, or PyTorch's C++ checks). Where a dict changed it
    compares the values, and a change that changed nothing (a value set to itself) takes the new
    tags and count.

    State: ``_seen_changes`` is the watcher's change count when the dicts were last known to
    hold (None without a watcher); ``_tags`` their version tags then (None without tags).
    """

    def __init__(self, fn: Any) -> None:
        from ..runtime.capture import _layout_check

        root = root_module(fn)
        self.modules: ModuleState | None = ModuleState(root) if root is not None else None
        code = _code_of(fn)
        self.globals: dict[str, Any] = code.__globals__ if code is not None else {}
        self.global_names: list[str] = [n for n in (code.__code__.co_names if code is not None else ())
                                        if n in self.globals]
        self.global_values: tuple[Any, ...] = tuple(map(self.globals.get, self.global_names))
        self.cells: list[Any] = list(code.__closure__ or ()) if code is not None else []
        self.cell_values: tuple[Any, ...] = tuple(self._cell_contents())
        self.tensors: list[torch.Tensor] = self._tensors(root)
        self._layouts = _layout_check(self.tensors) if self.tensors else (lambda: True)
        sized = self.modules.sized if self.modules is not None else []
        #: (label, its __dict__) of each config-like object the modules hold
        found = _objects(root)
        self.objects: list[tuple[str, dict[str, Any]]] = [(label, o.__dict__) for label, o in found]
        self._object_items = [(len(d), tuple(d.values())) for _, d in self.objects]
        # (not the globals dict: a script's loop assigns its globals on every call)
        self._dicts = [c for c in sized if isinstance(c, dict)] + [d for _, d in self.objects]
        self._rest = [c for c in sized if not isinstance(c, dict)]  # lists and sets
        self._rest_lengths = tuple(map(len, self._rest))
        self._rest_values = tuple(itertools.chain.from_iterable(self._rest))
        self._same_items = items_check()
        self._watch, self._native = _dict_watcher(), dict_tags()
        if ((self._watch is not None and _watch_needs_own_dicts)
                or (self._native is not None and _tags_need_own_dicts)):
            owners = [*(root.modules() if root is not None else ()), *(o for _, o in found)]
            if not all([_own_dict(o) for o in owners]):  # a dict that stays a view: compare values
                self._watch = self._native = None
        # watched first: watching marks a dict's version tag, which the tags then include
        self._seen_changes: int | None = (self._watch.watch_dicts(self._dicts) if self._watch is not None
                                          else None)
        self._tags = self._native.dict_versions(self._dicts) if self._native is not None else None
        #: what :meth:`holds` checks besides the tags and layouts: only the checks that have something
        #: to check (functions, not bound methods: a watch that refers to itself would be freed only by
        #: the cyclic collector, and a dropped state's watch holds its model's tensors)
        self._quick = tuple(check for check, needed in ((StateWatch._rest_holds, self._rest),
                                                        (StateWatch._globals_hold, self.global_names),
                                                        (StateWatch._cells_hold, self.cells)) if needed)

    def _cell_contents(self) -> Iterator[Any]:
        for c in self.cells:
            try:
                yield c.cell_contents
            except ValueError:  # an empty cell
                yield None

    def _tensors(self, root: torch.nn.Module | None) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        values: list[Any] = [*self.global_values, *self.cell_values]
        if root is not None:
            values += [*root.parameters(), *root.buffers()]
            values += [v for m in root.modules() for v in vars(m).values()]
        for v in values:  # and one level into containers (a list of tensors kept as an attribute)
            inside = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else (v,)
            for t in inside:
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    seen.setdefault(id(t), t)
        return list(seen.values())

    def holds(self) -> bool:
        """Whether the state is as it was (see the class docstring)."""
        if self._dicts_unchanged():
            for check in self._quick:
                if not check(self):
                    break
            else:
                if self._layouts():
                    return True
        changes = self._watch.dict_changes() if self._watch is not None else None
        if not self._values_hold():
            return False
        self._seen_changes = changes
        if self._tags is not None:
            self._tags = self._native.dict_versions(self._dicts)
        return True

    def _dicts_unchanged(self) -> bool:
        """Whether no dict of the state changed: the watcher's count, else the tags. Where the
        count moved (another watched dict changed) and the tags held, the count is taken."""
        if self._seen_changes is not None and self._watch.no_dict_change_since(self._seen_changes):
            return True
        if self._tags is None:
            return False
        changes = self._watch.dict_changes() if self._watch is not None else None
        if not self._native.same_dict_versions(self._dicts, self._tags):
            return False
        self._seen_changes = changes
        return True

    def memory_holds(self) -> bool:
        """Whether every tensor is where it was: address, shape and strides (a part of :meth:`holds`)."""
        return self._layouts()

    def _rest_holds(self) -> bool:
        if not self._rest:
            return True
        if self._same_items is not None:
            return self._same_items(self._rest, self._rest_lengths, self._rest_values)
        return (tuple(map(len, self._rest)) == self._rest_lengths
                and all(map(operator.is_, itertools.chain.from_iterable(self._rest), self._rest_values)))

    def _objects_hold(self) -> bool:
        return all(len(d) == n and all(map(operator.is_, d.values(), values))
                   for (_, d), (n, values) in zip(self.objects, self._object_items))

    def _globals_hold(self) -> bool:
        return all(map(operator.is_, map(self.globals.get, self.global_names), self.global_values))

    def _cells_hold(self) -> bool:
        return not self.cells or all(map(operator.is_, self._cell_contents(), self.cell_values))

    def _values_hold(self) -> bool:
        """The Python comparison: every value the same object, every tensor where it was."""
        return ((self.modules is None or self.modules.holds()) and self._objects_hold()
                and self._globals_hold() and self._cells_hold() and self._layouts())

    def changed(self) -> str:
        """What differs from the snapshot, in words ('' where nothing does)."""
        if self.modules is not None:
            where = self.modules.changed()
            if where:
                return where
        for (label, d), (n, values) in zip(self.objects, self._object_items):
            if len(d) != n or not all(map(operator.is_, d.values(), values)):
                return f"an attribute of {label}"
        for name, value in zip(self.global_names, self.global_values):
            if self.globals.get(name) is not value:
                return f"the global {name}"
        if not self._cells_hold():
            return "a variable of the function's closure"
        if not self._layouts():
            return "a parameter's or buffer's memory (replaced, moved or resized)"
        return ""

    def same_tensors(self, other: StateWatch) -> bool:
        """Whether both snapshots hold the same tensor objects (so keeping both keeps no old tensor)."""
        return {id(t) for t in self.tensors} == {id(t) for t in other.tensors}


def _objects(root: torch.nn.Module | None) -> list[tuple[str, Any]]:
    """The plain objects among the modules' attributes (a model's config), each once, with a label:
    the forward reads their fields, which the modules' own dicts do not show."""
    from .module_state import _fixed, _internals

    if root is None:
        return []
    internals, seen, found = _internals(), set(), []
    for m in root.modules():
        for attr, value in vars(m).items():
            if attr in internals or _fixed(value) or isinstance(value, (dict, list, set, tuple)):
                continue
            d = getattr(value, "__dict__", None)
            if isinstance(d, dict) and id(value) not in seen:
                seen.add(id(value))
                found.append((f"{type(m).__name__}.{attr} ({type(value).__name__})", value))
    return found


# -- the device side ---------------------------------------------------------------------------------
