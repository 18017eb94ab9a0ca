"""The tests' one seam into a runtime's internals.

A test goes through the public API wherever the behaviour it checks is reachable that way. The
few contracts that are not (where an op is queued, which code made a copy) are reached here, each
entry saying what it reaches and why the public API cannot, so that a change of the internals
changes this file, not the tests. And :func:`python_reference` makes runtimes run the Python
reference of the compiled hot path, as ``STREAMDAG_NATIVE=0`` does, in the same process: the
``path`` fixture (``conftest.py``) runs a test on each.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest

import streamdag as sd
from streamdag import native


def submit_to_lane(rt: sd.Runtime, lane: int, fn: Callable[..., Any], *args: Any, name: str) -> sd.Future:
    """``fn(*args)`` queued on ``lane`` (``Runtime._submit``). The public submit picks the lane
    itself, and from inside an op never that op's own lane; the tests of waits inside ops need
    ops queued behind given ones."""
    return rt._submit(fn, args, {}, (), (), name, True, lane)


def lane_waits(rt: sd.Runtime) -> dict[int, Any]:
    """The waits that lane threads are inside now, by thread (None: a wait with a timeout), read
    under their lock (``LaneWaits``): whether a wait is registered, and taken off again, shows only
    in how the runtime answers the next wait."""
    waits = rt._lane_waits
    with waits._lock:
        return dict(waits._waits)


def submitters_waiting_for_a_slot(rt: sd.Runtime) -> int:
    """How many submitters wait for a slot at ``max_inflight`` now (``completion.Slots``' count): a blocked
    submit shows no other way, and the test of close() waking them must know they all wait."""
    return rt._counts.waiting


def choose_stream(rt: sd.Runtime, device: str) -> int:
    """The Python submit's choice of stream for an op with no dependencies (``Runtime._choose_stream``),
    for the test of a finish that races with it, which no public call can time."""
    return rt._choose_stream([], device)


def submit_on(rt: sd.Runtime, stream: int, fn: Callable[..., Any], *args: Any, reads: list[Any],
              writes: list[Any], name: str | None = None) -> Any:
    """``fn(*args)`` on a given (copy) stream, ordered after its dependencies on the device only
    (``Runtime._submit_on``): the transfers' submit, compiled where the module builds. Publicly
    only a copy between pinned host memory and a GPU reaches its compiled form."""
    return rt._submit_on(stream, fn, *args, reads=reads, writes=writes, name=name)


def copy_stream(rt: sd.Runtime, kind: str, device: str) -> int:
    """The number of ``device``'s copy stream of ``kind`` ("h2d", "d2h", "p2p")."""
    return rt._copy_index[(kind, device)]


def stream_count(rt: sd.Runtime) -> int:
    """How many streams the runtime has: compute, copy and host lanes (one past the last)."""
    return len(rt._streams)


def copies_compiled(rt: sd.Runtime) -> bool:
    """Whether the runtime makes its copies between pinned host memory and a GPU in C."""
    return rt._copy_pinned is not None


def copy_pinned(rt: sd.Runtime, dst: Any, src: Any) -> sd.Future | None:
    """The compiled copy between pinned host memory and a GPU (``Runtime._copy_pinned``), or None
    where it leaves the copy to the Python code. ``rt.copy`` gives the same future either way:
    which code made it shows only here."""
    return rt._copy_pinned(dst, src, None)


# ---------------------------------------------------------------- the Python reference
#: the packages whose modules the runtime is made of: all imported before the swap, so that none
#: picks a compiled part at its import later, inside a test on the Python path
_RUNTIME_PACKAGES = ("streamdag.runtime", "streamdag.backends")
#: compiled parts that stay in place on the Python path: the module's set-up, and the global count
#: of lost devices that the compiled submit reads (``note_loss``), not code that runs per op
_KEPT = ("setup", "setup_clocks", "setup_compaction", "setup_submit", "note_loss", "note_losses_of",
         "use_torch")


def rerun_as_capture_timing_does(compiled: Any) -> None:
    """Every op of each graph that ``streamdag.compile(fn, engine="aten")`` recorded, run once more
    between saving and restoring the tensors the ops declare written, as ``CudaGraphRunner.prepare``
    does around the runs that time a graph before its capture. That path runs only on CUDA; here
    the same saving and restoring is checked against a graph recorded on the CPU."""
    from streamdag.runtime.capture import _writes_saved

    for spec in compiled._entries.values():
        for entry in spec.variants:
            ops = entry.graph._ops
            restore = _writes_saved(ops)
            for rec in ops:
                rec.fn(*rec.args, **rec.kwargs)
            restore()


def _python_twins(speedups: ModuleType) -> dict[int, Any]:
    """What the package uses where the compiled module is not loaded, by the ``id`` of the compiled
    part it stands for (the module itself: None, so that ``core`` makes no compiled submitter)."""
    from streamdag.backends import threads
    from streamdag.graph import buffers, hazards
    from streamdag.runtime import accel, budgets, ops
    from streamdag.schedule import waits

    pairs = [
        (speedups, None),
        (accel.CompiledDepsTracker, hazards.PyDepsTracker),
        (accel.CompiledStreamClocks, waits.PyStreamClocks),
        (speedups.accesses, buffers._py_accesses),
        (speedups.Lock, threading.Lock),
        (speedups.RLock, ops._PyRLock),
        (speedups.Counters, threads._Counters),
        (speedups.Parts, ops._Parts),
        # (ops.Op and ops.Future, made on them at import, keep their records: fields only)
        (speedups.OpFields, ops._PyOpFields),
        (speedups.FutureFields, ops._PyFutureFields),
        (speedups.BudgetCounts, budgets._BudgetCounts),
        (speedups.completions_pass, None),
        (speedups.completions_finish_one, None),
        (speedups.uses_torch, None),
    ]
    return {id(compiled): python for compiled, python in pairs}


def _runtime_modules() -> list[ModuleType]:
    for package_name in _RUNTIME_PACKAGES:
        package = importlib.import_module(package_name)
        for found in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package_name}.{found.name}")
    return [module for name, module in list(sys.modules.items())
            if name.startswith("streamdag.") and not name.startswith("streamdag.native")]


