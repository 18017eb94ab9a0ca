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
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

__all__ = ["BatchGroup", "BatchReport", "StackedConstants", "batch_independent_ops"]

aten = torch.ops.aten

_UNARY = {aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default,
          aten.gelu.default, aten.neg.default, aten.exp.default}


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

    def admits(self, members: list[torch.fx.Node]) -> bool:
        return self.only is None or frozenset(m.name for m in members) in self.only

    def add(self, kind: str, members: list[torch.fx.Node], ops: list[torch.fx.Node]) -> None:
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


def _stackable(gm: torch.fx.GraphModule, report: BatchReport, *nodes: Any) -> bool:
    """Whether the constants behind these get_attr nodes can be stacked (None: no constant)."""
    ok = True
    for node in nodes:
        if node is not None and getattr(gm, node.target).is_inference():
            report.inference_constants.add(node.target)
            ok = False
    return ok


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _descendants(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, int]:
    """Bit set of the nodes reachable from each node (bits by position in ``nodes``)."""
    index = {n: i for i, n in enumerate(nodes)}
    reach: dict[torch.fx.Node, int] = {}
    for n in reversed(nodes):
        bits = 0
        for user in n.users:
            if user in index:
                bits |= reach[user] | (1 << index[user])
        reach[n] = bits
    return reach


def _independent_groups(candidates: list[torch.fx.Node], reach: dict, index: dict) -> list[list]:
    """Greedy groups of candidates with no path between any two of them."""
    groups: list[tuple[list[torch.fx.Node], int, int]] = []  # members, their bits, their reach
    for n in candidates:
        bit = 1 << index[n]
        for g in groups:
            members, bits, reached = g
            if not (reached & bit) and not (reach[n] & bits):
                members.append(n)
                groups[groups.index(g)] = (members, bits | bit, reached | reach[n])
                break
        else:
            groups.append(([n], bit, reach[n]))
    return [members for members, _, _ in groups if len(members) > 1]


def _slices_of(args: list[Any]) -> torch.fx.Node | None:
    """The tensor whose ``unbind`` slices ``args`` are, all of them and in order; else None."""
    found = _slice_range_of(args)
    if found is None or found[1:] != (0, 1) or len(_val(args[0].args[0]) or ()) != len(args):
        return None
    return found[0]


def _slice_range_of(args: list[Any]) -> tuple[torch.fx.Node, int, int] | None:
    """``(tensor, k, step)`` when ``args`` are its ``unbind`` slices ``k, k+step, ...``; else None."""
    if not args or not all(isinstance(a, torch.fx.Node) and a.target is operator.getitem for a in args):
        return None
    source = args[0].args[0]
    if not (isinstance(source, torch.fx.Node) and source.target is aten.unbind.int
            and (len(source.args) < 2 or source.args[1] == 0)):
        return None
    k = args[0].args[1]
    step = args[1].args[1] - k if len(args) > 1 else 1
    if step < 1 or [a.args[0] for a in args] != [source] * len(args) or \
            [a.args[1] for a in args] != list(range(k, k + step * len(args), step)):
        return None
    return source.args[0], k, step


def _unbind(graph: torch.fx.Graph, batched: torch.fx.Node, members: list[torch.fx.Node]) -> None:
    """Replace each member's uses by its slice of ``batched``."""
    with graph.inserting_after(batched):
        parts = graph.call_function(aten.unbind.int, (batched, 0))
    _replace_by_items(graph, parts, members)


def _replace_by_items(graph: torch.fx.Graph, listing: torch.fx.Node, members: list[torch.fx.Node]) -> None:
    """Replace member ``i``'s uses by item ``i`` of ``listing`` (a node whose value is a list)."""
    listing.meta["val"] = [_val(m) for m in members]
    previous = listing
    for i, member in enumerate(members):
        with graph.inserting_after(previous):
            piece = graph.call_function(operator.getitem, (listing, i))
        piece.meta["val"] = _val(member)
        member.replace_all_uses_with(piece)
        previous = piece


