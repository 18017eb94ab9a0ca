"""What a captured training step's CUDA graph holds outside its arguments (see :mod:`.step_graph`).

A replay runs no Python: it reads and writes the tensors the capture saw, and
repeats every number the capture passed to a kernel. For the optimizers that
step inside the step, :class:`Baked` keeps what the graph depends on, taken
right after the capture:

* each param group's settings: plain values by value (a float ``lr`` is a
  kernel argument, repeated by every replay), tensors by identity (a tensor
  ``lr`` is read where it lies: a scheduler's in-place update reaches it);
* the parameters (identity and memory) and the optimizer's state (the dict
  object, which ``load_state_dict`` replaces, and its size; its tensors are
  held, so that memory a replay writes is never handed out again);
* the ``.grad`` of every parameter the step can reach (:func:`reachable_params`:
  those of the optimizers and of the modules it names in its closure and
  globals), by identity: the graph writes the gradient tensor the capture made
  or found, and a ``zero_grad(set_to_none=True)`` outside the step replaces it;
* the switches that choose what a matmul or a convolution computes
  (:func:`precision_switches`): the graph repeats the kernels chosen under
  those of its capture, while eager code reads them at each call.

:meth:`Baked.changed` says what differs now, or ``''``; the step's graph is
captured again (after a warm-up where tensors were replaced). It costs a few
list comprehensions over the parameters per replay (some 35 microseconds for
174 parameters, against milliseconds of a training step).

:func:`settings_changed_inside` compares the settings around the capture
itself: a step that changes them while it runs (a scheduler stepped inside it)
cannot be replayed, since the replay repeats the captured values.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .candidates import cudnn_settings

__all__ = ["Baked", "host_state", "optimizers_stepping", "precision_switches", "reachable_params", "settings",
           "settings_changed_inside"]


def precision_switches() -> tuple[Any, ...]:
    """cuDNN's switches (:func:`.candidates.cudnn_settings`) and the float32 matmul precision with
    the reduced-precision reductions of half-precision matmuls."""
    matmul = torch.backends.cuda.matmul
    try:
        fp32 = torch.get_float32_matmul_precision()
    except RuntimeError:  # set per backend (``torch.backends.cuda.matmul.fp32_precision``)
        fp32 = matmul.fp32_precision
    return (cudnn_settings(), fp32, matmul.allow_bf16_reduced_precision_reduction,
            matmul.allow_fp16_reduced_precision_reduction)


@contextmanager
def optimizers_stepping() -> Iterator[list[torch.optim.Optimizer]]:
    """Inside, the optimizers that step on this thread, in order of their first step (PyTorch's
    global step hook; other threads' optimizers are not noted)."""
    seen: list[torch.optim.Optimizer] = []
    me = threading.get_ident()

    def note(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if threading.get_ident() == me and all(o is not optimizer for o in seen):
            seen.append(optimizer)

    handle = register_optimizer_step_pre_hook(note)
    try:
        yield seen
    finally:
        handle.remove()


def settings(optimizers: Sequence[torch.optim.Optimizer]) -> list[tuple[Any, int, str, Any, int]]:
    """Every param group's settings: (optimizer, group index, key, value, the version of a tensor
    value or -1)."""
    return [(o, g, key, value, value._version if isinstance(value, torch.Tensor) else -1)
            for o in optimizers for g, group in enumerate(o.param_groups)
            for key, value in group.items() if key != "params"]


def _same(a: Any, b: Any) -> bool:
    """Whether a replay that captured ``a`` computes what ``b`` asks: tensors by identity, other
    values by equality (by identity where equality is no plain bool)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # (an object whose == is elementwise, or raises)
        return False


def _first_setting_changed(was: list[tuple[Any, int, str, Any, int]],
                           now: list[tuple[Any, int, str, Any, int]], versions: bool) -> str:
    if len(was) != len(now):
        return "the optimizers' param groups changed"
    for (o, g, key, a, va), (_, _, _, b, vb) in zip(was, now):
        if not _same(a, b):
            return f"{type(o).__name__}'s param group {g}: {key} was {a!r}, is {b!r}"
        if versions and va != vb:
            return f"{type(o).__name__}'s param group {g}: {key} (a tensor) was written"
    return ""


def settings_changed_inside(before: list[tuple[Any, int, str, Any, int]],
                            optimizers: Sequence[torch.optim.Optimizer]) -> str:
    """What the step changed in its optimizers' settings while it ran (''): a tensor setting
    written in place counts, as a replay would write the captured value again."""
    return _first_setting_changed(before, settings(optimizers), versions=True)


def host_state(optimizers: Sequence[torch.optim.Optimizer], device: torch.device) -> str:
    """The first optimizer whose state a replay would not advance (a step count kept as a Python
    number or a CPU tensor, as Adagrad keeps it), '' if none: a captured graph only replays the
    GPU's work."""
    for o in optimizers:
        for state in o.state.values():
            for key, value in state.items():
                if isinstance(value, (int, float)) or (isinstance(value, torch.Tensor)
                                                       and value.device != device):
                    where = "a CPU tensor" if isinstance(value, torch.Tensor) else "a Python number"
                    return f"{type(o).__name__} keeps its state {key!r} as {where}"
    return ""


def reachable_params(fn: Any, optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The parameters whose ``.grad`` a step may write: those of ``optimizers`` and of every module
    or optimizer that ``fn`` reaches by name, as itself, its ``__self__``, its closure's cells and
    the globals its code names, a method's object's attributes, a partial's function and
    arguments, one container (list, tuple, dict) deep, and through functions two levels deep; a
    compiled wrapper counts for the module it wraps. A parameter reached otherwise is not
    watched: ``CapturedStep.reset()`` after replacing its ``.grad`` outside the step."""
    found: dict[int, torch.Tensor] = {}

    def add(params: Any) -> None:
        for p in params:
            found.setdefault(id(p), p)

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, torch.nn.Module):
            add(value.parameters())
        elif isinstance(value, torch.optim.Optimizer):
            add(p for g in value.param_groups for p in g["params"])
        elif isinstance(value, (list, tuple)) and depth < 3:
            for item in value[:64]:
                visit(item, 3)
        elif isinstance(value, dict) and depth < 3:
            for item in list(value.values())[:64]:
                visit(item, 3)
        elif isinstance(value, functools.partial):
            for item in (value.func, *value.args, *value.keywords.values()):
                visit(item, depth)
        elif callable(value):
            inner = getattr(value, "__wrapped__", None)  # (streamdag.compile's model, functools.wraps)
            if isinstance(inner, torch.nn.Module):
                add(inner.parameters())
            elif depth < 2:
                visit_function(value, depth + 1)

    def visit_function(f: Any, depth: int) -> None:
        owner = getattr(f, "__self__", None)  # a method's object: a trainer's model and optimizer
        if owner is None and not hasattr(f, "__code__"):
            owner = f  # (an object with __call__: its attributes)
        else:
            visit(owner, depth)
        if owner is not None and not isinstance(owner, (torch.nn.Module, type, types.ModuleType)):
            attributes = getattr(owner, "__dict__", None)
            if isinstance(attributes, dict):
                visit(dict(attributes), depth)
        for cell in getattr(f, "__closure__", None) or ():
            with contextlib.suppress(ValueError):  # (an empty cell)
                visit(cell.cell_contents, depth)
        code, names = getattr(f, "__code__", None), getattr(f, "__globals__", None)
        if code is not None and isinstance(names, dict):
            for name in code.co_names:
                if name in names:
                    visit(names[name], depth)

    for o in optimizers:
        visit(o, 0)
    visit(fn, -1)  # (a function's own closure and globals at depth 0)
    return list(found.values())


class Baked:
    """What a captured step's graph depends on in ``optimizers`` and in the ``.grad`` of
    ``watched`` parameters (see the module docstring)."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], watched: Sequence[torch.Tensor]) -> None:
        self.optimizers = list(optimizers)
        # strong references: an identity compared later must not be a freed object's reused id
        self.params = self._params()
        self.watched = list(watched)
        self.ptrs = [p.data_ptr() for p in self.watched]
        self.grads = [p.grad for p in self.watched]
        self.state = [o.state for o in self.optimizers]  # (load_state_dict puts in a new dict)
        self.state_sizes = [len(o.state) for o in self.optimizers]
        # held: a state tensor dropped from the optimizer (its state cleared) is still the graph's
        self.state_tensors = [v for o in self.optimizers for st in o.state.values() for v in st.values()
                              if isinstance(v, torch.Tensor)]
        self.settings = settings(self.optimizers)
        self.switches = precision_switches()

    def _params(self) -> list[torch.Tensor]:
        return [p for o in self.optimizers for g in o.param_groups for p in g["params"]]

    def changed(self) -> tuple[str, bool]:
        """(what differs from the capture, '' if nothing; whether tensors were replaced, which
        asks for a warm-up before the next capture)."""
        params = self._params()
        if len(params) != len(self.params) or not all(map(operator.is_, params, self.params)):
            return "the optimizers' parameters changed", True
        if [p.data_ptr() for p in self.watched] != self.ptrs:
            return "a parameter's memory moved", True
        if not all(map(operator.is_, [o.state for o in self.optimizers], self.state)) or \
                [len(o.state) for o in self.optimizers] != self.state_sizes:
            return "the optimizers' state was replaced (load_state_dict?)", True
        if not all(map(operator.is_, [p.grad for p in self.watched], self.grads)):
            # (nothing compiled depends on it: the step is captured again without a warm-up)
            return ("a gradient the step adds to was replaced or set to None outside it (zero it "
                    "in place, or inside the step)"), False
        if precision_switches() != self.switches:  # (Dynamo may compile again for a matmul switch)
            return "a matmul or cuDNN precision switch changed (TF32, deterministic algorithms, ...)", True
        return _first_setting_changed(self.settings, settings(self.optimizers), versions=False), False
