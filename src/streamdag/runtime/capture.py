"""Recorded graphs on CUDA: captured once into a multi-stream CUDA graph, then replayed.

Capture forks side streams from a capture stream with an event, runs every
op on its scheduled side stream after exactly the schedule's waits, and joins
every side stream back. The runtime's own streams never take part in a
capture, so a failed capture cannot leave them in capture mode. Nor do
PyTorch's pooled streams, which any ``torch.cuda.Stream()`` may hand out
again: work another thread put on such a stream during a capture would be
captured into the graph instead of run, or would end the capture in an
error. A runner captures on CUDA streams of its own (made by the torch
extension, as a runtime's are), kept while it lives, so that its candidates
and recaptures reuse them.

The stream count is chosen by measurement: the schedule is captured for one
stream, for more, and for the count the cost model (:mod:`..schedule.cost`,
fed with per-op times from the graph's first, timed run) estimates best;
each candidate's replay is timed with CUDA events, and the fastest wins. One
stream is always a candidate, so a graph whose ops would not gain from
concurrency runs as a single-stream graph: never slower than the best
single-stream baseline.

A capture stays valid while every tensor argument keeps its address, shape
and strides; a change recaptures (``statistics()`` counts it). (A buffer
an op declares that has other memory than at recording is refused before,
by the graph's run: see ``declared.py``.)

A graph over several GPUs is captured into one multi-device CUDA graph: side
streams on every device fork from the capture stream (on the first device)
and join it again, and peer copies join through PyTorch's fences. Only the
first device's allocations go to the graph's private memory pool, so such a
graph must not allocate on the others: after a warm-up run on the same side
streams (which sets up library workspaces), any allocation on another device
during the capture rejects it, and the graph runs as a host replay instead.
"""

from __future__ import annotations

import functools
import gc
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .._diagnostics import get_logger
from ..backends.capture_memory import stream_reuse
from ..backends.cuda import _OwnStreams
from ..graph.buffers import region_of
from ..native import load_torch
from ..schedule.cost import simulate
from ..schedule.plan import Schedule
from .accel import build_schedule, pin_ops

if TYPE_CHECKING:
    from .recorded import RecordedGraph

__all__ = ["CaptureRuntime", "CaptureStatistics", "CudaGraphRunner"]


class CaptureRuntime(Protocol):
    """What a capture needs of the runtime of the graph it captures (``RecordedGraph._rt``): its
    backends (their peer-copy streams) and its streams (a copy stream's kind)."""

    backends: list[Any]
    _streams: list[Any]

_log = get_logger(__name__)


@dataclass
class CaptureStatistics:
    captures: int = 0
    replays: int = 0
    recaptures: int = 0
    fallbacks: int = 0
    choice_ms: dict[int, float] = field(default_factory=dict)
    estimate_ms: dict[int, float] = field(default_factory=dict)
    #: each op's GPU time (ms) in the one timed run, by op name (single-device graphs)
    op_ms: dict[str, float] = field(default_factory=dict)
    chosen_streams: int | None = None
    capture_seconds: float = 0.0


class _OpFailed(RuntimeError):
    def __init__(self, op_name: str, cause: BaseException) -> None:
        super().__init__(f"op {op_name!r} failed in the timed run: {cause}")


_CYCLES_PER_MS: dict[Any, float] = {}


def _cycles_per_ms(device: torch.device) -> float:
    """How many ``torch.cuda._sleep`` cycles make a millisecond on this GPU (measured once)."""
    if device not in _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS[device] = 1_000_000 / max(start.elapsed_time(end), 1e-3)
    return _CYCLES_PER_MS[device]


class CaptureFailed(RuntimeError):
    def __init__(self, op_name: str, cause: BaseException) -> None:
        super().__init__(f"op {op_name!r} cannot be captured into a CUDA graph: {cause}")
        self.op_name = op_name


