"""The compile path behind ``streamdag.compile(model)`` and ``torch.compile(model, backend="streamdag")``.

Dynamo captures the Python code and owns the guards (shapes, dtypes, grad mode, ``training``, the
code's constants), so a call whose guards fail compiles a new specialization and outputs come back
in the structure the code returns (dicts, dataclasses, ``ModelOutput``). :class:`StreamdagBackend`
gets each graph Dynamo captures and hands it to Inductor's ``compile_fx``, which runs AOTAutograd
and then our inner compiler (:mod:`.inner_compile`) on the aten graph (a write through a boolean
mask made a select first, :mod:`.masked_writes`, so that its backward and its capture see static
shapes). For an inference graph the inner compiler compiles:

* Inductor's own code for the whole graph (one stream, fused), and
* where streamdag's schedule finds independent branches worth their events
  (:func:`~.regions.plan_regions`), the graph cut into regions along the chain
  cover, each region compiled by Inductor (:mod:`.inductor_regions`).

and returns a :class:`_Switch` that runs whichever of them is selected.
Training graphs (gradients needed) get the same treatment, forward and
backward, and choose their own candidates at their first calls (:mod:`.training`).

At the first call with real tensors, :class:`GraphRunner` builds the candidates (the graph run
eagerly, Inductor on one stream, the regions on 2..N streams), captures each into a CUDA graph over
static inputs, times them and keeps the fastest (:mod:`.candidates`). A graph that cannot be
captured (CPU tensors, symbolic shapes, inputs whose metadata it mutates, outputs that alias inputs,
parameters it updates in place) runs Inductor's code uncaptured, and ``explain()`` says why. A graph
Inductor cannot compile runs on the older make_fx path (:class:`~.compiled.Compiled`, one op per
aten node on streams), with a warning.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._dynamo import exc as _dynamo_exc
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from .._diagnostics import get_logger, warn
from .adjacent_linears import AdjacentLayout, fuse_adjacent_linears
from .candidates import (
    Candidate,
    CapturedGraph,
    SharedPool,
    choose,
    cudnn_settings,
    region_candidates,
    static_indices,
)
from .inner_compile import (
    MIN_GAIN,
    Options,
    _pristine,
    _Switch,
    compile_options,
    inductor_settings,
    inner_compile,
)
from .make_fx_fallback import MakeFxFallback, fall_back
from .masked_writes import rewrite_masked_writes
from .whole_call import ACTIVE, NotWholeCapturable

__all__ = ["MIN_GAIN", "GraphRunner", "Options", "StreamdagBackend", "V2Statistics", "default_backend",
           "engine_from"]

ENGINES = ("inductor", "aten")

_log = get_logger(__name__)


def engine_from(engine: str | None) -> str:
    """The compile engine to use: the argument, else ``STREAMDAG_COMPILE_ENGINE``, else ``"inductor"``."""
    engine = engine or os.environ.get("STREAMDAG_COMPILE_ENGINE") or "inductor"
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r} "
                         "(from the argument or STREAMDAG_COMPILE_ENGINE)")
    return engine


@dataclass
class V2Statistics:
    """Counts of one backend: ``graphs`` compiled (one per Dynamo capture: a recompile adds one),
    ``calls`` of them, and ``eager_calls``: calls of the model ``streamdag.compile`` returned that
    ran none of them (Dynamo ran the code as written). ``tree_calls``: calls of training forwards and
    backwards that ran under Inductor's CUDA graph trees (:mod:`.training`), ``tree_skips`` of them
    the trees ran uncaptured; ``grads_taken_back``: ``.grad`` copied out of the trees' pool as a
    step began, because they still held gradients a backward lent (:mod:`.lent_gradients`)."""

    graphs: int = 0
    calls: int = 0
    captures: int = 0
    recaptures: int = 0
    replays: int = 0
    uncaptured_calls: int = 0
    fallbacks: int = 0
    compile_s: float = 0.0
    eager_calls: int = 0
    whole_captures: int = 0
    whole_replays: int = 0
    tree_calls: int = 0
    tree_skips: int = 0
    grads_taken_back: int = 0


class _GraphsRun(threading.local):
    """How many of a backend's graphs this thread has run: a model call that runs none ran eagerly."""

    count = 0


