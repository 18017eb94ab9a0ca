"""``streamdag.compile``: a PyTorch function or module, traced to aten ops and run as a streamdag graph.

Per set of input shapes, dtypes and devices (the guard), the function is
traced once with ``make_fx`` (PyTorch's own tracer), every node becomes an op
whose accesses come from its schema (:mod:`.fx_ops`), and the ops are
recorded into a :class:`~streamdag.RecordedGraph` on a runtime for the
inputs' device. On CUDA the graph runs eagerly once, is then captured into a
multi-stream CUDA graph and replayed; on the CPU it runs on worker lanes.

Calls copy their inputs into the graph's static inputs, except parameters
(``nn.Parameter``, as Dynamo passes them), which the graph reads in place;
a different parameter object is a different specialization. A module's own
state is guarded too (:mod:`.module_state`): its training flag, which
parameters, buffers and submodules it has, and its plain Python attributes.
Specializations are kept per state, so ``.train()`` and ``.eval()`` each
trace once; a replaced attribute traces again. Tracing is serialized across
threads and leaves every real tensor as it found it (:class:`_KeepRealTensors`).
Outputs keep the function's own types (:mod:`.outputs`). On a replay the
outputs are cloned on the caller's stream after it waits for the replay, so
they belong to the caller, survive later calls, and the call returns without
waiting for the GPU. Inputs the function mutates are written back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._diagnostics import get_logger, warn
from ..runtime.core import Runtime
from ..runtime.recorded import RecordedGraph
from .batch_choice import GroupEstimate, estimate_groups, paying_groups
from .batching import batch_independent_ops
from .fx_ops import ops_from_graph
from .module_state import ModuleState
from .outputs import CannotRebuild, flatten_outputs

__all__ = ["CompileStatistics", "Compiled", "compile"]

_log = get_logger(__name__)


@dataclass
class CompileStatistics:
    calls: int = 0
    traces: int = 0
    eager_calls: int = 0
    replays: int = 0
    guards: int = 0


def _guard(flat: list[Any]) -> tuple:
    key = []
    for v in flat:
        if isinstance(v, torch.nn.Parameter):  # bound directly: the graph reads it in place
            key.append(("P", v.data_ptr(), tuple(v.shape), v.stride(), v.dtype, v.device))
        elif isinstance(v, torch.Tensor):
            key.append(("T", tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad))
        else:
            try:
                hash(v)
                key.append(("V", v))
            except TypeError:
                key.append(("id", id(v)))
    return tuple(key)


#: make_fx patches ``nn.Module`` methods process-wide while it traces: one trace at a time
_TRACE_LOCK = threading.RLock()

_UNTRACED = object()

#: module states kept per compiled module (training and eval, say); the oldest goes first
_STATES_KEPT = 8


class _KeepRealTensors(TorchDispatchMode):
    """Undoes what tracing does to real tensors: the tracer runs an op whose tensors are all real
    (``num_batches_tracked.add_(1)``, a counter a function closes over) on those very tensors.
    The first value of each tensor such an op writes is saved, and put back by :meth:`restore`,
    so that the first call, which traces, updates it once, as every call does.
    """

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import is_fake
        from torch.utils._mode_utils import no_dispatch

        super().__init__()
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.is_fake = is_fake
        self.untraced = no_dispatch  # the tracer's modes come after this one: the copy is not traced

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if not any(map(self.is_fake, tensors)):  # all real: it runs on them
                for i, arg in enumerate(func._schema.arguments):
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        self._save(args[i] if i < len(args) else kwargs.get(arg.name))
        return func(*args, **kwargs)

    def _save(self, value: Any) -> None:
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and id(t) not in self.saved:
                with self.untraced():
                    self.saved[id(t)] = (t, t.clone())

    def restore(self) -> None:
        with torch.inference_mode():  # which also allows writing inference tensors
            for t, value in self.saved.values():
                t.copy_(value)


class _Entry:
    """One traced and scheduled specialization of the function."""

    def __init__(self, owner: Compiled, flat: list[Any], spec: Any, batch: bool = False,
                 only: frozenset | None = None) -> None:
        tensor_pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        constants = list(flat)

        def flat_fn(*tensors: torch.Tensor) -> Any:
            values = list(constants)
            for i, t in zip(tensor_pos, tensors):
                values[i] = t
            args, kwargs = pytree.tree_unflatten(values, spec)
            outputs, self.rebuild = flatten_outputs(owner._fn(*args, **kwargs))
            return outputs  # the graph returns tensors only; calls rebuild the function's output

        from torch.fx.experimental.proxy_tensor import make_fx

        examples = [flat[i] for i in tensor_pos]
        # fake tensors: nothing runs, inputs stay as they are, and control flow that
        # depends on data raises (it would be baked in) instead of tracing one branch
        keep = _KeepRealTensors()
        try:
            with torch.no_grad(), keep:
                gm = make_fx(flat_fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*examples)
        finally:
            keep.restore()
        self.label = "streams"
        self.stacked = None
        self.batch_report = None
        if batch:
            with torch.inference_mode(False):  # stacked copies are written outside inference mode too
                gm, self.stacked, self.batch_report = batch_independent_ops(gm, only)
        self.gm = gm
        self.tensor_pos = tensor_pos
        # the device of the inputs, or of the tensors the function closes over when it takes none
        consts = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
        device = next((t.device for t in [*examples, *consts]
                       if isinstance(t, torch.Tensor) and t.device.type != "cpu"), torch.device("cpu"))
        self.runtime = owner._runtime_for(device)
        ops, placeholders, output_arg, output_reads = ops_from_graph(gm)
        with torch.inference_mode(False):  # written by calls in and out of inference mode
            self.static_inputs = [
                t if isinstance(t, torch.nn.Parameter)
                else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
                for t in examples
            ]
        self.env: dict[torch.fx.Node, Any] = {}
        self.base_env: dict[torch.fx.Node, Any] = dict(zip(placeholders, self.static_inputs))
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                self.base_env[node] = getattr(gm, node.target)
        self.mutated_inputs = sorted({i for op in ops for i in op.writes_inputs})
        graph = RecordedGraph(self.runtime, copy_out=False)  # outputs are cloned by the caller
        graph.time_ops = True  # each op's GPU time feeds the choice between batching and streams
        env = self.env
        for op in ops:  # the real tensors it writes: capture's timing runs put them back
            written = [self.base_env[n] for n in op.writes_roots]
            graph.add(lambda run=op.run: run(env), (), {}, op.accesses, op.node.name, written=written)
        graph.add(lambda: torch.fx.node.map_arg(output_arg, env.__getitem__), (), {}, output_reads,
                  "outputs")
        graph.finish()
        self.graph = graph
        self.output_arg = output_arg
        self.lock = threading.Lock()
        self.replayed = torch.cuda.Event() if device.type == "cuda" else None

    def __call__(self, flat: list[Any]) -> Any:
        tensors = [flat[i] for i in self.tensor_pos]
        with self.lock:
            if self.stacked is not None:  # constants changed since they were stacked are copied in
                self.stacked.refresh()
            for static, t in zip(self.static_inputs, tensors):
                if static is not t:
                    static.copy_(t)
            if self.graph.captured:
                outputs, captured = self._replay_here(), True
            else:  # eager runs and the capture read the environment
                self.env.clear()
                self.env.update(self.base_env)
                future = self.graph.run()
                captured = self.graph.last_run_captured
                outputs = self._replayed_outputs() if captured else future.result()[-1]
            for i in self.mutated_inputs:
                if tensors[i] is not self.static_inputs[i]:
                    tensors[i].copy_(self.static_inputs[i])
        return self.rebuild(iter(outputs)), captured

    def _replay_here(self) -> Any:
        """Replay on the caller's stream: ordered with the caller's work, no runtime op needed.

        The graph's memory is its own (static inputs, its pool, parameters it reads),
        so nothing else in the runtime can conflict with it.
        """
        self.graph.replay_on_current_stream()
        static = self.graph.static_values()[-1]
        return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, static)

    def _replayed_outputs(self) -> Any:
        static = self.graph.static_values()[-1]
        self.replayed.record(self.runtime.backend.streams[0])  # the replay ran there
        torch.cuda.current_stream().wait_event(self.replayed)
        return pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, static)


class _Specialization:
    """The variants traced for one guard key (with and without batching), and the one that runs.

    With two variants on a GPU, calls alternate between them until each has
    replayed three times. Then the cost model estimates every batched group
    from the op times measured while capturing (:mod:`.batch_choice`); when
    some groups pay and others do not, a third variant batching only those
    that pay joins the race. The fastest by CUDA-event timing then runs alone.
    """

    SAMPLES = 3

    def __init__(self, variants: list[_Entry], make_variant: Callable[[list[Any], frozenset], _Entry]
                 | None = None) -> None:
        self.variants = variants
        self.chosen: int | None = 0 if len(variants) == 1 else None
        self.samples: list[list[tuple[Any, Any]]] = [[] for _ in variants]
        self.choice_ms: dict[str, float] = {}
        self.group_estimates: list[GroupEstimate] = []
        self._make_variant = make_variant
        self._turn = 0

    def __call__(self, flat: list[Any]) -> tuple[Any, bool]:
        if self.chosen is not None:
            return self.variants[self.chosen](flat)
        i = self._turn % len(self.variants)
        self._turn += 1
        entry = self.variants[i]
        if not entry.graph.captured:
            return entry(flat)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = entry(flat)
        end.record()
        self.samples[i].append((start, end))
        if all(len(s) >= self.SAMPLES for s in self.samples):
            ms = []
            for s in self.samples:
                s[-1][1].synchronize()
                ms.append(sorted(a.elapsed_time(b) for a, b in s)[len(s) // 2])
            self.choice_ms = {v.label: t for v, t in zip(self.variants, ms)}
            if not self._add_mixed_variant(flat):
                self.chosen = min(range(len(ms)), key=ms.__getitem__)
        return result

    def _add_mixed_variant(self, flat: list[Any]) -> bool:
        """Estimate each batched group; add a variant with only the paying ones if that is new."""
        make, self._make_variant = self._make_variant, None
        if make is None or len(self.variants) != 2:
            return False
        plain, batched = self.variants
        plain_stats, batched_stats = plain.graph.statistics(), batched.graph.statistics()
        if plain_stats is None or batched_stats is None or not plain_stats.op_ms or not batched_stats.op_ms:
            return False
        groups = batched.batch_report.groups
        self.group_estimates = estimate_groups(groups, plain_stats.op_ms, batched_stats.op_ms,
                                               plain_stats.chosen_streams or 1)
        inputs_of = {n.name: [a.name for a in n.all_input_nodes] for n in plain.gm.graph.nodes}
        only = paying_groups(self.group_estimates, groups, inputs_of)
        _log.info("batching: %s", "; ".join(str(e) for e in self.group_estimates))
        if only is None:
            _log.info("batching: no variant batching only the paying groups (all or none of them pay)")
            return False
        mixed = make(flat, only)
        if not mixed.batch_report.groups:
            return False
        mixed.label = "batched where it pays"
        self.variants.append(mixed)
        self.samples.append([])
        return True

    @property
    def entry(self) -> _Entry:
        return self.variants[self.chosen or 0]


class Compiled:
    """The callable :func:`compile` returns. ``statistics()`` counts traces, replays and eager calls."""

    def __init__(self, fn: Callable[..., Any], streams: int | None = None,
                 device: str | None = None, batch: bool | str = "auto", guard_module: bool = True) -> None:
        self._fn = fn
        self._streams = streams
        self._device = device
        self._batch = batch
        self._entries: dict[tuple, _Specialization | None] = {}  # those of the module's state now
        self._runtimes: dict[str, Runtime] = {}
        self._stats = CompileStatistics()
        self._warned: set[str] = set()
        self._eager_reasons: dict[str, None] = {}
        # the module whose state the graphs bake in: fn itself, or the module of a bound method
        root = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
        self._root = root if guard_module and isinstance(root, torch.nn.Module) else None
        self._state: ModuleState | None = None  # the state self._entries were traced for
        self._states: list[tuple[ModuleState, dict]] = []  # every state kept, with its entries
        self._retraces = 0
        self.__wrapped__ = fn

    def _runtime_for(self, device: torch.device) -> Runtime:
        name = "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"
        if name == "cpu" and self._device is not None:  # e.g. "sim" for tests
            name = self._device
        if name not in self._runtimes:
            self._runtimes[name] = Runtime(name, streams=self._streams, max_inflight=100_000)
        return self._runtimes[name]

    def _warn(self, reason: str) -> None:
        """Say once why calls run eagerly; ``explain()`` says it too."""
        self._eager_reasons[reason] = None
        self._note(f"running eagerly: {reason}", reason)

    def _note(self, message: str, once_key: str) -> None:
        if once_key not in self._warned:
            self._warned.add(once_key)
            warn(f"streamdag.compile: {message}")

    def statistics(self) -> CompileStatistics:
        return CompileStatistics(**vars(self._stats))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._stats.calls += 1
        flat, spec = pytree.tree_flatten((args, kwargs))
        needs_grad = torch.is_grad_enabled() and (
            any(isinstance(v, torch.Tensor) and v.requires_grad for v in flat)
            or any(p.requires_grad for p in _parameters(self._fn))
        )
        if needs_grad:
            self._warn("gradients are enabled; streamdag.compile runs inference graphs: call it "
                       "under torch.inference_mode() or torch.no_grad(), or set requires_grad=False")
            self._stats.eager_calls += 1
            return self._fn(*args, **kwargs)
        key = _guard(flat)
        entries = self._entries if self._root is None else self._entries_for_state()
        entry = entries.get(key, _UNTRACED)
        if entry is _UNTRACED:
            entry = self._trace(entries, key, flat, spec)
        if entry is None:
            self._stats.eager_calls += 1
            return self._fn(*args, **kwargs)
        outputs, captured = entry(flat)
        self._stats.replays += captured
        return outputs

    def _trace(self, entries: dict, key: tuple, flat: list[Any], spec: Any) -> _Specialization | None:
        with _TRACE_LOCK:
            if key in entries:  # traced by another thread meanwhile
                return entries[key]
            self._stats.guards += 1
            self._stats.traces += 1
            try:
                entries[key] = self._specialize(flat, spec)
            except CannotRebuild as exc:
                entries[key] = None
                self._warn(str(exc))
            except Exception as exc:  # not traceable: say why once, then run as written
                entries[key] = None
                self._warn(f"tracing failed ({type(exc).__name__}: {exc})")
            if self._state is not None and entries is self._entries and not self._state.holds():
                self._state.take()  # the forward set attributes while it was traced
            return entries[key]

    def _entries_for_state(self) -> dict:
        """The specializations traced for the module's state now; none yet for a new state."""
        if self._state is not None and self._state.holds():
            return self._entries
        with _TRACE_LOCK:
            for state, entries in self._states:
                if state.holds():
                    self._state, self._entries = state, entries
                    return entries
            changed = self._state.changed() if self._state is not None else ""
            self._state, self._entries = ModuleState(self._root), {}
            self._states = [*self._states[-(_STATES_KEPT - 1):], (self._state, self._entries)]
            if self._state.opaque:
                self._note("changes inside these attributes after the first call are not seen, as "
                           "the graph has their values of then: " + ", ".join(self._state.opaque) +
                           "; assign a new object to such an attribute to make the module re-trace",
                           "opaque attributes")
            if changed:
                self._retraces += 1
                if self._retraces >= _STATES_KEPT:
                    self._note(f"the module was re-traced {self._retraces} times because its state "
                               f"changed (last: {changed}): a replaced parameter, buffer, submodule or "
                               "Python attribute traces it again; update tensors in place "
                               "(tensor.copy_()) and keep the attributes its forward reads fixed",
                               "re-traced")
            return self._entries

    def _specialize(self, flat: list[Any], spec: Any) -> _Specialization:
        plain = _Entry(self, flat, spec, batch=self._batch is True)
        plain.label = "batched" if self._batch is True else "streams"
        variants = [plain]
        if self._batch == "auto" and plain.runtime.device.startswith("cuda"):
            batched = _Entry(self, flat, spec, batch=True)
            batched.label = "batched"
            if batched.batch_report.groups:  # a second variant only where batching changed something
                variants.append(batched)
            elif batched.batch_report.inference_constants:  # explain() says why nothing was batched
                plain.batch_report = batched.batch_report
        return _Specialization(variants, lambda flat, only: self._traced_variant(flat, spec, only))

    def _traced_variant(self, flat: list[Any], spec: Any, only: frozenset) -> _Entry:
        with _TRACE_LOCK:
            return _Entry(self, flat, spec, True, only)

    def explain(self) -> str:
        """The schedule of every traced specialization, its batching, and the variant chosen."""
        parts = []
        for i, spec in enumerate(e for e in self._entries.values() if e is not None):
            head = f"specialization {i}"
            if spec.choice_ms:
                timed = ", ".join(f"{k} {v:.3f} ms" for k, v in spec.choice_ms.items())
                head += f": variant {spec.entry.label!r} chosen by timed replays ({timed})"
            if spec.group_estimates:
                head += "\ncost model, per batched group (members timed in the 'streams' variant, " \
                        "batched ops in 'batched'; groups that read each other's results are " \
                        "decided together):\n  " + "\n  ".join(map(str, spec.group_estimates))
            for entry in spec.variants:
                report = f"\n{entry.batch_report}" if entry.batch_report else ""
                parts.append(f"{head}\n[{entry.label}] on {entry.runtime.device}{report}\n"
                             f"{entry.graph.explain()}")
                head = ""
        parts += [f"runs eagerly: {reason}" for reason in self._eager_reasons]
        return "\n\n".join(parts) or "not traced yet: call the function once"

    def close(self) -> None:
        for rt in self._runtimes.values():
            rt.close()


def _parameters(fn: Any) -> list[torch.Tensor]:
    return list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []


def compile(fn: Callable[..., Any], *, streams: int | None = None, device: str | None = None,
            batch: bool | str = "auto") -> Compiled:
    """Make ``fn`` (a function or ``nn.Module``) run its independent operators concurrently.

    Inference only: call the result under ``torch.inference_mode()`` or
    ``torch.no_grad()``. On CUDA the schedule is captured into a multi-stream
    CUDA graph after the first call for each input signature.
    """
    if not callable(fn):
        raise TypeError(f"streamdag.compile needs a function or torch.nn.Module, got {type(fn).__name__}")
    return Compiled(fn, streams=streams, device=device, batch=batch)
