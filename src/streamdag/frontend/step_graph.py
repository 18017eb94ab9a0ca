"""A whole training step as one CUDA graph: :func:`capture_step`.

At small batches a training step spends its time on the host. Under CUDA graph
trees (``reduce-overhead``) the forward and the backward are one replay each,
but around them the trees rebuild every output tensor (a forward's saved
activations, a backward's gradients), the autograd engine visits every
parameter and the optimizer loops over its parameters in Python: on GoogLeNet
at batch 8 about 3.8 ms of host time a step against a replay of some 3.7 ms of
GPU work. Captured whole, the forward, the backward and the optimizer's step
replay as one graph, and the host's part of a step is the copy of its inputs
and one launch.

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

A replay runs no Python, so what it cannot see is checked before it: the
optimizers that stepped inside ``fn`` during the warm-up (found by PyTorch's
global optimizer step hook) must be ``capturable``, and a change of their
plain-number hyperparameters (a scheduler's new ``lr`` as a float) or of
their parameters (another tensor, moved memory) captures the step again; an
``lr`` given as a tensor is read by the graph and changes nothing.

On the CPU (no CUDA graphs) every call runs ``fn`` as written; ``explain()``
says so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from .._diagnostics import warn
from ..backends.capture_memory import stream_reuse
from .candidates import _capture_stream, workspaces_in_pool

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


@dataclass
class _OptimizerState:
    """An optimizer that steps inside the step: what its captured graph baked in."""

    optimizer: torch.optim.Optimizer
    numbers: list[tuple[Any, ...]] = field(default_factory=list)

    def snapshot(self) -> None:
        self.numbers = self._read()

    def changed(self) -> str:
        """'' while the captured graph still computes what the optimizer would; else what changed."""
        now = self._read()
        if now == self.numbers:
            return ""
        for was, new in zip(self.numbers, now):
            if was != new:
                return (f"{type(self.optimizer).__name__}'s param group {was[0]}: {was[1]} was "
                        f"{was[2]!r}, is {new[2]!r}")
        return f"{type(self.optimizer).__name__}'s param groups changed"

    def _read(self) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        for g, group in enumerate(self.optimizer.param_groups):
            for key, value in group.items():
                if key == "params":
                    out.append((g, "params", tuple((id(p), p.data_ptr()) for p in value)))
                elif isinstance(value, torch.Tensor):
                    out.append((g, key, ("tensor", id(value))))  # read by the graph where it lies
                elif isinstance(value, (int, float, bool, tuple)) or value is None:
                    out.append((g, key, value))
        return out


class _Signature:
    """One signature's warm-up count, graph, static inputs and outputs."""

    def __init__(self) -> None:
        self.warm_calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor] = []  # static inputs, in the order of the tensor leaves
        self.outputs: Any = None  # the captured call's result (tensors in the pool)
        self.optimizers: list[_OptimizerState] = []
        self.captures = 0
        self.replays = 0
        self.recapture_reasons: list[str] = []


