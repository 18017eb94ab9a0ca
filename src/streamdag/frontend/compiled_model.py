"""What ``streamdag.compile`` returns: a model under ``torch.compile`` with a streamdag backend.

:class:`CompiledModel` is the user's side of the compile path: it sends each
call through the whole-call graph where one is captured (:mod:`.whole_call`)
and through Dynamo otherwise, counts the calls in which no compiled graph ran
and says once why. :mod:`.inductor_backend` is the graphs' side.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import re
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch._dynamo.utils import counters as _dynamo_counters

from .._diagnostics import get_logger, warn
from .call_key import call_key
from .hook_watch import HookWatch
from .inductor_backend import _EAGER_WHY, StreamdagBackend, V2Statistics
from .make_fx_fallback import MakeFxFallback
from .state_watch import root_module
from .whole_call import WholeCall

__all__ = ["CompiledModel", "compile_v2"]

log = get_logger(__name__)

#: Dynamo keeps compiled code per code object, and every ``streamdag.compile`` has a backend of its
#: own: without isolation the compiles of all the models sharing a ``forward`` count against one
#: recompile limit, so the ninth compiled instance of a module class would run eagerly
_OWN_RECOMPILE_LIMIT = ({"isolate_recompiles": True}
                        if "isolate_recompiles" in inspect.signature(torch.compile).parameters else {})

#: the compiles again for moved hooks (:meth:`CompiledModel._after_a_change`) before calls
#: on Dynamo's path run as written: a model whose hooks change at every call would compile at each
_HOOK_COMPILES = 4

#: a compiled model's own type, which ``train()`` and ``eval()`` return
_Self = TypeVar("_Self", bound="CompiledModel")

_compiles = itertools.count(1)
_compiles_made = 0  # streamdag.compile calls so far in this process

#: the most compiles whose allowances one shared frame adds up (:func:`_with_room_to_recompile`)
_ROOM_FOR = 8
#: the limit's name: ``cache_size_limit`` before PyTorch 2.7
_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
_room_lock = threading.Lock()
_room_depth = 0  # calls on Dynamo's path running now, in any thread: the limit is raised while > 0
_limit_outside = 0  # the recompile limit in force outside them, put back by the last to end
_limit_raised = 0  # the limit they run under, while no one sets another


def _frame_of_its_own(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called from a function whose code object belongs to this compile alone: where PyTorch
    has no ``isolate_recompiles``, what isolates one compile's recompile limit from the others'.

    Dynamo counts a frame's compiles per code object, and the frame it starts at would be shared:
    ``Module.__call__``'s, or a decorator's wrapper around every model of a library (Hugging
    Face's ``forward``s), so that models compiled one after another in a process spend one limit
    between them and the later ones run eagerly. Here each compile starts at a frame no other
    compile has; the frames Dynamo starts at after a graph break are still shared, which
    :func:`_with_room_to_recompile` answers."""
    global _compiles_made

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    _compiles_made = next(_compiles)
    code = call.__code__.replace(co_name=f"streamdag_compiled_{_compiles_made}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


def _with_room_to_recompile(compiled: Callable[..., Any], args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> Any:
    """``compiled(*args, **kwargs)`` with Dynamo's recompile limit times the compiles made (at most
    ``_ROOM_FOR`` times), where PyTorch has no ``isolate_recompiles``.

    After a graph break Dynamo starts at the frame the code runs into next, often a library's
    decorator that every model's submodules share (Hugging Face's output wrapper): each model
    compiled in the process adds its entries there, and under one limit the ninth model's calls
    ran none of their graphs (T5, Whisper, Pegasus and Marian, compiled after other Hugging Face
    models). Raised for the call alone, as PyTorch's own per-compile limit is; the cap bounds how
    often a model whose state changes on every call is compiled again before Dynamo runs it as
    written. The last call to end puts the limit back only where it is still the raised one: a
    limit set meanwhile (by the model, or another thread) stays. Costs about 3.5 µs a call on
    Dynamo's path; a whole-call replay does not come here."""
    global _room_depth, _limit_outside, _limit_raised
    config = torch._dynamo.config
    with _room_lock:
        if _room_depth == 0:
            _limit_outside = getattr(config, _LIMIT)
            _limit_raised = _limit_outside * min(max(_compiles_made, 1), _ROOM_FOR)
            setattr(config, _LIMIT, _limit_raised)
        _room_depth += 1
    try:
        return compiled(*args, **kwargs)
    finally:
        with _room_lock:
            _room_depth -= 1
            if _room_depth == 0 and getattr(config, _LIMIT) == _limit_raised:
                setattr(config, _LIMIT, _limit_outside)


def _rnn_left_to_eager(fn: Any) -> str:
    """Why Dynamo ran a model's recurrent layers as written, where it has some and leaves them so
    (``torch._dynamo.config.allow_rnn`` off, PyTorch's default); '' otherwise."""
    root = root_module(fn)
    if root is None or torch._dynamo.config.allow_rnn:
        return ""
    kinds = sorted({type(m).__name__ for m in root.modules() if isinstance(m, torch.nn.RNNBase)})
    if not kinds:
        return ""
    return (f"Dynamo runs recurrent layers ({', '.join(kinds)}) as written unless "
            "torch._dynamo.config.allow_rnn is set (PyTorch's default leaves it off: their cuDNN "
            "kernels are one call each); set it before the first call to compile them")


def _script_left_to_eager(fn: Any) -> str:
    """Why Dynamo ran a model as written where it holds TorchScript modules, which Dynamo does not
    trace (they run in the TorchScript interpreter); '' where it holds none."""
    root = root_module(fn)
    if root is None:
        return ""
    names = [name or type(root).__name__ for name, m in root.named_modules()
             if isinstance(m, torch.jit.ScriptModule)]
    if not names:
        return ""
    return (f"Dynamo does not trace TorchScript modules ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}), and stops at the frame that calls one: compile the "
            "eager modules they were scripted from")


def _dynamo_reasons() -> dict[str, int]:
    """What Dynamo could not trace so far, each reason with its count: what it ran as written (its
    ``unimplemented`` counter) and where it broke a graph (``graph_break``)."""
    return {**_dynamo_counters["graph_break"], **_dynamo_counters["unimplemented"]}


def _new_reasons(breaks: dict[str, int]) -> dict[str, int]:
    """Dynamo's reasons that came since ``breaks`` (its reasons then), each with how often."""
    return {k: n - breaks.get(k, 0) for k, n in _dynamo_reasons().items() if n > breaks.get(k, 0)}


def _in_brief(reason: str) -> str:
    """One of Dynamo's reasons on one line: its title, explanation and hint, without the debug
    context; an object's address dropped (``<...Backend object at 0x...>`` names the class); no
    hint to report the backend's failure, where Dynamo breaks a graph over an operator it cannot
    trace, as under ``torch.compile``; the first hint alone."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    kept = [lines[0]] if lines else []
    for line in lines[1:]:
        if line.startswith("Explanation: "):
            kept.append(line.removeprefix("Explanation: "))
        elif (line.startswith("Hint: ") and "Report an issue to the backend" not in line
              and not any(k.startswith("hint: ") for k in kept)):
            kept.append("hint: " + line.removeprefix("Hint: "))
    text = re.sub(r"<([\w.]*?)(\w+) object at 0x[0-9a-f]+>", r"\2", "; ".join(k.rstrip(".") for k in kept))
    return text if len(text) <= 300 else text[:297] + "..."


def _in_briefs(reasons: dict[str, int]) -> dict[str, int]:
    """``reasons`` in brief, less Dynamo's note that the backend failed on an operator another of
    them names (Dynamo's own reason for the operator says it better)."""
    briefs = {_in_brief(r): n for r, n in reasons.items()}
    failed = re.compile(r"^Backend compiler exception;.* failed with (\S+)")
    return {b: n for b, n in briefs.items()
            if not ((m := failed.match(b)) and any(m.group(1) in o for o in briefs if o != b))}


def _untraced(breaks: dict[str, int] | None) -> str:
    """Why Dynamo ran a call as written where it could not trace something in it (its reasons over
    ``breaks``, those before the call); '' else."""
    new = _new_reasons(breaks) if breaks is not None else {}
    if not new:
        return ""
    lines = [line.strip().removeprefix("Explanation: ").removeprefix("Hint: ").rstrip(".")
             for line in next(iter(new)).splitlines() if line.strip()]
    said = "; ".join(lines[:3])
    return (f"Dynamo could not trace the code ({said}) and ran it as written; "
            "TORCH_LOGS=graph_breaks shows where")


class CompiledModel:
    """What ``streamdag.compile`` returns: the model under ``torch.compile`` with a streamdag backend.

    Once its graphs have chosen their candidates, a call is captured whole into one CUDA graph
    and later calls with arguments of the same shapes replay it without entering Dynamo
    (:mod:`.whole_call`; ``whole_call=False`` keeps every call on Dynamo's path).

    A call in which none of the backend's graphs ran (this thread's count of graph calls did not
    move) ran eagerly: ``statistics().eager_calls`` counts it and the first one warns.

    Calls wait for the first call to finish: Dynamo looks its cache up before it takes its
    compile lock, so threads that all make a first call at once would each compile the model.
    """

    def __init__(self, fn: Callable[..., Any], backend: StreamdagBackend,
                 settings: dict[str, Any] | None = None) -> None:
        self.backend: StreamdagBackend = backend
        self.__wrapped__ = fn
        #: the options ``streamdag.compile`` took, for a copy compiled afresh (:meth:`__deepcopy__`)
        self._settings: dict[str, Any] = dict(settings or {})
        self._compiled = self._wrapped(dynamic=False)
        #: the wrapper with symbolic shapes, made when the static one reaches Dynamo's recompile
        #: limit (:meth:`_compile_with_symbolic_shapes`)
        self._compiled_symbolic: Callable[..., Any] | None = None
        #: calls on the static wrapper that compiled a graph, with gradients or without: Dynamo
        #: counts them together against its limit (a grad mode of its own is one more guard)
        self._compile_calls = 0
        #: the keys (:func:`.call_key.call_key`) of calls with gradients that compiled on the static
        #: wrapper: past the limit they keep its graphs (and the trees), the others go symbolic
        self._grad_static_keys: set[Any] = set()
        #: the module whose hooks the compiled code runs (Dynamo does not guard them), and those
        #: hooks, from the first call on Dynamo's path on
        self._hook_root = root_module(fn)
        self._hook_watch: HookWatch | None = None
        self._hook_compiles = 0  # compiles again because the hooks moved
        #: the wrappers compiled for each set of hooks met (:attr:`.HookWatch.signature`), so that
        #: hooks put back as they were (a hook added for a few calls, then removed) compile nothing
        self._wrappers_by_hooks: dict[Any, tuple[Any, ...]] = {}
        self._wrapper_hooks: Any = None  # the hooks the wrappers were compiled for (None: the first's)
        self._as_written = ""  # why every call on Dynamo's path runs the model as written, if they do
        self._first_call = threading.RLock()  # re-entrant: a forward may call its own model
        self._called = False
        options = backend.options
        self.whole: WholeCall | None = (WholeCall(fn, backend, options.clone_outputs) if options.whole_call
                                        else None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # inside another compiled model: Dynamo traces the model
            return self.__wrapped__(*args, **kwargs)  # into that model's graph, not this wrapper
        if not self._called:
            with self._first_call:
                out = self._dispatch(args, kwargs)
                self._called = True
                return out
        whole = self.whole  # (inline: a replay launches after as few Python calls as it can)
        if whole is not None:
            return whole(args, kwargs, self._through_dynamo)
        return self._call(args, kwargs)

    def _dispatch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        whole = self.whole
        if whole is not None:
            return whole(args, kwargs, self._through_dynamo)
        return self._call(args, kwargs)

    def _as_written_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The model called as written, counted as a call that ran no compiled graph."""
        self.backend.stats.eager_calls += 1
        return self.__wrapped__(*args, **kwargs)

    def _through_dynamo(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        grad = torch.is_grad_enabled()
        if self.backend.eager_reason and grad:  # (explain() says why)
            return self._as_written_call(args, kwargs)
        hooks = self._hook_watch
        if hooks is not None and not hooks.unchanged():
            with self._first_call:  # (one thread compiles again; the others wait, then find it done)
                if not hooks.unchanged():
                    return self._after_a_change(hooks, grad, args, kwargs)
        if self._as_written:  # (hooks that moved past the compiles for them, until they come back)
            return self._as_written_call(args, kwargs)
        out = self._run(grad, args, kwargs)
        if hooks is None and self._hook_root is not None:  # (after the first call: a lazy module's
            self._hook_watch = HookWatch(self._hook_root)  # initializing hook has gone during it)
        return out

    def _run(self, grad: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call through Dynamo, by the wrapper for its grad mode."""
        ran = self.backend.ran
        before = ran.count
        graphs = self.backend.stats.graphs
        compiled, key = self._compiled, None
        if self._compiled_symbolic is not None:  # (the static wrapper is full)
            if grad:
                key = call_key(args, kwargs)
                if key not in self._grad_static_keys:
                    compiled = self._compiled_symbolic
            else:
                compiled = self._compiled_symbolic
        # Dynamo's reasons for what it could not trace so far: a call that compiles files the new ones
        breaks = _dynamo_reasons()
        if _OWN_RECOMPILE_LIMIT:
            out = compiled(*args, **kwargs)
        else:
            out = _with_room_to_recompile(compiled, args, kwargs)
        if compiled is self._compiled and self.backend.stats.graphs != graphs:
            self._count_static_compile(grad, args, kwargs)
        if self.backend.stats.graphs != graphs or ran.count == before:
            for said, n in _in_briefs(_new_reasons(breaks)).items():
                self.backend.graph_breaks[said] = self.backend.graph_breaks.get(said, 0) + n
        if ran.count == before:
            if key is not None and compiled is self._compiled:  # a guard other than the key's failed on the
                self._grad_static_keys.discard(key)              # full static wrapper: symbolic from now on
            self._ran_eagerly(breaks)
        return out

    def _wrapped(self, dynamic: bool) -> Callable[..., Any]:
        """The model under ``torch.compile`` with this backend, afresh: it shares no compiled code
        with an earlier wrapper (Dynamo keeps each wrapper's code apart)."""
        fn = self.__wrapped__
        target = fn if _OWN_RECOMPILE_LIMIT else _frame_of_its_own(fn)
        return torch.compile(target, backend=self.backend, dynamic=dynamic, **_OWN_RECOMPILE_LIMIT)

    def _count_static_compile(self, grad: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A call on the static wrapper compiled a graph: at Dynamo's recompile limit of them, later
        calls go on with symbolic shapes (:meth:`_compile_with_symbolic_shapes`)."""
        with self._first_call:  # (threads at the limit together make one wrapper)
            if self._compiled_symbolic is not None:
                return
            self._compile_calls += 1
            key = call_key(args, kwargs) if grad else None
            if isinstance(key, tuple):  # (a string: arguments without a key, never taken as known)
                self._grad_static_keys.add(key)
            if self._compile_calls >= getattr(torch._dynamo.config, _LIMIT):
                self._compile_with_symbolic_shapes()

    def _compile_with_symbolic_shapes(self) -> None:
        """Once calls have compiled on the static wrapper as often as Dynamo's recompile limit
        allows (new input shapes, other argument values, either grad mode), later calls go through
        a wrapper that compiles with symbolic shapes, whose code serves every shape: past the limit
        Dynamo would run each new one as written. That code runs uncaptured (a graph with symbolic
        shapes is neither captured, nor part of a whole-call graph, nor under the CUDA graph trees).
        Without gradients, the shapes captured before keep their whole-call graphs; with gradients,
        a call keyed as one that compiled before keeps the static wrapper and its graphs, until a
        guard the key does not hold fails there (``eval()`` with gradients on, say)."""
        self.backend.dynamic_note = (
            f"compiles with symbolic shapes after {self._compile_calls} calls compiled with static ones, "
            "Dynamo's recompile limit (new input shapes and the like): their code runs uncaptured; calls "
            "with gradients keyed as one compiled before keep the static code")
        self._compiled_symbolic = self._wrapped(dynamic=True)
        log.info("streamdag.compile: %s", self.backend.dynamic_note)

    def _after_a_change(self, hooks: HookWatch, grad: bool, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> Any:
        """This call, after a hook dict or a submodule dict of the model changed (under
        ``_first_call``). Where the hooks the model runs are as they were (a hook added and removed
        again, a submodule without hooks put in), the snapshot is taken again. Where they moved, the
        compiled code runs the old ones (Dynamo does not guard module hooks): the model is compiled
        again by fresh ``torch.compile`` wrappers, which share no compiled code with the old ones,
        and this call compiles before the snapshot is taken again, so that other threads wait for
        it. Where the hooks are back to a set an earlier wrapper was compiled for (a hook added for
        a few calls, then removed), that wrapper serves again and nothing compiles; a wrapper whose
        hooks can never come back (one of them removed: a handle's id is never reused) is dropped.
        After ``_HOOK_COMPILES`` of these, or where PyTorch cannot keep a wrapper's code apart
        (no ``isolate_recompiles``: the frames after a graph break are shared), calls on Dynamo's
        path under hooks no wrapper serves run the model as written, and say why."""
        if not hooks.moved():
            hooks.take()
            if self._as_written:
                return self._as_written_call(args, kwargs)
            return self._run(grad, args, kwargs)
        name = type(hooks.root).__qualname__
        if not self._as_written:  # (filed under the hooks they were compiled for, which a call that
            # raised before the snapshot was taken leaves other than the snapshot's: no hooks is one set)
            compiled_for = hooks.signature if self._wrapper_hooks is None else self._wrapper_hooks
            self._wrappers_by_hooks[compiled_for] = (self._compiled, self._compiled_symbolic,
                                                     self._compile_calls, self._grad_static_keys)
        now = hooks.signature_now()
        # a wrapper whose hooks are not all registered now is dropped: a removed hook's handle id never
        # comes back (a submodule taken out and put back with its hooks compiles anew)
        live = {key for _, keys in now for key in keys}
        self._wrappers_by_hooks = {sig: w for sig, w in self._wrappers_by_hooks.items()
                                   if all(key in live for _, keys in sig for key in keys)}
        self._wrapper_hooks = now
        known = self._wrappers_by_hooks.get(now)
        if known is not None:  # hooks as they were at an earlier compile
            self._compiled, self._compiled_symbolic, self._compile_calls, self._grad_static_keys = known
            self._as_written = ""
            hooks.take()
            return self._run(grad, args, kwargs)
        if self._hook_compiles >= _HOOK_COMPILES or not _OWN_RECOMPILE_LIMIT:
            why = (f"after {_HOOK_COMPILES} compiles for earlier changes of them" if _OWN_RECOMPILE_LIMIT
                   else "and this PyTorch's torch.compile has no isolate_recompiles to compile them anew")
            self._as_written = (
                f"the hooks of {name} changed {why}: calls under hooks no compile serves run as written "
                "(Dynamo does not guard module hooks; register hooks before the first call, or compile "
                "the model again)")
            if "as written" not in self.backend._warned:
                self.backend._warned.add("as written")
                warn(f"streamdag.compile: {self._as_written}")
            self.backend.eager_why = self._as_written
            hooks.take()
            return self._as_written_call(args, kwargs)
        self._hook_compiles += 1
        self._as_written = ""
        self._compiled = self._wrapped(dynamic=False)
        if self._compiled_symbolic is not None:
            self._compiled_symbolic = self._wrapped(dynamic=True)
            self._grad_static_keys = set(self._grad_static_keys)  # (the earlier wrapper keeps its set)
        else:  # (a new static wrapper: Dynamo's limit counts its compiles from none)
            self._compile_calls = 0
            self._grad_static_keys = set()  # (a set of its own: the earlier wrapper keeps its set)
        if "hooks" not in self.backend._warned:
            self.backend._warned.add("hooks")
            warn(f"streamdag.compile: a hook of {name} or its submodules was added or removed after its "
                 "first calls: compiled again so that it runs (Dynamo does not guard module hooks); "
                 "registering hooks before the first call saves the compile")
        out = self._run(grad, args, kwargs)
        hooks.take()
        return out

    def _ran_eagerly(self, breaks: dict[str, int] | None) -> None:
        """Count a call that ran no compiled graph; the first one warns, with the reason: Dynamo's,
        where it could not trace something in this call (``breaks``: its reasons before the call)."""
        self.backend.stats.eager_calls += 1
        if "eager" not in self.backend._warned:
            self.backend._warned.add("eager")
            name = getattr(self.__wrapped__, "__qualname__", type(self.__wrapped__).__qualname__)
            self.backend.eager_why = (_rnn_left_to_eager(self.__wrapped__)
                                      or _script_left_to_eager(self.__wrapped__)
                                      or _untraced(breaks) or _EAGER_WHY)
            # the caller's line, past the whole-call path's frames (as many as the path it took)
            warn(f"streamdag.compile: a call of {name} ran none of its compiled graphs: "
                 f"{self.backend.eager_why}; statistics().eager_calls counts such calls")

    def explain(self) -> str:
        """Each graph: its region plan, every candidate with its time, and the one chosen; the
        whole-call graphs, and why a call that has none runs on Dynamo's path."""
        text = self.backend.explain()
        if self._as_written:
            text += f"\n\n{self._as_written}"
        return text if self.whole is None else f"{text}\n\n{self.whole.explain()}"

    def statistics(self) -> V2Statistics:
        """The backend's counts; ``captures``, ``recaptures`` and ``replays`` include the whole-call
        graphs', which ``whole_captures`` and ``whole_replays`` count alone."""
        stats = self.backend.statistics()
        whole = self.whole
        if whole is not None:
            stats.whole_captures, stats.whole_replays = whole.captures, whole.replays
            stats.captures += whole.captures
            stats.recaptures += whole.recaptures
            stats.replays += whole.replays
        return stats

    def train(self: _Self, mode: bool = True) -> _Self:
        """The wrapped module's ``train(mode)``; returns this compiled model, as ``torch.compile``'s
        wrapper does, so that ``model = model.eval()`` keeps the model compiled. (Dynamo guards the
        ``training`` flags: the next call compiles that mode's graphs, once.)"""
        module = self.__wrapped__
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"train() and eval() set a torch.nn.Module's mode; this compiled model wraps "
                            f"a {type(module).__name__}: set the mode on the module it calls")
        module.train(mode)
        return self

    def eval(self: _Self) -> _Self:
        """``train(False)``."""
        return self.train(False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The compiled call (``model.forward(x)`` as ``model(x)``, as through ``torch.compile``)."""
        return self(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """Any other attribute is the wrapped model's (``parameters()``, ``state_dict()``, a Hugging
        Face model's ``config``), as through ``torch.compile``'s wrapper: its methods run as written,
        and one that returns the model itself (``.to(device)``, ``.half()``, ``.requires_grad_()``)
        returns this compiled model, so that ``model = model.to(device)`` keeps it compiled."""
        wrapped = self.__dict__.get("__wrapped__")
        if wrapped is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        attr = getattr(wrapped, name)
        if not callable(attr) or getattr(attr, "__self__", None) is not wrapped:
            return attr

        @functools.wraps(attr)
        def method(*args: Any, **kwargs: Any) -> Any:
            out = attr(*args, **kwargs)
            return self if out is wrapped else out
        return method

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledModel:
        """A deep copy of the wrapped model, compiled afresh with the same options: a copy shares
        no compiled code, graph or memory with this one (as a copy of a model shares no tensors)."""
        return compile_v2(copy.deepcopy(self.__wrapped__, memo), **self._settings)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the wrapped model and the options, compiled afresh when loaded (``torch.save``
        of a model holding a compiled part): compiled code and graphs are not data to keep."""
        return (_compiled_again, (self.__wrapped__, self._settings))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__wrapped__!r})"

    def close(self) -> None:
        for r in self.backend.runners:
            if isinstance(r, MakeFxFallback):
                r.legacy.close()


#: CPython 3.13.0, where Dynamo's guards can miss a change to a model (:func:`_warn_of_stale_guards`)
_STALE_GUARDS = sys.version_info[:3] == (3, 13, 0)
_warned_of_stale_guards = False


def _warn_of_stale_guards() -> None:
    """Warn once where Dynamo's guards can miss a change to a model (CPython 3.13.0, whose inline
    attribute values skip the dict's version: python/cpython#125608, fixed in 3.13.1). There a model
    compiled by Dynamo, by torch.compile as well, runs its training graph after ``model.eval()``;
    PyTorch itself only warns that its guards may run slower."""
    global _warned_of_stale_guards
    if not _STALE_GUARDS or _warned_of_stale_guards:
        return
    _warned_of_stale_guards = True
    warn("streamdag.compile on CPython 3.13.0: Dynamo's guards can miss a change to the model "
         "(model.eval(), an attribute set) and run a graph compiled before it, as torch.compile does "
         "here (python/cpython#125608); upgrade Python to 3.13.1 or later")


def _compiled_again(fn: Callable[..., Any], settings: dict[str, Any]) -> CompiledModel:
    """``fn`` compiled with ``settings``: what a pickled compiled model loads as."""
    return compile_v2(fn, **settings)


def compile_v2(fn: Callable[..., Any], *, streams: int | None = None, regions: str = "auto",
               min_gain: float | None = None, candidates: Sequence[str] | None = None,
               clone_outputs: bool = True, whole_call: bool = True,
               inductor: dict[str, Any] | None = None) -> CompiledModel:
    """``fn`` (a function or ``nn.Module``) under Dynamo, AOTAutograd, Inductor and streamdag's streams.

    ``inductor``: Inductor settings by name for this model's graphs, as ``torch.compile``'s
    ``options`` takes them (e.g. ``{"combo_kernels": True}``)."""
    if not callable(fn):
        raise TypeError(f"streamdag.compile needs a function or torch.nn.Module, got {type(fn).__name__}")
    _warn_of_stale_guards()
    backend = StreamdagBackend(streams=streams, regions=regions, min_gain=min_gain, candidates=candidates,
                               clone_outputs=clone_outputs, inductor=inductor)
    if not isinstance(whole_call, bool):
        raise TypeError(f"whole_call takes True or False, got {whole_call!r}")
    backend.options.whole_call = whole_call
    settings = dict(streams=streams, regions=regions, min_gain=min_gain, candidates=candidates,
                    clone_outputs=clone_outputs, whole_call=whole_call, inductor=inductor)
    if isinstance(fn, torch.nn.Module):
        from .compiled_module import CompiledModule  # (it builds on CompiledModel, defined here)

        return CompiledModule(fn, backend, settings)
    return CompiledModel(fn, backend, settings)