class GraphRunner:
    """The callable Dynamo gets for one graph: chooses a candidate at the first call, then runs it."""

    def __init__(self, compiled: Callable[..., Any], eager: GraphModule, switch: _Switch | None,
                 options: Options, pool: SharedPool, stats: V2Statistics, index: int,
                 ran: _GraphsRun | None = None) -> None:
        self.compiled = compiled
        self.eager: Any = eager
        self.switch: _Switch | None = switch
        self.options = options
        self.pool = pool
        self.stats = stats
        self.index = index
        self.ran: _GraphsRun = _GraphsRun() if ran is None else ran
        self.candidates: list[Candidate] = []
        self.captures: list[CapturedGraph] = []
        self.chosen: Candidate | None = None
        self.note: str = ""
        self._lock = threading.Lock()
        self._run: Callable[[Sequence[Any]], Any] | None = None
        self.captured_run: bool = False  # whether _run replays a CUDA graph of the chosen candidate
        self.not_whole: str = ""  # why this graph cannot be part of a whole-call graph ('' where it can)
        self.training: list[Any] = []  # a training graph's forward and backward (:mod:`.training`)
        #: where the weights of linear layers fused into one product must lie (:mod:`.adjacent_linears`)
        self.layout: AdjacentLayout | None = None
        self.layout_moved: int = 0  # calls that ran the graph as traced: those weights had moved

    def __call__(self, *args: Any) -> Any:
        self.stats.calls += 1
        self.ran.count += 1
        if self.layout is not None and not self.layout.holds(args):
            return self._as_traced(args)
        if ACTIVE.mode is not None:
            return self._in_whole_call(args)
        run = self._run
        if run is None:
            with self._lock:
                if self._run is None:
                    self._run = self._first(args)
                run = self._run
        return run(args)

    def _in_whole_call(self, args: Sequence[Any]) -> Any:
        """A call inside the warm-up or capture of a whole-call graph (:mod:`.whole_call`): the chosen
        candidate runs directly, its work captured into the whole call's graph."""
        if self._run is None:
            if ACTIVE.mode == "capture":
                raise NotWholeCapturable(f"graph {self.index} had not chosen its candidate")
            ACTIVE.compiled = True
            with self._lock:
                if self._run is None:
                    self._run = self._first(args)
            return self._run(args)
        if ACTIVE.mode == "capture":  # the memory the whole call's graph reads (see whole_replay)
            for a in args:
                if isinstance(a, torch.Tensor):
                    ACTIVE.reads.setdefault(a.untyped_storage().data_ptr(), a.untyped_storage())
        if self.not_whole:
            ACTIVE.refusal = ACTIVE.refusal or f"graph {self.index}: {self.not_whole}"
            if ACTIVE.mode == "capture":
                raise NotWholeCapturable(ACTIVE.refusal)
            return self._run(args)
        if self.switch is not None:  # the storages it writes into: the caller's inputs are written back
            static = set(static_indices(args))
            ACTIVE.mutated.update(args[i].untyped_storage().data_ptr() for i in self.switch.mutated_inputs
                                  if i not in static and isinstance(args[i], torch.Tensor))
            ACTIVE.updates_state |= any(i in static for i in self.switch.mutated_inputs)
        if self.captured_run and self.chosen is not None:
            if ACTIVE.mode == "warm" and self.captures and self.options.clone_outputs:
                # (without the copies a caller may hold a graph's output: its memory stays taken)
                ACTIVE.parkable[id(self)] = self.park
            self._set_switch(self.chosen)
            return _made(self.chosen.run(list(args)))
        return _made(self._run(args))

    def _static(self, args: Sequence[Any]) -> list[int]:
        """The inputs a captured graph reads in place: the static ones, and the weights of fused linear
        layers (the one product reads past each first weight into the others: never copied)."""
        static = set(static_indices(args))
        if self.layout is not None:
            static.update(i for indices, _ in self.layout.groups for i in indices)
        return sorted(static)

    def _as_traced(self, args: Sequence[Any]) -> Any:
        """A call whose fused linear layers' weights do not lie side by side: the graph as Dynamo
        traced it, op by op (correct, not fast), with one warning. No whole-call graph takes such a
        call in: what it would write and read goes unrecorded on this path."""
        if not self.layout_moved:
            warn(f"streamdag: graph {self.index} fused linear layers whose weights lay side by side in "
                 "memory, and at this call they do not (a parameter's .data was replaced, or another "
                 "module's weights came through the same graph): the graph runs as traced, op by op; "
                 "lay the weights side by side again (a new streamdag.decoder packs a model's "
                 "projections), or call torch._dynamo.reset() to compile them as separate products")
        self.layout_moved += 1
        if ACTIVE.mode is not None:
            ACTIVE.refusal = ACTIVE.refusal or (
                f"graph {self.index}: the weights of its fused linear layers have moved")
            if ACTIVE.mode == "capture":
                raise NotWholeCapturable(ACTIVE.refusal)
        return self.eager(*args)

    # -- choosing ---------------------------------------------------------------------------------

    def _candidates(self) -> list[Candidate]:
        sw = self.switch
        assert sw is not None
        compiled, eager = self.compiled, self.eager

        def use(streams: int) -> Callable[[list[Any]], Any]:
            def run(args: list[Any]) -> Any:
                sw.streams = streams
                return compiled(*args)
            return run

        cands = [Candidate("eager", 1, lambda args: eager(*args)), Candidate("inductor", 1, use(0))]
        if sw.program is not None:
            top = min(self.options.streams, sw.program.plan.streams)
            cands += region_candidates(top, self.options.candidates, use)
        if self.options.candidates is not None:
            # ("cudagraphs" names a training graph's candidate: an inference graph's Inductor code
            # is captured into a CUDA graph anyway)
            kept = [c for c in cands if c.label in self.options.candidates
                    or c.label.split(" ")[0] in self.options.candidates
                    or (c.label == "inductor" and "cudagraphs" in self.options.candidates)]
            wants_regions = any(w.split(" ")[0] == "regions" for w in self.options.candidates)
            if not kept and wants_regions:
                why = (sw.region_note if sw.program is None
                       else f"its plan has {sw.program.plan.streams} stream(s)")
                self.note = (f"no candidate of {list(self.options.candidates)!r} for this graph ({why}): "
                             "Inductor's whole graph runs")
                kept = [c for c in cands if c.label == "inductor"]
            cands = kept
        return cands

    def _uncaptured(self, reason: str, streams: int = 0,
                    whole: bool = False) -> Callable[[Sequence[Any]], Any]:
        """Inductor's code runs without a CUDA graph of its own; ``whole``: it may still run inside
        the CUDA graph of a whole call."""
        self.note = f"{self.note}; {reason}" if self.note else reason
        _log.info("graph %d runs without a CUDA graph of its own: %s", self.index, reason)
        if not whole:
            self.not_whole = reason
        if self.switch is not None:
            self.switch.streams = streams
        compiled, stats = self.compiled, self.stats

        def run(args: Sequence[Any]) -> Any:
            stats.uncaptured_calls += 1
            return compiled(*args)
        return run

    def _first(self, args: Sequence[Any]) -> Callable[[Sequence[Any]], Any]:
        sw = self.switch
        if sw is None:
            return self._uncaptured("a training graph: its forward and backward choose their own "
                                    "candidates" if self.training else
                                    "a graph AOTAutograd compiled elsewhere: Inductor as is")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        cands = self._candidates()
        if not cands:
            raise ValueError(f"no candidate left by candidates={self.options.candidates!r}: "
                             "name some of 'eager', 'inductor', 'regions'")
        devices = {t.device for t in tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            where = "on the CPU" if {d.type for d in devices} <= {"cpu"} else "on several devices"
            return self._uncaptured_pick(cands, where)
        if sw.plan is None and sw.region_note.startswith("symbolic"):
            return self._uncaptured("symbolic shapes: Inductor's code runs uncaptured")
        if sw.mutates_metadata or sw.aliases_inputs:
            # a view of an input made inside a whole call's graph is a view of that graph's memory
            return self._uncaptured("the graph mutates an input's metadata or returns a view of an input: "
                                    "run uncaptured so the caller's tensors stay as eager leaves them",
                                    whole=not sw.mutates_metadata)
        static = self._static(args)
        if set(static) & set(sw.mutated_inputs):
            # a whole call's graph is captured after its warm-up, not warmed up inside: it updates once.
            # Untimed, the regions run where they were compiled (the planner's gain reached min_gain)
            streams = min(self.options.streams, sw.program.plan.streams) if sw.program is not None else 0
            return self._uncaptured("the graph updates a parameter or buffer in place (warm-up runs would "
                                    "repeat the update): run uncaptured" +
                                    (f", its regions on {streams} streams" if streams else ""),
                                    streams, whole=True)
        device = next(iter(devices))
        captured = []
        for c in cands:
            try:
                captured.append(CapturedGraph(c, args, static, sw.mutated_inputs, self.pool, device,
                                              private=len(cands) > 1))
                self.stats.captures += 1
            except Exception as exc:  # this candidate cannot be captured; the others still can
                c.error = f"{type(exc).__name__}: {exc}"
        self.candidates = cands
        if not captured:
            return self._uncaptured("no candidate could be captured: " +
                                    "; ".join(f"{c.label}: {c.error}" for c in cands))
        best = choose(captured, self.options.rounds, self.options.tie, self.options.memory_ratio,
                      base_mib=_held_mib(args))
        self.chosen = best.candidate
        _log.info("graph %d: candidate %s chosen (timed: %s)", self.index, best.candidate.label,
                  ", ".join(f"{c.label} {c.ms:.3f} ms" if c.ms is not None else f"{c.label} ({c.error})"
                            for c in cands))
        self._set_switch(best.candidate)
        if len(cands) > 1:  # the private pools go; the one kept joins the shared pool
            del captured
            best = CapturedGraph(best.candidate, args, static, sw.mutated_inputs, self.pool, device)
            self.stats.captures += 1
        self.captures = [best]
        self.captured_run = True
        return self._replay

    def _set_switch(self, cand: Candidate) -> None:
        if self.switch is not None and cand.label != "eager":
            self.switch.streams = cand.streams if cand.label.startswith("regions") else 0

    def _uncaptured_pick(self, cands: list[Candidate], where: str) -> Callable[[Sequence[Any]], Any]:
        """Off a single GPU nothing is captured: the first candidate left runs (Inductor's, by default)."""
        self.candidates = cands
        pick = next((c for c in cands if c.label == "inductor"), cands[0])
        self.chosen = pick
        _log.info("graph %d: candidate %s chosen (%s, nothing captured or timed)", self.index, pick.label,
                  where)
        self._set_switch(pick)
        if pick.label == "eager":
            eager, stats = self.eager, self.stats

            def run(args: Sequence[Any]) -> Any:
                stats.uncaptured_calls += 1
                return eager(*args)
            self.note = f"{self.note}; {where}: uncaptured" if self.note else f"{where}: uncaptured"
            self.not_whole = f"{where}: uncaptured"
            return run
        streams = pick.streams if pick.label.startswith("regions") else 0
        others = "" if len(cands) == 1 else " (nothing is timed: candidates= picks another)"
        return self._uncaptured(f"{where}: {pick.label} runs uncaptured{others}", streams)

    # -- the hot path -------------------------------------------------------------------------------

    def park(self) -> None:
        """Drop this graph's CUDA graphs: a whole-call graph is about to be captured that runs this
        graph's work itself (:data:`ACTIVE`), and their outputs and temporaries, freed into the
        shared pool now, become that capture's memory. A later call on Dynamo's path captures the
        chosen candidate again."""
        with self._lock:
            self.captures = []

    def _replay(self, args: Sequence[Any]) -> Any:
        settings = cudnn_settings()
        for g in self.captures:
            if g.settings == settings and g.statics_match(args):
                self.stats.replays += 1
                return g(args, self.options.clone_outputs)
        return self._recapture(args)

    def _recapture(self, args: Sequence[Any]) -> Any:
        """Parameters moved (replaced, or another model's), cuDNN's settings changed, or the graphs
        were parked: capture the chosen candidate for these arguments."""
        assert self.chosen is not None and self.switch is not None
        with self._lock:
            # another thread may have captured for these arguments meanwhile
            settings = cudnn_settings()
            g = next((g for g in self.captures if g.settings == settings and g.statics_match(args)), None)
            moved = bool(self.captures)  # none left: parked (a captured graph always keeps one)
            if g is None and not (moved and len(self.captures) >= self.options.max_captures):
                device = next(a.device for a in args if isinstance(a, torch.Tensor))
                g = CapturedGraph(self.chosen, args, self._static(args), self.switch.mutated_inputs,
                                  self.pool, device)
                self.captures.append(g)
                self.stats.captures += 1
                self.stats.recaptures += int(moved)
        if g is None:
            self.note = ("parameters moved or cuDNN's settings changed more than "
                         f"{self.options.max_captures} times: the chosen candidate runs uncaptured")
            self.stats.uncaptured_calls += 1
            self._set_switch(self.chosen)
            return self.compiled(*args) if self.chosen.label != "eager" else self.eager(*args)
        self.stats.replays += 1
        return g(args, self.options.clone_outputs)

    def explain(self) -> str:
        lines = [f"graph {self.index}: {len(self.eager.graph.nodes)} FX nodes"]
        sw = self.switch
        if sw is not None:
            lines.append(f"  compiled in {sw.compile_s:.2f} s")
            if sw.plan is not None:
                lines.append(f"  plan: {sw.plan}")
            if sw.region_note:
                lines.append(f"  regions: {sw.region_note}")
        lines += [f"  {c.describe(c is self.chosen)}" for c in self.candidates]
        if self.note:
            lines.append(f"  {self.note}")
        if self.layout is not None:
            lines.append(f"  {self.layout.products} groups of linear layers over one input run as one "
                         "product each (their weights lie side by side)")
            if self.layout_moved:
                lines.append(f"  {self.layout_moved} calls ran as traced: those weights had moved")
        lines += [t.explain() for t in self.training]
        if self._run is None:
            lines.append("  not called yet")
        return "\n".join(lines)


def _held_mib(args: Sequence[Any]) -> float:
    """What the graph's tensor inputs hold (each storage once), in MiB: weights, buffers, inputs."""
    storages: dict[int, int] = {}
    for a in args:
        if isinstance(a, torch.Tensor) and a.layout == torch.strided:  # (sparse tensors: no one storage)
            storage = a.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 2**20


def _made(out: Any) -> Any:
    """``out``, its tensors' storages noted where a capture made them: the whole call's own memory, which
    it need not keep allocated (an output that is a view of an input keeps the input's, read before)."""
    if ACTIVE.mode == "capture":
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ACTIVE.reads:
                ACTIVE.made.add(t.untyped_storage().data_ptr())
    return out


class StreamdagBackend:
    """A Dynamo backend: ``torch.compile(fn, backend=StreamdagBackend())`` (see the module docstring)."""

    def __init__(self, streams: int | None = None, regions: str = "auto", min_gain: float | None = None,
                 candidates: Sequence[str] | None = None, clone_outputs: bool = True,
                 inductor: dict[str, Any] | None = None) -> None:
        self.options: Options = compile_options(streams=streams, regions=regions, min_gain=min_gain,
                                                candidates=candidates, clone_outputs=clone_outputs,
                                                inductor=inductor)
        self.pool: SharedPool = SharedPool()
        self.stats: V2Statistics = V2Statistics()
        self.runners: list[GraphRunner | MakeFxFallback] = []
        self.ran: _GraphsRun = _GraphsRun()
        self._warned: set[str] = set()
        self.eager_reason: str = ""  # why streamdag.compile's model runs eagerly with gradients on
        self.eager_why: str = _EAGER_WHY  # why Dynamo ran a call as written (no compiled graph ran)
        self.dynamic_note: str = ""  # since when the model compiles with symbolic shapes, if it does
        #: what Dynamo could not trace in the model's compiling calls (its reasons, in brief, with their
        #: counts): it split the model there, or ran a frame as written
        self.graph_breaks: dict[str, int] = {}

    def __call__(self, gm: GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        t0 = time.perf_counter()
        self.stats.graphs += 1
        index = len(self.runners)
        rewrite_masked_writes(gm)  # first: the eager fallback's copy gets the static shapes too
        eager = _pristine(gm)
        layout = fuse_adjacent_linears(gm, example_inputs)  # after the copy: it depends on a layout
        switches: list[_Switch] = []
        trained: list[Any] = []
        # (AOTAutograd flattens a tensor subclass's inner tensors one way for the forward's inputs
        # and another for the backward's outputs: a training graph of one lends no gradients)
        plain = not any(is_traceable_wrapper_subclass(e) for e in example_inputs)

        def inner(g: torch.fx.GraphModule, ex: Sequence[Any], **kwargs: Any) -> Any:
            return inner_compile(g, ex, options=self.options, switches=switches, trained=trained,
                                 on_double_backward=self._double_backward, plain_inputs=plain, **kwargs)

        try:
            # AOTAutograd's cache would hand back a plain Inductor result and skip the inner compiler
            with torch._functorch.config.patch(enable_autograd_cache=False):
                # (compile_fx applies the settings to the backward too, whenever AOTAutograd compiles it)
                compiled = compile_fx(gm, example_inputs, inner_compile=inner,
                                      config_patches=self.options.inductor)
        except Exception as exc:
            signal = _signal_in(exc)
            if signal is None:
                return self._fallback(eager, example_inputs, exc, index)
            self.stats.graphs -= 1  # (Dynamo traces the code again, or runs it as written)
            if signal is exc:
                raise
            raise signal from None  # (Inductor wrapped it: Dynamo acts on the signal itself)
        finally:
            self.stats.compile_s += time.perf_counter() - t0
        runner = GraphRunner(compiled, eager, switches[0] if len(switches) == 1 else None, self.options,
                             self.pool, self.stats, index, self.ran)
        runner.training = trained  # the backward joins it when autograd first needs it
        runner.layout = layout if layout.groups else None
        self.runners.append(runner)
        return runner

    def _double_backward(self, message: str) -> None:
        from .training import warn_once

        self.eager_reason = message
        warn_once(self._warned, "double backward", message)

    def _fallback(self, eager: torch.fx.GraphModule, example_inputs: Sequence[Any], exc: Exception,
                  index: int) -> Callable[..., Any]:
        fb = fall_back(eager, example_inputs, exc, index, self.options.streams, self.ran, self.stats,
                       self._warned)
        self.runners.append(fb)
        return fb

    def explain(self) -> str:
        parts = [r.explain() for r in self.runners]
        n = self.stats.eager_calls
        if n:
            why = self.eager_reason or self.eager_why
            parts.append(f"{n} call{'s' if n != 1 else ''} ran no compiled graph: {why}")
        if self.dynamic_note:
            parts.append(f"the model {self.dynamic_note}")
        if self.graph_breaks:
            said = [f"  - {reason} (x{n})" for reason, n in list(self.graph_breaks.items())[:_BREAKS_SHOWN]]
            more = len(self.graph_breaks) - _BREAKS_SHOWN
            parts.append("Dynamo split the model where it could not trace it, and runs the code between "
                         "its graphs as written (TORCH_LOGS=graph_breaks shows where):\n" + "\n".join(said)
                         + (f"\n  and {more} more" if more > 0 else ""))
        return "\n\n".join(parts) or "nothing compiled yet: call the model once"

    def statistics(self) -> V2Statistics:
        stats = V2Statistics(**vars(self.stats))
        for r in self.runners:
            for t in getattr(r, "training", ()):
                stats.tree_calls += t.tree_calls
                stats.tree_skips += t.tree_skips
                stats.grads_taken_back += t.taken_back
        return stats


#: the reasons for graph breaks explain() lists
_BREAKS_SHOWN = 5

#: what Dynamo's passes raise to Dynamo from a backend's compile, to trace again another way (a float
#: specialized) or run the frame as written, and the fake-tensor exceptions (an op whose output depends
#: on data) Dynamo turns into a graph break, as under ``torch.compile``: never the backend's failures
_DYNAMO_SIGNALS: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(_dynamo_exc, n, None) for n in ("RestartAnalysis", "SkipFrame"))
    if isinstance(e, type)) + tuple(getattr(_dynamo_exc, "exceptions_allowed_to_be_fallback", ()))


