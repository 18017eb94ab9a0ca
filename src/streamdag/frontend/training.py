"""Training graphs: AOTAutograd's forward and backward, compiled by Inductor, under its CUDA graph
trees or cut into regions.

With gradients on, AOTAutograd splits each graph Dynamo captures into a forward
(which returns the outputs and the activations saved for the backward) and a
backward (which takes those activations and the outputs' gradients), and calls
the inner compiler on each: the forward at once, the backward at the first
``loss.backward()`` that reaches it. Each becomes a :class:`TrainingGraph`:

* Inductor's code for the whole graph, one stream, as ``torch.compile`` runs it.
  On a single CUDA device it is compiled as ``mode="reduce-overhead"`` compiles
  it, under Inductor's CUDA graph trees (the candidate ``cudagraphs``): the
  trees run a graph eagerly at its first call, record it at its second and
  replay it from then on, all graphs of a thread in one memory pool, and they
  keep a forward's saved activations in that pool, unwritten, until its
  backward has read them;
* where the region planner finds independent branches (a backward's weight and
  input gradients, a forward's parallel convolutions), the graph cut into regions,
  each compiled by Inductor, run on several streams
  (:class:`~.inductor_regions.RegionProgram`). Where the whole graph goes under
  the trees, the regions go there the same way (Inductor's own call that puts a
  graph under the trees, :class:`TreesCall`, made again for the regions): the
  program forks its side streams from the trees' stream and joins them, so the
  trees record it as one multi-stream CUDA graph in their pool. Elsewhere they
  run uncaptured.

Activations pass from the forward to the backward as AOTAutograd passes them:
the forward's outputs are the tensors its code made, not copies. Every output
of a forward's regions gets the strides Inductor's whole graph gave it, since
the backward is compiled (once) for the saved activations' strides, so either
forward candidate feeds either backward candidate.

**The trees.** A backward is compiled under the trees only where its forward
runs under them (its saved activations then live at the addresses the trees
recorded). Where Inductor's trees refuse a graph (a CPU tensor in it, an operator
they cannot capture) it runs uncaptured and ``explain()`` gives Inductor's
reason; a call the trees skip at run time (an input written in place that is
not a parameter or buffer) runs uncaptured too, and is counted
(``statistics().tree_skips``, from Inductor's ``cudagraph_skips`` counter). A
forward's returns (the loss, the logits) are copies out of the pool, unless
``clone_outputs=False``: the next replay overwrites the pool, and a loss kept
across steps must not change with it. A backward's parameters' gradients are
lent as they are, and a ``.grad`` that still holds one when the next step begins (gradient
accumulation: the next micro-batch's backward adds to it) gets a copy then
(:mod:`.lent_gradients`). Steps are the trees' as under ``reduce-overhead``: a training
loop that calls ``torch.compiler.cudagraph_mark_step_begin()`` at each step
tells them where one begins (the mark is the process's, so streamdag leaves it
to the loop). Batch norm's running statistics are buffers, which the trees let
a graph write in place; dropout's seeds come from the generator at each replay,
as an uncaptured call takes them.

**cuDNN's benchmark.** With ``torch.backends.cudnn.benchmark`` on, a convolution's first
run of each shape tries cuDNN's algorithms, with a workspace as large as the largest that
fits in the GPU's free memory. The trees run a graph's first call with every allocation of
the thread routed to their pool, so that workspace stays reserved in the pool for as long
as its graphs live (reduce-overhead's training step of a batch-32 ResNet-50 holds about
three times what ``torch.compile``'s does). A graph under the trees that calls convolutions
therefore runs its first call off them, as Inductor's code alone, and then empties the
caching allocator's cache: the trials' workspace goes back, and the trees' first call, one
call later, finds the algorithms chosen (cuDNN keys them by shapes, layouts and alignment,
not addresses). A backward whose forward did so does so too. Where the first call's timing
of several candidates ran them already (outside the trees), or an input is not at an
address Inductor's code assumes (the trees copy it first; Inductor's code alone would not),
the first call goes to the trees.

**Inside a captured step.** A forward compiled inside ``streamdag.capture_step``'s warm-up
(:mod:`.step_graph`), and its backward, stay off the trees: the step's one CUDA graph holds them.
Their candidates are timed captured, as that graph replays them. A graph under the trees called
while another capture runs (a model compiled before it was put in a captured step) runs its
chosen candidate uncaptured, where the outer capture records it.

**Choosing.** At a graph's first call on one CUDA device, each candidate is
timed and ``candidates.pick`` keeps the fastest: the one-stream Inductor graph
is always a candidate, a candidate on more streams must beat the best on fewer
by more than ``tie``, and one whose peak memory exceeds ``memory_ratio`` times
the one-stream peak (the graph's inputs counted with each) is not kept. For a
graph under the trees each candidate is captured into a CUDA graph of its own
pool, over the call's own inputs, and its replays are timed in ``rounds``
rounds, as the trees will replay the one kept; the timing graphs are dropped
before the call goes on. A backward is timed so at its first call, while its
forward's saved activations are alive. A graph off the trees runs each
candidate ``rounds`` times, interleaved, timed by CUDA events on the caller's
stream, its peak read with ``torch.cuda.reset_peak_memory_stats`` (the first
call of such a graph with several candidates resets the device's peak memory
statistics). The timing runs repeat the graph: inputs it writes in place
(batch norm's running statistics) are put back after each run, and the random
number generators' states after the last, so the call that follows computes
what a call without the timing would. A graph with one candidate (no regions)
runs it untimed. Off a single CUDA device the whole graph runs (or the regions,
where ``candidates`` keeps only them, as tests do).

**Memory.** A region program hands each value it made, and, as Inductor's
whole graph does with the inputs AOTAutograd hands it, each input (a saved
activation), to its last reader as that region's only reference, so the
region's code frees it after its own last use; a value read on another stream
than the one that made it is marked with ``record_stream`` first
(:mod:`.inductor_regions`). The memory rule above rejects a candidate whose
overlap, or whose cuts (a concatenation's inputs made in other regions than the
concatenation), cost more than ``memory_ratio``.

**Random numbers.** A graph with random operators (dropout) is not cut into
regions: Inductor draws one seed per graph call and derives every random
operator's numbers from it, so regions, each a graph of its own, would draw
different numbers than the whole graph. With the whole graph the numbers are
``torch.compile``'s for the same seed (they differ from eager's, as Inductor's
random kernels differ from eager's).

**Double backward.** AOTAutograd's compiled backward is not differentiable: a
backward with ``create_graph=True`` through it gives correct first gradients,
but a second backward through them raises. Such a backward warns
(:class:`~streamdag.errors.StreamdagWarning`) and makes ``streamdag.compile``'s
model run eagerly, with gradients on, from its next call; a backward under the
trees runs its aten graph op by op for that call, as the trees cannot record
it (they see its inputs freed while recording). A backward compiled
with AOTAutograd's donated buffers (PyTorch's default) never gets here: PyTorch
refuses the ``create_graph=True`` call first and names the setting to turn off.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._dynamo.utils import counters as _COUNTERS  # Inductor's counts, cudagraph_skips among them
from torch.fx import GraphModule

from .._diagnostics import warn
from ..backends.capture_memory import stream_reuse
from .aot_metadata import forward_returns, no_donated_buffers
from .aten_facts import has_random, written_inputs
from .candidates import Candidate, no_candidate_note, region_candidates
from .lent_gradients import LendPlan, Noted, hold, lend, node_run_last, parameter_positions, take_back
from .step_graph import in_captured_step
from .training_timing import time_captured, time_uncaptured
from .trees import (
    TreesCall,
    aligned,
    calls_convolution,
    copies,
    cudnn_benchmarks,
    make_trees_manager,
    refusal,
    seen_by_trees,
    trees_config,
)

__all__ = ["TREES", "TrainingGraph", "compile_training"]

#: the label of the candidate that runs Inductor's one-stream code under Inductor's CUDA graph
#: trees, as ``torch.compile(mode="reduce-overhead")`` does
TREES = "cudagraphs"


class TrainingGraph:
    """What AOTAutograd calls for a training forward or backward (see the module docstring)."""

    def __init__(self, kind: str, index: int, whole: Callable[[list[Any]], Any], options: Any,
                 written: list[int], on_double_backward: Callable[[str], None] | None) -> None:
        # an attribute of the instance: Dynamo's ``disable`` wraps the backward, keeping the
        # instance's attributes (which AOTAutograd reads to call it boxed), not its class's
        self._boxed_call = True
        self.kind = kind  # "forward" or "backward"
        self.index = index
        self.whole = whole
        self.options = options
        self.written = written  # inputs the graph writes in place: put back after each timing run
        self.on_double_backward = on_double_backward
        self.program: Any = None  # a RegionProgram, where the graph was cut into regions
        self.plan: Any = None
        self.region_note = ""
        self.compile_s: float = 0.0
        self.candidates: list[Candidate] = []
        self.chosen: Candidate | None = None
        self.note: str = ""
        self.calls: int = 0
        # ``whole`` under Inductor's cudagraph trees: whether it is, why not, and what it did
        self.captured = False
        self.tree_note = ""
        self.device_box: Any = None  # Inductor's BoxedDeviceIndex, shared by a forward and its backward
        self.copied: int | None = None  # outputs copied out of the trees' pool: the first n (None: all)
        self.tree_calls: int = 0
        self.tree_skips: int = 0
        # a backward under the trees: its aten graph, run op by op for a create_graph backward
        self.uncaptured: GraphModule | None = None
        # ``whole`` under the trees: Inductor's code as it compiled it (uncaptured, for timing the
        # candidates captured) and how Inductor put it under the trees, to put the regions there too
        self.raw: Callable[[list[Any]], Any] | None = None
        self.trees_call: TreesCall | None = None
        self._regions_in_trees: dict[int, Callable[[list[Any]], Any]] = {}
        self._copy_at: list[int] | None = None
        # gradients lent out of the trees' pool (:mod:`.lent_gradients`): a forward's parameters'
        # positions among its inputs (and how many inputs it takes), which its backward's outputs
        # follow, and the ``.grad`` a forward copied because they still held a lent gradient
        self.parameters_at: list[int] | None = None
        self.inputs: int = 0
        self.lends: bool = True  # a forward: its backward's outputs line up with its inputs
        self.held_in: Any = None  # a forward: the record its parameters were last noted in
        self.noted = Noted()  # a forward: which parameters it noted last, and where
        self.forward: TrainingGraph | None = None  # a backward's forward
        self.taken_back: int = 0
        self.lent: int = 0  # a backward: the gradients it lent
        self.lend_plan = LendPlan()  # a backward: what it lends at the trees' node that ran it
        self._streams: int | None = None  # 0: the whole graph; else the regions on this many streams
        self._lock = threading.Lock()
        # the graph calls convolutions and has its code apart from the trees: its first call runs
        # off them where cuDNN benchmarks (cleared at that call); off_trees_calls counts such calls
        self.benchmark_off_trees: bool = False
        self.off_trees_calls: int = 0
        # compiled inside ``streamdag.capture_step`` (a backward: its forward was): the step's CUDA
        # graph holds this one, so its candidates are timed captured, as that graph replays them
        self.in_step = False

    def __call__(self, args: list[Any]) -> Any:
        self.calls += 1
        if self.kind == "backward" and _in_double_backward():
            self._double_backward()
            if self.captured and self.uncaptured is not None:
                # the trees cannot record or replay a backward run for create_graph: its inputs
                # (the saved activations) are freed during recording and not during replay
                inputs = list(args)
                args.clear()  # the boxed convention: the callee owns the inputs
                return self.uncaptured(*inputs)
        streams = self._streams
        if streams is None:
            with self._lock:
                if self._streams is None:
                    self._streams = self._choose(args)
                streams = self._streams
        return self._run(args, streams)

    def _run(self, args: list[Any], streams: int) -> Any:
        if self.captured and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # inside another capture (a whole step's): the trees cannot record or replay there
            return self._run_uncaptured(args, streams)
        if self.captured and self.kind == "forward":
            self._take_back(args)
        if streams == 0:
            if not self.captured:
                return self.whole(args)
            if self.benchmark_off_trees:
                self.benchmark_off_trees = False
                if cudnn_benchmarks() and aligned(args):
                    return self._first_call_off_trees(args)
            return self._run_trees(args, self.whole)
        if self.captured and self.trees_call is not None:
            return self._run_trees(args, self._in_trees(streams))
        return self._run_uncaptured(args, streams)

    def _take_back(self, args: list[Any]) -> None:
        """Before the trees may begin a step (and replay over what the last one lent): copies for
        the ``.grad`` that hold lent gradients; then this call's parameters are noted for the next
        take-back (:mod:`.lent_gradients`)."""
        self.taken_back += take_back(self.device_box)
        if self.parameters_at is None:
            self.parameters_at, self.inputs = parameter_positions(args), len(args)
        if self.lends:  # (None: a parameter written in place from a tensor with gradients)
            self.held_in = hold(self.device_box, args, self.parameters_at, self.noted)
            self.lends = self.held_in is not None

    def _first_call_off_trees(self, args: list[Any]) -> Any:
        """Inductor's code alone, with cuDNN's trials outside the trees' pool (the module docstring's
        cuDNN paragraph). The trees' manager of the device is made first, as the trees' first call
        would make it: Inductor asserts it exists when it compiles a backward the trees refuse."""
        make_trees_manager(self.device_box)
        self.off_trees_calls += 1
        out = self._run_uncaptured(args, 0)
        torch.cuda.empty_cache()  # (the trials' workspace, cached, goes back before the pool grows)
        return out

    def _run_uncaptured(self, args: list[Any], streams: int) -> Any:
        """The candidate as compiled, outside the trees: Inductor's code, or the regions."""
        if streams == 0:
            return (self.raw or self.whole)(args)
        inputs = list(args)
        args.clear()  # the boxed convention: the callee owns the inputs and frees them after use
        return self.program.run(inputs, streams)

    def _in_trees(self, streams: int) -> Callable[[list[Any]], Any]:
        """The regions on ``streams`` streams under the trees, as Inductor puts its whole graph there:
        the trees warm the program up, record it (its side streams fork from the trees' stream and
        join it, so one capture holds them) and replay it, in the pool of its forward or backward."""
        fn = self._regions_in_trees.get(streams)
        if fn is None:
            assert self.trees_call is not None
            program = self.program

            def regions(args: list[Any]) -> Any:
                inputs = list(args)
                args.clear()
                with stream_reuse():  # (on while the trees warm it up and record it: no replay calls it)
                    return program.run(inputs, streams)

            fn = self._regions_in_trees[streams] = self.trees_call.wrap(regions)
        return fn

    def _run_trees(self, args: list[Any], fn: Callable[[list[Any]], Any]) -> Any:
        """``fn`` under the trees. The trees skip a call they cannot replay (an input written in
        place that is no parameter, say) and log it in Inductor's ``cudagraph_skips`` counter: it is
        read around the call. A backward's gradients are lent (:mod:`.lent_gradients`); a forward's
        returns are copied out of the trees' pool (``clone_outputs``): the next replay overwrites
        the pool, and a loss kept across steps must not change with it."""
        inductor = _COUNTERS["inductor"]
        skips = inductor["cudagraph_skips"]
        node_before = node_run_last(self.device_box) if self.kind == "backward" else None
        out = fn(args)
        self.tree_calls += 1
        if inductor["cudagraph_skips"] != skips:
            self.tree_skips += 1
        if self.kind == "backward":  # the parameters' gradients are lent, not copied
            fw = self.forward
            lendable = fw.parameters_at if fw is not None and fw.lends and len(out) == fw.inputs else None
            out, lent = lend(self.device_box, out, lendable, self.options.clone_outputs, self.lend_plan,
                             node_before, fw.held_in if fw is not None else None)
            self.lent += lent
            return out
        if not self.options.clone_outputs:
            return out
        out = list(out)
        if self._copy_at is None:  # which outputs are tensors is the same at every call
            n = len(out) if self.copied is None else min(self.copied, len(out))
            self._copy_at = [i for i in range(n) if isinstance(out[i], torch.Tensor)]
        for i, t in zip(self._copy_at, copies([out[i] for i in self._copy_at])):
            out[i] = t
        return out

    def _double_backward(self) -> None:
        message = ("a backward with create_graph=True ran through a compiled training graph: its "
                   "gradients are right, but a second backward through them raises, as AOTAutograd's "
                   "compiled backward is not differentiable. streamdag.compile's model runs eagerly "
                   "with gradients on from its next call; with torch.compile, wrap the code that needs "
                   "double backward in torch._dynamo.disable")
        if self.on_double_backward is not None:
            self.on_double_backward(message)

    # -- choosing ---------------------------------------------------------------------------------

    def _candidates(self) -> list[Candidate]:
        """The candidates, each running as compiled (its choice then runs under the trees, where
        the graph is put there)."""
        def use(streams: int) -> Callable[[list[Any]], Any]:
            return lambda args: self._run_uncaptured(args, streams)

        cands = [Candidate(TREES if self.captured else "inductor", 1, use(0))]
        wanted = self.options.candidates
        if self.program is not None and (not self.captured or self.trees_call is not None):
            top = min(self.options.streams, self.program.plan.streams)
            cands += region_candidates(top, wanted, use)
        if wanted is not None:
            kept = [c for c in cands if c.label in wanted or c.label.split(" ")[0] in wanted]
            if not kept:
                self.note = no_candidate_note(wanted, self.region_note, self.tree_note, cands[0].label)
            cands = kept or cands[:1]
        return cands

    def _choose(self, args: list[Any]) -> int:
        cands = self._candidates()
        self.candidates = cands
        devices = {a.device for a in args if isinstance(a, torch.Tensor)}
        if len(cands) == 1 or len(devices) != 1 or next(iter(devices)).type != "cuda":
            best = next((c for c in cands if c.label in (TREES, "inductor")), cands[0])
            if len(cands) > 1:
                self.note = f"off a single CUDA device nothing is timed: {best.label} runs"
        else:
            timed = time_captured if self.captured or self.in_step else time_uncaptured
            best = cands[timed(cands, args, next(iter(devices)), self.written, self.options)]
            self.benchmark_off_trees = False  # the timing ran the candidates, outside the trees
        self.chosen = best
        return 0 if best.label in (TREES, "inductor") else best.streams

    def explain(self) -> str:
        lines = [f"  {self.kind} (training) {self.index}: compiled in {self.compile_s:.2f} s"]
        if self.plan is not None:
            lines.append(f"    plan: {self.plan}")
        if self.region_note:
            lines.append(f"    regions: {self.region_note}")
        lines += [f"    {c.describe(c is self.chosen, memory='peak')}" for c in self.candidates]
        if self.captured:
            if self.chosen is not None and self.chosen.label not in (TREES, "inductor"):
                lines.append(f"    {self.chosen.label} runs under Inductor's CUDA graph trees, captured as "
                             "one multi-stream CUDA graph")
            lines.append(f"    cudagraph trees: {self.tree_calls} call(s) under Inductor's CUDA graph trees "
                         f"(they warm up, record, then replay), {self.tree_skips} of them skipped by the "
                         "trees and run uncaptured (TORCH_LOGS=cudagraphs says why)")
            if self.kind == "backward":
                lines.append(f"    parameters' gradients: {self.lent} handed to autograd out of the trees' "
                             "pool, not copied (a .grad still holding one as the next step begins gets a "
                             "copy then)" if self.lent else "    gradients: copied out of the trees' pool")
            elif self.taken_back:
                lines.append(f"    {self.taken_back} .grad copied out of the trees' pool as steps began: "
                             "they still held gradients a backward lent (gradient accumulation, or "
                             "zero_grad(set_to_none=False))")
            if self.off_trees_calls:
                lines.append("    first call off the trees: cuDNN's benchmark (torch.backends.cudnn."
                             "benchmark) chose its convolutions' algorithms outside the trees' pool, which "
                             "would keep the trials' workspaces")
            if self.kind == "forward" and not _steps_marked():
                lines.append("    no training step marked: call torch.compiler.cudagraph_mark_step_begin() "
                             "at the start of each step, as under reduce-overhead (the guide's Training "
                             "section says what it saves)")
        elif self.tree_note:
            lines.append(f"    cudagraph trees: {self.tree_note}")
        if self.note:
            lines.append(f"    {self.note}")
        if self._streams is None:
            lines.append("    not called yet")
        return "\n".join(lines)


