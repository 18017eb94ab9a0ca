"""The compiled submit and finish (``native/_submit.c``) against the Python methods, step by step.

A backend that holds every op until the test releases it (in any order) logs
each call the runtime makes: which stream each op launches on, which events
it waits on, what it records. The same random program (submits, some
failing, some with inline markers, with releases in between) runs on a runtime with the compiled
submit and on one with the Python reference (``internals.python_reference``); the logs, the ops'
stamps and the outcomes must be equal.
"""

import random
from contextlib import nullcontext

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streamdag as sd
from internals import python_reference
from streamdag import native

compiled = pytest.mark.skipif(native.load() is None, reason=f"no compiled hot path: {native.status()}")


class _Lane:
    def __init__(self, index: int) -> None:
        self.index, self.kind = index, "compute"


class _LoggedEvent:
    def __init__(self, log: list, tag: int) -> None:
        self.log, self.tag = log, tag

    def record(self, stream: _Lane) -> None:
        self.log.append(("record", self.tag, stream.index))

    def wait(self, stream: _Lane) -> None:
        self.log.append(("wait", self.tag, stream.index))

    def query(self) -> bool:
        return False

    def synchronize(self) -> None: ...


class HeldBackend:
    """Runs each op's host code at launch (as CUDA does) and finishes it only when released."""

    deferred = False

    def __init__(self, streams: int) -> None:
        self.device = "cpu"
        self.streams = [_Lane(i) for i in range(streams)]
        self.log: list = []
        self.held: list = []
        self._events = 0

    def event(self, timing: bool = False) -> _LoggedEvent:
        self._events += 1
        return _LoggedEvent(self.log, self._events)

    def launch(self, stream: _Lane, work, after_caller: bool = True) -> None:
        self.log.append(("launch", stream.index))
        work()

    def when_done(self, stream: _Lane, event: _LoggedEvent, callback) -> int:
        self.held.append(callback)
        return event.tag

    def release(self, picks: list[int]) -> None:
        for p in picks:
            if self.held:
                self.held.pop(p % len(self.held))()

    def synchronize(self) -> None: ...
    def close(self) -> None: ...


def _fails(x: np.ndarray) -> None:
    raise ValueError("injected")


steps = st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=3), st.integers(0, 5), st.booleans(),
                           st.lists(st.integers(0, 50), max_size=3)), min_size=1, max_size=40)


def _path(compiled_submit: bool):
    """Runtimes made inside submit through the compiled code, or through the Python reference."""
    return nullcontext() if compiled_submit else python_reference()


def _run(program, streams: int, compiled_submit: bool):
    with _path(compiled_submit):
        return _run_on(program, streams)


def _run_on(program, streams: int):
    backend = HeldBackend(streams)
    rt = sd.Runtime(backend=backend, max_inflight=1000)
    bufs = [np.zeros(4, dtype=np.int64) for _ in range(6)]
    futures, stamps = [], []
    for i, (reads, write, fail, releases) in enumerate(program):
        out = bufs[write]
        ins = [bufs[r] for r in reads]
        fn = _fails if fail else np.add
        args = (out,) if fail else (out, i, )
        kwargs = {} if fail else {"out": out}
        writes = [out]
        if i % 4 == 1:  # the inline form: the write marked among the arguments, or the keywords
            args, writes = (sd.write(out), *args[1:]), []
        elif i % 4 == 2 and not fail:
            kwargs, writes = {"out": sd.write(out)}, []
        futures.append(rt.submit(fn, *args, reads=ins, writes=writes, name=None if i % 3 else f"op{i}",
                                 **kwargs))
        stamps.append(sorted((op.name, op.stamp) for op in rt._pending.values()))
        backend.release(releases)
    while backend.held:
        backend.release([0])
    outcomes = [(f.done(), repr(f.exception()), f.result() is None if f.exception() is None else None)
                for f in futures]
    return backend.log, stamps, outcomes, [b.tolist() for b in bufs], rt.statistics()


@compiled
def test_the_runtime_submits_through_the_compiled_code_where_it_built():
    with sd.Runtime("cpu") as rt:
        assert type(rt.submit).__name__ == "builtin_function_or_method"
        assert type(rt.submit_nowait).__name__ == "builtin_function_or_method"
        assert rt.submit(np.add, 1, 2).result() == 3
    with python_reference(), sd.Runtime("cpu") as rt:
        assert type(rt.submit).__name__ == "method"


