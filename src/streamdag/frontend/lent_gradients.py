"""Gradients a backward under Inductor's CUDA graph trees hands out of the trees' pool, and how a
``.grad`` still holding one when the next step begins is given memory of its own.

Autograd keeps a gradient it is handed as the parameter's ``.grad`` where the parameter has none
(``optimizer.zero_grad()`` sets it to None): a backward under the trees hands it a tensor of the
trees' pool, which the next step's replays overwrite. Most training loops drop every ``.grad``
before that (``zero_grad()`` between steps), and the lent gradients cost nothing. Two loops keep
them: gradient accumulation (micro-batches without ``zero_grad``) and
``zero_grad(set_to_none=False)``. So before a forward under the trees runs, :func:`take_back`
finds each ``.grad`` that still lies in a storage a backward lent, among the parameters any
forward under the manager took (:func:`hold`), and replaces it by a copy (one multi-tensor copy
for all): the accumulation then adds to that copy, as eager adds to its own. A loop that zeroes
its gradients after its forward (``out = model(x); opt.zero_grad(); loss.backward()``), or trains
two models in turn, still holds the last step's (or the other model's) as the forward begins:
those are copied there.

Why lend rather than copy every gradient at each backward: the copy's host time is paid at every
step (GoogLeNet's 187 gradients: about 0.4-0.55 ms on an H200's host, 9% of a batch-8 training
step bound by the host), and the copies are a second set of gradients in memory.

What is lent (:func:`lend`): a backward's gradients of its forward's parameters, and only those.
AOTAutograd's backward returns the gradient of its forward's i-th input as its i-th output where
every input is a plain tensor (a tensor subclass is flattened one way for the forward's inputs
and another for the gradients: such graphs lend nothing). A gradient of any other input (an
activation across a graph break, a view of a parameter made before the call, a tensor a user made
require gradients, a parameter written in place from a tensor with gradients, which is no leaf)
flows on through autograd into tensors no forward saw, so it is copied. Two parameters'
gradients in one storage (Inductor returns one buffer for both where they are equal) are lent
once: autograd would keep both as ``.grad`` sharing memory, which an in-place change of one
(unscaling, clipping) would change twice. Gradients are copied too while the manager runs
functions streamdag did not put under it (another model under ``reduce-overhead``, a compiled
optimizer step): such a function may begin the trees' next step, and replay over lent memory,
before a forward of streamdag's takes its gradients back.

A lent gradient held elsewhere than a ``.grad`` (``g = p.grad`` or the result of
``torch.autograd.grad`` kept into the next step) cannot be given other memory, and the replay
would overwrite it without a word (the trees free and mark what is alive only as a recorded step
ends, not between replays). So after the copies, :func:`take_back` asks the trees which outputs
of the last step's graphs at lent addresses are still alive (their own weak references, which
count their cached tensors out). Where one is: a warning that says what it now holds and how to
keep a gradient, and the manager's gradients are copied at each backward from then on
(:attr:`_Lent.copying`). While the trees still warm up or record a step, they free and mark what
is alive themselves as the next step begins: reading such a gradient then raises their error.

What a step pays: a replay of a recorded graph returns its outputs at the addresses it recorded,
so what :func:`lend` finds for a backward's outputs (which to lend, their storages), and which of
the trees' weak references name the lent storages, are worked out once per recorded graph and
reused while the trees replay it (:class:`LendPlan`, :attr:`_Lent.alive`); a step then pays a
check of the addresses, the ``.grad`` of each parameter held, and the trees' liveness check of
each lent storage. (With GoogLeNet's 187 parameters, walking the trees' path and working the
storages out anew at every step costs about as much host time as the copies that lending saves.)

State: one :class:`_Lent` per trees manager (the trees keep one per device and thread; a backward
runs on autograd's thread and finds its forward's manager), in a weak dictionary: the manager
going (``reset_cudagraph_trees``) takes its record with it. ``_Lent.lock`` guards ``bases`` (emptied
by the forward that takes the gradients back) and ``holders`` (kept: weak references, the dead
ones dropped as the dictionary doubles). The memos (``_Lent.alive``, ``LendPlan.state``) are
one tuple each, read once and replaced whole, and hold the trees' node they were worked out for
weakly.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .._diagnostics import warn
from .trees import copies, put_by_streamdag

__all__ = ["LendPlan", "Noted", "hold", "lend", "node_run_last", "parameter_positions", "take_back"]


class _Lent:
    """One trees manager's lending: what its backwards lent since the last take-back, the tensors
    whose ``.grad`` may hold it, and whether it has stopped lending."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: the addresses of the lent gradients' storages (the trees' weak references name them so)
        self.bases: set[int] = set()
        #: every parameter a forward under the manager took, by id, weakly (a backward may lend
        #: for a forward called before the last take-back: a GAN's generator, say)
        self.holders: dict[int, weakref.ref[torch.Tensor]] = {}
        self.pruned_at = 0  # the count of holders when the dead ones were last dropped
        #: set once a lent gradient outlived its step elsewhere than in a ``.grad``: backwards copy
        self.copying = False
        #: whether the manager runs a function streamdag did not put under it, as of its count
        self.foreign = False
        self.functions = 0
        #: (a trees node, weakly; lent bases; where the trees keep their weak references to the
        #: outputs at those bases on the node's path: a node's list of them, a position), as
        #: :func:`_alive_elsewhere` last found them
        self.alive: tuple[weakref.ref[Any], set[int], list[tuple[list[Any], int]]] | None = None