def _tensors_in(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors_in(o)


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, values: list[Any], schedule: Schedule,
                 accesses: list[list[Any]], compute_streams: int) -> None:
        self.graph = graph
        self.values = values
        self.schedule = schedule  # copies on their copy streams
        self.compute_streams = compute_streams
        # results in the graph's private pool are copied out after each replay;
        # results that are the op's own declared outputs are returned as they are
        self.copy_out = [isinstance(v, torch.Tensor) and not _declared(acc, v)
                         for v, acc in zip(values, accesses)]
        self.any_copy_out = any(self.copy_out)

    def results(self, copy_out: bool) -> list[Any]:
        if not (copy_out and self.any_copy_out):  # (a loop over every op's value per replay otherwise)
            return list(self.values)
        return [v.clone() if c else v for v, c in zip(self.values, self.copy_out)]


class CudaGraphRunner:
    """Captures and replays one recorded graph."""

    def __init__(self, recorded: RecordedGraph, device: torch.device,
                 groups: list[int] | None = None, devices: list[torch.device] | None = None) -> None:
        self.recorded = recorded
        self.device = device
        #: for a graph over several devices: the device (index into ``devices``) of each op
        self.groups = groups
        self.devices: list[Any] = devices or [device]
        #: the streams it captures on, by role; ``_own`` holds the addresses of those it made,
        #: per device, given back for other runners and runtimes once it is gone
        self._streams: dict[tuple[Any, ...], torch.cuda.Stream] = {}
        self._own: dict[int, list[int]] = {}
        weakref.finalize(self, _give_back, self._own)
        self.stats: CaptureStatistics = CaptureStatistics()
        self._captured: _Captured | None = None
        self._tensors: list[torch.Tensor] = []
        self._layouts_unchanged: Callable[[], bool] = _never_captured
        self._failed: str | None = None
        self._pool = torch.cuda.graph_pool_handle()

    @property
    def fallback_reason(self) -> str | None:
        return self._failed

    def ready(self) -> bool:
        """Whether a replay may go ahead without a capture first: captured, with every tensor
        argument where and as it was."""
        return self._failed is None and self._captured is not None and self._still_valid()

    def _still_valid(self) -> bool:
        """Whether every tensor argument still has the address, shape and strides it was captured
        with: what in-place ``set_``, ``resize_``, ``t_`` or ``as_strided_`` change (a square
        ``t_()`` changes the strides only). Runs before every replay (see ``_layout_check``)."""
        return self._layouts_unchanged()

    def _stream(self, device: torch.device, *role: Any) -> torch.cuda.Stream:
        """The runner's stream for ``role`` on ``device``: made once, its own where it can be."""
        key = (device, *role)
        if key not in self._streams:
            self._streams[key] = _private_stream(device, self._own)
        return self._streams[key]

    def _side_streams(self, sched: Schedule, max_streams: int) -> list[torch.cuda.Stream]:
        """The schedule's streams; over several devices, ``max_streams`` per device in turn.
        Candidates share them: they are captured one after another (and warmed up on them)."""
        if self.groups is None:
            return [self._stream(self.device, "side", s) for s in range(sched.num_streams)]
        return [self._stream(self.devices[s // max_streams], "side", s % max_streams)
                for s in range(sched.num_streams)]

    def _copy_stream(self, device: str, kind: str) -> torch.cuda.Stream:
        """The side stream for copies of one kind on one device."""
        return self._stream(torch.device(device), "copy", kind)

    def _warm_up(self, stream_of: list[int], side: list[torch.cuda.Stream]) -> None:
        """Run every op once, in order, on its side stream: libraries set up per-stream state here."""
        for s in side:
            s.wait_stream(torch.cuda.current_stream(s.device))
        for v, rec in enumerate(self.recorded._ops):
            with torch.cuda.stream(side[stream_of[v]]):
                rec.fn(*rec.args, **rec.kwargs)
            side[stream_of[v]].synchronize()

    def _copy_keys(self) -> list[tuple[str, str] | None]:
        """Per op: the (device, kind) of the copy stream it is pinned to, or None for compute."""
        runtime: CaptureRuntime = self.recorded._rt
        streams = runtime._streams
        return [None if rec.stream is None else (rec.device, streams[rec.stream].kind)
                for rec in self.recorded._ops]

    def _schedule(self, max_streams: int) -> tuple[Schedule, Schedule]:
        """The compute schedule for ``max_streams``, and the same with each copy on its copy stream.

        Copies pinned to a copy stream (host<->device, peer) get a stream of their
        own per device and kind, so that they overlap compute inside the graph as
        they do outside it.
        """
        base = build_schedule(self.recorded._preds, max_streams, groups=self.groups)
        return base, pin_ops(base, self._copy_keys())

    def _capture(self, max_streams: int) -> _Captured:
        ops = self.recorded._ops
        base, sched = self._schedule(max_streams)
        side = self._side_streams(base, max_streams)
        side += [self._copy_stream(*key) for key in dict.fromkeys(k for k in self._copy_keys() if k)]
        stream_of, waits = sched.stream, sched.waits
        needs_event = {u for ws in waits for u in ws}
        graph = torch.cuda.CUDAGraph()
        origin = self._stream(self.device, "origin")
        others = [d for d in self.devices if d != self.device]
        if others:
            try:
                self._warm_up(stream_of, side)
            except Exception as exc:
                raise CaptureFailed("<warm-up>", exc) from exc
            allocations = [_allocations(d) for d in others]
        origin.wait_stream(torch.cuda.current_stream(self.device))
        values: list[Any] = [None] * len(ops)
        current = "<fork>"
        failure: BaseException | None = None
        try:
            with _collector_paused(), stream_reuse(), torch.cuda.graph(
                    graph, pool=self._pool, stream=origin, capture_error_mode="thread_local"):
                fork = torch.cuda.Event()
                fork.record(origin)
                for s in side:
                    s.wait_event(fork)
                events: dict[int, torch.cuda.Event] = {}
                try:
                    for v, rec in enumerate(ops):
                        current = rec.name
                        s = side[stream_of[v]]
                        for u in waits[v]:
                            s.wait_event(events[u])
                        with torch.cuda.stream(s):
                            values[v] = rec.fn(*rec.args, **rec.kwargs)
                        if v in needs_event:
                            ev = torch.cuda.Event()
                            ev.record(s)
                            events[v] = ev
                except Exception as exc:
                    failure = exc
                for s in side + _capturing_peer_streams(self.recorded):  # always join: the capture ends
                    ev = torch.cuda.Event()
                    ev.record(s)
                    origin.wait_event(ev)
        except Exception as exc:
            raise CaptureFailed(current, failure or exc) from exc
        if failure is not None:
            raise CaptureFailed(current, failure) from failure
        if others and [_allocations(d) for d in others] != allocations:
            raise CaptureFailed("<several devices>", RuntimeError(
                "ops allocated memory on another GPU than the first during capture, which a CUDA "
                "graph over several GPUs cannot own; write into preallocated outputs (out=, in place)"))
        return _Captured(graph, values, sched, [rec.accesses for rec in ops], base.num_streams)

    def _time_ops(self) -> list[float]:
        """One profiled run of the ops, in order on one stream: each op's GPU time (ms).

        The stream first sleeps on the GPU for longer than the host takes to
        enqueue the run, so that the events around each op time the op itself,
        not the host's launch gaps.
        """
        ops = self.recorded._ops
        stream = self._stream(self.device, "timing")
        stream.wait_stream(torch.cuda.current_stream(self.device))
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(ops) + 1)]
        host_ms = getattr(self.recorded, "first_run_host_ms", None) or 1.0
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(_cycles_per_ms(self.device) * (2.0 * host_ms + 0.2)))
            events[0].record(stream)
            for i, rec in enumerate(ops):
                try:
                    rec.fn(*rec.args, **rec.kwargs)
                except Exception as exc:
                    raise _OpFailed(rec.name, exc) from exc
                events[i + 1].record(stream)
        events[-1].synchronize()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return [events[i].elapsed_time(events[i + 1]) for i in range(len(ops))]

    def _time(self, captured: _Captured, reps: int = 5) -> float:
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        captured.graph.replay()
        times = []
        for _ in range(reps):
            start.record(stream)
            captured.graph.replay()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    def prepare(self, max_streams: int, before_capture: Any = None) -> bool:
        """Capture (choosing the stream count by measurement); False if the graph must run eagerly."""
        if self._failed is not None:
            return False
        if self._captured is not None and self._still_valid():
            return True
        if self._captured is not None:
            self.stats.recaptures += 1
        if before_capture is not None:
            before_capture()
        t0 = time.perf_counter()
        natural = build_schedule(self.recorded._preds, max_streams).num_streams
        candidates = {1, min(4, natural), natural}
        if self.groups is not None:  # over several devices: streams per device
            candidates = {1, max_streams}
            natural = 1  # the op-by-op timing below runs on one device's stream
        best: tuple[float, _Captured] | None = None
        restore = _writes_saved(self.recorded._ops)  # timing runs and replays must not change them
        try:
            if self.groups is None and (natural > 1 or self.recorded.time_ops):
                durations = self._time_ops()  # for the cost model here, and for batching's choice
                self.stats.op_ms = dict(zip(self.recorded.names, durations))
            if natural > 1:
                engines = [key[1] if key else "compute" for key in self._copy_keys()]
                for k in sorted({1, 2, 4, 8, 16, natural}):
                    if k <= natural:
                        self.stats.estimate_ms[k] = simulate(self._schedule(k)[1], durations,
                                                             engines=engines)
                # the cost model's pick is measured with the others
                candidates.add(min(self.stats.estimate_ms, key=self.stats.estimate_ms.get))
            for k in sorted(candidates):
                cap = self._capture(k)
                self.stats.captures += 1
                if len(candidates) > 1:
                    ms = self._time(cap)
                    self.stats.choice_ms[k] = ms
                else:
                    ms = 0.0
                if best is None or ms < best[0]:
                    best = (ms, cap)
        except (CaptureFailed, _OpFailed) as exc:
            self._failed = str(exc)
            self.stats.fallbacks += 1
            _log.info("CUDA graph capture failed, the graph runs on streams: %s", exc)
            torch.cuda.synchronize(self.device)
            _restore_random_generators(self.devices)
            return False
        finally:
            if self.groups is not None:  # replays ran on the first device's stream: wait for all of them
                for d in self.devices:
                    torch.cuda.synchronize(d)
            restore()
        assert best is not None
        self._captured = best[1]
        self.stats.chosen_streams = best[1].compute_streams
        _log.info("CUDA graph: %d stream(s) chosen by timed replays (%s)", best[1].compute_streams,
                  ", ".join(f"{k} stream(s) {ms:.3f} ms" for k, ms in sorted(self.stats.choice_ms.items())))
        seen: dict[int, torch.Tensor] = {}
        for op in self.recorded._ops:
            for t in _tensors_in((op.args, op.kwargs)):
                seen.setdefault(id(t), t)
        self._tensors = list(seen.values())
        self._layouts_unchanged = _layout_check(self._tensors)
        self.stats.capture_seconds = time.perf_counter() - t0
        return True

    def replay(self) -> list[Any]:
        """Replay on the current stream; tensor results not in declared writes are copied out."""
        cap = self._captured
        assert cap is not None
        cap.graph.replay()
        self.stats.replays += 1
        return cap.results(self.recorded.copy_out)


