"""The inner compiler ``compile_fx`` calls on each aten graph AOTAutograd makes (see
:mod:`.inductor_backend`).

For an inference graph it compiles Inductor's code for the whole graph and, where the
region planner finds independent branches worth their events, the graph cut into regions
(:mod:`.inductor_regions`), and returns a :class:`_Switch` that runs whichever is selected.
A training graph (AOTAutograd's forward, and its backward when autograd first needs it)
gets the same treatment through :mod:`.training`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx import GraphModule

from .candidates import REGIONS
from .kernels_together import kernels_compiled_together
from .regions import RegionPlan, plan_regions

__all__ = ["BACKWARD_MIN_GAIN", "MIN_GAIN", "Options", "compile_options", "inductor_settings",
           "inner_compile"]

#: the least gain the region cost model must predict before a graph's regions are compiled: two
#: and a half times the model's error on its calibration models (``regions.REGION_MODEL``), so
#: that regions, and their compile time, go only where they are likely to pay
MIN_GAIN = 0.15
#: the same for a training backward. Its weight- and input-gradient products are independent at
#: every layer, and the model misjudges them most: on GoogLeNet's backward (fp32, H200) it predicts
#: 7% at batch 8, where regions on 3 streams run 9% faster (4 streams 18%, over the memory rule),
#: and 5% at batch 32, where they tie. A backward runs at every step of a long training
#: run, so its regions' compile time is paid once against many steps; the timing at its first call
#: keeps the one-stream graph where they do not pay.
BACKWARD_MIN_GAIN = 0.05


@dataclass
class Options:
    streams: int = 4
    regions: str = "auto"  # "auto": where the cost model finds a gain; "always"; "never"
    # None: MIN_GAIN, and BACKWARD_MIN_GAIN for a training backward (:meth:`gain_needed`)
    min_gain: float | None = None
    # labels or kinds to keep, e.g. ("regions",), ("regions x2",), ("cudagraphs",) (training graphs
    # under Inductor's CUDA graph trees)
    candidates: tuple[str, ...] | None = None
    clone_outputs: bool = True
    max_captures: int = 4
    rounds: int = 10
    tie: float = 0.02
    memory_ratio: float = 1.1
    whole_call: bool = True
    # Inductor settings by name for this model's graphs (``torch._inductor.config``, dotted names for
    # nested ones), as ``torch.compile(options=...)`` takes them; None: the process's settings
    inductor: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.streams, int) or isinstance(self.streams, bool):
            raise TypeError(f"streams takes a number of streams, e.g. streams=2; got {self.streams!r}")
        if not isinstance(self.clone_outputs, bool):
            raise TypeError(f"clone_outputs takes True or False, got {self.clone_outputs!r}")
        if self.min_gain is not None and (not isinstance(self.min_gain, (int, float))
                                          or isinstance(self.min_gain, bool)):
            raise TypeError(f"min_gain takes a fraction, e.g. min_gain=0.15; got {self.min_gain!r}")
        if self.regions not in ("auto", "always", "never"):
            raise ValueError(f"regions must be 'auto', 'always' or 'never', got {self.regions!r}")
        if self.streams < 1:
            raise ValueError(f"streams must be at least 1, got {self.streams}")
        if self.min_gain is not None and not self.min_gain >= 0:  # (NaN too)
            raise ValueError(f"min_gain is the least fraction of a graph's one-stream time that its regions "
                             f"must save (0.15: 15%), at least 0; got {self.min_gain!r}")
        self.inductor = inductor_settings(self.inductor)  # (a copy: the caller's dict may change later)
        unknown = [c for c in self.candidates or () if not _is_candidate_label(c)]
        if unknown:
            raise ValueError(f"unknown candidates {unknown}: name some of 'eager', 'inductor', 'regions', "
                             "'cudagraphs' (training graphs under Inductor's CUDA graph trees), or a label "
                             "such as 'regions x2'")

    def gain_needed(self, backward: bool) -> float:
        """The least gain the cost model must predict before a graph's regions are compiled: the
        ``min_gain`` asked for, else :data:`MIN_GAIN` (:data:`BACKWARD_MIN_GAIN` for a backward)."""
        if self.min_gain is not None:
            return self.min_gain
        return BACKWARD_MIN_GAIN if backward else MIN_GAIN


def compile_options(*, streams: int | None = None, regions: str = "auto", min_gain: float | None = None,
                    candidates: Sequence[str] | str | None = None, clone_outputs: bool = True,
                    inductor: dict[str, Any] | None = None) -> Options:
    """The options as ``streamdag.compile`` takes them, checked: no ``streams`` is 4, and a single
    string of ``candidates`` is one label, not its letters."""
    labels = None if candidates is None else (
        (candidates,) if isinstance(candidates, str) else tuple(candidates))
    return Options(streams=4 if streams is None else streams, regions=regions, min_gain=min_gain,
                   candidates=labels, clone_outputs=clone_outputs, inductor=inductor)


def inductor_settings(settings: object) -> dict[str, Any] | None:
    """The settings as ``torch.compile``'s ``options`` takes them (``-`` read as ``_``; a value of
    the setting's type where that type is a plain class), checked now: Inductor would refuse an
    unknown name only at the first call's compile, and take a value of another type silently."""
    if settings is None:
        return None
    if not isinstance(settings, dict) or not all(isinstance(k, str) for k in settings):
        raise TypeError("inductor takes a dict of Inductor settings by name, e.g. "
                        f"inductor={{'combo_kernels': True}}; got {settings!r}")
    import typing

    from torch._inductor import config

    known = config.get_config_copy()
    named = {key.replace("-", "_"): value for key, value in settings.items()}
    unknown = sorted(k for k in named if k not in known)
    if unknown:
        raise ValueError(f"no Inductor setting named {', '.join(map(repr, unknown))} in this PyTorch "
                         "(torch._inductor.config; nested ones by dotted name, e.g. 'triton.cudagraphs')")
    get_type = getattr(config, "get_type", None)
    for name, value in named.items():
        kind = get_type(name) if get_type is not None else None
        if isinstance(kind, type) and typing.get_origin(kind) is None and not isinstance(value, kind):
            raise TypeError(f"Inductor's {name} takes a {kind.__name__} (it is "
                            f"{known[name]!r} now), got {value!r}")
    return named


