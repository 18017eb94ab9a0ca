"""The key of a whole call's arguments: which captured graph, if any, a call may replay.

A whole-call graph (:mod:`.whole_call`) reads its inputs at fixed addresses
with the layouts of the call it captured, and Dynamo's guards held for that
call's tensors and values. A later call replays it only where its arguments
key the same: each tensor's shape, strides, dtype, device, ``requires_grad``
and inference-ness (a parameter passed as an argument also by its address,
since the graph reads it in place), each other argument's type and value, and
whether inference mode is on. The torch extension's ``whole_launch`` compares
a call with a captured one by the same rules in C++ (:mod:`.whole_replay`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["CONSTANTS", "call_key"]

#: non-tensor argument and output values a whole-call graph keeps as they are
CONSTANTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)


class _Unkeyable(Exception):
    pass


def _meta(a: Any) -> Any:
    t = type(a)
    if t is torch.Tensor:  # what Dynamo guards on (an inference tensor has other dispatch keys)
        return (a.shape, a.stride(), a.dtype, a.device, a.requires_grad, a.is_inference())
    if t is torch.nn.Parameter:  # read in place, like the module's own parameters
        return (a.shape, a.stride(), a.dtype, a.device, a.requires_grad, a.is_inference(), a.data_ptr())
    if t in CONSTANTS:
        return (t, a)
    raise _Unkeyable(t.__name__)


def call_key(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...] | str:
    """The key of a call's arguments (see the module docstring), or why the call has none."""
    try:
        key: tuple[Any, ...] = tuple(map(_meta, args))
        if kwargs:
            key += tuple((k, _meta(v)) for k, v in sorted(kwargs.items()))
    except _Unkeyable as exc:
        return (f"an argument is a {exc}: only tensors, numbers, strings and None are keyed "
                "(the call runs on Dynamo's path)")
    except RuntimeError as exc:  # a tensor without strides (sparse, nested)
        return f"an argument's layout has no key ({exc}): the call runs on Dynamo's path"
    return (*key, torch.is_inference_mode_enabled())
