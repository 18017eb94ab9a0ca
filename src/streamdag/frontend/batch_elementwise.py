"""The batching passes over ops without weights: elementwise ops over slices of one tensor,
multi-tensor ``_foreach_`` kernels over independent tensors, and stacks of slices folded away.
Rewrites of an fx graph (see ``batching.py`` for the whole pass); no state."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from .batch_graph import (
    _channel_slices_of,
    _one_group_at_a_time,
    _op_name,
    _record_and_erase,
    _replace_by_items,
    _slice_range_of,
    _slices_of,
    _split_channels,
    _unbind,
    _val,
)

if TYPE_CHECKING:
    from .batching import BatchReport

aten = torch.ops.aten


_UNARY = {aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default,
          aten.gelu.default, aten.neg.default, aten.exp.default}


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