def _steps_marked() -> bool:
    """Whether this process has marked a step of the trees (``cudagraph_mark_step_begin``)."""
    from torch._inductor import cudagraph_trees

    box = getattr(cudagraph_trees, "MarkStepBox", None)
    return box is None or box.mark_step_counter != 0


def _in_double_backward() -> bool:
    """Whether AOTAutograd calls this backward for a ``create_graph=True`` backward: it then runs it
    inside the forward of its non-differentiable ``CompiledFunctionBackward``."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        code = frame.f_code
        if getattr(code, "co_qualname", code.co_name).endswith("CompiledFunctionBackward.forward"):
            return True
        frame = frame.f_back
    return False


def compile_training(gm: GraphModule, example_inputs: Sequence[Any], options: Any,
                     kwargs: dict[str, Any], index: int,
                     on_double_backward: Callable[[str], None] | None = None,
                     forward: TrainingGraph | None = None, plain_inputs: bool = False) -> TrainingGraph:
    """Inductor's code for a training forward or backward, and its regions (see the module docstring).

    ``forward``: for a backward, the forward it belongs to (it runs under the trees only if that does).
    ``plain_inputs``: Dynamo's graph took no tensor subclass (:mod:`.lent_gradients` lends then)."""
    from torch._guards import TracingContext
    from torch._inductor.cudagraph_utils import BoxedDeviceIndex
    from torch._inductor.utils import BoxedBool

    from .inner_compile import _add_regions, _is_dynamic, _pristine

    t0 = time.perf_counter()
    kind = "backward" if kwargs.get("is_backward") else "forward"
    dynamic = _is_dynamic(example_inputs)
    why_not = _why_not_trees(kind, example_inputs, options, dynamic, forward)
    uncaptured = _pristine(gm) if kind == "backward" and not why_not else None
    pristine = None if options.regions == "never" or dynamic else uncaptured or _pristine(gm)
    ctx = TracingContext.try_get()
    returns = forward_returns(gm, getattr(ctx, "fw_metadata", None) if ctx is not None else None)
    if not why_not and kind == "forward" and returns is None:
        why_not = "the forward's outputs cannot be told from its saved activations"
    trees = BoxedBool(not why_not)  # Inductor turns it off where its trees refuse the graph
    kwargs["cudagraphs"] = trees
    if kind == "forward":
        # set by Inductor when it puts the forward under the trees; its backward reads it
        device_box = kwargs.get("boxed_forward_device_index") or BoxedDeviceIndex(None)
    else:
        device_box = forward.device_box if forward is not None and forward.device_box is not None \
            else kwargs.get("boxed_forward_device_index")
    kwargs["boxed_forward_device_index"] = device_box
    convolves = calls_convolution(gm)  # (before Inductor's passes rewrite gm)
    whole, strides, seen, trees = _compile_whole(gm, example_inputs, kwargs, trees)
    # the strides go to AOTAutograd as Inductor reports them (the backward is compiled for the
    # saved activations' strides) and are kept for the regions
    if strides is not None and ctx is not None and ctx.output_strides is not None:
        ctx.output_strides.extend(strides)
    # the inputs a run may write: those its operators write in place, and a backward's donated
    # buffers (saved activations its code may reuse as scratch): timing runs put them back
    donated = list(getattr(getattr(ctx, "fw_metadata", None), "bw_donated_idxs", None) or ()) \
        if kind == "backward" else []
    written = sorted(set(donated) | set(written_inputs(pristine) if pristine is not None else ()))
    graph = TrainingGraph(kind, index, whole, options, written, on_double_backward)
    graph.device_box = device_box
    graph.forward = forward
    graph.lends = plain_inputs
    graph.in_step = forward.in_step if forward is not None else in_captured_step()
    graph.captured = bool(trees)
    graph.uncaptured = uncaptured if graph.captured else None
    if graph.captured and len(seen) == 1:
        graph.raw, graph.trees_call = seen[0]
        # a backward whose forward ran its first call off the trees does so too: the trees then meet
        # the two first at the same step, as a forward and the backward it leads to
        graph.benchmark_off_trees = convolves or (forward is not None and forward.off_trees_calls > 0)
    if graph.captured and kind == "forward":
        # the forward's returns (the outputs, and inputs' and views' bases AOTAutograd needs) come
        # before the activations saved for the backward, which stay in the trees' pool
        graph.copied = returns
    if why_not and why_not != _NOT_ASKED:
        graph.tree_note = f"not used: {why_not}"
    elif not why_not and not graph.captured:
        graph.tree_note = f"Inductor's trees refused the graph ({refusal(whole)}): it runs uncaptured"
    if pristine is None:
        graph.region_note = "symbolic shapes: the whole graph only" if dynamic else ""
    elif graph.captured and graph.trees_call is None:
        graph.region_note = ("Inductor did not put its code under the trees in one call (graph "
                             "partitions): the whole graph only")
    elif kind == "backward" and not why_not and not graph.captured:
        # Inductor's code for a backward the trees refused tells them that the backward ran (its
        # forward's activations are then free): regions in its place would leave them waiting
        graph.region_note = ("Inductor's trees refused it after its forward ran under them: the whole "
                             "graph only")
    elif has_random(pristine):
        graph.region_note = ("random operators: the whole graph only (regions would draw other random "
                             "numbers than Inductor's whole graph)")
    else:
        with no_donated_buffers(ctx):
            _add_regions(graph, pristine, example_inputs, options, kwargs, training=True,
                         output_strides=strides)
    graph.compile_s = time.perf_counter() - t0
    return graph


