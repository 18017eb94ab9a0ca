"""Gradients a backward under Inductor's CUDA graph trees hands out of the trees' pool, and how a
``.grad`` still holding one when the next step begins is given memory of its own.

Autograd keeps a gradient it is handed as the parameter's ``.grad`` where the parameter has none
(``optimizer.zero_grad()`` sets it to None): a backward under the trees hands it a tensor of the
trees' pool, which the next step's replays overwrite. When the trees begin a step they free each
output of the last one that is still alive and mark its memory, so that reading it raises their
error. Most training loops drop every ``.grad`` before that (``zero_grad()`` between steps), and
the lent gradients cost nothing. Two loops keep them: gradient accumulation (micro-batches without
``zero_grad``) and ``zero_grad(set_to_none=False)``. So before a forward under the trees runs,
:func:`take_back` finds each ``.grad`` that still lies at an address a backward lent, among the
tensors that required gradients in the forwards of those backwards, and replaces it by a copy (one
multi-tensor copy for all): the accumulation then adds to that copy, as eager adds to its own.

Why lend rather than copy every gradient at each backward: the copy's host time is paid at every
step (GoogLeNet's 187 gradients: about 0.4-0.55 ms on an H200's host, 9% of a batch-8 training
step bound by the host), and the copies are a second set of gradients in memory.

A lent gradient held elsewhere than a ``.grad`` of those tensors (``g = p.grad`` kept into the
next step) cannot be given other memory, and the replay would overwrite it without a word (the
trees free and mark what is alive only as a recorded step ends, not between replays). So after
the copies, :func:`take_back` asks the trees which outputs of the last step's backward are still
alive (their own weak references, which count their cached tensors). Where one is: a warning that
says what it now holds and how to keep a gradient, and the manager's gradients are copied at each
backward from then on (:attr:`_Lent.copying`), as they were before lending.

State: one :class:`_Lent` per trees manager (the trees keep one per device and thread; a backward
runs on autograd's thread and finds its forward's manager), in a weak dictionary: the manager
going (``reset_cudagraph_trees``) takes its record with it. ``_Lent.lock`` guards its two fields;
they are emptied together by the forward that takes the gradients back.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .._diagnostics import warn
from .trees import copies

__all__ = ["lend", "take_back", "tensors_with_gradients"]


class _Lent:
    """What the backwards of one trees manager lent since its last forward under the trees."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.addresses: set[int] = set()  # the data pointers of the lent gradients
        #: weak references to the tensors whose ``.grad`` may hold one: for each backward that lent,
        #: its forward's inputs that required gradients (the same list object once)
        self.holders: list[list[weakref.ref[torch.Tensor]]] = []
        #: set once a lent gradient outlived its step elsewhere than in a ``.grad``: backwards copy
        self.copying = False


_by_manager: weakref.WeakKeyDictionary[Any, _Lent] = weakref.WeakKeyDictionary()
_by_manager_lock = threading.Lock()
#: the record of graphs with no trees manager (a device not set yet; stand-ins in tests)
_unmanaged = _Lent()


def _record(device_box: Any) -> _Lent:
    """The record of the trees manager of the device in ``device_box`` (Inductor's
    ``BoxedDeviceIndex``, set when the forward went under the trees)."""
    index = getattr(device_box, "value", None)
    if index is None:
        return _unmanaged
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
    if manager is None:
        return _unmanaged
    lent = _by_manager.get(manager)
    if lent is None:
        with _by_manager_lock:
            lent = _by_manager.setdefault(manager, _Lent())
    return lent


def tensors_with_gradients(args: Sequence[Any]) -> list[int]:
    """The positions of a forward's inputs that require gradients: the parameters, and any input
    whose ``.grad`` autograd may set (Dynamo guards ``requires_grad``, so they hold for a graph)."""
    return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]


def lend(device_box: Any, outputs: Sequence[Any], holders: list[weakref.ref[torch.Tensor]]) -> Any:
    """A backward's ``outputs`` (its gradients) to hand to autograd: as they are, recorded with
    ``holders`` (the inputs of its forward whose ``.grad`` may keep one), or copies where the
    manager copies (:attr:`_Lent.copying`)."""
    lent = _record(device_box)
    if lent.copying:
        out = list(outputs)
        at = [i for i, t in enumerate(out) if isinstance(t, torch.Tensor)]
        for i, t in zip(at, copies([out[i] for i in at])):
            out[i] = t
        return out
    addresses = {t.data_ptr() for t in outputs if isinstance(t, torch.Tensor)}
    if addresses:
        with lent.lock:
            lent.addresses |= addresses
            if not any(h is holders for h in lent.holders):
                lent.holders.append(holders)
    return outputs


def take_back(device_box: Any) -> int:
    """Give each ``.grad`` that still holds a lent gradient a copy of its own, before a forward under
    the trees of ``device_box``'s device begins a step, and copy from then on where a lent gradient
    is held elsewhere (see the module docstring). Returns how many ``.grad`` were copied."""
    lent = _record(device_box)
    if not lent.addresses:
        return 0
    with lent.lock:
        addresses, holders = lent.addresses, lent.holders
        lent.addresses, lent.holders = set(), []
    held = _holding(holders, addresses)
    if held:
        for t, own in zip(held, copies([t.grad for t in held])):  # type: ignore[misc]
            t.grad = own  # (the old .grad is dropped here: no local keeps it alive for the check)
    alive = _alive_elsewhere(device_box, addresses)
    if alive:
        lent.copying = True
        warn(f"streamdag: {alive} gradient(s) of the last training step were still referenced "
             "outside .grad (g = p.grad kept into the next step) as the next step began: that step's "
             "CUDA graph replay reuses their memory, so such a tensor now holds the new step's numbers. "
             "Clone a gradient you keep (g = p.grad.clone()); from now on the gradients of training "
             "graphs on this device (and thread) are copied out of the CUDA graph pool")
    return len(held)


def _holding(holders: list[list[weakref.ref[torch.Tensor]]], addresses: set[int]) -> list[torch.Tensor]:
    """The tensors among ``holders`` whose ``.grad`` lies at one of ``addresses``, each once."""
    found: dict[int, torch.Tensor] = {}
    for refs in holders:
        for ref in refs:
            t = ref()
            if t is not None and t.grad is not None and t.grad.data_ptr() in addresses:
                found[id(t)] = t
    return list(found.values())


def _alive_elsewhere(device_box: Any, addresses: set[int]) -> int:
    """How many outputs of the backwards on the trees' current path, at ``addresses``, are alive
    (the trees' weak references count their own cached tensors out). A path the trees still warm
    up or record: 0, as the trees free and mark what is alive themselves when the next step
    begins there. Trees without these names: every address counts as alive (copying is safe)."""
    index = getattr(device_box, "value", None)
    if index is None:
        return 0
    try:
        from torch._inductor import cudagraph_trees as trees

        manager = trees.get_manager(index, create_if_none_exists=False)
        node = getattr(manager, "current_node", None)
        if not isinstance(node, trees.CUDAGraphNode):
            return 0
        return sum(1 for path_node in node._path_from_root for w in path_node.outputs_weakrefs
                   if w is not None and w.data_ptr() in addresses and trees.is_live(w))
    except AttributeError:
        return len(addresses)
