"""A whole training step as one CUDA graph: :func:`capture_step`.

At small batches a training step spends its time on the host. Under CUDA graph
trees (``reduce-overhead``) the forward and the backward are one replay each,
but around them the trees rebuild every output tensor (a forward's saved
activations, a backward's gradients), the autograd engine visits every
parameter and the optimizer loops over its parameters in Python, which at
small batches takes about as long as the GPU's work. Captured whole, the
forward, the backward and the optimizer's step replay as one graph, and the
host's part of a step is the copy of its inputs and one launch.

A :class:`CapturedStep` keeps, per *signature* of its arguments (the pytree's
structure; each tensor's shape, strides, dtype and device; every other value):

1. ``warmup`` calls that run ``fn`` as written, on a side stream:
   Dynamo and Inductor compile, a ``streamdag.compile``'d model times its
   candidates (captured, as the step's graph will replay them) and does not
   put its graphs under the CUDA graph trees (the step's graph holds them),
   optimizers make their state, cuBLAS and cuDNN choose their plans;
2. then one call that copies its tensors into static inputs and captures
   ``fn`` over them into a CUDA graph with a private memory pool (a step's
   activations, gradients and temporaries live there, reused within the step
   as the caching allocator reuses them) and replays it;
3. then, at every call, the copy of its tensors into the static inputs and a
   replay. The outputs (tensors, in any pytree) are copies out of the pool.

A replay runs no Python, so what it cannot see is checked (:mod:`.step_watch`).
The optimizers that step inside ``fn`` during the warm-up (PyTorch's global
optimizer step hook, on the calling thread) must keep their state on the GPU
(``capturable=True``; SGD keeps no step count). Before each replay, a change of
what the graph holds (a param group's plain-number setting, a scheduler's new
float ``lr``; another parameter or moved memory; a ``.grad`` replaced or set to
None outside the step; optimizer state replaced) captures the step again,
after new warm-up calls where tensors were replaced; an ``lr`` given as a
tensor is read by the graph and changes nothing. A step that changes its
optimizers' settings while it runs (a scheduler stepped inside it) cannot be
replayed and raises, as does a capture that fails; a signature whose capture
failed raises at every call until ``reset()``. Tensor arguments the step
writes in place are copied back after each replay. A replay on another stream
than the last one waits for it before copying its batch in.

On the CPU (no CUDA graphs) every call runs ``fn`` as written; ``explain()``
says so. Its arguments and result are held to the same rules (no argument
that requires grad, only tensors and plain values in, only tensors out), so
a step that runs on the CPU is not refused on a GPU for them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._diagnostics import warn
from .candidates import _capture_stream, capture_graph, workspaces_in_pool
from .step_watch import (
    Baked,
    host_state,
    optimizers_stepping,
    reachable_params,
    settings,
    settings_changed_inside,
)

__all__ = ["CapturedStep", "in_captured_step"]

#: whether this thread runs a captured step's warm-up or capture (``streamdag.compile``'s training
#: graphs compiled then stay off the CUDA graph trees: the step's graph holds them)
_inside = threading.local()

#: plain values a signature holds as they are
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def in_captured_step() -> bool:
    """Whether this thread is inside a :class:`CapturedStep`'s warm-up or capture."""
    return getattr(_inside, "depth", 0) > 0


@contextmanager
def _inside_step() -> Iterator[None]:
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1


class _Signature:
    """One signature's warm-up count, graph, static inputs and outputs.

    Invariants (under the step's lock): ``graph`` is None until a capture succeeds; then
    ``inputs`` are its static inputs (one per tensor argument, in order), ``outputs`` its result in
    the pool, and ``baked`` what it holds of the optimizers. ``failure`` is set by a capture that
    failed: the signature is not captured again until ``reset()``. ``done`` is recorded on
    ``stream`` after each replay, so that a call on another stream copies its batch in after it.
    """

    def __init__(self) -> None:
        self.warm_calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor] = []
        self.outputs: Any = None
        self.optimizers: list[torch.optim.Optimizer] = []  # those that stepped inside, in warm-ups
        self.baked: Baked | None = None
        self.written: set[int] = set()  # tensor arguments the step writes in place (copied back)
        self.watched: list[torch.Tensor] = []  # parameters whose .grad the graph may write
        # (parameter, the .grad the graph made and owns, the one it found): put back before each replay
        self.owned: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # what the step does with each parameter's .grad (by id), as warm-ups and captures saw it:
        # drops it (leaves None), keeps it (adds to the tensor it finds) or owns it (makes its own)
        self.grads = _ByParam()
        self.failure: str = ""
        self.done: torch.cuda.Event | None = None
        self.stream: torch.cuda.Stream | None = None
        self.captures = 0
        self.replays = 0
        self.recapture_reasons: list[str] = []


