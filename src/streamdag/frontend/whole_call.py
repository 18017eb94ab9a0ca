"""One CUDA graph for a whole call of a model that ``streamdag.compile`` compiled.

Dynamo cuts a model at its graph breaks and runs Python between the graphs it
compiled; each call enters Dynamo once per frame and checks its guards there,
and each graph's replay copies its inputs in and its outputs out. For a small
model at batch 1 that host work is as long as the GPU's. So, once the
per-graph candidates are chosen, :class:`WholeCall` captures the *whole* call
(``model(*args)``: every graph, with the candidate each graph chose, and the
Python between them) into one CUDA graph in the backend's shared pool, and
later calls with the same arguments' shapes replay it without entering Dynamo.

A miss (a call whose key or state differs) takes Dynamo's path, which may
compile; the call after it captures again. A call is captured in two steps:

1. *warm-up*: the call runs once on the capture stream, through Dynamo, with
   every graph running its chosen candidate directly (not its own CUDA graph)
   over tensors the whole-call graph owns (:data:`ACTIVE` tells the graphs).
   This call's result is the warm-up's. It finds out what would keep the call
   from being captured: a graph on the CPU or compiled for training, a graph
   compiled just now (the next call captures; a key whose calls keep compiling,
   as Dynamo's do when the code goes on with a number from ``.item()``, stays
   on Dynamo's path), a module whose state the call
   itself changes, outputs that are not tensors in containers, outputs that
   alias an input or a parameter.
2. *capture*: the same call again, under ``torch.cuda.graph``. A host
   synchronization (``.item()``, a copy to the CPU) fails the capture; the key
   then stays on Dynamo's path, and ``explain()`` says why. The graph is then
   timed against a plain CUDA graph of the eager call, and the faster is kept
   (:mod:`.eager_graph`).

Every call checks cheaply (:meth:`WholeCall.__call__`, a few microseconds):

* the key: each argument's shape, strides, dtype and device (a parameter
  passed as an argument also by its address, since it is read in place), the
  values of non-tensor arguments (``None``, numbers, strings), and whether
  inference mode is on; with grad mode on, Dynamo's path always runs;
* the global state Dynamo guards (``GlobalStateGuard``: grad mode, default
  dtype, deterministic algorithms, ...) and cuDNN's switches, which it leaves
  out (TF32, deterministic algorithms, cuDNN on), as they were at the capture
  (a key keeps the graphs of a few other such states, :data:`MAX_OTHERS`, for
  calls that alternate them);
* the module's state (:class:`StateWatch`): its submodules' attributes,
  parameters, buffers, submodules and hooks, the globals its ``forward``
  names, the tensors among them by address, shape and strides.

The key picks the graph; the module-state check runs after its launch, while
the GPU runs it, where the graph writes nothing outside its own memory
(:mod:`.whole_replay` says why that is safe), and so does the global one on the
last call's graph (on a keyed lookup it runs first: under a microsecond, and a
call under other settings then launches nothing for nothing). A call first tries the graph the
last call replayed (:meth:`Entry.launch_if`): its arguments are compared with
that graph's captured ones by the key's rules, without building a key, and
where the torch extension is loaded the comparison, the input copies and the
launch are one C++ call. Only a call they do not match builds its key.

What the check cannot see is Python that the forward runs besides its tensor
work (printing, appending to a list, a global other than those ``forward``
names): a replay runs none of it. ``streamdag.compile(model, whole_call=False)``
keeps every call on Dynamo's path.

Outputs belong to the caller: no later call changes them. The call is
captured twice more, and a replay lends the caller the outputs of a graph whose
outputs it no longer holds, or copies them into fresh tensors where it holds
them all (:mod:`.lent_outputs`).
Inputs are copied into the graph's own tensors; an input that the call writes
into is copied back after the replay.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._dynamo.guards import GlobalStateGuard
from torch.utils import _pytree as pytree

from .call_key import call_key
from .candidates import cudnn_settings
from .eager_graph import capture_eager, eager_refusal, keep_eager
from .lent_outputs import LENT_SETS, LentSet, OutputSets, lend_refusal
from .state_watch import StateWatch
from .whole_inputs import static_inputs
from .whole_replay import CudaCalls, Entry, fill_tensors, with_tensors_replaced
from .whole_results import result_parts

__all__ = ["ACTIVE", "NotWholeCapturable", "StateWatch", "WholeCall", "call_key"]

#: at most this many states of a module keep their graphs (train and eval, say); more drop the oldest
MAX_STATES = 4
#: a key whose capture fails this often for a passing reason (the state changed during the call)
#: stays on Dynamo's path
MAX_ATTEMPTS = 3
#: entries kept per key for global settings other than the current one's (each holds its graph
#: and memory)
MAX_OTHERS = 3
#: refused keys remembered (the least recently called goes first): a float argument that changes at
#: each call on the CPU would otherwise add a key for good at each call; a key forgotten is checked again
MAX_REFUSED = 256


class NotWholeCapturable(RuntimeError):
    """Raised inside a whole-call capture by a graph that cannot be part of one."""


class _Active(threading.local):
    """What this thread is doing for a whole-call graph: ``mode`` is None, "warm" or "capture".

    The graphs (``GraphRunner``) read it: in a warm-up or capture they run their chosen
    candidate directly, note in ``refusal`` why the call cannot be captured, in
    ``mutated`` the storages of the inputs they write into, and set ``compiled``
    when one of them chose its candidate during this call. In a warm-up, a graph
    that holds CUDA graphs of its own adds to ``parkable`` the call that drops
    them: the capture then runs the graph's work itself, so the memory those
    graphs hold in the shared pool is freed first and the capture reuses it (one
    graph's memory for the model, not two; a later call on Dynamo's path
    captures the graph's own again).
    """

    mode: str | None = None
    refusal: str = ""
    compiled: bool = False
    updates_state: bool = False  # a graph wrote into a parameter or buffer

    def __init__(self) -> None:
        self.mutated: set[int] = set()
        self.reads: dict[int, Any] = {}  # in a capture: the storages of the graphs' tensor arguments
        self.made: set[int] = set()  # in a capture: the storages of the graphs' outputs (its own memory)
        self.parkable: dict[int, Callable[[], None]] = {}  # in a warm-up: by the graph's id


ACTIVE = _Active()


@contextmanager
def _active(mode: str) -> Iterator[_Active]:
    ACTIVE.mode, ACTIVE.refusal, ACTIVE.compiled, ACTIVE.updates_state = mode, "", False, False
    ACTIVE.mutated, ACTIVE.reads, ACTIVE.made, ACTIVE.parkable = set(), {}, set(), {}
    try:
        yield ACTIVE
    finally:  # the thread keeps no storage: a dropped graph's memory must go back
        ACTIVE.mode, ACTIVE.reads, ACTIVE.parkable = None, {}, {}


def _device_for(device: torch.device, pool: Any) -> Any:
    return CudaCalls(device, pool)


@dataclass
class _State:
    """One state of the model, with the graphs captured in it."""

    watch: StateWatch
    entries: dict[Any, Entry] = field(default_factory=dict)
    #: each key's entries captured under other global settings (autocast, default dtype, cuDNN's
    #: switches...), the latest last: a call under one of them replays it instead of capturing
    others: dict[Any, list[Entry]] = field(default_factory=dict)
    attempts: dict[Any, int] = field(default_factory=dict)
    #: calls of each key that compiled a graph since its last capture, per global settings
    compiles: dict[Any, list[list[Any]]] = field(default_factory=dict)


class _GlobalState:
    """The global state a capture ran under: what Dynamo's ``GlobalStateGuard`` holds, and
    cuDNN's switches, which it leaves out (:func:`.candidates.cudnn_settings`)."""

    __slots__ = ("cudnn", "dynamo")

    def __init__(self) -> None:
        self.dynamo = GlobalStateGuard()
        self.cudnn = cudnn_settings()

    def check(self) -> bool:
        return self.dynamo.check() and cudnn_settings() == self.cudnn


class WholeCall:
    """The whole-call graphs of one compiled model (see the module docstring)."""

    def __init__(self, fn: Any, backend: Any, clone: bool = True) -> None:
        self.fn = fn
        self.backend = backend
        self.clone = clone
        self.states: list[_State] = []
        self.current: _State | None = None
        self.refused: dict[Any, str] = {}  # keys that stay on Dynamo's path, and why
        self.note: str = ""  # why the last call that missed took Dynamo's path
        self.captures: int = 0
        self.recaptures: int = 0  # captures for a key captured before over other tensors (parameters moved)
        self.replays: int = 0
        self._captured_over: dict[Any, frozenset[int]] = {}  # each key's last capture: its tensors' ids
        self.baseline: str = ""  # the last capture against the eager call's plain CUDA graph, in words
        #: the state and entry of the last speculative replay: the next call tries it first, by
        #: :meth:`Entry.launch_if` (no key built, no lookup); only while that state is current
        self._last: tuple[_State, Entry] | None = None
        self._lock = threading.Lock()

    # -- the hot path ---------------------------------------------------------------------------------

    def __call__(self, args: Sequence[Any], kwargs: dict[str, Any], dynamo: Callable[..., Any]) -> Any:
        last = self._last
        if last is not None and last[0] is self.current and ACTIVE.mode is None:
            state, entry = last
            with self._lock:  # one replay at a time: they share the graph's inputs and outputs
                # launched first, checked while the GPU runs it (unless another thread's call moved on)
                launched = self._last is last and entry.launch_if(args, kwargs)
                if launched and entry.global_state.check() and state.watch.holds():
                    self.replays += 1
                    return entry.result(())
            if launched:  # the state moved: its outputs are never read
                return self._miss(call_key(args, kwargs), args, kwargs, dynamo)
        if torch.is_grad_enabled() or ACTIVE.mode is not None:
            return dynamo(*args, **kwargs)
        key = call_key(args, kwargs)
        state = self.current
        if state is not None:
            entry = state.entries.get(key)
            if entry is not None:
                with self._lock:
                    if entry.speculative and entry.global_state.check():  # (checked first: cheap)
                        tensors = entry.launch(args, kwargs)
                        if state.watch.holds():
                            self.replays += 1
                            if state is self.current and state.entries.get(key) is entry:  # still kept
                                self._last = (state, entry)
                            return entry.result(tensors)
                    elif entry.global_state.check() and state.watch.holds():
                        self.replays += 1
                        return entry.replay(args, kwargs)
        return self._miss(key, args, kwargs, dynamo)

    # -- misses ---------------------------------------------------------------------------------------

    def _miss(self, key: Any, args: Sequence[Any], kwargs: dict[str, Any], dynamo: Callable[..., Any]) -> Any:
        self._drop_moved()  # first: the calls after model.cpu() never reach _state()
        if isinstance(key, str):
            self.note = key
            return dynamo(*args, **kwargs)
        if key in self.refused:
            self.note = self.refused[key] = self.refused.pop(key)  # (last to go: it is in use)
            return dynamo(*args, **kwargs)
        device, why = _one_cuda_device(args, kwargs)  # before any snapshot: on the CPU there is no graph
        if device is None:
            self._refuse(key, why)
            return dynamo(*args, **kwargs)
        with self._lock:
            state = self._state()
            entry = state.entries.get(key)
            if entry is not None and entry.global_state.check():
                self.replays += 1
                return entry.replay(args, kwargs)
            self._last = None  # (calls that alternate settings take the keyed path: no wasted launch)
            if entry is not None:  # captured under other global settings: kept for calls under them
                state.others.setdefault(key, []).append(state.entries.pop(key))
            others = state.others.get(key, [])
            other = next((e for e in reversed(others) if e.global_state.check()), None)
            if other is not None:
                others.remove(other)
                state.entries[key] = other
                self.replays += 1
                return other.replay(args, kwargs)
            del others[:-MAX_OTHERS]
            return self._capture(state, key, device, args, kwargs, dynamo)

    def _state(self) -> _State:
        """The state the model is in now: the current one, a kept one that holds, or a new one."""
        if self.current is not None and self.current.watch.holds():
            return self.current
        for s in self.states:
            if s is not self.current and s.watch.holds():
                self.current = s
                return s
        watch = StateWatch(self.fn)
        # a state with other tensors, or whose tensors moved, goes: its graphs read memory the model
        # no longer holds (and keep it allocated)
        self.states = [s for s in self.states
                       if s.watch.same_tensors(watch) and s.watch.memory_holds()][-(MAX_STATES - 1):]
        self.current = _State(watch)
        self.states.append(self.current)
        self._forget_dropped()
        return self.current

    def _drop_moved(self) -> None:
        """States whose tensors moved go, with the memory their graphs keep allocated (``held``)."""
        if all(s.watch.memory_holds() for s in self.states):
            return
        with self._lock:
            self.states = [s for s in self.states if s.watch.memory_holds()]
            if not any(s is self.current for s in self.states):
                self.current = None
            self._forget_dropped()

    def _forget_dropped(self) -> None:
        """The last replay's entry is let go with its state: it holds the memory its graph reads."""
        if self._last is not None and not any(s is self._last[0] for s in self.states):
            self._last = None

    def _refuse(self, key: Any, reason: str) -> None:
        self.refused[key] = reason
        if len(self.refused) > MAX_REFUSED:
            del self.refused[next(iter(self.refused))]
        self.note = reason
        for state in self.states:  # (no call of a refused key replays: their memory goes back)
            state.others.pop(key, None)

    def _passing(self, state: _State, key: Any, reason: str) -> None:
        """The capture waits for a later call; after ``MAX_ATTEMPTS`` such calls the key is refused."""
        state.attempts[key] = state.attempts.get(key, 0) + 1
        if state.attempts[key] >= MAX_ATTEMPTS:
            self._refuse(key, f"{reason} ({MAX_ATTEMPTS} calls in a row)")
        else:
            self.note = reason

    # -- capturing ------------------------------------------------------------------------------------

    def _capture(self, state: _State, key: Any, device: torch.device, args: Sequence[Any],
                 kwargs: dict[str, Any], dynamo: Callable[..., Any]) -> Any:
        inputs = static_inputs(args, kwargs)
        if isinstance(inputs, str):
            self._refuse(key, inputs)
            return dynamo(*args, **kwargs)
        arg_index, kw_names, tensors, statics, s_args, s_kwargs = inputs
        dev = _device_for(device, self.backend.pool)
        marks = self._marks()
        caller = dev.caller()
        gs = _GlobalState()
        # the graphs note their own writes; eager code that Dynamo runs at a graph break writes
        # unseen, and only the version counters show it (an inference tensor keeps none)
        watched = [*statics, *state.watch.tensors]
        versions = _versions(watched)
        with _active("warm") as active, dev.on_capture_stream():
            out = dynamo(*s_args, **s_kwargs)
            parks = list(active.parkable.values())
        bumped = {i for i, (a, b) in enumerate(zip(versions, _versions(watched))) if a != b}
        parts = result_parts(out, device, statics, state.watch.tensors)
        leaves = parts.outputs if not isinstance(parts, str) else pytree.tree_leaves(out)
        dev.join(caller, [t for t in leaves if isinstance(t, torch.Tensor) and t.device == device])
        # what the call wrote into its inputs, in a graph or in the Python between (an inference
        # tensor keeps no version counter: the values say it; one synchronization, at a capture only)
        written = active.mutated
        write_back = [i for i, (s, t) in enumerate(zip(statics, tensors))
                      if i in bumped or s.untyped_storage().data_ptr() in written or not torch.equal(s, t)]
        for i in write_back:  # this call's writes into the caller's inputs
            tensors[i].copy_(statics[i])
        own = {s.untyped_storage().data_ptr() for s in statics}  # else: a parameter's, a buffer's, a global's
        updates_state = active.updates_state or bool(written - own) or max(bumped, default=-1) >= len(statics)
        reason = active.refusal or (parts if isinstance(parts, str) else "")
        if reason:
            self._refuse(key, reason)
            return out
        if active.compiled or self._marks() != marks:
            if self._recompiles(state, key, marks[0]):
                return out
            self.note = "a graph was compiled or chose its candidate in this call: the next call captures"
            return out
        if not state.watch.holds():
            self._passing(state, key, f"the call changes the model's state ({state.watch.changed()})")
            return out
        for park in parks:  # their memory goes to this capture
            park()
        try:
            with _active("capture") as active:
                graph, captured, own_inputs = dev.capture_own_inputs(dynamo, s_args, s_kwargs, statics)
                reads = {p: st for p, st in active.reads.items() if p not in active.made}
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self._refuse(key, f"the call cannot be captured ({type(exc).__name__}: {first[:200]})")
            return out
        s_args, s_kwargs = with_tensors_replaced(s_args, s_kwargs, statics, own_inputs)  # in its pool
        statics = own_inputs
        entry = self._entry(graph, dev, statics, arg_index, kw_names, write_back, captured, gs)
        if isinstance(entry, str):
            self._refuse(key, entry)
        elif active.refusal or active.compiled or self._marks() != marks or not state.watch.holds():
            self._passing(state, key, "the capture ran other code than the warm-up")
        else:  # what its graph reads stays allocated while it may launch before the checks
            entry.held = list({**{t.untyped_storage().data_ptr(): t.untyped_storage()
                                  for t in state.watch.tensors}, **reads}.values())
            entry.speculative = not write_back and not updates_state
            kept = state.entries[key] = self._against_eager(entry, dev, s_args, s_kwargs, updates_state,
                                                            state.watch.tensors)
            kept.key = key
            if kept is entry:
                self._lend(kept, dev, dynamo, s_args, s_kwargs, state.watch.tensors, compiled=True)
            else:
                e_args, e_kwargs = with_tensors_replaced(s_args, s_kwargs, entry.statics, kept.statics)
                self._lend(kept, dev, self.fn, e_args, e_kwargs, state.watch.tensors, compiled=False)
            if kept.speculative:
                kept.native = dev.launch_plan(args, kwargs, kept.statics, kept.replay_graph, key[-1])
                self._last = (state, kept)
            state.attempts.pop(key, None)
            state.compiles.pop(key, None)  # (a compile for new settings, then a capture: no loop)
            self.captures += 1
            over = frozenset(map(id, state.watch.tensors))
            if self._captured_over.get(key, over) != over:
                self.recaptures += 1
            self._captured_over[key] = over
            self.note = ""
        return out

    def _against_eager(self, entry: Entry, dev: Any, args: Sequence[Any], kwargs: dict[str, Any],
                       updates_state: bool, held: list[torch.Tensor]) -> Entry:
        """``entry``, or a plain CUDA graph of the eager call where that replays faster
        (:mod:`.eager_graph`)."""
        why = eager_refusal(self.fn, entry.write_back, updates_state)
        got = why or capture_eager(self.fn, dev, args, kwargs, entry.statics)
        if isinstance(got, str):
            self.baseline = f"whole call: no plain CUDA graph of the eager call: {got}"
            return entry
        eager = self._entry(got[0], dev, got[2], entry.arg_index, entry.kw_names, entry.write_back,
                            got[1], entry.global_state, held)
        if isinstance(eager, str) or eager.spec != entry.spec or _metas(eager) != _metas(entry):
            self.baseline = ("whole call: the eager call's result differs from the compiled call's: "
                             f"{eager if isinstance(eager, str) else 'other outputs, shapes or dtypes'}")
            return entry
        # the model's tensors, not what the compiled graph read: that may lie in the shared pool
        # (a tensor made between graph breaks), which no graph would use once the compiled one is
        # dropped, and a pool no graph uses while a tensor in it lives cannot be captured into again
        eager.held = list({t.untyped_storage().data_ptr(): t.untyped_storage() for t in held}.values())
        eager.speculative = entry.speculative
        kept, self.baseline = keep_eager(dev, entry, eager)
        return eager if kept else entry

    def _lend(self, entry: Entry, dev: Any, fn: Callable[..., Any], args: Sequence[Any],
              kwargs: dict[str, Any], held: list[torch.Tensor], compiled: bool) -> None:
        """The call captured :data:`LENT_SETS` more times beside ``entry``'s graph, each graph
        copying its outputs into a set of tensors of its own, lent to the caller in turn
        (:mod:`.lent_outputs`), where the outputs may be lent. ``compiled``: ``fn`` is Dynamo's
        path, captured as the entry was; a capture that compiles a graph, or takes other code
        than the first, lends nothing (the entry copies).

        A set's tensors are allocated outside the graphs' pool: any graph's outputs in the pool
        may lie in memory that another graph of the pool uses for its temporaries (the graphs of a
        pool replay one after another, so each may reuse what the others freed at their capture),
        and a replay of that graph would overwrite a result the caller still holds."""
        entry.lending = lend_refusal(entry.outputs, entry.clone) or (
            "outputs copied at each replay: some share memory" if entry.copied is not None else "")
        if entry.lending or not entry.outputs:
            return
        marks = self._marks()
        sets: list[LentSet] = []
        for _ in range(LENT_SETS):
            lent = [torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
                    for o in entry.outputs]
            made: list[Any] = []

            def run_and_copy(*a: Any, lent: list[torch.Tensor] = lent, made: list[Any] = made,
                             **k: Any) -> list[torch.Tensor]:
                parts = result_parts(fn(*a, **k), dev.device, entry.statics, held)
                made.append(parts)
                if _same_parts(parts, entry):
                    fill_tensors(lent, parts.outputs)
                return lent
            try:
                with _active("capture") if compiled else nullcontext() as active:
                    graph, _ = dev.capture_beside(entry.graph, run_and_copy, args, kwargs)
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                entry.lending = (f"outputs copied at each replay: a second capture failed "
                                 f"({type(exc).__name__}: {first[:160]})")
                return
            if active is not None and (active.refusal or active.compiled or self._marks() != marks):
                entry.lending = ("outputs copied at each replay: a second capture ran other code than "
                                 "the first")
                return
            if not _same_parts(made[0], entry):
                entry.lending = "outputs copied at each replay: a second capture returned other outputs"
                return
            sets.append(LentSet(graph, lent))
        entry.lend_from(OutputSets(entry.graph, sets, dev.device))

    def _recompiles(self, state: _State, key: Any, graphs_before: int) -> bool:
        """Whether Dynamo compiled a graph in ``MAX_ATTEMPTS`` calls of this key in this state under
        the same global settings since its last capture; the key is then refused. Dynamo compiles a
        key's graphs once per state and global settings unless its guards fail on a value the key
        and the state do not hold (a number that ``.item()`` returns, passed on past the graph
        break), and then it compiles at every call, so no call would ever capture."""
        if self.backend.stats.graphs == graphs_before:
            return False
        counts = state.compiles.setdefault(key, [])  # per global settings: [_GlobalState, compiles]
        mine = next((c for c in counts if c[0].check()), None)
        if mine is None:
            mine = [_GlobalState(), 0]
            counts.append(mine)
        mine[1] += 1
        if mine[1] < MAX_ATTEMPTS:
            return False
        self._refuse(key, f"Dynamo compiled a graph in each of {MAX_ATTEMPTS} calls with these arguments: "
                          "a value the code reads changes from call to call, such as a number from "
                          ".item() (TORCH_LOGS=recompiles names it)")
        return True

    def _marks(self) -> tuple[int, int]:
        stats = self.backend.stats
        return stats.graphs, stats.captures

    def _entry(self, graph: Any, dev: Any, statics: list[torch.Tensor], arg_index: list[int],
               kw_names: list[str], write_back: list[int], out: Any, gs: Any,
               held: Sequence[Any] = ()) -> Entry | str:
        parts = result_parts(out, dev.device, statics, list(held))
        if isinstance(parts, str):
            return parts
        return Entry(graph=graph, device=dev, statics=statics, arg_index=arg_index, kw_names=kw_names,
                     write_back=write_back, outputs=parts.outputs, leaves=parts.leaves, slots=parts.slots,
                     spec=parts.spec, objects=parts.objects, copied=parts.copied, views=parts.views,
                     unflatten=parts.unflatten, global_state=gs, clone=self.clone,
                     inference=any(s.is_inference() for s in statics))

    def explain(self) -> str:
        lines = [f"whole-call graphs: {self.captures} captured, {self.replays} replays"]
        if self.baseline:
            lines.append(f"  {self.baseline}")
        for key, entry in (self.current.entries.items() if self.current is not None else ()):
            when = ("launched before its state checks" if entry.speculative else
                    "checked before its launch: it writes " +
                    ("its inputs" if entry.write_back else "a parameter, buffer or other tensor"))
            if entry.native is not None:
                when += " (arguments compared, copied in and launched in C++)"
            lines.append(f"  {_describe(key)}: {entry.replays} replays, {when}")
            if entry.sets is not None:
                lines.append(f"    outputs lent from {len(entry.sets.sets)} sets in turn; copied in "
                             f"{entry.sets.copied} replays, which found every set held by the caller")
            elif entry.lending:
                lines.append(f"    {entry.lending}")
            kept = len(self.current.others.get(key, ())) if self.current is not None else 0
            if kept:
                lines.append(f"    and {kept} graph(s) of it captured under other global settings (autocast, "
                             "default dtype, cuDNN's switches...), replayed under them")
        by_reason: dict[str, list[Any]] = {}
        for key, reason in self.refused.items():
            by_reason.setdefault(reason, []).append(key)
        for reason, keys in by_reason.items():
            more = f" (and {len(keys) - 3} more calls)" if len(keys) > 3 else ""
            lines.extend(f"  {_describe(key)}: on Dynamo's path: {reason}{more if i == 2 else ''}"
                         for i, key in enumerate(keys[:3]))
        if self.note and self.note not in self.refused.values():
            lines.append(f"  last miss: {self.note}")
        return "\n".join(lines)


def _metas(entry: Entry) -> list[tuple[Any, Any]]:
    return [(o.shape, o.dtype) for o in entry.outputs]


def _same_parts(parts: Any, entry: Entry) -> bool:
    """Whether a capture's result taken apart (or why it cannot be) is as ``entry``'s."""
    return (not isinstance(parts, str) and parts.spec == entry.spec and parts.slots == entry.slots
            and len(parts.objects) == len(entry.objects)
            and _layouts(parts.outputs) == _layouts(entry.outputs))


def _layouts(outputs: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    return [(o.shape, o.stride(), o.dtype, o.device) for o in outputs]


def _describe(key: Any) -> str:
    parts = []
    for k in key[:-1]:
        meta = k[1] if isinstance(k, tuple) and len(k) == 2 and isinstance(k[0], str) else k
        if isinstance(meta, tuple) and meta and isinstance(meta[0], torch.Size):
            parts.append(f"{tuple(meta[0])} {str(meta[2]).replace('torch.', '')}")
        else:
            parts.append(repr(meta[1]) if isinstance(meta, tuple) and len(meta) == 2 else "?")
    return f"call({', '.join(parts)})"


def _versions(tensors: Sequence[torch.Tensor]) -> list[int | None]:
    """Each tensor's version counter, which every in-place write bumps; None for an inference tensor."""
    return [None if t.is_inference() else t._version for t in tensors]


def _one_cuda_device(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[torch.device | None, str]:
    """The one CUDA device of the call's tensors, or None and why there is none."""
    params = [a for a in itertools.chain(args, kwargs.values()) if isinstance(a, torch.Tensor)]
    devices = {t.device for t in params}
    if not devices:
        return None, "no tensor argument: nothing says which GPU to capture on"
    if len(devices) > 1:
        return None, "tensor arguments on several devices"
    device = next(iter(devices))
    if device.type != "cuda":
        return None, f"the arguments are on the {device.type.upper()}: whole-call graphs are CUDA graphs"
    return device, ""
