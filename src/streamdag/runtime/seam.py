"""What the compiled submit (``native/_submit.c``) is handed by a runtime: the seam's declared side.

The runtime builds one :class:`SubmitterParts` when it makes its ``Submitter`` and passes it to
the constructor. The C reads its fields by position (in the order below) and calls the bound
methods it holds; it reads no attribute of the runtime by name. Each field says what it is and
what guards it ("under X": read or changed only with lock X held; "set once": never replaced,
so the C keeps the object it was handed).

The methods are the Python reference's own: each is where a rare case (recording, profiling, a
held op, a failure) parts from the compiled common case, so each rare case has one implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

__all__ = ["SeamRuntime", "SubmitterParts", "setup_submit", "submitter_parts", "use_compiled_submit"]


class SeamRuntime(Protocol):
    """What :func:`submitter_parts` reads of a runtime: its state and the methods of its parts."""

    backend: Any
    device: str
    _lock: Any
    _done_lock: Any
    _busy: list[int]
    _pending: dict[int, Any]
    _streams: list[Any]
    _hurry_of: list[Any]
    _spaces: set[str]
    _recordings: dict[int, Any]
    _host_ops: dict[int, Any]
    _slots: Any
    _next_stream: dict[Any, int]
    _counts: Any
    _parts: Any
    _lane_threads: set[Any]
    _compute: int
    _can_be_lost: bool

    _submit: Callable[..., Any]
    _take_slot: Callable[[bool], Any]
    _would_block: Callable[[], Any]
    _fail_lost: Callable[[Any, Any], Any]
    _launch_placed: Callable[..., Any]
    _finish_launch: Callable[..., Any]
    _finish: Callable[[Any, Any], Any]
    _settle: Callable[[Any, Any, Any], Any]
    _hold: Callable[..., bool]
    _host_deps: Callable[[Any, str], list[Any]]
    _caller_fence: Callable[[Any], Any]

    # what use_compiled_submit replaces with the Submitter's methods, and the copy state it hands it
    _submit_on: Callable[..., Any]
    _launch_held: Callable[..., Any]
    _finish_bound: Callable[..., Any]
    _copy_pinned: Callable[..., Any]
    _copy_index: dict[tuple[str, str], int]
    _bytes: Any


class SubmitterParts(NamedTuple):
    """A runtime's state and methods that the compiled ``Submitter`` uses (see the module)."""

    #: the runtime's re-entrant lock (``_lock``): submits, placement, holds, recording; taken
    #: before ``done_lock``, never after it
    lock: Any
    #: the lock of finishing (``_done_lock``); backend threads take it alone
    done_lock: Any
    #: per stream, the pending ops placed on it (``_busy``); under ``done_lock``
    busy: list[int]
    #: the ops submitted or held and not finished, by number, in order (``_pending``); under
    #: ``done_lock``
    pending: dict[int, Any]
    #: every stream, numbered (``_streams``); set once
    streams: list[Any]
    #: the runtime's one backend; set once
    backend: Any
    #: its device; set once
    device: str
    #: per stream, what a wait on its op calls, or None (``_hurry_of``); set once
    hurry_of: list[Any]
    #: the address spaces ops may touch (``_spaces``); set once
    spaces: set[str]
    #: the graph each recording thread records into, by thread id (``_recordings``); under ``lock``
    recordings: dict[int, Any]
    #: the unfinished host-lane ops a device op may be held behind (``_host_ops``); under ``lock``
    host_ops: dict[int, Any]
    #: the in-flight bound (``Slots``); counts in ``counts``, under ``done_lock``
    slots: Any
    #: per device, where its round robin resumes (``_next_stream``); under ``lock``
    next_stream: dict[Any, int]
    #: the runtime's ``Counters`` (``_counts``): ``seq`` under ``lock``; the rest under ``done_lock``
    counts: Any
    #: the runtime's ``Parts`` (``_parts``: tracker, clocks, profiler, finish_ready, closed); the
    #: tracker, clocks and profiler under ``lock``
    parts: Any
    #: the threads of every host lane (``backends.cpu.LANE_THREADS``); changed by the lanes
    lane_threads: set[Any]

    #: ``_submit(fn, args, kwargs, reads, writes, name, blocking, stream, device_ordered, run_on)``:
    #: the Python submit, for whatever the compiled one does not cover; takes ``lock`` itself
    submit: Callable[..., Any]
    #: ``_take_slot(blocking)``: waits for a slot under ``max_inflight``; takes ``done_lock``
    take_slot: Callable[[bool], Any]
    #: ``_would_block()``: raises what ``submit_nowait`` raises at the bound
    would_block: Callable[[], Any]
    #: ``_fail_lost(op, backend)``: fails an op whose device is lost; caller holds ``lock``
    fail_lost: Callable[[Any, Any], Any]
    #: ``_launch_placed(op, deps, stream, live, waits, host_inputs, fence)``: the Python launch of a
    #: placed op (profiling, host inputs, a dep with no event yet); caller holds ``lock``
    launch_placed: Callable[..., Any]
    #: ``_finish_launch(op, stream, failed=False)``: after a launch that raised; caller holds ``lock``
    finish_launch: Callable[..., Any]
    #: ``_finish(op, device_error)``: the Python finish, for any op the compiled one leaves
    finish: Callable[[Any, Any], Any]
    #: ``_settle(future, value, error)``: settles a watched future and runs its done-callbacks; the
    #: op is counted in ``in_callbacks`` already; takes ``done_lock`` itself
    settle: Callable[[Any, Any, Any], Any]
    #: ``_hold(op, deps, holders, stream, device, host_inputs, fence)``: holds an op behind host-lane
    #: ops; True where held; caller holds ``lock``
    hold: Callable[..., bool]
    #: ``_host_deps(accesses, op_name)``: the host-lane ops an op must follow (a list); caller holds
    #: ``lock``
    host_deps: Callable[[Any, str], list[Any]]
    #: ``_caller_fence(device)``: an event on the caller's stream for a held op to wait for
    caller_fence: Callable[[Any], Any]
    #: ``Slots.release_locked()``: gives a slot back and wakes a submitter waiting for one; caller
    #: holds ``done_lock`` (the compiled finish counts the slot itself where nobody waits)
    release_slot_locked: Callable[[], Any]
    #: the backend's compute streams (``_compute``, at least 1); set once
    compute: int
    #: whether the backend may lose its device (``_can_be_lost``); set once
    can_be_lost: bool


