"""Inductor's kernel compiles of several graphs waited for once, so they run in parallel.

Inductor hands each Triton kernel of a graph to its pool of compile workers and,
when the graph's module is loaded, waits for that graph's kernels
(``AsyncCompile.wait(globals())`` at the end of the module). Compiling a
graph's regions one after another (:func:`.inductor_regions.compile_regions`)
so waits once per region: a model of many small regions keeps the workers
busy with a region's few kernels and then idle while the next region is
lowered. Under :func:`kernels_compiled_together` the waits of this thread are
collected instead and made at the end, when the kernels of every region are
already in the pool together (googlenet: 126 kernels of 46 regions; waiting
per region took 27 s of its 62 s compile).

Only the wait at the end of the module of a graph ``compile_fx`` compiles is
collected: its globals have a ``__file__`` and Inductor's graph handler is the
unnamed, top-level lowering. Modules Inductor builds and runs at once wait as
before: a subgraph it times while autotuning (``benchmark_...``, under
``max_autotune``), a constant graph, code run right after its wait (autotuning
at compile time), a module timed by ``profile_bandwidth_output``.

Every collected wait is made when the block ends, also when it ends by an
exception, so no loaded module keeps Futures in place of its kernels; a kernel
that two modules share (the same source) is waited for once and given to both.
What it costs: Inductor bundles the kernels a compile built into its FX graph
cache entry when they are ready before the entry is saved, which deferred ones
are not, so a later process that hits that entry loads its kernels from
Triton's own cache instead of the bundle. Other threads wait as before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .._progress import progress

__all__ = ["kernels_compiled_together"]


class _Collected(threading.local):
    waits: list[tuple[Any, dict[str, Any]]] | None = None  # this thread's (AsyncCompile, scope), in order


_collected = _Collected()
_install_lock = threading.Lock()
_original_wait: Any = None


def _deferrable(scope: Any) -> bool:
    """Whether ``scope`` is the globals of the module of a graph ``compile_fx`` compiles (see the
    module docstring); a lowering Inductor builds on the side has a name, or is a constant graph."""
    if not isinstance(scope, dict) or "__file__" not in scope:
        return False
    from torch._inductor import config
    from torch._inductor.virtualized import V

    if getattr(config, "profile_bandwidth_output", None):
        return False
    try:
        graph = V.graph
        return graph.name is None and not getattr(graph, "is_const_graph", False)
    except AttributeError:  # no graph being lowered (Inductor's NullHandler)
        return False


def _install() -> bool:
    """Route ``AsyncCompile.wait`` through the collecting wait (once); False where Inductor has none."""
    global _original_wait
    with _install_lock:
        if _original_wait is not None:
            return True
        try:
            from torch._inductor.async_compile import AsyncCompile
        except ImportError:
            return False
        original = getattr(AsyncCompile, "wait", None)
        if not callable(original):
            return False
        _original_wait = original

        def wait(self: Any, scope: dict[str, Any]) -> None:
            waits = _collected.waits
            if waits is None or not _deferrable(scope):
                return _original_wait(self, scope)
            waits.append((self, scope))
            return None

        wait.__doc__ = original.__doc__
        AsyncCompile.wait = wait
        return True


@contextmanager
def kernels_compiled_together() -> Iterator[None]:
    """Within the block, this thread's Inductor compiles wait for their kernels at its end (see the
    module docstring). A block inside another waits for its own compiles at its own end, so a
    kernel that fails to compile fails the block that compiled it."""
    if not _install():
        yield
        return
    outer, waits = _collected.waits, []
    _collected.waits = waits
    failed = True
    try:
        yield
        failed = False
    finally:
        _collected.waits = outer
        _finish(waits, failed)


def _finish(waits: list[tuple[Any, dict[str, Any]]], failed: bool) -> None:
    """Make every collected wait; raise the first error, unless the block already raises its own.

    A Future that an earlier module's wait resolved is replaced by its kernel first: Inductor hands
    a kernel's pending Future to every module of the same kernel source, and its wait would build
    the kernel again for each."""
    resolved: dict[int, tuple[Any, Any]] = {}  # id(Future): (the Future, kept so its id stays; its kernel)
    error: Exception | None = None
    for compiler, scope in progress(waits, desc="streamdag.compile: Inductor, kernels", unit="graph"):
        for key, value in list(scope.items()):
            hit = resolved.get(id(value))
            if hit is not None and hit[0] is value:
                scope[key] = hit[1]
        before = dict(scope)
        try:
            _original_wait(compiler, scope)
        except Exception as exc:
            error = error or exc
        for key, value in before.items():
            now = scope.get(key)
            if now is not value:
                resolved[id(value)] = (value, now)
    if error is not None and not failed:
        raise error
