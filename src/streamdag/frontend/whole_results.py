"""A whole call's result taken apart for its replays (:mod:`.whole_call` captures, :mod:`.whole_replay`
replays): its distinct output tensors, the structure and the other leaves around them, the objects
rebuilt around fresh tensors at each replay, or why a replay cannot return it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .call_key import CONSTANTS
from .result_objects import Template, template
from .unflatten import unflattener
from .whole_replay import copy_plan

__all__ = ["ResultParts", "output_refusal", "result_parts"]


@dataclass
class ResultParts:
    """A call's result taken apart for replays (see :func:`result_parts`)."""

    spec: Any  # the result's structure
    outputs: list[torch.Tensor]  # its distinct tensors, those inside objects too
    leaves: list[Any]  # its leaves, with None where a tensor or an object goes
    slots: list[int]  # for each leaf, its output (-1: none)
    objects: list[tuple[int, Template]]  # the leaves that are objects, rebuilt at each replay
    copied: list[torch.Tensor] | None = None  # where outputs share memory: see whole_replay.copy_plan
    views: list[Any] | None = None
    unflatten: Any = None  # the structure's rebuild around the leaves (.unflatten.unflattener)


def result_parts(out: Any, device: torch.device, statics: list[torch.Tensor],
                 held: list[torch.Tensor]) -> ResultParts | str:
    """A call's result taken apart for replays, or why its outputs cannot come from a replay."""
    leaves, spec = pytree.tree_flatten(out)
    outputs: list[torch.Tensor] = []
    slot_of: dict[int, int] = {}

    def slot(t: torch.Tensor) -> int:
        if slot_of.setdefault(id(t), len(outputs)) == len(outputs):
            outputs.append(t)
        return slot_of[id(t)]

    slots, kept, objects = [], [], []
    for pos, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            slots.append(slot(leaf))
            kept.append(None)
            continue
        slots.append(-1)
        kept.append(leaf if isinstance(leaf, CONSTANTS) else None)
        if isinstance(leaf, CONSTANTS):
            continue
        tpl = template(leaf, slot)
        if isinstance(tpl, str):
            hf = any(c.__name__ == "Cache" and c.__module__.startswith("transformers")
                     for c in type(leaf).__mro__)
            return (f"the result holds a {type(leaf).__name__} that holds {tpl}: whole-call graphs return "
                    "tensors, numbers, strings and None in tuples, lists, dicts, the containers "
                    "torch.utils._pytree knows and plain objects of them"
                    + ("; a Hugging Face model's KV cache: call it with use_cache=False, or generate with "
                       "streamdag.decoder" if hf else ""))
        objects.append((pos, tpl))
    reason = output_refusal(outputs, device, statics, held)
    if reason:
        return reason
    plan = copy_plan(outputs)
    if isinstance(plan, str):
        return plan
    return ResultParts(spec, outputs, kept, slots, objects, *plan, unflattener(spec, out))


def output_refusal(outputs: list[torch.Tensor], device: torch.device, statics: list[torch.Tensor],
                    held: list[torch.Tensor]) -> str:
    """Why these output tensors cannot come from a replay ('' where they can)."""
    inputs = {s.untyped_storage().data_ptr() for s in statics} - {0}  # 0: no memory (no elements)
    kept = {t.untyped_storage().data_ptr() for t in held if t.device == device} - {0}
    for leaf in outputs:
        if leaf.layout != torch.strided:
            return f"an output is a {leaf.layout} tensor"
        if leaf.device != device:
            return f"an output is on {leaf.device}, not on {device}"
        if type(leaf) not in (torch.Tensor, torch.nn.Parameter):
            return f"an output is a {type(leaf).__name__}, a tensor subclass"
        ptr = leaf.untyped_storage().data_ptr()
        if ptr in inputs:
            return "an output is an input or a view of one: the caller's tensor, not a copy, is returned"
        if ptr in kept:
            return "an output is a parameter or buffer or a view of one: the module's tensor is returned"
    return ""