def check_step_settings(warmup: int, max_signatures: int) -> None:
    """Refuse settings :class:`CapturedStep` cannot take, naming what they must be."""
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"capture_step: warmup must be an int of at least 1 (compiling, choosing "
                         f"candidates and making optimizer state happen there), got {warmup!r}")
    if not isinstance(max_signatures, int) or isinstance(max_signatures, bool) or max_signatures < 1:
        raise ValueError(f"capture_step: max_signatures must be an int of at least 1 (the signatures of "
                         f"arguments kept captured), got {max_signatures!r}")


class CapturedStep:
    """``fn`` (a whole training step) replayed as one CUDA graph per argument signature (see the
    module docstring). ``warmup``: calls per signature run as written before the capture;
    ``max_signatures``: signatures kept captured (past it, calls of a new one raise)."""

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 3, max_signatures: int = 4) -> None:
        if not callable(fn):
            raise TypeError(f"streamdag.capture_step needs a function, got {type(fn).__name__}")
        check_step_settings(warmup, max_signatures)
        self.fn = fn
        self.warmup = warmup
        self.max_signatures = max_signatures
        self._signatures: dict[Hashable, _Signature] = {}
        self._lock = threading.Lock()
        self.eager_calls: int = 0  # calls off CUDA, run as written
        self.warmup_calls: int = 0  # warm-ups, all signatures (a signature warms up again after new tensors)
        self.found_gradients: int = 0  # calls run as written: they found gradients the step drops at its end
        self._zero_grads = _ByParam()  # zeros like each parameter: see _zeros()
        self._recapture_warned = False

    # -- calling --------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        devices = {t.device for t in tensors}
        for t in tensors:
            if t.requires_grad:
                raise ValueError("capture_step: an argument requires grad; the step's arguments are "
                                 "data (a batch): pass it detached, or make it a parameter of the model")
        key = (_spec_key(spec), tuple(_leaf_key(x) for x in leaves))
        if {d.type for d in devices} <= {"cpu"}:
            return self._as_written(args, kwargs, bool(devices))
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"capture_step: the step's tensor arguments are on {sorted(map(str, devices))}; "
                             "a captured step takes them on one CUDA device (move the batch there "
                             "first, e.g. x.cuda(non_blocking=True))")
        with self._lock:
            sig = self._signatures.get(key)
            if sig is None:
                if len(self._signatures) >= self.max_signatures:
                    raise RuntimeError(
                        f"capture_step: a new signature of arguments after {self.max_signatures} "
                        "captured ones (each holds a graph and its memory): keep the batch's shape "
                        "fixed (pad, or drop the last short batch), or raise max_signatures")
                sig = self._signatures[key] = _Signature()
            device = next(iter(devices))
            if sig.failure:
                raise RuntimeError(f"capture_step: this signature's capture failed ({sig.failure}); "
                                   "fix the step, then call reset() to capture it again")
            if sig.graph is not None:
                why, replaced = sig.baked.changed() if sig.baked is not None else ("", False)
                if why:
                    self._note_recapture(sig, why)
                    sig.graph = None
                    if replaced:  # (new tensors: Dynamo may compile again, outside a capture)
                        sig.warm_calls = 0
            if sig.graph is None and sig.warm_calls < self.warmup:
                return self._warm(sig, args, kwargs, tensors, device)
            caller = torch.cuda.current_stream(device)
            if sig.graph is None:
                if not self._capture(sig, args, kwargs, device):
                    return self._warm(sig, args, kwargs, tensors, device)
            else:
                if sig.stream is not None and sig.stream != caller and sig.done is not None:
                    caller.wait_event(sig.done)  # the last replay, on another stream, read the inputs
                _copy_in(sig.inputs, tensors)
                for p, grad, _ in sig.owned:
                    if p.grad is not grad:
                        p.grad = grad
                sig.graph.replay()
            for i in sig.written:
                tensors[i].copy_(sig.inputs[i])
            if sig.done is None:
                sig.done = torch.cuda.Event()
            sig.done.record(caller)
            sig.stream = caller
            sig.replays += 1
            return _copies(sig.outputs)

    def _as_written(self, args: tuple, kwargs: dict, on_cpu: bool) -> Any:
        """A call whose tensors are all on the CPU, or that has none: ``fn`` as written, its arguments
        and result held to the rules of a captured step, so that a step written on the CPU is
        refused there for what a GPU would refuse."""
        self.eager_calls += 1
        if self.eager_calls == 1 and torch.cuda.is_available():
            where = "on the CPU" if on_cpu else "no tensors (they come from the step's closure)"
            warn(f"capture_step: the step's arguments hold {where}, so it runs as written, uncaptured: "
                 "pass the batch as an argument, on the GPU, for the step to be captured (a replay "
                 "reads its inputs only from its arguments)")
        out = self.fn(*args, **kwargs)
        _check_outputs(pytree.tree_leaves(out))
        return out

    def _warm(self, sig: _Signature, args: tuple, kwargs: dict, tensors: list[torch.Tensor],
              device: torch.device) -> Any:
        caller = torch.cuda.current_stream(device)
        stream = _warm_stream(device)
        stream.wait_stream(caller)
        versions = [t._version for t in tensors]
        watched = reachable_params(self.fn, sig.optimizers)
        found = [p.grad for p in watched]
        try:
            with optimizers_stepping() as seen, _inside_step(), torch.cuda.stream(stream):
                out = self.fn(*args, **kwargs)
        finally:
            caller.wait_stream(stream)
        for p, before in zip(watched, found):  # what the step does with each gradient
            after = p.grad
            if after is None:
                sig.grads.put(p, _DROPS)
            elif before is not None:
                sig.grads.put(p, _KEEPS if after is before else _OWNS)
        sig.written |= {i for i, (t, v) in enumerate(zip(tensors, versions)) if t._version != v}
        leaves = pytree.tree_leaves(out)
        _check_outputs(leaves)
        for t in leaves:  # made on the side stream, used on the caller's
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(caller)
        sig.warm_calls += 1
        self.warmup_calls += 1
        sig.optimizers += [o for o in seen if all(o is not k for k in sig.optimizers)]
        return out

    def _capture(self, sig: _Signature, args: tuple, kwargs: dict, device: torch.device) -> bool:
        """Capture ``fn`` over static copies of this call's tensors and replay it once; False where
        this call must run as written instead (below).

        A replay repeats what the capture saw of each gradient, so each reachable one is captured
        as the step expects it, by what warm-ups and earlier captures saw the step do with it
        (``sig.grads``). One it *drops* (leaves None: zeroed at the step's end, or never made) is
        captured None. One it *keeps* (adds to the tensor it finds: gradients accumulated over
        calls, zeroed in place) is captured as the call finds it, zeros where it has none; that
        tensor must be there at each replay (:class:`.step_watch.Baked`). One it *owns* (drops the
        tensor it finds and makes its own: ``zero_grad`` at its start) is captured from zeros of
        its own, held with the graph, and the one the graph makes is put back as ``.grad`` before
        each replay (steps of several signatures share none). A gradient the capture made where
        the step was to drop it is captured again from zeros, so that replays add to it as
        ``backward()`` does. A call that finds a gradient the step drops at its end (made outside
        it) runs as written: the step adds to it, which a graph captured without it would not."""
        self._check_optimizers(sig, device)
        sig.graph = sig.outputs = sig.baked = None
        leaves, spec = pytree.tree_flatten((args, kwargs))
        sig.inputs = [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor)]
        statics = iter(sig.inputs)
        s_args, s_kwargs = pytree.tree_unflatten(
            [next(statics) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        watched = sig.watched = reachable_params(self.fn, sig.optimizers)
        given = [p.grad for p in watched]
        kinds = [sig.grads.of(p) for p in watched]
        if any(g is not None and k == _DROPS for g, k in zip(given, kinds)):
            self._ran_as_written()
            return False
        # (a gradient the step drops and makes anew is captured from zeros shared by every capture
        # of the step, held with the graph: no old graph's pool stays held for it)
        start = [None if k == _DROPS else self._zeros(p) if k == _OWNS else
                 torch.zeros_like(p) if g is None else g for p, g, k in zip(watched, given, kinds)]
        try:
            for attempt in range(2):
                _set_grads(watched, start)
                graph, out = self._record(sig, s_args, s_kwargs, device)
                made = [x is None and p.grad is not None for p, x in zip(watched, start)]
                if attempt == 1 or not any(made):
                    break
                graph = out = None  # (its pool goes back before the second capture)
                start = [torch.zeros_like(p) if m else x for p, x, m in zip(watched, start, made)]
            post = [p.grad for p in watched]
            if any(x is not None and q is None for x, q in zip(start, post)):
                self._failed(sig, "the step adds to a gradient it finds, then sets it to None")
                raise RuntimeError(f"capture_step: {sig.failure}: a replay would add to a tensor "
                                   "no one holds. Zero the gradients at the start or the end of "
                                   "the step, not in between")
        except BaseException:
            _set_grads(watched, given)  # (a capture runs nothing: the gradients are as found)
            raise
        # (the tensor it found is held too, as a step that read it before it made its own would read
        # it at each replay; such a step, p.grad = p.grad + g, is not supported: it reads zeros)
        sig.owned = [(p, q, x) for p, x, q in zip(watched, start, post)
                     if x is not None and q is not None and q is not x]
        owned = {id(p) for p, _, _ in sig.owned}
        for p, x in zip(watched, start):
            if x is not None:
                sig.grads.put(p, _OWNS if id(p) in owned else _KEEPS)
        sig.graph, sig.outputs = graph, out
        sig.captures += 1
        sig.baked = Baked(sig.optimizers, [p for p in watched if id(p) not in owned])
        graph.replay()  # (the capture recorded the step; this runs it)
        return True

    def _zeros(self, p: torch.Tensor) -> torch.Tensor:
        """Zeros like ``p``, one tensor per parameter for every capture of the step."""
        zeros = self._zero_grads.of(p)
        if zeros is None:
            zeros = torch.zeros_like(p)
            self._zero_grads.put(p, zeros)
        return zeros

    def _ran_as_written(self) -> None:
        self.found_gradients += 1
        if self.found_gradients == 1:
            warn("capture_step ran the step as written: it found gradients made outside it, which "
                 "it adds to before it zeroes them at its end, and a captured graph would not. Zero "
                 "them before calling the step (or zero them at the step's start)")

    def _record(self, sig: _Signature, s_args: Any, s_kwargs: Any,
                device: torch.device) -> tuple[torch.cuda.CUDAGraph, Any]:
        """One capture of the step (:func:`.candidates.capture_graph`: a failed one leaves the
        caller's stream current, the random generators and the allocator out of capture)."""
        stream = _capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        before = settings(sig.optimizers)
        states = [len(o.state) for o in sig.optimizers]
        try:
            with optimizers_stepping() as seen, _inside_step(), workspaces_in_pool(stream):
                graph, out = capture_graph(lambda: self.fn(*s_args, **s_kwargs), stream, device, None,
                                           "thread_local")
            # (the capture's prologue set the random generator's seed on the capture stream)
            torch.cuda.current_stream(device).wait_stream(stream)
        except Exception as exc:
            self._failed(sig, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            raise RuntimeError(
                f"capture_step: the step could not be captured into a CUDA graph ({sig.failure}). "
                "A captured step cannot wait for the host: no .item(), no printing of a tensor, no "
                "branch on a tensor's value; no torch.compile(mode='reduce-overhead') inside (use the "
                "default mode or streamdag.compile), no streamdag.compile'd model called with "
                "gradients off (its own CUDA graphs cannot replay inside the step's); return tensors "
                "and read them after the call") from exc
        why = settings_changed_inside(before, sig.optimizers)
        new = [o for o in seen if all(o is not k for k in sig.optimizers)]
        grew = [o for o, n in zip(sig.optimizers, states) if len(o.state) != n]
        if why or new or grew:
            self._failed(sig, f"the step changed {why} while it ran" if why else
                         f"{type(new[0]).__name__} stepped first in the capture, after the warm-up" if new
                         else f"{type(grew[0]).__name__} made state for a parameter during the capture")
            raise RuntimeError(
                f"capture_step: {sig.failure}: a replay runs no Python and repeats what the capture "
                "saw. Step a learning-rate scheduler outside the step (give lr as a tensor, "
                "capturable=True, so that its changes reach the graph); optimizers must step, for "
                "every parameter they update, in the warm-up calls already (raise warmup)")
        return graph, out

    def _check_optimizers(self, sig: _Signature, device: torch.device) -> None:
        """The optimizers that stepped in the warm-ups keep their state where a replay advances it."""
        for o in sig.optimizers:
            name = type(o).__name__
            if not all(g.get("capturable", True) for g in o.param_groups):
                raise RuntimeError(
                    f"capture_step: {name} steps inside the captured step but is not capturable: "
                    f"create it with capturable=True (e.g. torch.optim.{name}(params, fused=True, "
                    "capturable=True)), so that its step count lives on the GPU where a replay "
                    "advances it")
        why = host_state(sig.optimizers, device)
        if why:
            raise RuntimeError(f"capture_step: {why}, which a replay of the GPU's work does not "
                               "advance: use an optimizer made with capturable=True (Adam, AdamW, "
                               "...) or one without step counts (SGD)")

    def _failed(self, sig: _Signature, why: str) -> None:
        """A failed capture: the signature is not captured again until ``reset()``."""
        sig.failure = why
        sig.graph = sig.outputs = sig.baked = None

    def _note_recapture(self, sig: _Signature, why: str) -> None:
        sig.recapture_reasons.append(why)
        if sig.captures >= 2 and not self._recapture_warned:
            self._recapture_warned = True
            warn(f"capture_step captures the step again at each change of what its graph holds ({why}): "
                 "keep it unchanged between steps. Give lr as a tensor (lr=torch.tensor(1e-3, "
                 "device='cuda'), capturable=True), which the graph reads where it lies and a scheduler "
                 "updates in place, and zero the gradients inside the step")

    # -- reading --------------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every captured graph (its memory goes back): the next calls warm up and capture
        again. For changes a replay cannot see: a frozen parameter replaced, a new closure value."""
        with self._lock:
            self._signatures.clear()

    def statistics(self) -> dict[str, int]:
        """Calls run as written (warm-up and off CUDA), captures and replays, over all signatures."""
        sigs = list(self._signatures.values())
        return {"signatures": len(sigs),
                "warmup_calls": self.warmup_calls,
                "eager_calls": self.eager_calls,
                "captures": sum(s.captures for s in sigs),
                "replays": sum(s.replays for s in sigs)}

    def explain(self) -> str:
        """How the step runs, per signature."""
        lines = [f"capture_step of {getattr(self.fn, '__qualname__', type(self.fn).__name__)}: "
                 f"{len(self._signatures)} signature(s), warm-up {self.warmup} call(s) each"]
        if self.eager_calls:
            lines.append(f"  {self.eager_calls} call(s) off CUDA ran the step as written (a CUDA graph "
                         "needs a CUDA device)")
        for i, sig in enumerate(self._signatures.values()):
            state = "captured" if sig.graph is not None else "warming up"
            names = ", ".join(type(o).__name__ for o in sig.optimizers) or "none seen"
            lines.append(f"  signature {i}: {state}; {sig.warm_calls} warm-up call(s), {sig.captures} "
                         f"capture(s), {sig.replays} replay(s); optimizers checked before each replay: "
                         f"{names}")
            lines += [f"    captured again: {why}" for why in sig.recapture_reasons[-3:]]
            if sig.failure:
                lines.append(f"    capture failed: {sig.failure} (reset() to try again)")
        return "\n".join(lines)


_WARM_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


_DROPS, _KEEPS, _OWNS = "drops", "keeps", "owns"


class _ByParam(dict):
    """Values by parameter: keyed by id, each checked against a weak reference to its parameter (a
    new parameter may take a freed one's id)."""

    def of(self, p: torch.Tensor) -> Any:
        entry = self.get(id(p))
        return entry[1] if entry is not None and entry[0]() is p else None

    def put(self, p: torch.Tensor, value: Any) -> None:
        self[id(p)] = (weakref.ref(p), value)


def _warm_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream warm-ups run on (not the capture stream: a ``streamdag.compile``'d graph's
    candidates are captured on that one while the warm-up runs)."""
    if device not in _WARM_STREAMS:
        _WARM_STREAMS[device] = torch.cuda.Stream(device)
    return _WARM_STREAMS[device]


def _leaf_key(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device)
    if isinstance(x, _PLAIN):
        return (type(x), x)
    raise TypeError(f"capture_step: an argument of type {type(x).__name__}: a captured step takes "
                    "tensors and plain values (int, float, bool, str, None), the latter keyed by "
                    "value; reach other objects through the step's closure")


def _set_grads(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.grad = g


def _check_outputs(leaves: list[Any]) -> None:
    stale = [type(x).__name__ for x in leaves if not isinstance(x, torch.Tensor) and x is not None]
    if stale:
        raise TypeError(f"capture_step: the step returns {', '.join(sorted(set(stale)))}: a replay "
                        "recomputes tensors only; return tensors (a loss, not loss.item())")


def _spec_key(spec: Any) -> Hashable:
    try:
        hash(spec)
    except TypeError:  # (a PyTorch whose TreeSpec does not hash)
        return repr(spec)
    return spec


def _copy_in(static: list[torch.Tensor], tensors: list[torch.Tensor]) -> None:
    for s, t in zip(static, tensors):  # (a step takes a few tensors: a batch and its targets)
        s.copy_(t, non_blocking=True)


def _copies(out: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, out)
