"""Masked writes made selects: ``x[mask] = value`` as ``x.copy_(torch.where(mask, value, x))``.

A write through a boolean mask (speech models mask their features so; ``x[x < 0] = 0`` is the
everyday form) is an ``index_put`` whose backward gathers by the mask: an operator whose output
shape depends on the data. AOTAutograd cannot trace that backward, so under ``torch.compile``
the whole frame runs eagerly in training; and on a GPU the forward finds the mask's positions
with a synchronizing ``nonzero``, which no CUDA graph can capture. Where the value is the same
for every selected position (a number, or a tensor that broadcasts over one position's trailing
dimensions), the write is a select with static shapes, forward and backward: every position
takes ``value`` where the mask is set and keeps its own elsewhere, and the gradients are the
same (the value's is the sum over the selected positions, ``x``'s is zero there).

The rewrite is made on Dynamo's graph, before AOTAutograd, and only where the example values
prove it exact: the index is one boolean tensor over ``x``'s leading dimensions, ``value`` is a
number or a tensor that broadcasts to ``x.shape[mask.dim():]``, and no shape is symbolic. A value
with one row per selected position (its length depends on the data) is left as it is, and so is a
row of another dtype than ``x``'s (the write raises on it); a number or a zero-dimensional value
is converted to ``x``'s dtype first, as the write converts it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx

__all__ = ["rewrite_masked_writes"]


def _example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else node


def _broadcasts(value: torch.Tensor, shape: torch.Size) -> bool:
    if value.dim() > len(shape):
        return False
    return all(v == 1 or v == s for v, s in zip(reversed(value.shape), reversed(shape)))


def _select_form(target: Any, index: Any, value: Any) -> int | None:
    """The number of trailing dimensions of ``target`` a mask write leaves whole, where the write
    ``target[index] = value`` is a select (see the module docstring); None where it is not."""
    if not (isinstance(target, torch.Tensor) and isinstance(index, torch.Tensor)):
        return None
    tensors = [t for t in (target, index, value) if isinstance(t, torch.Tensor)]
    if not all(type(d) is int for t in tensors for d in t.shape):
        return None  # symbolic shapes: their comparisons would add guards
    if index.dtype is not torch.bool or index.dim() == 0 or index.dim() > target.dim():
        return None
    if tuple(index.shape) != tuple(target.shape[:index.dim()]) or index.device != target.device:
        return None
    trailing = target.shape[index.dim():]
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 and (value.device != target.device or value.dtype != target.dtype):
            return None  # (a row of another dtype: the write as written raises, and so it stays)
        return target.dim() - index.dim() if _broadcasts(value, trailing) else None
    if isinstance(value, (bool, int, float)):
        return target.dim() - index.dim()
    return None


def rewrite_masked_writes(gm: torch.fx.GraphModule) -> int:
    """Rewrite each mask write of Dynamo's graph ``gm`` that is a select (in place); how many."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not operator.setitem or len(node.args) != 3:
            continue
        target, index, value = node.args
        trailing = _select_form(_example(target), _example(index), _example(value))
        if trailing is None or node.users:
            continue
        with gm.graph.inserting_before(node):
            mask = index
            if trailing:  # a size-1 dimension for each one the mask leaves whole
                mask = gm.graph.call_function(operator.getitem, (index, (Ellipsis, *[None] * trailing)))
            # a number or a zero-dimensional value in the target's dtype first, as the write converts
            # it: ``where`` would promote both to a common dtype, and an int64 target's values past
            # 2**24 would come back rounded through float32 where the value is a float
            target_dtype = _example(target).dtype
            example = _example(value)
            if isinstance(example, torch.Tensor):
                if example.dtype != target_dtype:
                    value = gm.graph.call_method("to", (value, target_dtype))
            elif torch.result_type(_example(target), example) != target_dtype:
                value = gm.graph.call_method("new_full", (target, (), value))
            selected = gm.graph.call_function(torch.where, (mask, value, target))
            gm.graph.call_method("copy_", (target, selected))
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.graph.lint()
        gm.recompile()
    return rewritten