def _groups_by_key(gm: torch.fx.GraphModule, report: BatchReport, key_of: Any
                   ) -> tuple[list[list[torch.fx.Node]], dict[torch.fx.Node, int]]:
    """Groups of mutually independent nodes with one ``key_of(node)`` (None: not a candidate)
    that the report admits, and every node's position."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    reach = _descendants(nodes)
    by_key: dict[Any, list[torch.fx.Node]] = {}
    for n in nodes:
        key = key_of(n)
        if key is not None:
            by_key.setdefault(key, []).append(n)
    groups = [g for cands in by_key.values() for g in _independent_groups(cands, reach, index)]
    return [g for g in groups if report.admits(g)], index


def _matmul_key(gm: torch.fx.GraphModule, report: BatchReport, n: torch.fx.Node) -> tuple | None:
    if n.target is aten.mm.default and n.args[1].op == "get_attr" and _stackable(gm, report, n.args[1]):
        a, b = _val(n.args[0]), _val(n.args[1])
        if a is not None and b is not None:
            return (tuple(a.shape), tuple(b.shape), a.dtype, b.dtype, str(a.device))
    return None


def _one_group_at_a_time(gm: torch.fx.GraphModule, report: BatchReport, key_of: Any, rewrite: Any) -> bool:
    """Rewrite groups one by one, finding them again after each.

    Groups whose members read arbitrary inputs cannot all be merged at once:
    with a member of each feeding the other's inputs, two groups are each
    independent, but merged they would wait on each other (a cycle).
    """
    changed = False
    for _ in range(len(gm.graph.nodes)):  # every rewrite removes at least two candidates
        groups, index = _groups_by_key(gm, report, key_of)
        if not groups:
            break
        rewrite(groups[0], index)
        gm.graph = _topological(gm.graph)
        changed = True
    return changed


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


def _record_and_erase(graph: torch.fx.Graph, report: BatchReport, kind: str, members: list[torch.fx.Node],
                      ops: list[torch.fx.Node]) -> None:
    """The group is rewritten: report it, then drop its members (their uses are replaced)."""
    report.add(kind, members, ops)
    for m in members:
        graph.erase_node(m)


def _op_name(target: Any) -> str:
    return str(target).split(".")[1]  # aten.relu.default -> relu


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


def _channels(node: torch.fx.Node) -> int | None:
    if "channels" in node.meta:
        return node.meta["channels"]
    val = _val(node)
    return int(val.shape[1]) if val is not None and val.dim() > 1 else None


def _channel_slices_of(args: list[Any]) -> torch.fx.Node | None:
    """The tensor that ``args`` slice along dim 1, all of it and in order; else None."""
    if not args or not all(isinstance(a, torch.fx.Node) and a.target is aten.slice.Tensor
                           and len(a.args) == 4 and a.args[1] == 1 for a in args):
        return None
    base = args[0].args[0]
    end = 0
    for a in args:
        if a.args[0] is not base or a.args[2] != end:
            return None
        end = a.args[3]
    return base if end == _channels(base) else None


def _split_channels(graph: torch.fx.Graph, combined: torch.fx.Node, members: list[torch.fx.Node],
                    widths: list[int]) -> None:
    """Replace each member's uses by its channel slice of ``combined``."""
    combined.meta["channels"] = sum(widths)
    start, previous = 0, combined
    for member, width in zip(members, widths):
        with graph.inserting_after(previous):
            piece = graph.call_function(aten.slice.Tensor, (combined, 1, start, start + width))
        piece.meta["val"] = _val(member)
        member.replace_all_uses_with(piece)
        start, previous = start + width, piece


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
#: hold) has the same layout, but grouping it made GoogLeNet's batched variant 13% slower on the
#: H100 (bench/results/models_NVIDIA_H100_80GB_HBM3_cudnn_bn_grouped.json), so it is left alone.
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