@compiled
@settings(max_examples=400, deadline=None)
@given(steps, st.integers(1, 4))
def test_the_compiled_submit_launches_waits_and_finishes_as_the_python_one(program, streams):
    log, stamps, outcomes, bufs, stats = _run(program, streams, True)
    log_py, stamps_py, outcomes_py, bufs_py, stats_py = _run(program, streams, False)
    assert log == log_py
    assert stamps == stamps_py
    assert outcomes == outcomes_py
    assert bufs == bufs_py
    assert (stats.completed, stats.failed, stats.inflight, stats.peak_inflight) == (
        stats_py.completed, stats_py.failed, stats_py.inflight, stats_py.peak_inflight)


@compiled
def test_the_compiled_submit_takes_every_form_of_call_as_the_python_one():
    """Keywords for the function, a name, inline markers, iterables, run_on: each goes where
    the Python ``submit`` sends it, with the same result and the same errors."""
    def f(x, *, scale=1, reads=None):
        return float(np.sum(x)) * scale

    for compiled_submit in (True, False):
        a = np.zeros(3)
        with _path(compiled_submit), sd.Runtime("cpu") as rt:
            assert rt.submit(f, a, scale=2, reads=[a]).result() == 0.0
            assert rt.submit(f, sd.read(a), scale=3).result() == 0.0
            assert rt.submit_nowait(f, sd.read(a), scale=4).result() == 0.0
            assert rt.submit(np.add, a, 1, out=a, writes=iter([a]), name="named").result() is a
            assert rt.submit(f, a, run_on="cpu").result() == 3.0
            with pytest.raises(TypeError, match="reads= takes a list"):
                rt.submit(f, a, reads=a)
            with pytest.raises(TypeError, match="needs a callable"):
                rt.submit(3)
            with pytest.raises(TypeError):
                rt.submit()
            big = rt.submit(lambda: random.random(), name="")
            assert 0 <= big.result() < 1


@compiled
@pytest.mark.parametrize("which", ["Op", "Future"])
def test_a_slot_the_compiled_submit_does_not_set_is_refused_at_setup(which):
    """An op or future made in C has only the fields the C sets: one added in Python alone would be
    missing from every op (an AttributeError far from its cause). The setup refuses it instead."""
    from streamdag.runtime import ops, seam

    def with_extra(cls):
        return type(cls.__name__, cls.__bases__, {"__slots__": (*cls.__slots__, "added_later")})

    op_type = with_extra(ops.Op) if which == "Op" else ops.Op
    future_type = with_extra(ops.Future) if which == "Future" else ops.Future
    refusal = ("Op must subclass native OpFields and add no fields .* native/_submit.c" if which == "Op"
               else "Future has a slot added_later .* native/_submit.c")
    try:
        with pytest.raises(TypeError, match=refusal):
            seam.setup_submit(native.load(), op_type, future_type)
    finally:  # the module's state is global: the runtime's own classes again
        seam.setup_submit(native.load(), ops.Op, ops.Future)


@compiled
@pytest.mark.parametrize("which", ["Op", "Future"])
def test_the_compiled_records_have_the_fields_of_the_python_ones(which):
    """``native.OpFields`` and ``native.FutureFields`` (the records in C) declare the fields of
    ``ops._PyOpFields`` and ``ops._PyFutureFields``; Op adds none, Future only its lazy ones; and
    one made by ``__init__`` on the compiled record has every field set."""
    import types

    from streamdag.runtime import ops

    record = getattr(native.load(), f"{which}Fields")
    compiled = {name for name, d in vars(record).items() if isinstance(d, types.MemberDescriptorType)}
    assert compiled == set(getattr(ops, f"_Py{which}Fields").__slots__)
    cls = getattr(ops, which)
    assert cls.__bases__[0] is record
    assert set(cls.__slots__) == (set() if which == "Op" else {"_condition", "_done_callbacks", "_waiters"})
    made = ops.Op(7, "f", print, (), {}, []) if which == "Op" else ops.Future()
    assert all(hasattr(made, name) for name in compiled)