class LendPlan:
    """What :func:`lend` found for one backward graph's outputs at the trees' node that returned
    them: a replay of that node returns them at the same addresses, so the same outputs are lent.
    ``state``: (the node, weakly; the data pointers of the outputs at the parameters' positions;
    the positions lent; their storages' addresses; the positions copied), or None."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: tuple[weakref.ref[Any], list[int], set[int], set[int], list[int]] | None = None


_by_manager: weakref.WeakKeyDictionary[Any, _Lent] = weakref.WeakKeyDictionary()
_by_manager_lock = threading.Lock()
#: the record of graphs with no trees manager (a device not set yet; stand-ins in tests)
_unmanaged = _Lent()


def _manager(device_box: Any, make: bool = False) -> Any:
    """The trees manager of the device in ``device_box`` (Inductor's ``BoxedDeviceIndex``, set when
    the forward is compiled for the trees), or None. ``make``: made where the trees have not made it
    yet (they make it at their first call, after the first forward's :func:`hold`)."""
    index = getattr(device_box, "value", None)
    if index is None:
        return None
    from torch._inductor import cudagraph_trees

    return cudagraph_trees.get_manager(index, create_if_none_exists=make)


def _record(manager: Any) -> _Lent:
    if manager is None:
        return _unmanaged
    lent = _by_manager.get(manager)
    if lent is None:
        with _by_manager_lock:
            lent = _by_manager.setdefault(manager, _Lent())
    return lent


def parameter_positions(args: Sequence[Any]) -> list[int]:
    """The positions of a forward's inputs that are parameters (leaves whose ``.grad`` autograd sets;
    a graph's parameters stay at their positions, as Dynamo's guards keep them)."""
    return [i for i, a in enumerate(args) if isinstance(a, torch.nn.Parameter)]


class Noted:
    """A forward's memo of the parameters it last noted, and where: the next call with the same
    tensors (their weak references, which Python keeps one per tensor) notes nothing again."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state: tuple[_Lent, list[weakref.ref[torch.Tensor]]] | None = None


def hold(device_box: Any, args: Sequence[Any], positions: Sequence[int],
         noted: Noted | None = None) -> _Lent | None:
    """Note a forward's parameters (at ``positions`` of ``args``) as tensors whose ``.grad`` the
    next take-back reads; returns the record they are noted in, for the backward (:func:`lend`).
    None where one is no leaf (written in place from a tensor with gradients: its gradient flows
    on to tensors no forward saw, so nothing may be lent). The manager is made here if need be:
    the holders of a first forward belong in the record its backward lends to, not in that of
    graphs with no manager. ``noted``: the forward's memo of what it noted last."""
    lent = _record(_manager(device_box, make=True))
    if lent.copying:
        return lent
    tensors = list(map(args.__getitem__, positions))
    if not all(map(_is_leaf, tensors)):
        return None
    refs = list(map(weakref.ref, tensors))
    state = noted.state if noted is not None else None
    if state is not None and state[0] is lent and len(state[1]) == len(refs) \
            and all(map(operator.is_, refs, state[1])):
        return lent  # (the same tensors, noted in this record already: holders are dropped dead only)
    with lent.lock:
        holders = lent.holders
        holders.update(zip(map(id, tensors), refs))
        if len(holders) > 2 * lent.pruned_at + 64:  # (parameters that died leave dead references)
            lent.holders = holders = {k: r for k, r in holders.items() if r() is not None}
            lent.pruned_at = len(holders)
    if noted is not None:
        noted.state = (lent, refs)
    return lent


_is_leaf = operator.attrgetter("is_leaf")


def lend(device_box: Any, outputs: Sequence[Any], parameters: Sequence[int] | None,
         copy_rest: bool = True, plan: LendPlan | None = None, node_before: Any = None,
         held_in: _Lent | None = None) -> tuple[list[Any], int]:
    """A backward's ``outputs`` to hand to autograd, and how many of them are lent: those at
    ``parameters`` (its forward's parameters' gradients) as they are, one per storage, and
    recorded; the others copied where ``copy_rest``, the parameters' always. Everything is copied
    where ``parameters`` is None (outputs that do not line up with the forward's inputs) and where
    the manager copies (:attr:`_Lent.copying`, or functions of others under it). ``plan``: the
    graph's memo of what it lent at the trees' node that returned these outputs; ``node_before``:
    the trees' node that had run last before this call (:func:`node_run_last`): where it still is,
    the trees skipped the call (the outputs are no node's), and the plan is not used.
    ``held_in``: the record the forward noted its parameters in (:func:`hold`); where it is not
    the one lent into (a manager the trees made anew in between), its holders join that one, so
    that the next take-back finds every ``.grad`` lent."""
    manager = _manager(device_box)
    lent = _record(manager)
    out = list(outputs)
    if parameters is None:
        copy_rest, parameters, lending = True, (), False
    else:
        lending = not (lent.copying or _runs_others(manager, lent))
    if lending:
        node = _replayed_node(manager)
        kept, bases, at = _lent_at(out, parameters, None if node is node_before else node, plan, copy_rest)
    else:
        kept, bases, at = set(), set(), _copied_at(out, set(), parameters, copy_rest)
    if bases:
        if held_in is not None and held_in is not lent:
            with held_in.lock:
                holders = dict(held_in.holders)
            with lent.lock:
                lent.holders.update(holders)
        with lent.lock:
            lent.bases |= bases
    for i, t in zip(at, copies([out[i] for i in at])):
        out[i] = t
    return out, len(kept)


def _copied_at(out: list[Any], kept: set[int], parameters: Sequence[int], copy_rest: bool) -> list[int]:
    """The positions of the tensors of ``out`` to copy: all but those ``kept``; without ``copy_rest``,
    only the parameters' (the gradients of other inputs are handed out of the pool unrecorded, as
    under reduce-overhead; a parameter's never)."""
    params = set(parameters)
    return [i for i, t in enumerate(out) if isinstance(t, torch.Tensor) and i not in kept
            and (copy_rest or i in params)]


def _lent_at(out: list[Any], parameters: Sequence[int], node: Any, plan: LendPlan | None,
             copy_rest: bool) -> tuple[set[int], set[int], list[int]]:
    """The positions among ``parameters`` whose outputs are lent (the first per storage), their
    storages' addresses, and the positions to copy (:func:`_copied_at`): ``plan``'s where ``node``
    (the trees' node that returned ``out``; None while they warm up) is the plan's and the outputs
    lie where they lay."""
    picked = list(map(out.__getitem__, parameters)) if not parameters or parameters[-1] < len(out) \
        else [out[i] if i < len(out) else None for i in parameters]
    pointers = [t.data_ptr() if type(t) is torch.Tensor else 0 for t in picked]
    state = plan.state if plan is not None and node is not None else None
    if state is not None and state[0]() is node and state[1] == pointers:
        return state[2], state[3], state[4]
    kept: set[int] = set()
    bases: set[int] = set()
    for i in parameters:
        t = out[i] if i < len(out) else None
        # (two parameters' gradients in one buffer: autograd would keep both, sharing memory that an
        # in-place change of one, such as an unscaling, would change twice; the second is copied)
        if type(t) is torch.Tensor and (b := _base(t)) not in bases:
            kept.add(i)
            bases.add(b)
    at = _copied_at(out, kept, parameters, copy_rest)
    if plan is not None and node is not None:
        plan.state = (weakref.ref(node), pointers, kept, bases, at)
    return kept, bases, at


def node_run_last(device_box: Any) -> Any:
    """The trees' recorded node that ran last on the device of ``device_box``, or None."""
    return _replayed_node(_manager(device_box))


def _replayed_node(manager: Any) -> Any:
    """The trees' node that ran last (a recorded graph, whose replays return their outputs where it
    recorded them), or None (no manager; the trees warm up)."""
    if manager is None:
        return None
    from torch._inductor import cudagraph_trees as trees

    node = getattr(manager, "current_node", None)
    return node if isinstance(node, trees.CUDAGraphNode) else None


def _base(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (the trees' weak references name storages by it)."""
    return t.data_ptr() - int(t.storage_offset()) * t.element_size()


def take_back(device_box: Any) -> int:
    """Give each ``.grad`` that still holds a lent gradient a copy of its own, before a forward under
    the trees of ``device_box``'s device begins a step, and copy from then on where a lent gradient
    is held elsewhere (see the module docstring). Returns how many ``.grad`` were copied."""
    manager = _manager(device_box)
    lent = _record(manager)
    if not lent.bases:
        return 0
    with lent.lock:
        bases, holders = lent.bases, list(lent.holders.values())
        lent.bases = set()
    held = _holding(holders, bases)
    if held:
        for t, own in zip(held, copies([t.grad for t in held])):  # type: ignore[misc]
            t.grad = own  # (the old .grad is dropped here: no local keeps it alive for the check)
    alive = _alive_elsewhere(manager, bases, lent)
    if alive and not lent.copying:
        lent.copying = True
        warn(f"streamdag: {alive} gradient(s) of the last training step were still referenced "
             "outside .grad (g = p.grad, or torch.autograd.grad's results, kept into the next step) as "
             "the next step began: that step's CUDA graph replay reuses their memory, so such a tensor "
             "now holds the new step's numbers. Clone a gradient you keep (g = p.grad.clone()); from "
             "now on the gradients of training graphs on this device (and thread) are copied out of "
             "the CUDA graph pool")
    return len(held)


def _holding(holders: Any, bases: set[int]) -> list[torch.Tensor]:
    """The tensors among ``holders`` (weak references) whose ``.grad`` lies in a storage at one of
    ``bases`` (a lent gradient, or a view of one)."""
    found = []
    for ref in holders:
        t = ref()
        if t is not None and type(g := t.grad) is torch.Tensor and _base(g) in bases:
            found.append(t)
        g = None  # (no local keeps a lent gradient alive for the liveness check)
    return found


def _runs_others(manager: Any, lent: _Lent) -> bool:
    """Whether ``manager`` runs a function streamdag did not put under it (checked again when its
    count of functions changes). Trees without these names: True (copying is safe)."""
    if manager is None:
        return False
    try:
        functions = manager.ids_to_funcs
        if len(functions) != lent.functions:
            lent.foreign = not all(put_by_streamdag(f.model) for f in list(functions.values()))
            lent.functions = len(functions)
    except AttributeError:
        return True
    return lent.foreign


def _alive_elsewhere(manager: Any, bases: set[int], lent: _Lent | None = None) -> int:
    """How many outputs of the graphs on the trees' current path whose storages lie at ``bases`` are
    alive (the trees' weak references count their own cached tensors out). A path the trees still
    warm up or record: 0, as the trees free and mark what is alive themselves when the next step
    begins there. Trees without these names: every lent gradient counts as alive (copying is
    safe). ``lent``: the record whose memo of the weak references at ``bases`` serves while the
    trees' node and the bases stay the same."""
    if manager is None:
        return 0
    try:
        from torch._inductor import cudagraph_trees as trees

        node = manager.current_node
        if not isinstance(node, trees.CUDAGraphNode):
            return 0
        memo = lent.alive if lent is not None else None
        if memo is not None and memo[0]() is node and memo[1] == bases:
            at = memo[2]
        else:
            # (by position: a node puts new weak references in its list at its first replay, and
            # again after the trees checkpoint it; the list and the positions stay)
            at = [(path_node.outputs_weakrefs, j) for path_node in node._path_from_root
                  for j, w in enumerate(path_node.outputs_weakrefs)
                  if w is not None and w.data_ptr() in bases]
            if lent is not None:
                lent.alive = (weakref.ref(node), bases, at)
        return sum(1 for refs, j in at if trees.is_live(refs[j]))
    except AttributeError:
        return len(bases)
