"""The tracker, the stream clocks and the accesses of buffers the runtime uses: compiled where the
compiled hot path is built, else the Python code. The one place that chooses.

``graph/`` and ``schedule/`` hold the Python code, the reference that the compiled code is checked
against (``tests/test_native_*.py``), and import no compiled code, so that they can be read, tested
and reused on their own. The compiled twins are assembled here from ``native._speedups``'s types
and those modules' methods, and handed what they read of the Python side. The runtime, and code
above it that wants the speed, imports from here:

- :data:`DepsTracker` (``graph.hazards``): its fields and ``link`` compiled;
- :data:`StreamClocks` (``schedule.waits``): compiled;
- :data:`accesses` (``graph.buffers``): the byte ranges of tensors and arrays read in C;
- :func:`build_schedule`, :func:`pin_ops` and :func:`plan_waits` (``schedule``), on those clocks.

``CompiledDepsTracker``, ``CompiledStreamClocks`` and ``compiled_accesses`` are the compiled twins
themselves (None where they are not built), for the tests and benchmarks that compare the two.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ..graph import buffers
from ..graph.buffers import Access, Region
from ..graph.hazards import _MAX_HORIZON, PyDepsTracker, _SpaceMethods, _TrackerMethods
from ..native import load as load_native
from ..native import twin
from ..schedule import plan, waits
from ..schedule.dag import Preds
from ..schedule.plan import CLOSURE_LIMIT, Schedule
from ..schedule.waits import PyStreamClocks, Stamp

__all__ = ["CompiledDepsTracker", "CompiledStreamClocks", "DepsTracker", "StreamClocks", "accesses",
           "build_schedule", "compiled_accesses", "pin_ops", "plan_waits"]

# the tracker's compiled fields, with the clocks and the accesses of the same module
_speedups = load_native() if twin("TrackerFields", None) is not None else None
if _speedups is not None:
    _speedups.setup(buffers._HANDLERS, buffers._torch_region, buffers.region_of, buffers._CUDA_SPACES,
                    Region, Access, buffers._RESIZING, buffers._numpy_like_region)
    _speedups.setup_clocks(Stamp)

    class _Space(_SpaceMethods, _speedups.SpaceFields):
        __slots__ = ()
        record_type = _speedups.Record

        def keep(self, gone: Callable[[Hashable], bool], now: int) -> None:
            """:meth:`_SpaceMethods.keep`, compiled."""
            self._keep(gone, now, _MAX_HORIZON)

        #: :meth:`_SpaceMethods.overlapping`, compiled
        overlapping = _speedups.SpaceFields._overlapping

    class CompiledDepsTracker(_TrackerMethods, _speedups.TrackerFields):
        """Sequentially consistent hazard tracking over byte ranges (RAW, WAR, WAW).

        Its fields and :meth:`link` are compiled (``native/_speedups.c``); the rest is
        ``graph/hazards.py``'s, as in :class:`~streamdag.graph.hazards.PyDepsTracker`.
        """

        space_type = _Space

    # their compaction (``_space`` -> ``_compact`` -> ``_Space.keep``) runs in link(), compiled
    _speedups.setup_compaction(CompiledDepsTracker, _Space, _MAX_HORIZON, _TrackerMethods._space)

    class CompiledStreamClocks(_speedups.Clocks):
        """Vector clocks for ``num_streams`` streams: :class:`~streamdag.schedule.waits.PyStreamClocks`,
        compiled."""

        __slots__ = ()

    #: compiled (``native/_speedups.c``): tensors read in C, anything else through ``region_of``
    compiled_accesses: Any = _speedups.accesses
    DepsTracker: Any = CompiledDepsTracker
    StreamClocks: Any = CompiledStreamClocks
    accesses: Callable[[Sequence[Any], Sequence[Any]], list[Access]] = _speedups.accesses
else:
    CompiledDepsTracker = CompiledStreamClocks = compiled_accesses = None
    DepsTracker = PyDepsTracker
    StreamClocks = PyStreamClocks
    accesses = buffers._py_accesses


def build_schedule(preds: Preds, max_streams: int, costs: Sequence[float] | None = None,
                   closure_limit: int = CLOSURE_LIMIT, groups: Sequence[int] | None = None) -> Schedule:
    """Schedule a DAG whose ops are numbered in a topological order (see :mod:`streamdag.schedule.dag`).

    :func:`streamdag.schedule.plan.build_schedule` (which says what each argument means), its waits
    planned on :data:`StreamClocks`: the compiled clocks where they are built, which place the same.
    """
    return plan.build_schedule(preds, max_streams, costs, closure_limit, groups, StreamClocks)


def pin_ops(sched: Schedule, pinned: Sequence[Hashable | None]) -> Schedule:
    """:func:`streamdag.schedule.plan.pin_ops`, its waits planned on :data:`StreamClocks`."""
    return plan.pin_ops(sched, pinned, StreamClocks)


def plan_waits(preds: Sequence[Sequence[int]], streams: Sequence[int], num_streams: int
               ) -> list[tuple[int, ...]]:
    """:func:`streamdag.schedule.waits.plan_waits` on :data:`StreamClocks`."""
    return waits.plan_waits(preds, streams, num_streams, StreamClocks)
