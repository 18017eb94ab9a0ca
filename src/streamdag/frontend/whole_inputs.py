"""A whole call's tensor arguments copied into tensors of its graph's own (:mod:`.whole_call`).

A captured graph reads its inputs where they lay at the capture, so each call's
tensors are copied into tensors the graph owns, of the same layouts; an
argument that is not strided, or whose elements overlap in memory (an
expanded tensor), cannot be copied into one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .whole_replay import empty_like_input, fill_tensors

__all__ = ["StaticInputs", "overlaps", "static_inputs"]


class StaticInputs(NamedTuple):
    """A call's tensors copied into tensors of the graph's own, and the arguments with them in place."""

    arg_index: list[int]  # where the copied tensors are among the positional arguments
    kw_names: list[str]  # and among the keyword arguments, after them
    tensors: list[torch.Tensor]  # the caller's
    statics: list[torch.Tensor]  # the graph's, holding the caller's values
    args: list[Any]
    kwargs: dict[str, Any]


def static_inputs(args: Sequence[Any], kwargs: dict[str, Any]) -> StaticInputs | str:
    """The call's tensors copied into tensors of the graph's own, or why they cannot be."""
    arg_index = [i for i, a in enumerate(args) if type(a) is torch.Tensor]
    kw_names = [k for k, v in kwargs.items() if type(v) is torch.Tensor]
    tensors = [args[i] for i in arg_index] + [kwargs[k] for k in kw_names]
    other = next((t.layout for t in tensors if t.layout != torch.strided), None)
    if other is not None:
        return f"an argument is a {other} tensor: only strided ones are copied into a graph"
    if any(map(overlaps, tensors)):
        return "an input's elements overlap in memory (an expanded tensor): not copied into a graph's input"
    statics = [empty_like_input(t) for t in tensors]
    fill_tensors(statics, tensors)
    s_args, s_kwargs = list(args), dict(kwargs)
    for s, i in zip(statics, arg_index):
        s_args[i] = s
    for s, k in zip(statics[len(arg_index):], kw_names):
        s_kwargs[k] = s
    return StaticInputs(arg_index, kw_names, tensors, statics, s_args, s_kwargs)


def overlaps(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements share memory (an expanded tensor): nothing can be copied into it."""
    extent = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride < extent:
            return True
        extent += (size - 1) * stride
    return False
