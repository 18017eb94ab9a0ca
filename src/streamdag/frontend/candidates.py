"""Candidates: ways to run one graph, each captured into a CUDA graph, timed, the fastest kept.

A candidate is a function of the graph's flat inputs (as Dynamo passes them):
the graph run eagerly, Inductor's whole-graph code on one stream, or Inductor's
regions on several streams. On CUDA each is captured into a CUDA graph over
*static inputs*: parameters and buffers are bound in place (the graph reads
them where they are, and a call whose parameters moved captures again), other
inputs are copied into tensors the graph owns (one ``_foreach_copy_``). Every
capture of one backend shares one memory pool: the graphs of one backend run
one after another on its callers' streams (:class:`SharedPool` orders a replay
after the previous one when the caller's stream changes), so one graph's
temporaries may reuse another's.

:func:`choose` replays the captured candidates in rounds, timed by CUDA events
on the caller's stream, and keeps the one with the lowest median. A candidate
on more streams must beat the best on fewer by more than ``tie`` (ties go to
fewer streams), and one that needs more than ``memory_ratio`` times the memory
of the leanest one-stream candidate, the graph's inputs (weights and all)
counted with each, is not kept. While they are
compared, each candidate is captured in a private pool (so its memory can be
read off the pool); the one kept is captured again in the shared pool.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.capture_memory import stream_reuse
from ..native import load_torch

__all__ = ["REGIONS", "Candidate", "CapturedGraph", "SharedPool", "capture_graph", "choose", "cudnn_settings",
           "pick", "region_candidates", "static_indices", "time_replays", "workspaces_in_pool"]


def cudnn_settings() -> tuple[bool, bool, bool]:
    """cuDNN's switches that change what a convolution computes: TF32, deterministic algorithms,
    cuDNN itself. A captured graph replays the kernels chosen under the switches of its capture,
    while eager code and uncaptured Inductor code read them at each call, and Dynamo's guards
    (``GlobalStateGuard``) leave them out; so a replay is only for calls under the same ones."""
    return (_cudnn_tf32(), torch._C._get_cudnn_deterministic(), torch._C._get_cudnn_enabled())


def _cudnn_tf32() -> Any:
    try:
        return torch._C._get_cudnn_allow_tf32()
    except RuntimeError:  # set per operator (``torch.backends.cudnn.conv.fp32_precision``), which the
        cudnn = torch.backends.cudnn  # flag of both then cannot say
        return (cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision)


#: the label of a graph's regions on N streams is REGIONS + str(N)
REGIONS = "regions x"


@dataclass
class Candidate:
    """One way to run the graph: ``run(args)`` returns the graph's outputs as a list or tuple."""

    label: str
    streams: int
    run: Callable[[list[Any]], Sequence[Any]]
    ms: float | None = None
    peak_mib: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self, chosen: bool, memory: str = "capture") -> str:
        """One line of ``explain()``: how it ran, its time and memory, why it failed, if it was chosen."""
        timing = "" if self.ms is None else f" {self.ms:.4f} ms"
        peak = "" if self.peak_mib is None else f", {memory} {self.peak_mib:.1f} MiB"
        extra = (f" ({self.error})" if self.error else "") + "".join(f" ({n})" for n in self.notes)
        mark = " <- chosen" if chosen else ""
        return f"candidate {self.label} on {self.streams} stream(s):{timing}{peak}{extra}{mark}"


def no_candidate_note(wanted: Sequence[str], region_note: str, tree_note: str, runs: str) -> str:
    """Why a training graph has none of the candidates ``wanted``, label by label (``region_note``:
    why it has no regions; ``tree_note``: why it is not under Inductor's CUDA graph trees), and
    which candidate (``runs``) runs instead."""
    said = []
    for label in wanted:
        kind = label.split(" ")[0]
        if kind == "cudagraphs":
            said.append("cudagraphs: Inductor's CUDA graph trees take training graphs on one CUDA device"
                        + (f" ({tree_note})" if tree_note else ""))
        elif kind == "eager":
            said.append("eager: a training graph's candidates are Inductor's code, whole or in regions")
        else:
            said.append(f"{label}: {region_note or 'not among the region plans compiled'}")
    return f"no candidate of {wanted!r} for this graph ({'; '.join(said)}): {runs} runs"


