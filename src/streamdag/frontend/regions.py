"""Regions: an aten FX graph cut along streamdag's chain cover, for Inductor to compile piece by piece.

Inductor fuses within one graph and runs it on one stream. To run independent
branches concurrently, the graph is cut into *regions*: each region runs on one
stream, is compiled by Inductor as a graph of its own (so it is fused inside),
and waits only at its start and is waited on only at its end.

1. Ops are grouped into units: a tuple's ``getitem`` goes with the op that makes
   the tuple, and a free op (a view) goes with the op that uses it, so no region
   boundary carries a tuple or a lone view. Ops without FLOPs of their own
   (pointwise, reductions, pools) join the unit whose kernels Inductor fuses
   them into (:func:`_fuse_flopless`): a unit is a convolution or matmul with
   its epilogue, or a join of branches. (Where the graph writes in place
   between other ops, nothing joins: a write orders the reads around it by
   graph order. Writes that only end the graph, as a training forward's
   ``copy_`` into batch norm's running statistics does, let the ops before
   them join.) Units are numbered in a topological
   order, graph order where it leaves a choice.
2. Each unit gets an estimated cost (FLOPs and bytes, see :func:`node_cost_ms`,
   calibrated on Inductor's times at batch 1).
   Ops with side effects (``copy_`` into an input, asserts) are barriers: they
   follow every unit before them and precede every unit after them.
3. :func:`streamdag.schedule.build_schedule` assigns units to streams by a
   minimum chain cover; a side stream with a negligible share of the work goes
   back to stream 0 (its events would cost more than its overlap gains).
4. A region is a run of units on one stream that starts at the stream's start or
   at a unit that waits on another stream, and ends at the stream's end or at a
   unit another stream waits on. So an edge between regions always goes from
   the last unit of one to the first unit of another, and the regions, numbered
   by their first unit, are in a topological order.
5. The plan's estimate (:attr:`RegionPlan.gain`) simulates the regions on their
   streams (:data:`REGION_MODEL`, fitted to measured region candidates); the
   compile path compiles the regions only where it predicts a large gain.

Pure planning over FX nodes: nothing here compiles or runs anything.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx
from torch.fx import GraphModule, Node

from ..runtime.accel import build_schedule, plan_waits
from ..schedule.cost import CostModel, simulate
from ..schedule.plan import Schedule

__all__ = ["Region", "RegionPlan", "node_cost_ms", "plan_regions"]

#: The time of a convolution or matmul with the kernels Inductor fuses around it (its epilogue:
#: bias, normalization, activation): ``HEAVY_MS + max(FLOPs / PEAK_FLOPS, bytes / PEAK_BYTES)``.
#: Fitted to Inductor's one-stream CUDA-graph replays on an H200 at batch 1, fp32 with TF32:
#: ResNet-50, GoogLeNet and Inception-v3 take 0.614, 0.552 and 1.067 ms for 54, 58 and 95 such
#: ops of 8.2, 3.0 and 11.4 GFLOP; the model says 0.66, 0.56 and 1.06 ms. At batch 1 the fixed
#: part (a few kernels' launch, ramp and tail) is most of the time.
HEAVY_MS = 0.0085
PEAK_FLOPS = 5.5e13
PEAK_BYTES = 3.0e12
#: Pointwise and reduction ops mostly fuse into their neighbours' kernels: a share of their bytes.
FUSED_SHARE = 0.3
#: How ops on several streams share the device (:class:`~streamdag.schedule.cost.CostModel`),
#: fitted to the region candidates of the same three models as they were cut before ops without
#: FLOPs joined their neighbours (a unit, and mostly a region, per op; times over the one-stream
#: time: GoogLeNet on 2, 3 and 4 streams 1.09, 1.02 and 0.97, ResNet-50 1.21-1.22, Inception-v3
#: on 4 streams 1.01): an op 16 µs long fills the device alone (shorter ones leave room for
#: others), each cross-stream wait costs 1 µs. The fit's error is 6% (root mean square); the gain
#: the compile path requires before it compiles regions (``MIN_GAIN``) is two and a half times that
#: (a training backward's, ``BACKWARD_MIN_GAIN``, lies under it: its first call's timing decides).
REGION_MODEL = CostModel(launch_ms=0.0, wait_ms=0.001, saturating_ms=0.016)

_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


@dataclass(frozen=True)
class Region:
    """One piece of the graph: its nodes in graph order, the stream it was planned on, its values."""

    index: int
    nodes: tuple[Node, ...]
    stream: int
    inputs: tuple[Node, ...]
    outputs: tuple[Node, ...]
    cost_ms: float


@dataclass(frozen=True)
class RegionPlan:
    """The regions of a graph, the region DAG, and the cost model's verdict on running them concurrently."""

    regions: tuple[Region, ...]
    preds: tuple[tuple[int, ...], ...]
    streams: int
    width: int | None
    one_stream_ms: float
    estimate_ms: float

    @property
    def gain(self) -> float:
        """Estimated fraction of the one-stream time that concurrency saves (0 when it saves nothing)."""
        if self.one_stream_ms <= 0:
            return 0.0
        return max(0.0, 1.0 - self.estimate_ms / self.one_stream_ms)

    def schedule(self, max_streams: int) -> Schedule:
        """The regions on at most ``max_streams`` streams: chain cover over the region DAG, fewest waits."""
        return build_schedule(self.preds, max_streams, [r.cost_ms for r in self.regions])

    def __str__(self) -> str:
        width = "?" if self.width is None else self.width
        return (f"{len(self.regions)} regions on {self.streams} streams (graph width {width}); "
                f"estimated {self.estimate_ms:.4f} ms against {self.one_stream_ms:.4f} ms on one stream "
                f"({self.gain:.0%} saved)")


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _tensor_vals(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _val(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or len(schema.returns) != 1:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _flops(node: torch.fx.Node) -> float:
    name = getattr(getattr(node.target, "_overloadpacket", None), "__name__", "")
    out = _val(node)
    if name in _MATMULS:
        a = _val(node.args[1] if name in ("addmm", "baddbmm") else node.args[0])
        if isinstance(out, torch.Tensor) and isinstance(a, torch.Tensor):
            return 2.0 * _numel(out.shape) * int(a.shape[-1])
    if name in ("convolution", "_convolution"):
        w = _val(node.args[1])  # (out channels, in channels / groups, *kernel)
        if isinstance(out, torch.Tensor) and isinstance(w, torch.Tensor):
            return 2.0 * _numel(out.shape) * _numel(w.shape[1:])
    if name == "convolution_backward":  # each gradient asked for costs about one forward convolution
        grad_out, w = _val(node.args[0]), _val(node.args[2])
        mask = node.args[10] if len(node.args) > 10 else (True, True, True)
        if isinstance(grad_out, torch.Tensor) and isinstance(w, torch.Tensor):
            return 2.0 * _numel(grad_out.shape) * _numel(w.shape[1:]) * sum(map(bool, mask[:2]))
    if "scaled_dot_product" in name:
        q, k = _val(node.args[0]), _val(node.args[1])
        if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
            # the backward computes the scores again and three products: about 2.5 forwards
            return (10.0 if name.endswith("_backward") else 4.0) * _numel(q.shape) * int(k.shape[-2])
    return 0.0


def node_cost_ms(node: Node) -> float:
    """Estimated GPU time of one aten node: FLOPs or bytes over the device's ceilings, views free."""
    if node.op != "call_function" or _is_view(node):
        return 0.0
    moved = sum(t.numel() * t.element_size() for a in node.all_input_nodes for t in _tensor_vals(_val(a)))
    moved += sum(t.numel() * t.element_size() for t in _tensor_vals(_val(node)))
    flops = _flops(node)
    if flops:
        return HEAVY_MS + max(flops / PEAK_FLOPS, moved / PEAK_BYTES) * 1e3
    return FUSED_SHARE * moved / PEAK_BYTES * 1e3


def _is_barrier(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable) or node.is_impure()


def _units(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each compute node's unit, named by its anchor node (see the module's step 1)."""
    inside = set(nodes)
    anchor = {n: n for n in nodes}
    for n in nodes:  # a tuple's items go with the op that makes the tuple
        if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and n.args[0] in inside:
            anchor[n] = anchor[n.args[0]]
    for n in reversed(nodes):  # a free view goes with the one unit that uses it
        if anchor[n] is not n or not _is_view(n) or n.target is operator.getitem or _is_barrier(n):
            continue
        users = {anchor[u] for u in n.users if u in inside}
        if len(users) == 1 and len(n.users) == len(users) and all(u in inside for u in n.users):
            anchor[n] = next(iter(users))
    # a barrier keeps its order with the reads around it by graph order, which fusing across it
    # could change; barriers that only end the graph (AOTAutograd's copy_ into mutated inputs:
    # batch norm's running statistics in a training forward) leave the ops before them to fuse
    first = next((i for i, n in enumerate(nodes) if _is_barrier(n)), len(nodes))
    if all(_is_barrier(n) for n in nodes[first:]):
        _fuse_flopless(nodes[:first], anchor, set(nodes[:first]))
    return {n: _root(anchor, n) for n in nodes}


def _root(anchor: dict[torch.fx.Node, torch.fx.Node], n: torch.fx.Node) -> torch.fx.Node:
    while anchor[n] is not n:
        n = anchor[n]
    return n


def _fuse_flopless(nodes: list[torch.fx.Node], anchor: dict[torch.fx.Node, torch.fx.Node],
                   inside: set[torch.fx.Node]) -> None:
    """Ops with no FLOPs of their own (pointwise, reductions, pools) join a neighbour's unit.

    Inductor fuses them into the kernels around them, so on a stream of their own they would
    cost events and a kernel each and save nothing. An op whose activations all come from one
    unit joins it (an epilogue: BatchNorm's scale and shift, an activation); an op computed
    from the graph's inputs alone (BatchNorm's ``rsqrt(var + eps) * weight``: per-channel work
    on parameters) joins the one unit that reads it. Without this, every such chain is an
    independent branch, and a ResNet looks a hundred branches wide.
    """
    leaf: dict[torch.fx.Node, bool] = {}  # light work on the graph's inputs alone
    for n in nodes:
        leaf[n] = _flops(n) == 0 and all(a not in inside or leaf[a] for a in n.all_input_nodes)
    for n in nodes:  # forward: an epilogue goes with the unit that makes its activations
        if anchor[n] is not n or leaf[n] or _flops(n) > 0:
            continue
        sources = {_root(anchor, a) for a in n.all_input_nodes if a in inside and not leaf[a]}
        if len(sources) == 1:
            anchor[n] = sources.pop()
    for n in reversed(nodes):  # backward: work on the inputs alone goes with the unit that reads it
        if anchor[n] is not n or not leaf[n] or _flops(n) > 0:
            continue
        users = {_root(anchor, u) for u in n.users if u in inside}
        if len(users) == 1 and all(u in inside for u in n.users):
            anchor[n] = users.pop()


def _topological(roots: list[torch.fx.Node], preds: dict[torch.fx.Node, set[torch.fx.Node]]
                 ) -> list[torch.fx.Node]:
    """The units in an order their dependencies allow, graph order where they leave a choice (a
    unit may hold ops from before its anchor, so anchor order alone need not be topological)."""
    position = {r: i for i, r in enumerate(roots)}
    waiting = {r: len(preds[r]) for r in roots}
    users: dict[torch.fx.Node, list[torch.fx.Node]] = {r: [] for r in roots}
    for r in roots:
        for p in preds[r]:
            users[p].append(r)
    ready = [(position[r], r) for r in roots if waiting[r] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, r = heapq.heappop(ready)
        order.append(r)
        for u in users[r]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (position[u], u))
    if len(order) != len(roots):  # the fusions above never join a unit to one that depends on it
        raise AssertionError("the units of the graph form a cycle")
    return order


def plan_regions(gm: GraphModule, max_streams: int = 4, min_stream_share: float = 0.02,
                 model: CostModel | None = None) -> RegionPlan:
    """Cut ``gm`` into regions for at most ``max_streams`` streams (see the module docstring).

    ``model``: how concurrent regions share the device, for the estimate (:data:`REGION_MODEL`).
    """
    if max_streams < 1:
        raise ValueError(f"max_streams must be at least 1, got {max_streams}")
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    anchor = _units(nodes)
    roots = [n for n in nodes if anchor[n] is n]
    unit_preds: dict[torch.fx.Node, set[torch.fx.Node]] = {r: set() for r in roots}
    for n in nodes:
        unit_preds[anchor[n]].update(anchor[a] for a in n.all_input_nodes if a in anchor)
    for r in roots:
        unit_preds[r].discard(r)
    anchors = _topological(roots, unit_preds)
    index = {a: i for i, a in enumerate(anchors)}
    members: list[list[torch.fx.Node]] = [[] for _ in anchors]
    for n in nodes:
        members[index[anchor[n]]].append(n)
    costs = [sum(node_cost_ms(n) for n in m) for m in members]
    preds: list[set[int]] = [{index[p] for p in unit_preds[a]} for a in anchors]
    last_barrier = -1
    for u, group in enumerate(members):  # barriers follow all before them, precede all after them
        if any(_is_barrier(n) for n in group):
            preds[u].update(range(u))
            last_barrier = u
        elif last_barrier >= 0:
            preds[u].add(last_barrier)
    for u, ps in enumerate(preds):
        if any(p >= u for p in ps):  # units are numbered in a topological order: never expected
            raise AssertionError(f"unit {u} depends on a later unit: {sorted(ps)}")
    pred_lists = [sorted(p) for p in preds]
    sched = build_schedule(pred_lists, max_streams, costs)
    sched = _demote_light_streams(sched, costs, min_stream_share)
    regions, region_preds = _cut(sched, members, gm)
    one = sum(costs)
    # unit by unit (a unit's kernels share the device as kernels of that length do), with the waits
    # of the cut: a region ends where another stream waits, so these are the regions' waits
    estimate = simulate(sched, costs, model or REGION_MODEL) if sched.num_streams > 1 else one
    return RegionPlan(regions=tuple(regions), preds=tuple(tuple(p) for p in region_preds),
                      streams=sched.num_streams, width=sched.width, one_stream_ms=one,
                      estimate_ms=min(estimate, one))


def _demote_light_streams(sched: Schedule, costs: list[float], min_share: float) -> Schedule:
    """Move the ops of side streams that carry less than ``min_share`` of the work to stream 0."""
    total = sum(costs) or 1.0
    load = [0.0] * sched.num_streams
    for v, s in enumerate(sched.stream):
        load[s] += costs[v]
    keep = [s for s in range(sched.num_streams) if s == 0 or load[s] / total >= min_share]
    renumber = {s: i for i, s in enumerate(keep)}
    stream = [renumber.get(s, 0) for s in sched.stream]
    if stream == list(sched.stream):
        return sched
    order: list[list[int]] = [[] for _ in keep]
    for v, s in enumerate(stream):
        order[s].append(v)
    waits = plan_waits(sched.preds, stream, len(order))
    return replace(sched, stream=tuple(stream), order=tuple(tuple(o) for o in order),
                   waits=tuple(tuple(w) for w in waits))


def _cut(sched: Schedule, members: list[list[torch.fx.Node]], gm: torch.fx.GraphModule
         ) -> tuple[list[Region], list[list[int]]]:
    n = sched.num_ops
    succ_streams: list[set[int]] = [set() for _ in range(n)]
    for v, ps in enumerate(sched.preds):
        for u in ps:
            succ_streams[u].add(sched.stream[v])
    runs: list[list[int]] = []
    for ops in sched.order:
        run: list[int] = []
        for v in ops:
            waits_on_other = any(sched.stream[u] != sched.stream[v] for u in sched.preds[v])
            if run and waits_on_other:
                runs.append(run)
                run = []
            run.append(v)
            if succ_streams[v] - {sched.stream[v]}:
                runs.append(run)
                run = []
        if run:
            runs.append(run)
    runs.sort(key=lambda r: r[0])
    region_of_unit = {v: i for i, run in enumerate(runs) for v in run}
    position = {m: i for i, m in enumerate(gm.graph.nodes)}
    output_node = next(m for m in gm.graph.nodes if m.op == "output")
    regions: list[Region] = []
    region_preds: list[list[int]] = []
    for i, run in enumerate(runs):
        nodes = [m for v in run for m in members[v]]
        nodes.sort(key=position.__getitem__)
        inside = set(nodes)
        inputs: list[torch.fx.Node] = []
        for m in nodes:
            for a in m.all_input_nodes:
                if a not in inside and a.op != "get_attr" and a not in inputs:
                    inputs.append(a)
        outputs = [m for m in nodes if any(u not in inside or u is output_node for u in m.users)]
        # from the units' edges, not the values: a barrier follows units it reads nothing from
        preds = sorted({region_of_unit[u] for v in run for u in sched.preds[v]} - {i})
        regions.append(Region(index=i, nodes=tuple(nodes), stream=sched.stream[run[0]], inputs=tuple(inputs),
                              outputs=tuple(outputs), cost_ms=sum(node_cost_ms(m) for m in nodes)))
        region_preds.append(preds)
    return regions, region_preds