@compiled
def test_ops_are_named_after_their_functions_builtins_included():
    """The compiled submit keeps the last builtin's name (a builtin makes its ``__name__`` anew at
    each call): ops of builtins, bound builtin methods, Python functions and given names, in turns,
    are each named as the Python submit names them."""
    import math

    def names(compiled_submit: bool) -> list[str]:
        with _path(compiled_submit):
            return names_on(compiled_submit)

    def names_on(compiled_submit: bool) -> list[str]:
        rt = sd.Runtime(backend=HeldBackend(2))
        assert isinstance(rt.submit.__self__, native.load().Submitter) == compiled_submit
        x = np.zeros(4)
        fns = [math.sqrt, math.floor, x.sum, x.mean, abs, lambda v: v, math.sqrt, abs]
        futures = [rt.submit(fn, 1.0) for fn in fns * 2]
        futures.append(rt.submit(math.sqrt, 4.0, name="root"))
        futures.append(rt.submit(math.sqrt, 9.0))
        rt.backend.release([0] * len(futures))
        assert all(f.done() for f in futures)
        return [f.op_name for f in futures]

    compiled_names = names(True)
    assert compiled_names == names(False)
    assert compiled_names[:6] == ["sqrt#1", "floor#2", "sum#3", "mean#4", "abs#5", "<lambda>#6"]
    assert compiled_names[-2:] == ["root", "sqrt#18"]


@compiled
def test_cuda_launch_parts_whose_completion_queues_are_not_a_counted_list_are_refused():
    """The compiled submit takes what a CUDA put touches from ``launch_parts`` (queues, counts, wake-up
    event), not from the completion queues' own attributes: anything but (a list, a native Counters,
    an event) there is refused when the submitter is made, and a well-formed tuple is taken."""
    import threading

    from streamdag.runtime import accel, seam

    speedups = native.load()
    put = ([], speedups.Counters(), threading.Event())
    parts = (print,) * 6 + (object(), {}, [], 0, object(), put, print, print)
    with sd.Runtime(streams=2) as rt:
        speedups.Submitter(rt, seam.submitter_parts(rt), accel.accesses, False, parts)
        for bad in (((), put[1], put[2]), ([], object(), put[2]), put[:2]):
            with pytest.raises(TypeError):
                speedups.Submitter(rt, seam.submitter_parts(rt), accel.accesses, False,
                                   (*parts[:11], bad, *parts[12:]))


@compiled
def test_submitter_parts_of_the_wrong_shape_are_refused_when_the_submitter_is_made():
    """The compiled submit reads the runtime's ``SubmitterParts`` by position: a tuple of another
    length, state of another type, or a field that cannot be called where a method is due, is
    refused at construction rather than read out of place later."""
    from streamdag.runtime import accel, seam

    speedups = native.load()
    with sd.Runtime(streams=2) as rt:
        parts = seam.submitter_parts(rt)
        speedups.Submitter(rt, parts, accel.accesses, False, None)
        with pytest.raises(TypeError, match="SubmitterParts"):
            speedups.Submitter(rt, parts[:-1], accel.accesses, False, None)
        with pytest.raises(TypeError, match="not callable"):
            speedups.Submitter(rt, parts._replace(settle=None), accel.accesses, False, None)
        with pytest.raises(TypeError, match="expected types"):
            speedups.Submitter(rt, parts._replace(busy=tuple(parts.busy)), accel.accesses, False, None)
        with pytest.raises(TypeError, match="slots must count"):
            speedups.Submitter(rt, parts._replace(counts=speedups.Counters()), accel.accesses, False, None)


@compiled
def test_the_compiled_copy_counts_in_the_parts_the_byte_budget_hands_it():
    """``ByteBudget.compiled_parts()`` is what the compiled copy counts a copy's bytes in: the same
    counts the budget's own methods change; ``setup_copies`` takes them, or None (the budget's
    methods count), and refuses anything else."""
    from streamdag.runtime import transfers
    from streamdag.runtime.budgets import ByteBudget

    budget = ByteBudget(100)
    counts, lock, held = budget.compiled_parts()
    budget.acquire(30)
    assert counts.used == budget.used == 30 and held == {}
    with sd.Runtime(streams=2) as rt:
        submitter = rt.submit.__self__
        copy = transfers.copy
        submitter.setup_copies(print, {}, {}, budget, copy, budget.compiled_parts())
        submitter.setup_copies(print, {}, {}, budget, copy, None)
        with pytest.raises(TypeError, match="budget_parts"):
            submitter.setup_copies(print, {}, {}, budget, copy, (counts, lock))