class CapturedStep:
    """``fn`` (a whole training step) replayed as one CUDA graph per argument signature (see the
    module docstring). ``warmup``: calls per signature run as written before the capture;
    ``max_signatures``: signatures kept captured (past it, calls of a new one raise)."""

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 3, max_signatures: int = 4) -> None:
        if not callable(fn):
            raise TypeError(f"streamdag.capture_step needs a function, got {type(fn).__name__}")
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"capture_step: warmup must be an int of at least 1 (compiling, choosing "
                             f"candidates and making optimizer state happen there), got {warmup!r}")
        self.fn = fn
        self.warmup = warmup
        self.max_signatures = max_signatures
        self._signatures: dict[Hashable, _Signature] = {}
        self._lock = threading.Lock()
        self.eager_calls = 0  # calls off CUDA, run as written
        self._recapture_warned = False

    # -- calling --------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        devices = {t.device for t in tensors}
        if {d.type for d in devices} <= {"cpu"}:
            return self._as_written(args, kwargs, bool(devices))
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"capture_step: the step's tensor arguments are on {sorted(map(str, devices))}; "
                             "a captured step takes them on one CUDA device (move the batch there "
                             "first, e.g. x.cuda(non_blocking=True))")
        for t in tensors:
            if t.requires_grad:
                raise ValueError("capture_step: an argument requires grad; the step's arguments are "
                                 "data (a batch): pass it detached, or make it a parameter of the model")
        key = (_spec_key(spec), tuple(_leaf_key(x) for x in leaves))
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
            if sig.graph is None and sig.warm_calls < self.warmup:
                return self._warm(sig, args, kwargs, device)
            if sig.graph is not None:
                why = next((w for w in (o.changed() for o in sig.optimizers) if w), "")
                if why:
                    self._note_recapture(sig, why)
                    sig.graph = None
            if sig.graph is None:
                self._capture(sig, args, kwargs, device)
            else:
                _copy_in(sig.inputs, tensors)
                sig.graph.replay()
            sig.replays += 1
            return _copies(sig.outputs)

    def _as_written(self, args: tuple, kwargs: dict, on_cpu: bool) -> Any:
        """A call whose tensors are all on the CPU, or that has none: ``fn`` as written."""
        self.eager_calls += 1
        if self.eager_calls == 1 and torch.cuda.is_available():
            where = "on the CPU" if on_cpu else "no tensors (they come from the step's closure)"
            warn(f"capture_step: the step's arguments hold {where}, so it runs as written, uncaptured: "
                 "pass the batch as an argument, on the GPU, for the step to be captured (a replay "
                 "reads its inputs only from its arguments)")
        return self.fn(*args, **kwargs)

    def _warm(self, sig: _Signature, args: tuple, kwargs: dict, device: torch.device) -> Any:
        seen: list[torch.optim.Optimizer] = []

        def note(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            if all(o is not optimizer for o in seen):
                seen.append(optimizer)

        caller = torch.cuda.current_stream(device)
        stream = _warm_stream(device)
        stream.wait_stream(caller)
        handle = register_optimizer_step_pre_hook(note)
        try:
            with _inside_step(), torch.cuda.stream(stream):
                out = self.fn(*args, **kwargs)
        finally:
            handle.remove()
            caller.wait_stream(stream)
        for t in pytree.tree_leaves(out):  # made on the side stream, used on the caller's
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(caller)
        sig.warm_calls += 1
        known = {id(o.optimizer) for o in sig.optimizers}
        sig.optimizers += [_OptimizerState(o) for o in seen if id(o) not in known]
        return out

    def _capture(self, sig: _Signature, args: tuple, kwargs: dict, device: torch.device) -> None:
        for state in sig.optimizers:
            groups = state.optimizer.param_groups
            # (an optimizer without the setting, SGD say, keeps no step count and is capturable as is)
            if not all(g.get("capturable", True) for g in groups):
                name = type(state.optimizer).__name__
                raise RuntimeError(
                    f"capture_step: {name} steps inside the captured step but is not capturable: "
                    f"create it with capturable=True (e.g. torch.optim.{name}(params, fused=True, "
                    "capturable=True)), so that its step count lives on the GPU where a replay "
                    "advances it")
        sig.graph = None
        sig.outputs = None
        leaves, spec = pytree.tree_flatten((args, kwargs))
        sig.inputs = [t.detach().clone() for t in leaves if isinstance(t, torch.Tensor)]
        statics = iter(sig.inputs)
        s_args, s_kwargs = pytree.tree_unflatten(
            [next(statics) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        graph = torch.cuda.CUDAGraph()
        caller = torch.cuda.current_stream(device)
        stream = _capture_stream(device)
        stream.wait_stream(caller)
        try:
            with _inside_step(), stream_reuse(), workspaces_in_pool(stream), \
                    torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                out = self.fn(*s_args, **s_kwargs)
        except Exception as exc:
            raise RuntimeError(
                f"capture_step: the step could not be captured into a CUDA graph ({type(exc).__name__}: "
                f"{str(exc)[:300]}). A captured step cannot wait for the host: no .item(), no printing "
                "of a tensor, no branch on a tensor's value, no GradScaler (use bf16 autocast), no "
                "torch.compile(mode='reduce-overhead') inside (use the default mode or "
                "streamdag.compile); return tensors and read them after the call") from exc
        out_leaves = pytree.tree_leaves(out)
        stale = [type(x).__name__ for x in out_leaves if not isinstance(x, torch.Tensor) and x is not None]
        if stale:
            raise TypeError(f"capture_step: the step returns {', '.join(sorted(set(stale)))}: a replay "
                            "recomputes tensors only; return tensors (a loss, not loss.item())")
        sig.graph, sig.outputs = graph, out
        sig.captures += 1
        for state in sig.optimizers:
            state.snapshot()
        graph.replay()  # (the capture recorded the step; this runs it)
        caller.wait_stream(stream)

    def _note_recapture(self, sig: _Signature, why: str) -> None:
        sig.recapture_reasons.append(why)
        if sig.captures >= 2 and not self._recapture_warned:
            self._recapture_warned = True
            warn(f"capture_step captures the step again at each change of a number its graph holds "
                 f"({why}). A scheduler that changes lr every step makes every step a capture: create "
                 "the optimizer with lr as a tensor (lr=torch.tensor(1e-3), capturable=True), which "
                 "the graph reads where it lies")

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
                "warmup_calls": sum(s.warm_calls for s in sigs),
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
            names = ", ".join(type(o.optimizer).__name__ for o in sig.optimizers) or "none seen"
            lines.append(f"  signature {i}: {state}; {sig.warm_calls} warm-up call(s), {sig.captures} "
                         f"capture(s), {sig.replays} replay(s); optimizers checked before each replay: "
                         f"{names}")
            lines += [f"    captured again: {why}" for why in sig.recapture_reasons[-3:]]
        return "\n".join(lines)


_WARM_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


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