def _compile_whole(gm: GraphModule, example_inputs: Sequence[Any], kwargs: dict[str, Any],
                   trees: Any) -> tuple[Any, Any, list[tuple[Any, TreesCall]], Any]:
    """Inductor's code for the whole graph: (it, the strides of its outputs as Inductor reports them
    to AOTAutograd, the calls that put it under the trees, the box saying whether it went there).

    Under the trees the graph is compiled whole, without Inductor's graph partitions, so that one
    call puts it there and its regions can go there the same way; where the trees refuse it so, it
    is compiled again with partitions, as ``reduce-overhead`` compiles it (its regions then stay
    out: one call per partition)."""
    from torch._guards import TracingContext
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    from .inner_compile import _pristine

    spare = _pristine(gm) if trees else None  # (Inductor's passes rewrite the graph they compile)
    skips = _COUNTERS["inductor"]["cudagraph_skips"]
    with TracingContext.report_output_strides() as strides, trees_config(bool(trees), partitions=False), \
            seen_by_trees() as seen:
        whole = compile_fx_inner(gm, list(example_inputs), **kwargs)
    if spare is not None and not trees:
        trees = kwargs["cudagraphs"] = BoxedBool(True)
        with TracingContext.report_output_strides() as strides, trees_config(True), seen_by_trees() as seen:
            whole = compile_fx_inner(spare, list(example_inputs), **kwargs)
        seen.clear()
        if trees:  # the graph went under the trees after all: the first refusal is no skip
            _COUNTERS["inductor"]["cudagraph_skips"] = skips
    return whole, strides, seen, trees


