"""The functions of eager ops, sent to each worker once and then named by a small number.

A call names its function by the number the worker holds it under, or brings it (pickled once on
the driver, for every worker) the first time that worker runs it: a submit neither pickles the
function again nor makes the worker unpickle it, which for a function sent by value (a lambda, a
closure, a function of ``__main__``) costs more than the rest of the call. So a function goes to
a worker as it is at its first submit there, as Ray sends a remote function once; a new function
object (a new closure) is a new function.

The driver keeps, per worker, the numbers that worker holds. Calls to a worker are sent in order
under the runtime's lock, and Ray runs one caller's calls to an actor in that order, so what the
driver records is what the worker has when the call arrives, until Ray restarts the worker with
an empty table: then a call naming a number it lacks fails with :class:`WorkerLost` (as one naming
a buffer it lost does), and the driver forgets what that worker held (:meth:`Functions.lost`), on
that failure, on Ray's report that the worker died, or on a new incarnation's token.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import types
import weakref
from typing import Any

import numpy as np
import ray

from ._worker import FnDef

__all__ = ["Functions", "pickled_by_name"]

_CACHED_KINDS = (types.FunctionType, types.BuiltinFunctionType, np.ufunc)
_MAX_HELD = 512  # numbers a worker holds before it is told to drop them all (new closures pile up)

_by_name: dict[int, Any] = {}  # id -> the functions that the standard pickle sends by name
_by_value: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()  # and those it cannot


def pickled_by_name(fn: Any) -> bool:
    """Whether ``fn`` pickles to the same bytes with the standard pickle as with cloudpickle: it
    goes by name (a function of an importable module), not by value (a lambda, a closure, a
    function of ``__main__``), so that the standard pickle may send the call."""
    if _by_name.get(id(fn)) is fn:
        return True
    try:
        if fn in _by_value:
            return False
    except TypeError:  # not hashable
        return False
    try:
        same = pickle.dumps(fn, 5) == ray.cloudpickle.dumps(fn, 5)
    except Exception:  # the standard pickle cannot send it at all
        same = False
    if same:  # held, so that its id stays its own; a module's function lives as long anyway
        if len(_by_name) > 1024:
            _by_name.clear()
        _by_name[id(fn)] = fn
    else:
        with contextlib.suppress(TypeError):  # weakly: a closure's captured data is not kept alive
            _by_value[fn] = False
    return same


class Functions:
    """Numbers for functions, and which numbers each worker holds (driver side, under the runtime's lock)."""

    def __init__(self, workers: int) -> None:
        self._numbers = itertools.count(1)
        self._weak: weakref.WeakKeyDictionary[Any, tuple[int, bytes]] = weakref.WeakKeyDictionary()
        self._strong: dict[int, tuple[Any, int, bytes]] = {}  # id -> by-name functions without weakrefs
        self._held: list[set[int]] = [set() for _ in range(workers)]
        self._dead: list[int] = []  # numbers of functions the driver let go: the workers may drop them
        self._forget: list[list[int]] = [[] for _ in range(workers)]  # told with a worker's next FnDef

    def spec(self, fn: Any, worker: int) -> Any:
        """What a call to ``worker`` names ``fn`` by: its number where the worker holds it, a
        :class:`FnDef` the first time, or ``fn`` itself where it is not cached (any callable other
        than a function: its state may change between submits)."""
        if not isinstance(fn, _CACHED_KINDS):
            return fn
        entry = self._entry(fn)
        if entry is None:
            return fn
        number, data = entry
        held = self._held[worker]
        if number in held:
            return number
        if self._dead:
            dead, self._dead = self._dead, []
            for h, forget in zip(self._held, self._forget):
                forget += [n for n in dead if n in h]
                h.difference_update(dead)
        forget, self._forget[worker] = tuple(self._forget[worker]), []
        reset = len(held) >= _MAX_HELD
        if reset:
            held.clear()
        held.add(number)
        return FnDef(number, data, forget, reset)

    def lost(self, worker: int) -> None:
        """``worker`` was restarted (or may have been): it holds no function."""
        self._held[worker].clear()
        self._forget[worker].clear()

    def _entry(self, fn: Any) -> tuple[int, bytes] | None:
        strong = self._strong.get(id(fn))
        if strong is not None and strong[0] is fn:
            return strong[1], strong[2]
        try:
            entry = self._weak.get(fn)
        except TypeError:  # unhashable, or no weak references (a ufunc, a builtin)
            entry = None
        if entry is not None:
            return entry
        try:
            data = ray.cloudpickle.dumps(fn, 5)
        except Exception:  # left to the call's own pickling, which reports it as the submit's error
            return None
        entry = (next(self._numbers), data)
        try:
            self._weak[fn] = entry
            weakref.finalize(fn, self._dead.append, entry[0])
        except TypeError:  # no weak references (a ufunc, a builtin): held if it goes by name
            if not pickled_by_name(fn):  # else (unhashable too) it goes with each call
                return None
            if len(self._strong) > 1024:
                self._strong.clear()
            self._strong[id(fn)] = (fn, *entry)
        return entry
