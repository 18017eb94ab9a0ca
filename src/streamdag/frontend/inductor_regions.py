"""Regions compiled by Inductor, and the program that runs them on several streams.

Each region of a :class:`~.regions.RegionPlan` becomes an FX graph of its own,
compiled with ``torch._inductor.compile_fx.compile_fx_inner`` (the same entry
Inductor uses for a whole graph), so each region is fused as Inductor fuses.
Regions are compiled in graph order; each region's outputs keep the strides
Inductor chose for them (reported through ``TracingContext.report_output_strides``)
and the regions that read them are compiled for exactly those strides, so no
copy is added at a boundary. Outputs of the whole graph keep the strides eager
would give them, as Inductor keeps them for a whole graph.

:class:`RegionProgram` runs the compiled regions. On CUDA the caller's stream is
stream 0 and the others are side streams: they wait for the caller's stream at
the start, each region waits on the events of the regions the schedule says it
must (:meth:`RegionPlan.schedule`: chain cover and vector clocks, the fewest
waits), and the caller's stream waits for every side stream at the end. So a
run is one fork-join on the caller's stream and can be captured into one CUDA
graph. A value made on one stream and read on another is marked with
``record_stream`` before the program drops it, so the caching allocator does not
hand its memory to the next region of the making stream while a reader may still
run (during a capture that memory is not reused at all). On the CPU the regions
run one after another, in graph order or in any order the waits allow.

Memory: every value the regions make is handed to the last region that reads
it, in graph order, as that region's only reference (Inductor's boxed call
takes its inputs' list and clears it), so the region's code frees it after its
own last use, as Inductor's whole graph frees its buffers. A program that owns
its inputs (a training graph's: AOTAutograd hands the backward its saved
activations and keeps no reference) hands each input over the same way, so no
activation outlives its last use. A value read on a stream other than the one
that made it is marked with ``record_stream`` for each reading stream before it
is handed over: the allocator reuses its memory once those streams have done
the work queued when it was freed. That delay keeps the memory reserved, not
allocated (the allocator counts a block as allocated until it is freed), so
what several streams hold at once beyond one stream's order, in allocated
bytes, is the values of regions that overlap and what cutting a graph costs
(a region's output cannot be written straight into the buffer of a
concatenation in another region), which the candidates' memory rule bounds.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx import GraphModule

from .._progress import progress
from ..schedule.plan import Schedule
from .kernels_together import kernels_compiled_together
from .lent_outputs import dense_strides
from .regions import Region, RegionPlan

__all__ = ["CompiledRegion", "RegionProgram", "compile_regions", "region_graph"]


@dataclass
class CompiledRegion:
    region: Region
    fn: Callable[[list[Any]], Any]  # Inductor's boxed call: takes a list (and may clear it)


def _copy(graph: torch.fx.Graph, node: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node],
          name: str) -> torch.fx.Node:
    args = torch.fx.node.map_arg(node.args, env.__getitem__)
    kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
    new = graph.create_node(node.op, node.target, args, kwargs, name=name, type_expr=node.type)
    new.meta = {k: v for k, v in node.meta.items() if k != "stack_trace"}
    return new


def region_graph(gm: GraphModule, region: Region, examples: Sequence[Any]) -> GraphModule:
    """The region as a GraphModule of its own: its inputs become placeholders, constants are copied in.

    Nodes get names by position (``in0``, ``v0``, ...) and no stack traces, so regions of the
    same structure (a transformer's layers) have the same code and hit Inductor's FX graph cache.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for i, (node, example) in enumerate(zip(region.inputs, examples)):
        p = graph.placeholder(f"in{i}")
        p.meta = {k: v for k, v in node.meta.items() if k != "stack_trace"}
        p.meta["val"] = example
        env[node] = p
    for node in region.nodes:
        for a in node.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = _copy(graph, a, env, f"c{len(env)}")
        env[node] = _copy(graph, node, env, f"v{len(env)}")
    graph.output(tuple(env[o] for o in region.outputs))
    return torch.fx.GraphModule(gm, graph)


def _graph_outputs(gm: torch.fx.GraphModule) -> tuple[torch.fx.Node, list[Any]]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    args = out.args[0]
    return out, list(args) if isinstance(args, (list, tuple)) else [args]


def _int_strides(strides: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(s) for s in strides)
    except (TypeError, ValueError):
        return None


def compile_regions(gm: GraphModule, example_inputs: Sequence[Any], plan: RegionPlan,
                    static_input_idxs: Sequence[int], compile_kwargs: dict[str, Any],
                    output_strides: Sequence[Any] | None = None) -> list[CompiledRegion]:
    """Compile every region of ``plan`` with Inductor (see the module docstring); in region order.

    ``output_strides``: the strides every output of the graph must have (a training forward's,
    whose saved activations the backward was compiled for), instead of eager's for the outputs
    the user sees. ``compile_kwargs`` may say ``is_inference`` and ``is_backward``.
    """
    from torch._guards import TracingContext, detect_fake_mode
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import BoxedBool

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example_of: dict[torch.fx.Node, Any] = dict(zip(placeholders, example_inputs))
    static = {placeholders[i] for i in static_input_idxs if i < len(placeholders)}
    out_node, outs = _graph_outputs(gm)
    visible = set(out_node.meta.get("user_visible_output_idxs", range(len(outs))))
    original = out_node.meta.get("original_output_strides")
    if output_strides is not None:
        visible, original = set(range(len(outs))), [_int_strides(s) if s else None for s in output_strides]
    kept_strides: dict[torch.fx.Node, Any] = {}
    for i, o in enumerate(outs):
        if isinstance(o, torch.fx.Node) and i in visible:
            stride = original[i] if original is not None and i < len(original) else None
            if stride is None and isinstance(o.meta.get("val"), torch.Tensor):
                stride = o.meta["val"].stride()
            kept_strides[o] = stride
    fake_mode = detect_fake_mode(list(example_inputs))
    reports = TracingContext.try_get() is not None
    compiled = []
    with kernels_compiled_together():  # each region's kernels compile while the next is lowered
        for region in progress(plan.regions, desc="streamdag.compile: Inductor, regions", unit="region"):
            examples = [example_of[n] if n in example_of else n.meta["val"] for n in region.inputs]
            sub = region_graph(gm, region, examples)
            sub_out = next(n for n in sub.graph.nodes if n.op == "output")
            # outputs of the whole graph keep eager's strides; where strides cannot be reported back,
            # every output does, so that its readers are compiled for the strides it will have
            keep = [i for i, o in enumerate(region.outputs) if o in kept_strides or not reports]
            sub_out.meta["user_visible_output_idxs"] = keep
            sub_out.meta["original_output_strides"] = [
                kept_strides.get(o) or (o.meta["val"].stride() if isinstance(o.meta.get("val"), torch.Tensor)
                                        else None) for o in region.outputs]
            if output_strides is not None and fake_mode is not None:
                _force_strides(sub, region.outputs, kept_strides, fake_mode)
            kwargs = {"is_inference": True, "is_backward": False, **compile_kwargs}
            kwargs.update(static_input_idxs=[i for i, n in enumerate(region.inputs) if n in static],
                          cudagraphs=BoxedBool(False))
            with TracingContext.report_output_strides() as strides:
                fn = compile_fx_inner(sub, list(examples), **kwargs)
            for i, o in enumerate(region.outputs):
                val = o.meta.get("val")
                stride = _int_strides(strides[i]) if strides and i < len(strides) and strides[i] else None
                if output_strides is not None and isinstance(val, torch.Tensor) and stride is not None \
                        and not _same_layout(val.shape, stride, kept_strides.get(o)):
                    # (a saved activation read by a backward compiled for other strides: wrong gradients)
                    raise RuntimeError(f"a region's output {o.name} came out with strides {stride}, not the "
                                       f"whole graph's {tuple(kept_strides[o])}")
                if isinstance(val, torch.Tensor) and stride is not None and fake_mode is not None \
                        and tuple(stride) != tuple(val.stride()):
                    with fake_mode:
                        val = torch.empty_strided(val.shape, stride, dtype=val.dtype, device=val.device)
                example_of[o] = val
            compiled.append(CompiledRegion(region, fn))
    return compiled


def _force_strides(sub: torch.fx.GraphModule, outputs: Sequence[torch.fx.Node],
                   wanted: dict[torch.fx.Node, Any], fake_mode: Any) -> None:
    """Each output of ``sub`` with ``wanted`` strides goes through Inductor's ``force_stride_order``,
    even where its metadata shows them already: Inductor takes an output's strides from what its
    lowering makes (a convolution's input may go channels-last), not from the output node's
    metadata. Where the layout already holds, the forcing copies nothing. Strides with gaps (an
    output padded by Inductor) are left to the exact strides asked for the output: forcing their
    order would make a dense buffer first, and a copy."""
    import torch._inductor.inductor_prims  # registers prims.inductor_force_stride_order

    out = next(n for n in sub.graph.nodes if n.op == "output")
    args = list(out.args[0])
    changed = False
    for i, (o, a) in enumerate(zip(outputs, args)):
        stride, val = wanted.get(o), a.meta.get("val")
        if stride is None or not isinstance(val, torch.Tensor) or not dense_strides(val.shape, stride):
            continue
        with sub.graph.inserting_before(out):
            forced = sub.graph.call_function(torch.ops.prims.inductor_force_stride_order.default,
                                             (a, list(stride)))
        with fake_mode:
            forced.meta["val"] = torch.empty_strided(val.shape, stride, dtype=val.dtype, device=val.device)
        args[i] = forced
        changed = True
    if changed:
        out.args = (tuple(args),)
        sub.recompile()


def _same_layout(shape: Sequence[int], stride: Sequence[int], wanted: Sequence[int] | None) -> bool:
    """Whether ``stride`` lays a tensor of ``shape`` out as ``wanted`` does (a dimension of one
    element takes any stride; an empty tensor, any layout). None wanted: any layout."""
    if wanted is None or any(int(n) == 0 for n in shape):
        return True
    return all(int(n) == 1 or int(a) == int(b) for n, a, b in zip(shape, stride, wanted))


class RegionProgram:
    """The compiled regions of one graph and how to run them (see the module docstring).

    ``output_strides``: the strides the graph's outputs must have (see :func:`compile_regions`);
    an input the graph returns with other strides is returned as a copy with them, as
    Inductor's whole graph returns it."""

    def __init__(self, gm: GraphModule, plan: RegionPlan, compiled: list[CompiledRegion],
                 owns_inputs: bool = False, output_strides: Sequence[Any] | None = None) -> None:
        self.plan = plan
        self.owns_inputs = owns_inputs
        self.compiled = compiled
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        slot: dict[torch.fx.Node, int] = {n: i for i, n in enumerate(placeholders)}
        for c in compiled:
            for o in c.region.outputs:
                slot[o] = len(slot)
        self.num_inputs: int = len(placeholders)
        self.num_slots: int = len(slot)
        self.input_slots: list[list[int]] = [[slot[n] for n in c.region.inputs] for c in compiled]
        self.output_slots: list[list[int]] = [[slot[n] for n in c.region.outputs] for c in compiled]
        _, outs = _graph_outputs(gm)
        self.result: list[tuple[int, Any]] = [(slot[o], None) if isinstance(o, torch.fx.Node) else (-1, o)
                                              for o in outs]
        self.restride: list[tuple[int, tuple[int, ...]]] = []  # (output index, strides) of returned inputs
        for i, o in enumerate(outs):
            stride = _int_strides(output_strides[i]) if output_strides and i < len(output_strides) \
                and output_strides[i] else None
            val = o.meta.get("val") if isinstance(o, torch.fx.Node) and o.op == "placeholder" else None
            if stride is not None and isinstance(val, torch.Tensor) and tuple(val.stride()) != stride:
                self.restride.append((i, stride))
        # an input is the caller's to free, unless the program owns it (a training graph's: the
        # backward's saved activations are freed after their last reader, as Inductor frees them)
        keep = {s for s, _ in self.result if s >= 0} | (set() if owns_inputs else set(range(self.num_inputs)))
        last_use = {}
        for r, slots in enumerate(self.input_slots):
            for s in slots:
                last_use[s] = r
        self.free_after: list[list[int]] = [[] for _ in compiled]
        for s, r in last_use.items():
            if s not in keep:
                self.free_after[r].append(s)
        self.readers: dict[int, list[int]] = {}
        for r, slots in enumerate(self.input_slots):
            for s in slots:
                self.readers.setdefault(s, []).append(r)
        self.producer: dict[int, int] = {s: r for r, slots in enumerate(self.output_slots) for s in slots}
        self._schedules: dict[int, Schedule] = {}

    def schedule(self, streams: int) -> Schedule:
        if streams not in self._schedules:
            self._schedules[streams] = self.plan.schedule(streams)
        return self._schedules[streams]

    def run(self, args: list[Any], streams: int = 1, order: Sequence[int] | None = None) -> list[Any]:
        """Run every region on ``args`` (the graph's inputs); returns the graph's outputs.

        A program that owns its inputs empties ``args`` (the boxed convention) and drops each input
        after its last reader, where it runs the regions in index order."""
        first = next((t for t in args if isinstance(t, torch.Tensor)), None)
        device = None if first is None else first.device
        del first  # no reference of ours may outlive the input's last reader
        if streams > 1 and device is not None and device.type == "cuda":
            return self._run_cuda(args, self.schedule(streams), device)
        return self._run_serial(args, order)

    def _finish(self, env: list[Any]) -> list[Any]:
        out = [env[s] if s >= 0 else const for s, const in self.result]
        for i, stride in self.restride:
            t = out[i]
            if isinstance(t, torch.Tensor) and tuple(t.stride()) != stride:
                out[i] = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
        return out

    def _env(self, args: list[Any]) -> list[Any]:
        env: list[Any] = list(args) + [None] * (self.num_slots - self.num_inputs)
        if self.owns_inputs:
            args.clear()
        return env

    def _run_serial(self, args: list[Any], order: Sequence[int] | None) -> list[Any]:
        env = self._env(args)
        for r in range(len(self.compiled)) if order is None else order:
            inputs = [env[s] for s in self.input_slots[r]]
            if order is None:  # last uses are counted in index order
                for s in self.free_after[r]:  # the region's list holds the last reference
                    env[s] = None
            outs = self.compiled[r].fn(inputs)
            del inputs
            for s, v in zip(self.output_slots[r], outs):
                env[s] = v
        return self._finish(env)

    def interleaving(self, streams: int, seed: int) -> list[int]:
        """A random order of the regions that keeps each stream's order and every planned wait.

        Stands for what several streams may do on a device: a region starts once the one
        before it on its stream and the regions it waits on are done, and nothing else
        orders it. Running the regions in such orders checks that the waits suffice.
        """
        sched = self.schedule(streams)
        rng = random.Random(seed)
        heads = [0] * sched.num_streams
        done: set[int] = set()
        order: list[int] = []
        while len(order) < len(self.compiled):
            ready = [s for s in range(sched.num_streams) if heads[s] < len(sched.order[s])
                     and all(w in done for w in sched.waits[sched.order[s][heads[s]]])]
            if not ready:
                raise RuntimeError("the region schedule deadlocks")
            s = rng.choice(ready)
            r = sched.order[s][heads[s]]
            heads[s] += 1
            done.add(r)
            order.append(r)
        return order

    def _run_cuda(self, args: list[Any], sched: Schedule, device: torch.device) -> list[Any]:
        main = torch.cuda.current_stream(device)
        streams = [main, *side_streams(device, sched.num_streams - 1)]
        for s in streams[1:]:  # fork: the side streams start after what the caller queued
            s.wait_stream(main)
        events = [torch.cuda.Event() if needed else None for needed in _waited_on(sched)]
        env = self._env(args)
        stream_of = sched.stream
        try:
            for r in range(len(self.compiled)):  # index order is a topological order
                stream = streams[stream_of[r]]
                inputs = [env[s] for s in self.input_slots[r]]
                for s in self.free_after[r]:  # the region's list holds the last reference
                    self._mark_readers(env[s], s, stream_of, streams)
                    env[s] = None
                with torch.cuda.stream(stream):
                    for w in sched.waits[r]:
                        stream.wait_event(events[w])
                    outs = self.compiled[r].fn(inputs)
                    del inputs
                    if events[r] is not None:
                        events[r].record(stream)
                for s, v in zip(self.output_slots[r], outs):
                    env[s] = v
            for s, _ in self.result:  # outputs made on a side stream are used on the caller's
                if s >= self.num_inputs and stream_of[self.producer[s]] != 0 \
                        and isinstance(env[s], torch.Tensor):
                    env[s].record_stream(main)
        finally:  # join even when a region fails: a capture cannot end with a side stream still forked
            for s in streams[1:]:
                main.wait_stream(s)
        return self._finish(env)

    def _mark_readers(self, value: Any, slot: int, stream_of: Sequence[int],
                      streams: list[torch.cuda.Stream]) -> None:
        if not isinstance(value, torch.Tensor):
            return
        # an input was made on the caller's stream before the fork; one the program owns may be
        # its last reference, so each side stream that read it marks it as the made values are
        made_on = stream_of[self.producer[slot]] if slot >= self.num_inputs else 0
        for r in {stream_of[r] for r in self.readers[slot]} - {made_on}:
            value.record_stream(streams[r])


def _waited_on(sched: Schedule) -> list[bool]:
    needed = [False] * sched.num_ops
    for ws in sched.waits:
        for w in ws:
            needed[w] = True
    return needed


_SIDE_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}


def side_streams(device: torch.device, n: int) -> list[torch.cuda.Stream]:
    """``n`` side streams of ``device``, made once and shared: each run forks from and joins its caller."""
    have = _SIDE_STREAMS.setdefault(device, [])
    while len(have) < n:
        have.append(torch.cuda.Stream(device))
    return have[:n]