def use_python_reference(monkeypatch: pytest.MonkeyPatch, *also: ModuleType) -> None:
    """Until ``monkeypatch`` undoes it, runtimes run as under ``STREAMDAG_NATIVE=0``: every module of
    the package (and ``also``: a test's own module that imported, say, the runtime's tracker) refers
    to the Python code where it referred to a compiled part. ``accel``'s ``Compiled*`` names, the
    twins themselves, stay. A reference to a compiled part that has no twin here is an error, so
    that no new compiled part is left on the Python path unnoticed."""
    speedups = native.load()
    if speedups is None:
        return  # the Python code is all there is
    twins = _python_twins(speedups)
    kept = {id(getattr(speedups, name)) for name in _KEPT}
    parts = {id(value): name for name, value in vars(speedups).items() if not name.startswith("__")}
    for module in [*_runtime_modules(), *also]:
        for name, value in list(vars(module).items()):
            if name.startswith(("Compiled", "compiled_")) or id(value) in kept:
                continue
            if id(value) in twins:
                monkeypatch.setattr(module, name, twins[id(value)])
            elif id(value) in parts:
                raise AssertionError(f"{module.__name__}.{name} is the compiled {parts[id(value)]}, which "
                                     "has no Python twin in tests/internals.py: add it to _python_twins")


@contextmanager
def python_reference() -> Iterator[None]:
    """Runtimes made and used inside run the Python reference of the compiled hot path."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_python_reference(monkeypatch)
        yield


def host_lane_for(rt: sd.Runtime, pending: int | None) -> int:
    """The host lane a large pageable copy is staged on (``Runtime._host_lane_for``), given the lane
    of the ring's copy still pending (None: none): only CUDA runtimes stage such copies, so no
    public call reaches the choice on the CPU."""
    return rt._host_lane_for(pending)


def host_lanes(rt: sd.Runtime) -> range:
    """The numbers of the runtime's host lanes among its streams."""
    return rt._compute_of["host"]


def host_lane_here(rt: sd.Runtime) -> int:
    """The number of the host lane the calling thread runs (inside an op there), or -1."""
    lanes = host_lanes(rt)
    return rt._calling_lane(lanes.start, len(lanes))


def quiet(rt: sd.Runtime) -> bool:
    """Whether no op but the caller's could run on the host now (``Runtime._quiet``, under the
    runtime's lock): what a recorded graph's capture waits for. Only CUDA runtimes capture, so
    without a GPU the check is reached here."""
    with rt._lock:
        return rt._quiet()
