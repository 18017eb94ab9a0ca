"""Fewer, larger kernels: independent ops of one kind and shape, run as one batched op.

A rewrite pass over an aten-level fx graph (pure graph surgery; it runs no
kernel):

1. **Matmuls and convolutions.** Mutually independent ``aten.mm`` nodes with equal shapes whose
   right operand is a constant become one ``aten.bmm``: the constants are
   stacked once, when the graph is built; the left operands are the same
   tensor (expanded, no copy), slices of one tensor in order (that tensor, no
   copy), or stacked. Each original result is a view of the batched one.
   Convolutions that read one input with one geometry become one convolution
   over concatenated filters (the 1x1 convolutions that open GoogLeNet's and
   Inception's branches); inference batch norms over all its channel slices
   become one batch norm over concatenated parameters.
2. **Elementwise ops.** The same unary op (relu, tanh, ...) applied to every
   slice of one batched result becomes one op on the whole batch; two-operand
   ops over slices (index for index, or with a shared operand) likewise.
   Last, the same unary op on independent tensors of any shapes becomes one
   of PyTorch's multi-tensor ``_foreach_`` kernels.
3. **Stacks of slices.** ``stack`` of all slices of one tensor, in order, is
   that tensor.

Repeated, these turn a wide graph of B branches into one chain of batched ops.
Stacked constants are checked before every call (:class:`StackedConstants`):
an in-place update or a new tensor behind a constant is copied into the stack,
in place, so results are never stale and captured graphs stay valid.
Inference tensors (made, moved or cast under ``torch.inference_mode()``) have
no version counter that in-place updates bump, so constants that are
inference tensors are never stacked; the report names how many were left.

This module holds the passes that stack constants (matmuls, convolutions, batch
norms) and the driver; ``batch_elementwise.py`` the passes over elementwise ops
and stacks; ``batch_graph.py`` the graph surgery they share.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx
from torch.fx import GraphModule, Node

from .batch_elementwise import _batch_binary, _batch_foreach, _batch_unary, _fold_stacks
from .batch_graph import (
    _channel_slices_of,
    _groups_by_key,
    _one_group_at_a_time,
    _record_and_erase,
    _slices_of,
    _split_channels,
    _stackable,
    _topological,
    _unbind,
    _val,
)

__all__ = ["BatchGroup", "BatchReport", "StackedConstants", "batch_independent_ops"]

aten = torch.ops.aten


@dataclass
class StackedConstants:
    """Stacked or concatenated copies of constants: for each, its parts, and what each copies.

    ``parts[i]`` is the view of the combined tensor that holds ``sources[i]``;
    the version counters and addresses the copies were taken at are kept per
    group, as lists, so that the check before every call is two list
    comparisons when nothing changed (the common case).
    """

    groups: list[tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[int]]] = field(
        default_factory=list)

    def add(self, parts: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        self.groups.append((parts, sources, [s._version for s in sources], [s.data_ptr() for s in sources]))

    def refresh(self) -> int:
        """Copy every source that changed since it was copied; returns how many were."""
        changed = 0
        for parts, sources, versions, ptrs in self.groups:
            if [s._version for s in sources] == versions and _same_addresses(sources, ptrs):
                continue
            for i, src in enumerate(sources):
                if src._version != versions[i] or src.data_ptr() != ptrs[i]:
                    parts[i].copy_(src)
                    versions[i], ptrs[i] = src._version, src.data_ptr()
                    changed += 1
        return changed


def _same_addresses(tensors: list[torch.Tensor], ptrs: list[int]) -> bool:
    check = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    if check is None:
        return [t.data_ptr() for t in tensors] == ptrs
    return check(tensors, ptrs, list(range(len(tensors))))


@dataclass(frozen=True)
class BatchGroup:
    """One group the pass rewrote: its kind, the nodes it replaced, and the nodes that now do the work.

    ``members`` are node names of the traced graph before the rewrite, so a
    group is known by the same key in every trace of one function; ``ops``
    are the new nodes that launch kernels (the batched op, and any stack of
    its inputs), whose measured times are the batched cost.
    """

    kind: str
    members: tuple[str, ...]
    ops: tuple[str, ...]

    @property
    def key(self) -> frozenset[str]:
        return frozenset(self.members)


@dataclass
class BatchReport:
    """The groups a pass made; ``only`` (keys of groups) limits it to those groups when set."""

    groups: list[BatchGroup] = field(default_factory=list)
    only: frozenset[frozenset[str]] | None = None
    inference_constants: set[str] = field(default_factory=set)  # left unbatched: no version counter

    def admits(self, members: list[Node]) -> bool:
        return self.only is None or frozenset(m.name for m in members) in self.only

    def add(self, kind: str, members: list[Node], ops: list[Node]) -> None:
        self.groups.append(BatchGroup(kind, tuple(m.name for m in members), tuple(o.name for o in ops)))

    def __str__(self) -> str:
        kinds: dict[str, list[int]] = {}
        for g in self.groups:
            kinds.setdefault(g.kind, []).append(len(g.members))
        parts = [f"{len(sizes)} x {kind} (sizes {sorted(set(sizes))})" for kind, sizes in kinds.items()]
        text = "batching: " + (", ".join(parts) or "no groups")
        if self.inference_constants:
            text += (f"; {len(self.inference_constants)} weights left out: they are inference tensors "
                     "(made, moved or cast under torch.inference_mode()), whose in-place updates "
                     "cannot be seen in a stacked copy; make or move the model under torch.no_grad() "
                     "to batch them")
        return text


def _matmul_key(gm: torch.fx.GraphModule, report: BatchReport, n: torch.fx.Node) -> tuple | None:
    if n.target is aten.mm.default and n.args[1].op == "get_attr" and _stackable(gm, report, n.args[1]):
        a, b = _val(n.args[0]), _val(n.args[1])
        if a is not None and b is not None:
            return (tuple(a.shape), tuple(b.shape), a.dtype, b.dtype, str(a.device))
    return None


def _batch_matmuls(gm: torch.fx.GraphModule, constants: StackedConstants, report: BatchReport) -> bool:
    return _one_group_at_a_time(gm, report, lambda n: _matmul_key(gm, report, n),
                                lambda members, index: _merge_matmuls(gm, constants, report, members, index))


def _merge_matmuls(gm: torch.fx.GraphModule, constants: StackedConstants, report: BatchReport,
                   members: list[torch.fx.Node], index: dict[torch.fx.Node, int]) -> None:
    graph = gm.graph
    k = len(members)
    lefts = [m.args[0] for m in members]
    sources = [getattr(gm, m.args[1].target) for m in members]
    stack = torch.stack(sources).contiguous()
    last = max(members, key=index.__getitem__)
    weights = _constant(gm, constants, stack, list(stack.unbind(0)), sources, last)
    base = _slices_of(lefts)
    with graph.inserting_after(weights):
        if base is not None:
            left = base
        elif all(a is lefts[0] for a in lefts):
            shape = list(_val(lefts[0]).shape)
            left = graph.call_function(aten.expand.default, (
                graph.call_function(aten.unsqueeze.default, (lefts[0], 0)), [k, *shape]))
        else:
            left = graph.call_function(aten.stack.default, (lefts, 0))
    with graph.inserting_after(left if left is not base else weights):
        batched = graph.call_function(aten.bmm.default, (left, weights))
    _unbind(graph, batched, members)
    stacked_left = [left] if left is not base and left.target is aten.stack.default else []
    _record_and_erase(graph, report, "matmul", members, [batched, *stacked_left])


def _constant(gm: torch.fx.GraphModule, constants: StackedConstants, value: torch.Tensor,
              parts: list[torch.Tensor], sources: list[torch.Tensor], after: torch.fx.Node) -> torch.fx.Node:
    """Register a combined constant on ``gm``; its get_attr node goes after ``after``."""
    name = f"_streamdag_const_{len(constants.groups)}"
    gm.register_buffer(name, value, persistent=False)
    constants.add(parts, sources)
    with gm.graph.inserting_after(after):
        node = gm.graph.get_attr(name)
    node.meta["val"] = value
    return node


def _conv_key(gm: torch.fx.GraphModule, report: BatchReport, n: torch.fx.Node) -> tuple | None:
    if n.target is not aten.convolution.default:
        return None
    x, w, b, stride, padding, dilation, transposed, _, groups = n.args
    if transposed or groups != 1 or w.op != "get_attr" or (b is not None and b.op != "get_attr"):
        return None
    if not _stackable(gm, report, w, b):
        return None
    wv = getattr(gm, w.target)
    return (x, tuple(wv.shape[1:]), tuple(stride), tuple(padding), tuple(dilation), b is None, wv.dtype)


def _batch_convs(gm: torch.fx.GraphModule, constants: StackedConstants, report: BatchReport) -> bool:
    """Convolutions reading one input with one geometry: one convolution over concatenated filters."""
    graph = gm.graph
    groups, index = _groups_by_key(gm, report, lambda n: _conv_key(gm, report, n))
    changed = False
    for members in groups:
        last = max(members, key=index.__getitem__)
        ws = [getattr(gm, m.args[1].target) for m in members]
        widths = [int(w.shape[0]) for w in ws]
        cat_w = torch.cat(ws).contiguous()
        weights = _constant(gm, constants, cat_w, list(cat_w.split(widths)), ws, last)
        bias = None
        if members[0].args[2] is not None:
            bs = [getattr(gm, m.args[2].target) for m in members]
            cat_b = torch.cat(bs).contiguous()
            bias = _constant(gm, constants, cat_b, list(cat_b.split(widths)), bs, weights)
        x, _, _, *geometry = members[0].args
        with graph.inserting_after(bias or weights):
            conv = graph.call_function(aten.convolution.default, (x, weights, bias, *geometry))
        _split_channels(graph, conv, members, widths)
        _record_and_erase(graph, report, "convolution", members, [conv])
        changed = True
    return changed


#: Batch norms grouped: argument layout (input, weight, bias, running mean, running var,
#: training, momentum, eps), normalized input as output 0. ``cudnn_batch_norm`` (what GPU traces
#: hold) has the same layout, but grouping it makes GoogLeNet's batched variant 13% slower
#: (bench/results/models_NVIDIA_H100_80GB_HBM3_cudnn_bn_grouped.json), so it is left alone.
_BATCH_NORMS = (aten.native_batch_norm.default,)


def _batch_norms(gm: torch.fx.GraphModule, constants: StackedConstants, report: BatchReport) -> bool:
    """Inference batch norms over all the channel slices of one tensor: one batch norm."""
    graph = gm.graph
    by_base: dict[tuple, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if n.target not in _BATCH_NORMS or n.args[5]:  # training
            continue
        x, *params = n.args[:5]
        if not all(isinstance(p, torch.fx.Node) and p.op == "get_attr" for p in params):
            continue
        if not _stackable(gm, report, *params):
            continue
        if any(u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in n.users):
            continue
        if isinstance(x, torch.fx.Node) and x.target is aten.slice.Tensor:
            by_base.setdefault((x.args[0], n.target, n.args[6], n.args[7]), []).append(n)
    changed = False
    position = {n: i for i, n in enumerate(graph.nodes)}
    for (_, target, momentum, eps), members in by_base.items():
        members.sort(key=lambda m: m.args[0].args[2])
        base = _channel_slices_of([m.args[0] for m in members])
        if base is None or len(members) < 2 or not report.admits(members):
            continue
        after = max(members, key=position.__getitem__)
        combined = []
        for p in range(1, 5):
            srcs = [getattr(gm, m.args[p].target) for m in members]
            cat = torch.cat(srcs).contiguous()
            node = _constant(gm, constants, cat, list(cat.split([len(t) for t in srcs])), srcs, after)
            combined.append(node)
            after = node
        widths = [int(getattr(gm, m.args[1].target).shape[0]) for m in members]
        with graph.inserting_after(after):
            bn = graph.call_function(target, (base, *combined, False, momentum, eps))
        with graph.inserting_after(bn):
            out = graph.call_function(operator.getitem, (bn, 0))
        outs = [next(u for u in m.users if u.args[1] == 0) for m in members]
        _split_channels(graph, out, outs, widths)
        for m in members:  # the getitems of its outputs go first
            for u in list(m.users):
                graph.erase_node(u)
        _record_and_erase(graph, report, "batch_norm", members, [bn])
        changed = True
    return changed


def batch_independent_ops(
    gm: GraphModule, only: Iterable[frozenset[str]] | None = None,
) -> tuple[GraphModule, StackedConstants, BatchReport]:
    """Rewrite ``gm`` in place; returns it with the stacked constants and what was grouped.

    ``only``: keys (:attr:`BatchGroup.key`) of the groups to make; others stay as they are.
    """
    constants = StackedConstants()
    report = BatchReport(only=None if only is None else frozenset(only))
    passes = [
        lambda: _batch_matmuls(gm, constants, report),
        lambda: _batch_convs(gm, constants, report),
        lambda: _batch_norms(gm, constants, report),
        lambda: _batch_unary(gm, report),
        lambda: _batch_binary(gm, report),
        lambda: _fold_stacks(gm),
    ]
    for _ in range(64):  # each round batches one more layer of a wide graph
        changed = False
        for rewrite in passes:
            if rewrite():  # new nodes sit after the last member: restore a topological order
                gm.graph = _topological(gm.graph)
                changed = True
        gm.graph.eliminate_dead_code()
        if not changed:
            break
    if _batch_foreach(gm, report):
        gm.graph = _topological(gm.graph)
    # a stack made for one group may have been folded away by a later one: it costs nothing
    present = {n.name for n in gm.graph.nodes}
    report.groups = [BatchGroup(g.kind, g.members, tuple(o for o in g.ops if o in present))
                     for g in report.groups]
    gm.recompile()
    return gm, constants, report