def _writes_saved(ops: Sequence[Any]) -> Callable[[], None]:
    """A copy of every tensor the ops declare written, and a function that puts it back: the ops
    run more often while a graph is timed and captured than the call that captures it asks for, and
    an op that updates a tensor in place (a batch norm's running statistics) must update it once."""
    written = [t for rec in ops for t in rec.written if isinstance(t, torch.Tensor)]
    saved = [t.clone() for t in written]

    def restore() -> None:
        with torch.inference_mode():  # which also allows writing inference tensors
            for t, copy in zip(written, saved):
                t.copy_(copy)
    return restore


def _never_captured() -> bool:
    return False


def _layout_check(tensors: list[torch.Tensor]) -> Callable[[], bool]:
    """A check that each of ``tensors`` still has its address, shape and strides of now.

    One loop of the torch extension's over a snapshot in bytes where it is
    loaded, else PyTorch's own C++ checks of all the tensors at once (a Python
    call per tensor costs more still). For the 258 tensors of the tiny wide
    graph on the H100: 3.8 µs against 60 µs, and g.run()'s host time 74 µs
    against 135.
    """
    ext = load_torch()
    if ext is not None:
        return functools.partial(ext.same_layouts, tensors, ext.layouts(tensors))
    return _checked_by_pytorch(tensors)