def _is_candidate_label(label: object) -> bool:
    """A kind of candidate, or one label: ``regions xN`` (N streams, at least 1)."""
    if label in ("eager", "inductor", "regions", "cudagraphs"):
        return True
    if not isinstance(label, str) or not label.startswith(REGIONS):
        return False
    count = label.removeprefix(REGIONS)
    return count.isdigit() and int(count) >= 1


class _Switch:
    """What AOTAutograd calls for an inference graph: Inductor's whole graph, or its regions."""

    _boxed_call = True

    def __init__(self, whole: Callable[[list[Any]], Any]) -> None:
        self.whole = whole
        self.program: Any = None  # a RegionProgram, where the graph was cut into regions
        self.plan: RegionPlan | None = None
        self.region_note = ""
        self.streams = 0  # 0: the whole graph; else the regions on this many streams
        self.mutated_inputs: list[int] = []
        self.mutates_metadata = False
        self.aliases_inputs = False
        self.compile_s: float = 0.0

    def __call__(self, args: list[Any]) -> Any:
        if self.streams == 0:
            return self.whole(args)
        inputs = list(args)
        args.clear()  # the boxed convention: the callee owns the inputs
        return self.program.run(inputs, self.streams)


def _pristine(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm``'s graph (meta shared): Inductor's passes rewrite the graph they compile in place."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return torch.fx.GraphModule(gm, graph)


def _is_dynamic(example_inputs: Sequence[Any]) -> bool:
    for e in example_inputs:
        if isinstance(e, torch.SymInt):
            return True
        if isinstance(e, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in e.shape):
            return True
    return False


def inner_compile(gm: GraphModule, example_inputs: Sequence[Any], *, options: Options,
                  switches: list[_Switch], trained: list[Any],
                  on_double_backward: Callable[[str], None] | None = None, plain_inputs: bool = False,
                  **kwargs: Any) -> Any:
    """Inductor's inner compiler, plus the regions of the graph (see the module docstring)."""
    from torch._guards import TracingContext
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    if kwargs.get("is_backward") or not kwargs.get("is_inference"):
        from .training import compile_training

        forward = next((g for g in trained if g.kind == "forward"), None)
        graph = compile_training(gm, example_inputs, options, kwargs, len(trained), on_double_backward,
                                 forward if kwargs.get("is_backward") else None, plain_inputs)
        trained.append(graph)
        return graph
    t0 = time.perf_counter()
    pristine = None if options.regions == "never" or _is_dynamic(example_inputs) else _pristine(gm)
    kwargs["cudagraphs"] = BoxedBool(False)  # the runner captures, with every candidate's streams
    with kernels_compiled_together():  # the whole graph's kernels compile beside its regions'
        switch = _Switch(compile_fx_inner(gm, list(example_inputs), **kwargs))
        ctx = TracingContext.try_get()
        meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
        if meta is not None:
            switch.mutated_inputs = [i for i, info in enumerate(meta.input_info) if info.mutates_data]
            switch.mutates_metadata = any(info.mutates_metadata for info in meta.input_info)
            switch.aliases_inputs = any(o.output_type.name in ("is_input", "alias_of_input")
                                        for o in meta.output_info)
        if pristine is not None:
            _add_regions(switch, pristine, example_inputs, options, kwargs)
        elif options.regions != "never":
            switch.region_note = "symbolic shapes: the whole graph only"
    switch.compile_s = time.perf_counter() - t0
    switches.append(switch)
    return switch


def _add_regions(switch: Any, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 options: Options, kwargs: dict[str, Any], training: bool = False,
                 output_strides: Sequence[Any] | None = None) -> None:
    """Sets ``switch.plan``, ``switch.program`` (where the regions compile) and ``switch.region_note``.

    ``training``: AOTAutograd's forward or backward (``kwargs["is_backward"]`` says which): its
    regions are compiled as such, every graph output gets the strides in ``output_strides``
    (the whole graph's: the backward was compiled for the saved activations' strides), and the
    program drops each input after its last reader, as Inductor's whole graph frees its inputs.
    """
    from .inductor_regions import RegionProgram, compile_regions

    if options.streams < 2:
        switch.region_note = "one stream asked for"
        return
    on_cpu = all(e.device.type == "cpu" for e in example_inputs if isinstance(e, torch.Tensor))
    if on_cpu and options.regions == "auto" and options.candidates is None:
        switch.region_note = "on the CPU the whole graph runs: regions pay on streams"
        return
    try:
        plan = plan_regions(gm, options.streams)
    except Exception as exc:  # a planner's bug must not cost the graph Inductor's whole-graph code
        switch.region_note = f"no region plan ({type(exc).__name__}: {exc})"
        return
    switch.plan = plan
    if plan.streams < 2:
        switch.region_note = "no independent branches worth a stream"
        return
    needed = options.gain_needed(backward=training and bool(kwargs.get("is_backward")))
    if options.regions == "auto" and plan.gain < needed:
        switch.region_note = f"the cost model's gain {plan.gain:.1%} is under {needed:.0%}"
        return
    try:
        from torch._inductor.graph import GraphLowering

        region_kwargs = {k: v for k, v in kwargs.items() if k not in ("static_input_idxs", "graph_id")}
        # one layout decision for the whole graph: a region deciding alone could convert to
        # channels-last and back at each of its boundaries
        region_kwargs["layout_opt"] = GraphLowering.decide_layout_opt(gm, is_inference=not training)
        if training:
            region_kwargs.update(is_inference=False, is_backward=bool(kwargs.get("is_backward")))
        compiled = compile_regions(gm, example_inputs, plan, kwargs.get("static_input_idxs", ()),
                                   region_kwargs, output_strides=output_strides)
    except Exception as exc:  # the whole graph still runs: say why the regions do not
        switch.region_note = f"regions not compiled ({type(exc).__name__}: {exc})"
        return
    switch.program = RegionProgram(gm, plan, compiled, owns_inputs=training, output_strides=output_strides)
