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

Only the wait at the end of a loaded module is collected (its globals have a
``__file__``): Inductor also waits in code it runs at once (its autotuning at
compile time), which needs the kernels then. A module's kernels are Futures in
its globals until its wait replaces them, so every collected wait is made when
the block ends, also when it ends by an exception: Inductor keeps loaded
modules by their code's hash, and a later compile of the same code gets the
module as it was left. Other threads wait as before.
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


def _install() -> bool:
    """Route ``AsyncCompile.wait`` through :func:`_wait` (once); False where Inductor has no such wait."""
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
            # a loaded module's globals only: code Inductor runs at once after its wait (its
            # autotuning at compile time, for the C++ wrapper) is not deferred
            if waits is None or not isinstance(scope, dict) or "__file__" not in scope:
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
    """Make every collected wait (each module gets its kernels, see the module docstring); raise the
    first error, unless the block already raises its own."""
    error: Exception | None = None
    for compiler, scope in progress(waits, desc="streamdag.compile: Inductor, kernels", unit="graph"):
        try:
            _original_wait(compiler, scope)
        except Exception as exc:
            error = error or exc
    if error is not None and not failed:
        raise error