def region_candidates(top: int, wanted: Sequence[str] | None,
                      use: Callable[[int], Callable[[list[Any]], Sequence[Any]]]) -> list[Candidate]:
    """A graph's regions on 2 to ``top`` streams, ``use(k)`` running them on k; on one stream too
    where the candidates ``wanted`` name the kind (one stream is otherwise Inductor's own code)."""
    cands = [Candidate(f"{REGIONS}{k}", k, use(k)) for k in range(2, top + 1)]
    if wanted is not None and "regions" in wanted:
        cands.append(Candidate(f"{REGIONS}1", 1, use(1)))
    return cands


def static_indices(args: Sequence[Any]) -> list[int]:
    """Inputs the graph may read in place: parameters, and the buffers Dynamo marks as static."""
    return [i for i, a in enumerate(args) if isinstance(a, torch.nn.Parameter)
            or (isinstance(a, torch.Tensor) and getattr(a, "_dynamo_static_input_type", None) is not None)]


class SharedPool:
    """One CUDA graph memory pool per device for all the graphs of one backend."""

    def __init__(self) -> None:
        self._pools: dict[torch.device, Any] = {}
        self._last: dict[torch.device, torch.cuda.Stream] = {}
        self._last_raw: dict[torch.device, int] = {}  # the last replay's stream, as its CUDA handle
        self.lock: threading.RLock = threading.RLock()  # held by a capture into one of the pools

    def handle(self, device: torch.device) -> Any:
        if device not in self._pools:
            self._pools[device] = torch.cuda.graph_pool_handle()
        return self._pools[device]

    def discard(self, device: torch.device) -> None:
        """Later captures on ``device`` go to a new pool (see :func:`capture_graph`); the graphs
        captured into this one keep reading it."""
        self._pools.pop(device, None)

    def order(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        """Make ``stream`` follow the last replay in this pool when it ran on another stream."""
        last = self._last.get(device)
        if last is not None and last != stream:
            stream.wait_stream(last)
        self._last[device] = stream
        self._last_raw[device] = stream.cuda_stream

    def order_current(self, device: torch.device, index: int) -> None:
        """:meth:`order` for the current stream of device ``index``: a replay on the same stream as
        the last one (the usual case) costs one read of the current stream's handle, not a
        ``torch.cuda.current_stream()`` (a few microseconds)."""
        if self._last_raw.get(device) != torch._C._cuda_getCurrentRawStream(index):
            self.order(device, torch.cuda.current_stream(device))


def capture_graph(fn: Callable[[], Any], stream: torch.cuda.Stream, device: torch.device,
                  pool: SharedPool | None, error_mode: str = "global", beside: Any = None) -> tuple[Any, Any]:
    """``fn()`` captured into a new CUDA graph on ``stream``, in ``pool``'s memory pool (None: a
    pool of its own, all of which goes back when the graph goes), or in the pool of the graph
    ``beside`` (taking ``pool``'s lock): (the graph, ``fn``'s result).

    Captures into one shared pool take its lock: two at once would fail, and the cleanup of
    one would end the other's recording. A failed capture leaves the process as it found it:
    the caller's stream is current, the random generators are out of capture state (else
    every later random op fails), and the pool takes no more allocations. Where an earlier
    failed capture left the shared pool recording all the same ("already recording to
    mempool_id"), the capture goes to a new shared pool instead."""
    if beside is not None:
        with pool.lock if pool is not None else contextlib.nullcontext():
            return _capture_once(fn, stream, device, beside.pool(), False, error_mode)
    if pool is None:
        return _capture_once(fn, stream, device, torch.cuda.graph_pool_handle(), True, error_mode)
    with pool.lock:
        try:
            return _capture_once(fn, stream, device, pool.handle(device), False, error_mode)
        except RuntimeError as exc:
            if "already recording" not in str(exc):
                raise
        pool.discard(device)
        return _capture_once(fn, stream, device, pool.handle(device), False, error_mode)


def _capture_once(fn: Callable[[], Any], stream: torch.cuda.Stream, device: torch.device, handle: Any,
                  private: bool, error_mode: str) -> tuple[Any, Any]:
    from ..runtime.capture import _collector_paused, _restore_random_generators

    index = device.index if device.index is not None else torch.cuda.current_device()
    caller = torch.cuda.current_stream(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with _collector_paused(), stream_reuse(), torch.cuda.graph(graph, pool=handle, stream=stream,
                                                                   capture_error_mode=error_mode):
            out = fn()
    except BaseException:
        torch.cuda.set_stream(caller)  # a failed capture_end leaves the capture stream current
        _restore_random_generators([device])
        _end_failed_capture(index, handle, private)
        raise
    return graph, out


def _end_failed_capture(index: int, pool: Any, private: bool) -> None:
    """A failed ``capture_end`` leaves ``pool`` taking allocations (later captures into it fail:
    "already recording to mempool_id") and counted as used by a graph that never releases it.
    Where ``capture_end`` got past ending the allocations, the pool is no longer recording and
    the graph releases it when it goes; otherwise a pool of its own is released here, so that its
    memory goes back (a shared pool stays counted as used by the failed graph: released here,
    its count could reach zero while other graphs read it)."""
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
    except RuntimeError:
        return
    if private:
        torch._C._cuda_releasePool(index, pool)


@contextmanager
def workspaces_in_pool(stream: torch.cuda.Stream) -> Iterator[None]:
    """cuBLAS's workspaces of the capture stream dropped before a capture and after it.

    cuBLAS keeps a workspace per handle and stream (32 MiB on Hopper), allocated at its first
    use there. One allocated by the warm-up runs lies outside the graph's pool and the graph
    reads it, so it stays allocated for good. Dropped before the capture, the capture allocates
    it inside the pool; dropped after, the next capture into the same pool reuses that memory
    (the graphs of a pool replay one after another). Only the capture stream's are dropped: it
    is streamdag's own (:func:`_capture_stream`), and every capture on it drops them first, so
    no graph reads one from outside its pool; a graph captured elsewhere may read the workspace
    of its own stream, which stays (``torch._C._cuda_clearCublasWorkspaces``, which Inductor's
    CUDA graph trees call, drops every stream's). Without the torch extension, or on a PyTorch
    whose workspace maps it does not know, nothing is dropped and the workspace stays outside."""
    clear = getattr(load_torch(), "clear_blas_workspaces", None)
    if clear is not None:
        clear(stream.cuda_stream)
    try:
        yield
    finally:
        if clear is not None:
            clear(stream.cuda_stream)


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


class CapturedGraph:
    """A candidate captured for one set of static input addresses (see the module docstring).
    ``error_mode``: the capture's ``capture_error_mode`` ("thread_local" lets other threads make
    CUDA calls while it records)."""

    WARMUP = 2

    def __init__(self, candidate: Candidate, args: Sequence[Any], static: Sequence[int],
                 mutated: Sequence[int], pool: SharedPool, device: torch.device,
                 private: bool = False, error_mode: str = "global") -> None:
        self.candidate = candidate
        self.device = device
        self.pool = pool
        static_set = set(static)
        with torch.inference_mode(False):  # written by later calls in any mode
            self.inputs: list[Any] = [a if i in static_set or not isinstance(a, torch.Tensor)
                                      else torch.empty_strided(a.shape, a.stride(), dtype=a.dtype,
                                                               device=a.device)
                                      for i, a in enumerate(args)]
        self.copied: list[int] = [i for i, a in enumerate(args)
                                  if isinstance(a, torch.Tensor) and i not in static_set]
        self.copied_back: list[int] = [i for i in mutated if i not in static_set]
        self.static: list[int] = list(static)
        self.static_ptrs: list[int | None] = [None] * len(args)
        for i in static:
            self.static_ptrs[i] = args[i].data_ptr()
        self._copy_in(args)
        caller = torch.cuda.current_stream(device)
        stream = _capture_stream(device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):  # warm up where the capture runs: autotuning, workspaces, cuDNN plans
            for _ in range(self.WARMUP):
                candidate.run(list(self.inputs))
        stream.synchronize()
        # a private pool starts empty, so what it reserves is what this capture needs (no peak
        # statistics are reset: they belong to the caller). The capture empties the allocator's
        # cache as it starts: emptied first, so that what it frees does not offset the pool's growth
        with workspaces_in_pool(stream):  # (first: the warm-up's workspace is not the pool's growth)
            if private:
                torch.cuda.empty_cache()
            base = torch.cuda.memory_reserved(device)
            self.graph, outs = capture_graph(lambda: candidate.run(list(self.inputs)), stream, device,
                                             None if private else pool, error_mode)
        self.settings = cudnn_settings()
        self.outputs: list[Any] = list(outs)
        self.out_type: type[tuple[Any, ...]] | type[list[Any]] = tuple if isinstance(outs, tuple) else list
        self.out_tensors: list[int] = [i for i, o in enumerate(self.outputs) if isinstance(o, torch.Tensor)]
        self.peak_bytes = torch.cuda.memory_reserved(device) - base if private else 0
        caller.wait_stream(stream)

    def _copy_in(self, args: Sequence[Any]) -> None:
        dst = [self.inputs[i] for i in self.copied if self.inputs[i] is not args[i]]
        if dst:
            torch._foreach_copy_(dst, [args[i] for i in self.copied if self.inputs[i] is not args[i]])

    def statics_match(self, args: Sequence[Any]) -> bool:
        if not self.static:
            return True
        try:
            return torch._C._tensors_data_ptrs_at_indices_equal(list(args), self.static_ptrs, self.static)
        except (AttributeError, TypeError):  # a torch without the helper
            return all(args[i].data_ptr() == self.static_ptrs[i] for i in self.static)

    def replay(self) -> None:
        self.pool.order_current(self.device, self.device.index)
        self.graph.replay()

    def __call__(self, args: Sequence[Any], clone: bool = True) -> Sequence[Any]:
        # ordered before the copy: the inputs are written only after the last replay has read them
        self.pool.order_current(self.device, self.device.index)
        self._copy_in(args)
        self.graph.replay()
        for i in self.copied_back:
            args[i].copy_(self.inputs[i])
        if not clone:
            return self.out_type(self.outputs)
        outs = list(self.outputs)
        if len(self.out_tensors) == 1:
            i = self.out_tensors[0]
            outs[i] = outs[i].clone()
        elif self.out_tensors:  # one launch copies them all (models that return caches return many)
            fresh = [torch.empty_like(outs[i]) for i in self.out_tensors]
            torch._foreach_copy_(fresh, [outs[i] for i in self.out_tensors])
            for i, t in zip(self.out_tensors, fresh):
                outs[i] = t
        return self.out_type(outs)


def time_replays(graphs: Sequence[Any], rounds: int, device: torch.device) -> list[float]:
    """Each graph's median GPU time in ms (anything with ``replay()``), timed by CUDA events on the
    current stream: one untimed replay each (first-launch costs stay out), then ``rounds`` rounds
    whose order turns from round to round, so that none always runs first."""
    for g in graphs:
        g.replay()
    events: list[list[tuple[Any, Any]]] = [[] for _ in graphs]
    for r in range(rounds):
        turn = r % len(graphs)
        for i in list(range(turn, len(graphs))) + list(range(turn)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[i].replay()
            end.record()
            events[i].append((start, end))
    torch.cuda.synchronize(device)
    return [statistics.median(a.elapsed_time(b) for a, b in timed) for timed in events]


def choose(captured: list[CapturedGraph], rounds: int = 10, tie: float = 0.02,
           memory_ratio: float = 1.1, base_mib: float = 0.0) -> CapturedGraph:
    """Time the captured candidates by replays in rounds; the fastest, ties to fewer streams.

    ``base_mib``: what the graph's inputs (weights, buffers, the caller's tensors) hold, for
    :func:`pick`'s memory rule."""
    if len(captured) == 1:
        return captured[0]
    for c, ms in zip(captured, time_replays(captured, rounds, captured[0].device)):
        c.candidate.ms = ms
        c.candidate.peak_mib = c.peak_bytes / 2**20
    return captured[pick([c.candidate for c in captured], tie, memory_ratio, base_mib=base_mib)]


#: what each stream past the first may add to a capture's pool whatever the model: the CUDA caching
#: allocator serves each stream from segments of its own, a 2 MiB one for blocks up to 1 MiB and a
#: 20 MiB one for blocks up to 10 MiB. On a batch-1 googlenet (26 MiB of weights) these segments
#: are all a 3-stream capture adds (52 MiB of pool against 24), for a replay 1.5x faster.
STREAM_SEGMENTS_MIB = 22.0


def pick(cands: Sequence[Candidate], tie: float = 0.02, memory_ratio: float = 1.1,
         slack_mib: float = 8.0, base_mib: float = 0.0, segments_mib: float = STREAM_SEGMENTS_MIB) -> int:
    """The index of the candidate to keep, from their times (``ms``) and capture sizes (``peak_mib``).

    The fastest on one stream, unless one on more streams beats the best on fewer by more
    than ``tie``. Memory is judged for the whole graph: what its inputs hold (``base_mib``:
    weights, buffers, the caller's tensors) plus what a capture's pool needs. A candidate on
    several streams whose whole comes to more than ``memory_ratio`` times the whole of the
    leanest one-stream candidate, plus ``slack_mib`` (pools grow by whole segments) and
    ``segments_mib`` for each stream past the first (:data:`STREAM_SEGMENTS_MIB` for captures,
    whose sizes are the pools' reserved bytes; 0 for sizes in allocated bytes), is not kept. (Against the
    pools alone, a one-stream pool of a few MiB would reject any second stream however small
    its share of the model's memory.)
    """
    if any(c.ms is None for c in cands):
        raise ValueError("every candidate needs its time (ms) before one is picked")
    lean = min((c.peak_mib for c in cands if c.streams == 1 and c.peak_mib is not None), default=None)
    best: int | None = None
    for i in sorted(range(len(cands)), key=lambda i: cands[i].streams):
        c = cands[i]
        allowed = None if lean is None else (memory_ratio * (base_mib + lean) + slack_mib
                                             + (c.streams - 1) * segments_mib)
        if c.streams > 1 and allowed is not None and c.peak_mib is not None \
                and base_mib + c.peak_mib > allowed:
            c.notes.append(f"not kept: with the graph's inputs it needs {base_mib + c.peak_mib:.1f} MiB "
                           f"(its capture {c.peak_mib:.1f}), over the {allowed:.1f} MiB allowed: "
                           f"{memory_ratio}x the {base_mib + lean:.1f} MiB of the leanest one-stream "
                           f"candidate and {segments_mib:.0f} MiB of segments per added stream")
            continue
        if best is None:
            best = i
            continue
        margin = 1.0 if c.streams == cands[best].streams else 1.0 - tie
        if c.ms < cands[best].ms * margin:
            best = i
    if best is None:
        raise ValueError("no candidate to pick from")
    return best