def _batch_unary(gm: torch.fx.GraphModule, report: BatchReport) -> bool:
    """The same unary op on every slice of one tensor (by ``unbind`` or along channels): one op."""
    graph = gm.graph
    by_source: dict[tuple, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if (n.target in _UNARY or n.target is aten.relu_.default) and len(n.args) == 1 and not n.kwargs:
            arg = n.args[0]
            if isinstance(arg, torch.fx.Node) and arg.target in (operator.getitem, aten.slice.Tensor):
                by_source.setdefault((n.target, arg.target, arg.args[0]), []).append(n)
    changed = False
    position = {n: i for i, n in enumerate(graph.nodes)}
    for (target, kind, _), members in by_source.items():
        channels = kind is aten.slice.Tensor
        members.sort(key=lambda m: m.args[0].args[2] if channels else m.args[0].args[1])
        args = [m.args[0] for m in members]
        base = _channel_slices_of(args) if channels else _slices_of(args)
        if base is None or len(members) < 2 or not report.admits(members):
            continue
        with graph.inserting_after(max(members, key=position.__getitem__)):
            whole = graph.call_function(target, (base,))
        if channels:
            _split_channels(graph, whole, members, [a.args[3] - a.args[2] for a in args])
        else:
            _unbind(graph, whole, members)
        _record_and_erase(graph, report, _op_name(target), members, [whole])
        changed = True
    return changed


_BINARY = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.maximum.default,
           aten.minimum.default}