def submitter_parts(rt: SeamRuntime) -> SubmitterParts:
    """``rt``'s :class:`SubmitterParts` (made once, when it sets up its compiled submit)."""
    return SubmitterParts(
        lock=rt._lock,
        done_lock=rt._done_lock,
        busy=rt._busy,
        pending=rt._pending,
        streams=rt._streams,
        backend=rt.backend,
        device=rt.device,
        hurry_of=rt._hurry_of,
        spaces=rt._spaces,
        recordings=rt._recordings,
        host_ops=rt._host_ops,
        slots=rt._slots,
        next_stream=rt._next_stream,
        counts=rt._counts,
        parts=rt._parts,
        lane_threads=rt._lane_threads,
        submit=rt._submit,
        take_slot=rt._take_slot,
        would_block=rt._would_block,
        fail_lost=rt._fail_lost,
        launch_placed=rt._launch_placed,
        finish_launch=rt._finish_launch,
        finish=rt._finish,
        settle=rt._settle,
        hold=rt._hold,
        host_deps=rt._host_deps,
        caller_fence=rt._caller_fence,
        release_slot_locked=rt._slots.release_locked,
        compute=rt._compute,
        can_be_lost=rt._can_be_lost,
    )


def use_compiled_submit(rt: Any, speedups: Any) -> None:
    """Submit and finish in C (``native/_submit.c``) for ``rt``: its compiled ``Submitter``'s methods
    replace the Python ones on the instance, which stay the reference and run every case the C
    leaves to them."""
    from ..native import load_torch
    from . import arguments, submitting, transfers

    launch_parts = getattr(rt.backend, "launch_parts", None)
    if launch_parts is not None:
        load_torch()  # the CUDA calls in C++, where the torch extension builds
    cuda = launch_parts() if launch_parts is not None else None
    submitter = speedups.Submitter(rt, submitter_parts(rt), arguments.accesses_of, submitting._DROP_WAITS,
                                   cuda)
    rt.submit = submitter.submit
    rt._submit_on = submitter.submit_on
    rt._launch_held = submitter.launch_held
    rt.submit_nowait = submitter.submit_nowait
    rt._finish_bound = submitter.finish
    h2d, d2h = ({space: i for (k, space), i in rt._copy_index.items() if k == kind}
                for kind in ("h2d", "d2h"))
    if h2d or d2h:
        submitter.setup_copies(transfers._copy_async, h2d, d2h, rt._bytes, transfers.copy,
                               rt._bytes.compiled_parts())
        rt.copy = submitter.copy
        rt._copy_pinned = submitter.copy_pinned


def setup_submit(speedups: Any, op_type: type, future_type: type) -> None:
    """Hand the compiled module the op and future types it makes (``setup_submit``), once a future
    made in C is known to be whole: C sets every field of the record (``native.FutureFields``) and
    none of the future's own slots, which must be those ``ops.Future`` makes when first asked for
    (the base class's condition and lists). A slot added in Python alone would be missing from
    every future made in C: an AttributeError far from its cause."""
    from ..graph.buffers import Marker
    from . import completion, frames, ops

    extra = sorted(set(getattr(future_type, "__slots__", ())) - ops.LAZY_FIELDS)
    if extra:
        raise TypeError(f"setup_submit: Future has a slot {extra[0]} that the compiled submit does not "
                        "set: declare it in the future record in native/_submit.c (future_field_names, "
                        "new_future)")
    speedups.setup_submit(op_type, future_type, Marker, ops._LAZY, ops._PENDING, ops._FINISHED,
                          completion.finished_ok, frames.release_frames)
