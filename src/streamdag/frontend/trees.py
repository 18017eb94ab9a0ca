"""How a training graph goes under Inductor's CUDA graph trees, as ``torch.compile(mode=
"reduce-overhead")`` puts it there, and how its outputs come out of the trees' pool.

Inductor puts a compiled graph under the trees in one place: its post-compile step calls
``torch._inductor.compile_fx.cudagraphify`` with the graph's code, its static inputs and what the
trees need to know of the graph (device, placeholders, stack traces, inputs it mutates).
:func:`seen_by_trees` sees that call while a graph compiles; the :class:`TreesCall` it keeps puts
another function of the same inputs (the graph's regions on several streams) under the trees the
same way, in the same tree of graphs as the forward or backward it stands for.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

__all__ = ["MULTIPLIED", "TreesCall", "aligned", "calls_convolution", "copies", "cudnn_benchmarks",
           "make_trees_manager", "put_by_streamdag", "refusal", "seen_by_trees", "trees_config"]


class TreesCall:
    """How Inductor put a graph's code under its CUDA graph trees: its call of
    ``compile_fx.cudagraphify`` (the static inputs, the device, the graph's placeholders...), to
    put another function of the same inputs there the same way."""

    def __init__(self, cudagraphify: Callable[..., Any], static_input_idxs: Sequence[int],
                 kwargs: dict[str, Any]) -> None:
        self.cudagraphify = cudagraphify
        self.static_input_idxs = tuple(static_input_idxs)
        self.kwargs = kwargs

    def wrap(self, fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """``fn`` under the trees (Inductor's ``cudagraphify`` reads its configuration as it is
        called: the trees' is set around it, as while the graph compiled)."""
        _put(fn)
        with trees_config(True, partitions=False):
            return self.cudagraphify(fn, static_input_idxs=self.static_input_idxs, **self.kwargs)


# state, under _lock: _users counts the compiles inside seen_by_trees(); while it is above zero
# compile_fx.cudagraphify is _record and _real the function it stood for. _local.seen is the list
# of the compile in progress on this thread (None outside one).
_lock = threading.Lock()
_users = 0
_real: Callable[..., Any] | None = None
_local = threading.local()


def _record(model: Any, static_input_idxs: Sequence[int] = (), **kwargs: Any) -> Any:
    real = _real
    assert real is not None
    seen = getattr(_local, "seen", None)
    if seen is not None:
        seen.append((model, TreesCall(real, static_input_idxs, kwargs)))
        _put(model)
    return real(model, static_input_idxs=static_input_idxs, **kwargs)


@contextlib.contextmanager
def seen_by_trees() -> Iterator[list[tuple[Any, TreesCall]]]:
    """Inductor's calls of ``compile_fx.cudagraphify`` from this thread while a graph compiles, each
    as (the code it puts under the trees, a :class:`TreesCall`); each call goes on to the trees.
    (Inductor imports that name at the call, the one place that puts a graph under the trees.) The
    name stands for a recorder while any thread compiles inside this; each thread's calls go to its
    own list, and the name is put back when the last compile leaves."""
    global _users, _real
    from torch._inductor import compile_fx

    with _lock:
        if _users == 0:
            _real = compile_fx.cudagraphify
            compile_fx.cudagraphify = _record
        _users += 1
    outer = getattr(_local, "seen", None)
    _local.seen = seen = []
    try:
        yield seen
    finally:
        _local.seen = outer
        with _lock:
            _users -= 1
            if _users == 0 and compile_fx.cudagraphify is _record:
                compile_fx.cudagraphify = _real


#: the functions streamdag put under the trees (the trees' manager keeps each as the ``model`` of
#: its ``WrappedFunction``), weakly: what a manager runs besides them is another's
_ours: weakref.WeakSet[Any] = weakref.WeakSet()


def _put(model: Any) -> None:
    # (a function with no weak reference to it counts as another's: gradients are then copied)
    with contextlib.suppress(TypeError):
        _ours.add(model)


def put_by_streamdag(model: Any) -> bool:
    """Whether streamdag put ``model`` under the trees (:class:`TreesCall`, :func:`seen_by_trees`)."""
    try:
        return model in _ours
    except TypeError:
        return False


def trees_config(on: bool, partitions: bool = True) -> Any:
    """Inductor's configuration for a graph under its cudagraph trees, as ``mode="reduce-overhead"``
    sets it; without ``partitions``, a graph goes under the trees whole or not at all (with them,
    where Inductor lays graphs out in partitions, it puts each partition there and runs what
    cannot be captured between them)."""
    if not on:
        return contextlib.nullcontext()
    from torch._inductor import config

    changes: dict[str, Any] = {"triton.cudagraphs": True, "triton.cudagraph_trees": True}
    if not partitions and hasattr(config, "graph_partition"):
        changes["graph_partition"] = False
    return config.patch(changes)


def refusal(whole: Any) -> str:
    """Inductor's reason for not putting a compiled graph under the trees, on one line (its
    stack trace cut: ``TORCH_LOGS=cudagraphs`` logs it whole)."""
    reason = getattr(whole, "disabled_cudagraphs_reason", None)
    info = getattr(whole, "cudagraph_info", None)
    fails = getattr(info, "cudagraph_fail_reasons", None) if info is not None else None
    text = " ".join(str(reason or "; ".join(str(f) for f in fails or ())).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return text or "no part of the graph can be captured"


def copies(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``ts`` with their strides: one ``_foreach_mul`` by 1 (exact) for floating tensors,
    so that a backward's hundred gradients cost one call, not a hundred."""
    if not ts:
        return []
    if all(t.dtype in MULTIPLIED for t in ts):
        return list(torch._foreach_mul(ts, 1))
    return [t.clone() for t in ts]


#: the dtypes :func:`copies` copies by a multiplication (float8 has no ``mul`` kernel)
MULTIPLIED = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                         torch.complex128})


def cudnn_benchmarks() -> bool:
    """Whether a convolution's first run of a shape tries cuDNN's algorithms."""
    return bool(torch.backends.cudnn.benchmark) and torch.backends.cudnn.enabled


#: the operators whose first run of a shape cuDNN's benchmark times (core ATen, as AOTAutograd
#: hands Inductor a graph)
_CONVOLUTIONS = frozenset({"convolution", "convolution_backward", "_convolution", "cudnn_convolution",
                           "cudnn_convolution_transpose"})


def calls_convolution(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` calls an operator that cuDNN's benchmark times at its first run of a shape: a
    graph the trees would warm up with the trials' workspaces in their pool."""
    for node in gm.graph.nodes:
        if node.op == "call_function":
            packet = getattr(node.target, "_overloadpacket", None)
            if packet is not None and packet.__name__ in _CONVOLUTIONS:
                return True
    return False


def aligned(args: Sequence[Any]) -> bool:
    """Whether every CUDA tensor among ``args`` lies at an address Inductor's code assumes: the trees
    copy one that does not before they run the code, and Inductor's code under the trees has no
    such copy of its own."""
    from torch._inductor.utils import ALIGNMENT

    return all(not (isinstance(a, torch.Tensor) and a.is_cuda) or a.data_ptr() % ALIGNMENT == 0
               for a in args)


def make_trees_manager(device_box: Any) -> None:
    """Make the trees' manager of the device in ``device_box`` (Inductor's ``BoxedDeviceIndex``, set
    when a forward is compiled for the trees), as the trees' first call makes it."""
    index = getattr(device_box, "value", None)
    if index is not None:
        from torch._inductor import cudagraph_trees

        cudagraph_trees.get_manager(index)