def _signal_in(exc: BaseException) -> BaseException | None:
    """The signal for Dynamo that ``exc`` is or wraps; None where it is a failure to compile (the
    graph goes to the make_fx path). Inductor wraps what its compile raises in ``InductorError``
    (a ``BackendCompilerFailed``): a failure (no working C++ compiler, no Triton) or, where it
    compiles past its cache, a signal too."""
    inner = getattr(exc, "inner_exception", None)
    if isinstance(exc, _dynamo_exc.BackendCompilerFailed) and isinstance(inner, BaseException):
        return _signal_in(inner)
    return exc if isinstance(exc, _DYNAMO_SIGNALS) else None


_DEFAULT: StreamdagBackend | None = None
_DEFAULT_LOCK = threading.Lock()


#: the backends of ``torch.compile(..., backend="streamdag", options=...)``: one per settings that
#: compare equal (objects among the values, such as graph passes, compare as themselves: by identity
#: unless their class says otherwise); under _DEFAULT_LOCK
_WITH_SETTINGS: list[tuple[dict[str, Any], StreamdagBackend]] = []


def default_backend(inductor: dict[str, Any] | None = None) -> StreamdagBackend:
    """The backend ``torch.compile(..., backend="streamdag")`` uses: one per process (one pool per
    device), and one more for each set of Inductor settings passed as ``options`` (models compiled
    with equal settings share it: its statistics and its pools)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if inductor:
            settings = inductor_settings(inductor)  # (checked, and named as Inductor names them)
            for kept_settings, kept in _WITH_SETTINGS:
                if kept_settings == settings:
                    return kept
            backend = StreamdagBackend(inductor=settings)
            _WITH_SETTINGS.append((settings, backend))  # type: ignore[arg-type]
            return backend
        if _DEFAULT is None:
            _DEFAULT = StreamdagBackend()
        return _DEFAULT


_EAGER_WHY = ("Dynamo ran the code as written, as it does past torch._dynamo.config.recompile_limit "
              "(a Python value the code reads, such as a module attribute, changes from call to call: "
              "TORCH_LOGS=recompiles names it) or where the code has no tensor operation to compile")