#: why a graph is not compiled under the trees where that needs no saying: the candidates asked for
#: leave them out, or the graph is on the CPU
_NOT_ASKED = "not asked for"


def _why_not_trees(kind: str, example_inputs: Sequence[Any], options: Any, dynamic: bool,
                   forward: TrainingGraph | None) -> str:
    """Why the graph is not compiled under Inductor's cudagraph trees ('' where it is)."""
    wanted = options.candidates
    if wanted is not None and not any(w.split(" ")[0] == TREES for w in wanted):
        return _NOT_ASKED
    devices = {e.device for e in example_inputs if isinstance(e, torch.Tensor)}
    if {d.type for d in devices} <= {"cpu"}:
        return _NOT_ASKED  # (the trees are CUDA's: nothing to say on the CPU)
    if (kind == "forward" and in_captured_step()) or (forward is not None and forward.in_step):
        return "it runs inside streamdag.capture_step, whose CUDA graph of the whole step holds it"
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return "the graph's inputs are not on a single CUDA device"
    if dynamic:
        return "symbolic shapes"
    if kind == "backward":
        if forward is None or not forward.captured:
            return "its forward runs uncaptured (the saved activations are not in the trees' pool)"
        if forward.chosen is not None and forward.chosen.label != TREES and forward.trees_call is None:
            return f"its forward runs {forward.chosen.label}, uncaptured"
    return ""


def warn_once(seen: set[str], key: str, message: str) -> None:
    """One :class:`StreamdagWarning` per ``key`` for a backend, pointing at the user's code."""
    if key in seen:
        return
    seen.add(key)
    warn(f"streamdag: {message}")