def _batch_binary(gm: torch.fx.GraphModule, report: BatchReport) -> bool:
    """The same two-operand op on consecutive ``unbind`` slices of one tensor, with consecutive
    slices of another (or the same) tensor index for index, or with one value shared by all:
    one op over the two ranges (broadcasting the shared value)."""
    graph = gm.graph
    by_key: dict[tuple, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if n.target not in _BINARY or len(n.args) != 2 or n.kwargs:
            continue
        a, b = n.args
        if not (isinstance(a, torch.fx.Node) and a.target is operator.getitem):
            continue
        if isinstance(b, torch.fx.Node) and b.target is operator.getitem:
            other: Any = ("slices", b.args[0], b.args[1] - a.args[1])  # pairs at one offset
        elif isinstance(b, torch.fx.Node) and b.op == "get_attr":  # tracing lifts a constant per use
            other = ("shared", id(getattr(gm, b.target)), 0)
        elif isinstance(b, torch.fx.Node | int | float):
            other = ("shared", b, 0)
        else:
            continue
        by_key.setdefault((n.target, a.args[0], other), []).append(n)
    changed = False
    position = {n: i for i, n in enumerate(graph.nodes)}
    for (target, _, (kind, _, _)), members in by_key.items():
        members.sort(key=lambda m: m.args[0].args[1])
        b_source = members[0].args[1]
        range_a = _slice_range_of([m.args[0] for m in members])
        if range_a is None or len(members) < 2 or not report.admits(members):
            continue
        # every result has the shape of its left slice: no operand broadcasts a slice up
        piece, result = _val(members[0].args[0]), _val(members[0])
        if piece is None or result is None or tuple(result.shape) != tuple(piece.shape):
            continue
        if kind == "slices":
            range_b = _slice_range_of([m.args[1] for m in members])
            right = _val(members[0].args[1])
            if range_b is None or right is None or tuple(right.shape) != tuple(piece.shape):
                continue
        elif isinstance(b_source, torch.fx.Node):  # broadcast over the stacked dimension
            shared = _val(b_source) if b_source.op != "get_attr" else getattr(gm, b_source.target)
            if shared is None or shared.dim() > piece.dim():
                continue
        after = max(members, key=position.__getitem__)
        operands = []
        for source, k, step in ([range_a, range_b] if kind == "slices" else [range_a]):
            with graph.inserting_after(after):
                after = graph.call_function(aten.slice.Tensor,
                                            (source, 0, k, k + step * (len(members) - 1) + 1, step))
            operands.append(after)
        if kind == "shared":
            operands.append(b_source)
        with graph.inserting_after(after):
            whole = graph.call_function(target, tuple(operands))
        _unbind(graph, whole, members)
        _record_and_erase(graph, report, _op_name(target), members, [whole])
        changed = True
    return changed


#: unary op -> its multi-tensor form (one kernel over a list of tensors) and extra arguments
_FOREACH = {
    aten.relu.default: (aten._foreach_clamp_min.Scalar, (0.0,)),  # NaN stays NaN in both
    aten.tanh.default: (aten._foreach_tanh.default, ()),
    aten.sigmoid.default: (aten._foreach_sigmoid.default, ()),
    aten.exp.default: (aten._foreach_exp.default, ()),
    aten.neg.default: (aten._foreach_neg.default, ()),
}


def _foreach_key(n: torch.fx.Node) -> tuple | None:
    if n.target not in _FOREACH or len(n.args) != 1 or n.kwargs:
        return None
    val = _val(n.args[0])
    if val is None or not val.is_floating_point():
        return None
    return (n.target, val.dtype, str(val.device))


def _batch_foreach(gm: torch.fx.GraphModule, report: BatchReport) -> bool:
    """The same unary op on independent tensors that are not slices of one: one multi-tensor kernel.

    Runs once the other passes are done, so that ops they could batch over
    one tensor (cheaper still) go to them first. Shapes may differ.
    """
    return _one_group_at_a_time(gm, report, _foreach_key,
                                lambda members, index: _merge_foreach(gm.graph, report, members, index))


def _merge_foreach(graph: torch.fx.Graph, report: BatchReport, members: list[torch.fx.Node],
                   index: dict[torch.fx.Node, int]) -> None:
    target = members[0].target
    foreach, extra = _FOREACH[target]
    with graph.inserting_after(max(members, key=index.__getitem__)):
        whole = graph.call_function(foreach, ([m.args[0] for m in members], *extra))
    _replace_by_items(graph, whole, members)
    _record_and_erase(graph, report, "foreach " + _op_name(target), members, [whole])


def _fold_stacks(gm: torch.fx.GraphModule) -> bool:
    changed = False
    for n in list(gm.graph.nodes):
        if n.target is aten.stack.default and (len(n.args) < 2 or n.args[1] == 0):
            base = _slices_of(list(n.args[0]))
            if base is not None:
                n.replace_all_uses_with(base)
                gm.graph.erase_node(n)
                changed = True
    return changed


def _topological(graph: torch.fx.Graph) -> torch.fx.Graph:
    """The same graph with its nodes in an order where every input comes first."""
    placed: set[torch.fx.Node] = set()
    order: list[torch.fx.Node] = []

    def inputs(n: torch.fx.Node) -> Iterable[torch.fx.Node]:
        found: list[torch.fx.Node] = []
        torch.fx.node.map_arg((n.args, n.kwargs), found.append)
        return found

    open_: set[torch.fx.Node] = set()  # expanded, inputs not all placed yet
    for root in graph.nodes:
        stack = [(root, False)]
        while stack:
            n, expanded = stack.pop()
            if n in placed:
                continue
            if expanded:
                placed.add(n)
                open_.discard(n)
                order.append(n)
                continue
            if n in open_:
                raise RuntimeError(f"batching made a cycle through {n.name!r}: this is a streamdag bug; "
                                   "pass batch=False to streamdag.compile meanwhile")
            open_.add(n)
            stack.append((n, True))
            stack.extend((i, False) for i in inputs(n) if i not in placed)
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in order:
        env[n] = new.node_copy(n, lambda x: env[x])
    return new


def batch_independent_ops(
    gm: torch.fx.GraphModule, only: Iterable[frozenset[str]] | None = None,
) -> tuple[torch.fx.GraphModule, StackedConstants, BatchReport]:
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