def _checked_by_pytorch(tensors: list[torch.Tensor]) -> Callable[[], bool]:
    """The layout check of ``_layout_check`` through PyTorch's own C++ checks."""
    ptrs, layouts = [t.data_ptr() for t in tensors], [(t.shape, t.stride()) for t in tensors]
    indices, guard = list(range(len(tensors))), _layout_guard(tensors)
    same_ptrs = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)

    def unchanged() -> bool:
        if same_ptrs is None:
            if [t.data_ptr() for t in tensors] != ptrs:
                return False
        elif not same_ptrs(tensors, ptrs, indices):  # one C++ loop instead of a Python call per tensor
            return False
        if guard is not None and guard.check(*tensors):  # sizes and strides unchanged (and more)
            return True
        # the guard also fails for what does not matter here (dtype, requires_grad, inference mode)
        return [(t.shape, t.stride()) for t in tensors] == layouts

    return unchanged


def _layout_guard(tensors: list[torch.Tensor]) -> Any:
    """PyTorch's C++ check of many tensors' sizes and strides (what Dynamo guards with), or None.

    Its ``check(*tensors)`` is True only if every size and stride is as now,
    among other properties (dtype, device, requires_grad, dispatch keys), so a
    False needs a closer look but a True needs none.
    """
    try:
        from torch._C._dynamo.guards import TensorGuards

        return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except Exception:  # not in this PyTorch build: the Python comparison does the work
        return None


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No automatic cyclic garbage collection while a capture runs (``torch.cuda.graph`` collects
    once as it starts). A collection runs, in the thread that triggers it, the finalizers of
    what it frees; a PyTorch object freed then (a CUDA event, an earlier CUDA graph) makes CUDA
    calls that a capture forbids: an earlier graph's ``reset`` fails with "operation not
    permitted when stream is capturing" and the capture is invalidated, a rare and
    timing-dependent failure; a cuda test reproduces it without the pause
    (``test_a_graph_the_collector_frees_during_a_capture_does_not_fail_it``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _restore_random_generators(devices: list[torch.device]) -> None:
    """Take each device's default CUDA generator out of capture state if a failed capture left it there.

    A capture that CUDA invalidates ends without PyTorch's generator epilogue
    (PyTorch 2.11 keeps one capture flag per generator), so every later random
    op in the process fails with "Offset increment outside graph capture". A
    one-element draw finds out (it raises before launching anything); a stuck
    generator gets a fresh state with the same seed and offset, and a healthy
    one gets its offset back, so the user's random numbers are as without the probe.
    """
    for device in devices:
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        offset = generator.get_offset()
        try:
            torch.empty(1, device=device).uniform_()
        except RuntimeError as exc:
            if "outside graph capture" in str(exc):
                generator.graphsafe_set_state(generator.clone_state())
        else:
            generator.set_offset(offset)


def _private_stream(device: torch.device, own: dict[int, list[int]]) -> torch.cuda.Stream:
    """A CUDA stream on ``device`` that no ``torch.cuda.Stream()`` hands out (its address noted in
    ``own``); one from PyTorch's pool without the torch extension."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    taken = _OwnStreams.take(index, 1)
    if taken is None:
        return torch.cuda.Stream(device)
    own.setdefault(index, []).extend(taken)
    return torch.cuda.ExternalStream(taken[0], device=torch.device("cuda", index))


def _give_back(own: dict[int, list[int]]) -> None:
    """A gone runner's streams, for others. Its graph went with it, and a graph's replay runs on
    the caller's stream, not on the streams it was captured on."""
    for index, addresses in own.items():
        _OwnStreams.give_back(index, addresses)


def _allocations(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("allocation.all.allocated", 0)


def _capturing_peer_streams(recorded: Any) -> list[torch.cuda.Stream]:
    """The source-side streams of peer copies that joined the capture (through PyTorch's fences)."""
    out = []
    runtime: CaptureRuntime = recorded._rt
    for backend in getattr(runtime, "backends", ()):
        peer = getattr(backend, "peer_out", None)
        if peer is None:
            continue
        with torch.cuda.stream(peer):
            if torch.cuda.is_current_stream_capturing():
                out.append(peer)
    return out


def _declared(accesses: list[Any], value: torch.Tensor) -> bool:
    r = region_of(value)
    return any(a.write and a.region.covers(r) for a in accesses)
