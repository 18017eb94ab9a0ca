"""The compiled hot path (``native/_speedups.c``) against its Python reference, step by step.

The tracker, the stream clocks and the accesses of tensors each have a
Python implementation that the compiled one must match exactly: same
dependencies in the same order, same records kept and dropped, same stamps
and waits, same regions and errors.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamdag import native
from streamdag.graph import Access, Region, buffers, hazards
from streamdag.runtime import accel
from streamdag.schedule import plan, waits

compiled = pytest.mark.skipif(native.load() is None, reason=f"no compiled hot path: {native.status()}")


def test_the_runtime_uses_the_compiled_hot_path_where_it_builds():
    if os.environ.get("CI"):  # CI machines have a compiler: the compiled path must be what runs there
        assert native.load() is not None, native.status()
    if native.load() is None:
        assert (accel.DepsTracker, accel.StreamClocks) == (hazards.PyDepsTracker, waits.PyStreamClocks)
        assert accel.accesses is buffers._py_accesses
        assert accel.CompiledDepsTracker is accel.CompiledStreamClocks is accel.compiled_accesses is None
    else:
        assert accel.DepsTracker is accel.CompiledDepsTracker
        assert issubclass(accel.DepsTracker, native.load().TrackerFields)
        assert accel.StreamClocks is accel.CompiledStreamClocks
        assert issubclass(accel.StreamClocks, native.load().Clocks)
        assert accel.accesses is accel.compiled_accesses is native.load().accesses
    from streamdag import Runtime

    with Runtime("cpu", streams=2) as rt:
        assert type(rt._tracker) is accel.DepsTracker and type(rt._clocks) is accel.StreamClocks
    assert native.status()


def test_the_pure_layers_load_no_compiled_code():
    """graph/ and schedule/ import no compiled code: the runtime chooses it (runtime/accel.py).
    The package's ``__init__`` imports the runtime, so the subprocess imports them under a bare
    package, as a program that uses the pure layers alone would see them."""
    code = ("import importlib.util, sys, types\n"
            "package = types.ModuleType('streamdag')\n"
            "package.__path__ = list(importlib.util.find_spec('streamdag').submodule_search_locations)\n"
            "sys.modules['streamdag'] = package\n"
            "import streamdag.schedule.plan, streamdag.graph.hazards, streamdag.graph.buffers\n"
            "assert 'streamdag.native._speedups' not in sys.modules\n"
            "loaded = [m for m in sys.modules if m.startswith(('streamdag.native', 'streamdag.runtime'))]\n"
            "assert not loaded, loaded\n"
            "assert streamdag.schedule.plan.build_schedule([[], [0], [0]], 2).num_waits == 1\n")
    done = _python(code, STREAMDAG_NATIVE="1")
    assert done.returncode == 0, done.stderr


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


#: a subprocess's first line that makes it run as if the install had not compiled the hot path
_NOT_BUILT = "import sys; sys.modules['streamdag.native._speedups'] = None\n"


def test_without_the_compiled_module_streamdag_warns_once_at_the_users_import_and_runs_python():
    code = (
        _NOT_BUILT
        + "import numpy as np, streamdag as sd\n"  # line 2: where the warning must point
        "from streamdag import native\n"
        "from streamdag.graph import hazards\n"
        "from streamdag.runtime import accel\n"
        "assert accel.DepsTracker is hazards.PyDepsTracker\n"
        "a = np.zeros(4)\n"
        "with sd.Runtime('cpu', streams=2) as rt:\n"
        "    rt.submit(np.add, a, 1, out=a, writes=[a])\n"
        "    rt.submit(np.multiply, a, 3, out=a, writes=[a])\n"
        "assert a.tolist() == [3.0] * 4\n"
        "print(native.status())\n"
    )
    done = _python(code, STREAMDAG_NATIVE="")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Python only:") and "not installed" in done.stdout
    assert done.stderr.count("StreamdagWarning") == 1 and "STREAMDAG_NATIVE=0" in done.stderr
    assert done.stderr.startswith("<string>:2: StreamdagWarning: "), done.stderr


def test_a_required_compiled_hot_path_that_is_not_installed_is_an_error_that_says_how_to_build_it():
    done = _python(_NOT_BUILT + "import streamdag", STREAMDAG_NATIVE="1")
    assert done.returncode != 0 and "NativeBuildError" in done.stderr and "STREAMDAG_NATIVE=1" in done.stderr
    assert "pip install -e ." in done.stderr


def test_streamdag_native_0_runs_the_python_code_without_a_warning():
    done = _python("import warnings; warnings.simplefilter('error')\n"
                   "import streamdag\nfrom streamdag import native\nprint(native.status())",
                   STREAMDAG_NATIVE="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Python only: STREAMDAG_NATIVE=0"


accesses = st.tuples(
    st.sampled_from(["cpu", "cuda:0"]),
    st.integers(0, 12),  # start (in units of 8 bytes): few, so that ranges meet and overlap often
    st.integers(0, 4),  # length: 0 is an empty range, skipped
    st.booleans(),  # write
)
steps = st.lists(
    st.tuples(st.lists(accesses, max_size=4), st.booleans(), st.integers(0, 7)),  # accesses, forget, finish
    min_size=1, max_size=120,
)


@compiled
@settings(max_examples=600, deadline=None)
@given(steps)
def test_the_compiled_tracker_links_as_the_python_one(program):
    done: set = set()
    trackers = [cls(retired=done.__contains__) for cls in (accel.CompiledDepsTracker, hazards.PyDepsTracker)]
    for i, (accs, forget, finish_back) in enumerate(program):
        node = ("op", i)  # a tuple: nodes are told apart by equality, as in a dict, not by identity
        acc = [Access(Region(space, 8 * start, 8 * (start + length)), write)
               for space, start, length, write in accs]
        assert trackers[0].depends_on(acc) == trackers[1].depends_on(acc)
        assert trackers[0].link(node, acc) == trackers[1].link(node, acc)
        if finish_back and i >= finish_back:
            done.add(("op", i - finish_back))  # ops finish out of order, as on several streams
        if forget:
            for t in trackers:
                t.forget(done.__contains__)
        assert len(trackers[0]) == len(trackers[1])
        for name, space in trackers[1]._spaces.items():
            other = trackers[0]._spaces[name]
            for lo, hi in ((0, 8), (8, 24), (40, 104), (0, 200), (16, 17)):
                assert [(r.start, r.end) for r in other.overlapping(lo, hi)] == [
                    (r.start, r.end) for r in space.overlapping(lo, hi)]
            assert [(r.start, r.end, r.writer, r.readers, r.shared, r.last) for r in other.records] == [
                (r.start, r.end, r.writer, r.readers, r.shared, r.last) for r in space.records]
            assert (other.count, other.compact_at, other.horizon, other.scanned) == (
                space.count, space.compact_at, space.horizon, space.scanned)
            assert list(other.dropped) == list(space.dropped)


@compiled
def test_the_compiled_tracker_compacts_as_the_python_one_over_many_ranges():
    """Thousands of fresh ranges, some recurring: the horizon grows and dropped ranges are forgotten
    in the same way (the paths a short random program seldom reaches)."""
    done: set = set()
    trackers = [cls(retired=done.__contains__) for cls in (accel.CompiledDepsTracker, hazards.PyDepsTracker)]
    rng = np.random.default_rng(0)
    for i in range(40000):
        start = 64 * int(rng.integers(0, 300)) if i % 3 == 0 else 64 * (1000 + i)
        acc = [Access(Region("cpu", start, start + 8), bool(i % 2))]
        assert trackers[0].link(i, acc) == trackers[1].link(i, acc)
        done.add(i - 3)
        assert len(trackers[0]._spaces["cpu"].dropped) <= hazards._MAX_HORIZON  # the oldest are forgotten
    spaces = [t._spaces["cpu"] for t in trackers]
    assert [(r.start, r.end) for r in spaces[0].records] == [(r.start, r.end) for r in spaces[1].records]
    assert list(spaces[0].dropped) == list(spaces[1].dropped)
    assert spaces[0].horizon == spaces[1].horizon > hazards._FIRST_HORIZON


@compiled
@pytest.mark.parametrize("kind", ["op", "tuple"])
@pytest.mark.parametrize("readers", [1, 31, 32, 33, 100])
def test_a_write_after_many_reads_links_every_reader_in_order(readers, kind):
    """The compiled link keeps the ops it finds in a small array, and past a few dozen (or for
    nodes other than ops) in a dict, as the Python code does: the same dependencies, in the same
    order, either way."""
    from streamdag.runtime.ops import Op

    def node(i):
        return Op(i if isinstance(i, int) else -1, f"op{i}", print, (), {}, []) if kind == "op" else ("op", i)

    nodes = {i: node(i) for i in [*range(readers), "w", "last"]}
    trackers = [accel.CompiledDepsTracker(), hazards.PyDepsTracker()]
    shared, own = Access(Region("cpu", 0, 64), False), Access(Region("cpu", 64, 128), False)
    for t in trackers:
        for i in range(readers):  # each reads the shared range, some also a second, overlapping view
            t.link(nodes[i], [shared] + ([Access(Region("cpu", 0, 32), False)] if i % 3 == 0 else []))
        t.link(nodes["w"], [own])
    write = [Access(Region("cpu", 0, 128), True)]
    linked = [t.link(nodes["last"], write) for t in trackers]
    assert linked[0] == linked[1] == [nodes[i] for i in range(readers)] + [nodes["w"]]


@compiled
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, 200), max_size=5)),
                                   min_size=1, max_size=60))
def test_the_compiled_clocks_place_as_the_python_ones(num_streams, program):
    clocks = [accel.CompiledStreamClocks(num_streams), waits.PyStreamClocks(num_streams)]
    stamps: list = []
    for stream, picks in program:
        stream %= num_streams
        deps = [stamps[p % len(stamps)] for p in picks] if stamps else []
        got, want = (c.place(stream, deps) for c in clocks)
        assert got == want
        assert type(got[0]) is waits.Stamp
        assert clocks[0].tail(stream) == clocks[1].tail(stream)
        for d in deps:
            assert clocks[0].implied(stream, d) == clocks[1].implied(stream, d)
        stamps.append(got[0])
    assert clocks[0].num_streams == num_streams


@st.composite
def any_stamps(draw, num_streams):
    """Stamps no run of clocks would make (a clock need not know what its op waited for): they
    reach the pass that drops a wait implied by the others."""
    stream = draw(st.integers(0, num_streams - 1))
    clock = draw(st.lists(st.integers(0, 4), min_size=num_streams, max_size=num_streams))
    clock[stream] = max(1, clock[stream])
    return waits.Stamp(stream, clock[stream], tuple(clock))


@compiled
@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(1, 4))
def test_the_compiled_clocks_drop_the_same_implied_waits(data, num_streams):
    clocks = [accel.CompiledStreamClocks(num_streams), waits.PyStreamClocks(num_streams)]
    for _ in range(data.draw(st.integers(1, 8))):
        stream = data.draw(st.integers(0, num_streams - 1))
        deps = data.draw(st.lists(any_stamps(num_streams), max_size=5))
        got, want = (c.place(stream, deps) for c in clocks)
        assert got == want


def test_a_wait_implied_by_a_later_one_is_dropped():
    clocks = accel.StreamClocks(4)
    first = waits.Stamp(0, 1, (1, 0, 0, 9))  # knows most, so visited first
    second = waits.Stamp(1, 1, (1, 1, 0, 0))  # also knows stream 0's first op: implies ``first``
    assert clocks.place(2, [first, second])[1] == [1]


def test_clocks_refuse_a_stream_out_of_range():
    with pytest.raises(IndexError):
        accel.StreamClocks(2).place(2, [])


def test_the_runtime_plans_schedules_on_its_own_clocks(monkeypatch):
    made = []

    class Counted(accel.StreamClocks):
        __slots__ = ()

        def __init__(self, num_streams):
            made.append(num_streams)
            super().__init__(num_streams)

    monkeypatch.setattr(accel, "StreamClocks", Counted)
    sched = accel.build_schedule([[], [0], [0]], 2)
    accel.pin_ops(sched, ["copy", None, None])
    accel.plan_waits([[], [0]], [0, 1], 2)
    assert made == [2, 3, 2]


@compiled
@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10_000), max_size=4), min_size=1, max_size=60), st.integers(1, 5))
def test_schedules_planned_on_the_compiled_clocks_equal_the_pure_layers(picks, max_streams):
    """The runtime's planners (runtime/accel.py) hand the compiled clocks to the pure layer's:
    the same streams, waits and pinned copy streams as the pure layer's own, on the Python clocks."""
    preds = [sorted({p % v for p in ps}) if v else [] for v, ps in enumerate(picks)]
    sched = accel.build_schedule(preds, max_streams)
    assert sched == plan.build_schedule(preds, max_streams)
    pinned = [("copy", v % 2) if v % 3 == 0 else None for v in range(len(preds))]
    assert accel.pin_ops(sched, pinned) == plan.pin_ops(sched, pinned)
    streams = [v % max_streams for v in range(len(preds))]
    assert accel.plan_waits(preds, streams, max_streams) == waits.plan_waits(preds, streams, max_streams)


torch = pytest.importorskip("torch")


def _tensors():
    base = torch.arange(64, dtype=torch.float32)
    return [
        base, base[3:17], base[::3], base.view(8, 8).t(), base[5:5], torch.zeros(0, 4),
        torch.zeros(3, 4, dtype=torch.float64)[:, 1], torch.nn.Parameter(torch.ones(4)),
        np.arange(10), np.arange(12).reshape(3, 4)[:, ::2], torch.tensor(3.0),
    ]


def test_accesses_of_tensors_and_arrays_equal_the_python_ones():
    values = _tensors()
    got = accel.accesses(values[:6], values[6:])
    assert got == buffers._py_accesses(values[:6], values[6:])
    assert [type(a) for a in got] == [Access] * len(values)
    assert all(type(a.region) is Region for a in got)
    assert [a.write for a in got] == [False] * 6 + [True] * 5


@compiled
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 40), st.booleans()), min_size=1, max_size=60))
def test_accesses_stay_equal_to_the_python_ones_as_memory_is_reused(program):
    """The compiled accesses hand out the same Region and Access objects again for a range seen
    before: freed memory that comes back with another size, views into one buffer, a read then a
    write of one tensor, and more ranges than it keeps must all still read as the Python code does."""
    base = torch.zeros(4096)
    kept = []
    for size, offset, write in program:
        t = torch.empty(size) if size % 2 else base[offset:offset + size]
        reads, writes = ([t], [t]) if write else ([t], [])
        assert accel.compiled_accesses(reads, writes) == buffers._py_accesses(reads, writes)
        kept = [*kept[-3:], t]  # some stay alive, the rest go back to the allocator
    # more ranges than the compiled code keeps: some share a start, some an end
    many = [base[i:i + 1] for i in range(1500)] + [base[:k] for k in range(1, 1500)]
    many += [base[k:] for k in range(1500)]
    for order in (many, many[::-1], many[::7] + many):
        assert accel.compiled_accesses(order, order[:700]) == buffers._py_accesses(order, order[:700])


def _numpy_arrays():
    """Arrays whose byte range the compiled code reads through the buffer protocol (or, where numpy
    exports none, hands to the Python code): views of every kind, dtypes that export no buffer."""
    dtypes = st.sampled_from(["f8", "f4", "i2", "u1", ">i4", "c16", "?", "O", "M8[s]", "U3",
                              [("a", "i4"), ("b", "f8")]])
    shapes = st.lists(st.integers(0, 5), max_size=3)

    @st.composite
    def array(draw):
        shape = draw(shapes)
        base = np.zeros(shape, dtype=draw(dtypes))
        kind = draw(st.sampled_from(["plain", "step", "reversed", "transposed", "broadcast",
                                     "readonly", "scalar", "subclass"]))
        if kind == "step" and base.ndim:
            return base[:: draw(st.integers(1, 3))]
        if kind == "reversed" and base.ndim:
            return base[::-1]
        if kind == "transposed":
            return base.T
        if kind == "broadcast" and base.ndim and base.shape[0]:
            return np.broadcast_to(base[:1], (4, *base.shape[1:]))
        if kind == "readonly":
            base.flags.writeable = False
        if kind == "scalar":
            return np.zeros((), dtype=base.dtype)
        if kind == "subclass":
            return base.view(np.ma.MaskedArray) if base.dtype != object else base
        return base

    return array()


@compiled
@settings(max_examples=300 if os.environ.get("CI") else 80, deadline=None)
@given(st.lists(_numpy_arrays(), min_size=1, max_size=4), st.integers(0, 4))
def test_accesses_of_numpy_arrays_equal_the_python_ones(arrays, split):
    """The compiled code reads a numpy array through the buffer protocol, not its
    ``__array_interface__``: the same byte range for every view and dtype, or the Python code's."""
    reads, writes = arrays[:split], arrays[split:]
    assert accel.compiled_accesses(reads, writes) == buffers._py_accesses(reads, writes)


@pytest.mark.parametrize("bad", [torch.zeros(4).to_sparse(), [1, 2], "text"])
def test_accesses_of_what_is_not_memory_raise_the_same_clear_error(bad):
    with pytest.raises(sd_invalid()) as compiled_error:
        accel.accesses([bad], [])
    with pytest.raises(sd_invalid()) as python_error:
        buffers._py_accesses([bad], [])
    assert str(compiled_error.value) == str(python_error.value)


def sd_invalid():
    from streamdag import InvalidBuffer

    return InvalidBuffer


@compiled
def test_a_look_up_that_re_enters_the_tracker_is_safe_and_equal_to_the_python_one():
    """A node's hash runs Python code, which may link more ops into the same tracker while the
    compiled ``link`` is reading a record (a finalizer that submits would do the same): the C code
    must hold its own references to what it reads, and end where the Python code does."""

    def run(tracker_type):
        tracker, busy, budget = tracker_type(), [False], [60]

        class Reentrant:
            def __init__(self, i):
                self.i = i

            def __hash__(self):
                if not busy[0] and budget[0] > 0:
                    busy[0], budget[0] = True, budget[0] - 1
                    for k in range(5):  # replace the writer and the readers being read
                        tracker.link(Reentrant(1000 + k), [Access(Region("cpu", 0, 8), True),
                                                           Access(Region("cpu", 0, 16), False)])
                    busy[0] = False
                return self.i

            def __eq__(self, other):
                return self is other

        linked = []
        for i in range(120):
            deps = tracker.link(Reentrant(i), [Access(Region("cpu", 0, 8), i % 2 == 0),
                                               Access(Region("cpu", 4, 12), False),
                                               Access(Region("cpu", 0, 16), True)])
            linked.append([d.i for d in deps])
        return linked, len(tracker)

    assert run(accel.CompiledDepsTracker) == run(hazards.PyDepsTracker)


_ENTRY = st.tuples(st.booleans(), st.booleans(), st.sampled_from(["", "", "", "loses", "raises"]),
                   st.sampled_from(["", "", "sticky", "refused"]))


class _Owner:
    """A completion pass's owner, as ``CudaBackend`` is one: its device loss and its event pool."""

    def __init__(self, lost=None):
        self.lost = lost
        self._free_events = []

    def mark_lost(self, exc):  # as CudaBackend's
        from streamdag.backends import cuda

        if cuda.refused_during_capture(exc):
            return None
        self.lost = self.lost or f"lost: {exc}"
        return self.lost

    def recycle(self, event):
        if not event.timing:
            self._free_events.append(event)


class _Event:
    """A completion event whose query says ``done``, or raises a sticky or a refused CUDA error."""

    def __init__(self, name, done, timing, raises):
        self.name, self.done, self.timing, self.raises = name, done, timing, raises

    def query(self):
        if self.raises == "sticky":
            raise RuntimeError(f"an illegal memory access at {self.name}")
        if self.raises == "refused":
            raise RuntimeError(f"operation not permitted when stream is capturing: {self.name}")
        return self.done


@compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_ENTRY, max_size=6), min_size=1, max_size=4))
def test_the_compiled_completion_pass_finishes_as_the_python_one(queues):
    """``_Completions._pass``, compiled and in Python: the same callbacks with the same errors in the
    same order, the same events back in the pool, the same entries left, the same device loss (a
    query raising a sticky CUDA error marks it, or a callback does; a query refused during a CUDA
    graph capture leaves its entry queued), the same exception from a callback. Each entry: its
    event's query says done, the event times, what its callback does, what its query raises."""
    from collections import deque

    from streamdag.backends import cuda

    def run(compiled):
        owner, log = _Owner(), []
        completions = object.__new__(cuda._Completions)
        completions._owner = owner

        def callback_for(name, does):
            def callback(error):
                log.append((name, error))
                if does == "loses":
                    owner.lost = f"lost in {name}"
                if does == "raises" and error is None:
                    raise ValueError(f"callback {name}")
            return callback

        completions._queues = [
            deque((j, _Event((i, j), done, timing, raises), callback_for((i, j), does))
                  for j, (done, timing, does, raises) in enumerate(entries))
            for i, entries in enumerate(queues)
        ]
        saved = cuda._compiled_pass
        cuda._compiled_pass = native.load().completions_pass if compiled else None
        try:
            outcome = completions._pass()
        except ValueError as exc:
            outcome = str(exc)
        finally:
            cuda._compiled_pass = saved
        left = [[entry[0] for entry in q] for q in completions._queues]
        return outcome, log, [e.name for e in owner._free_events], left, owner.lost

    assert run(compiled=True) == run(compiled=False)


@compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(_ENTRY, max_size=6), st.integers(0, 7), st.booleans())
def test_the_compiled_finish_of_one_waited_op_is_the_python_one(entries, pick, lost_before):
    """``_Completions._finish_one`` (a waiter's op finished ahead of its queue), compiled and in
    Python: the same answer (finished, left queued, gone already), the same callback with the same
    error, the same events back in the pool, the same entries left, the same device loss. Entries
    as in the pass's test; ``pick``: the entry waited on (past the end: one finished already)."""
    from collections import deque

    from streamdag.backends import cuda

    def run(compiled):
        owner, log = _Owner("lost before" if lost_before and pick % 3 == 0 else None), []
        completions = object.__new__(cuda._Completions)
        completions._owner = owner
        completions._query_relaxed = lambda event: event.query()
        # tokens as put() makes them for queue 1 of 3: 3k + 1, in order
        def callback_for(j, does):
            def callback(error):
                log.append((j, error))
                if does == "raises":
                    raise ValueError(f"callback {j}")
            return callback

        completions._queues = [deque(), deque(
            (3 * j + 1, _Event(j, done, timing, raises), callback_for(j, does))
            for j, (done, timing, does, raises) in enumerate(entries)), deque()]
        token = 3 * pick + 1
        saved = cuda._compiled_finish_one
        cuda._compiled_finish_one = None
        try:
            if compiled:
                outcome = native.load().completions_finish_one(
                    completions, completions._queues[1], token, owner, owner._free_events, cuda.CudaEvent)
            else:
                outcome = completions._finish_one(token, relaxed=True)
        except ValueError as exc:
            outcome = str(exc)
        finally:
            cuda._compiled_finish_one = saved
        left = [entry[0] for entry in completions._queues[1]]
        return outcome, log, [e.name for e in owner._free_events], left, owner.lost

    assert run(compiled=True) == run(compiled=False)


def test_a_query_refused_during_a_capture_is_no_device_loss():
    """While a CUDA graph is captured in PyTorch's default (global) mode, CUDA refuses event
    queries from every thread: the completion pass must query again later, not fail every op."""
    import types

    from streamdag.backends import cuda
    from streamdag.errors import DeviceLost

    owner = types.SimpleNamespace(lost=None, device="cuda:0")
    refused = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    assert cuda.CudaBackend.mark_lost(owner, refused) is None and owner.lost is None
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered")
    lost = cuda.CudaBackend.mark_lost(owner, sticky)
    assert isinstance(lost, DeviceLost) and owner.lost is lost
    assert cuda.CudaBackend.mark_lost(owner, refused) is None and owner.lost is lost


#: what PyTorch appends to the message of every CUDA error it raises
PYTORCH_ADVICE = (
    "\nSearch for `cudaErrorX' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html"
    " for more information.\nCUDA kernel errors might be asynchronously reported at some other API call,"
    " so the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
    "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


@pytest.mark.parametrize("words, sticky, refused", [
    ("CUDA error: an illegal memory access was encountered", True, False),
    ("CUDA error: device-side assert triggered", True, False),
    ("CUDA error: unspecified launch failure", True, False),
    ("CUDA error: invalid argument", False, False),
    ("CUDA error: invalid configuration argument", False, False),
    ("CUDA error: operation not permitted when stream is capturing", False, True),
    ("CUDA error: operation failed due to a previous error during capture", False, False),
])
def test_cuda_errors_are_told_by_their_own_words_not_pytorchs_advice(words, sticky, refused):
    """Only a sticky error loses the device; PyTorch's advice after every CUDA error mentions
    "device-side assertions", which made every CUDA error count as sticky."""
    from streamdag.backends import cuda

    exc = RuntimeError(words + PYTORCH_ADVICE)
    assert cuda.is_sticky(exc) == sticky
    assert cuda.refused_during_capture(exc) == refused


def test_without_cuda_the_torch_extension_is_not_built_and_doctor_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/test_cuda.py requires the extension instead")
    assert native.load_torch() is None
    status = native.torch_status()
    assert status.startswith("through PyTorch's Python bindings: ")
    assert ("no CUDA here" in status) or ("no compiled hot path" in status), status


def _excludes_under_contention(lock, depth: int = 1) -> None:
    """Four threads count to 20,000 under ``lock`` (taken ``depth`` times), handing over mid-section."""
    import threading
    import time
    from contextlib import ExitStack

    count = [0]

    def add(n):
        for _ in range(n):
            with ExitStack() as held:
                for _ in range(depth):
                    held.enter_context(lock)
                seen = count[0]
                if seen % 97 == 0:
                    time.sleep(0)  # hand over mid-section now and then
                count[0] = seen + 1

    threads = [threading.Thread(target=add, args=(5000,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert count[0] == 20000


def _condition_waits_on(lock, outer=None) -> None:
    """``threading.Condition(lock)`` waits for another thread's notify (``outer``: held around it too)."""
    import threading
    import time
    from contextlib import nullcontext

    cond, box = threading.Condition(lock), []

    def produce():
        time.sleep(0.02)
        with cond:
            box.append(1)
            cond.notify()

    producer = threading.Thread(target=produce)
    producer.start()
    with outer if outer is not None else nullcontext(), cond:
        assert cond.wait_for(lambda: box, timeout=5)
        assert not hasattr(lock, "_is_owned") or lock._is_owned()  # taken back, as often as it was held
    producer.join()


@compiled
def test_the_compiled_lock_behaves_as_threading_lock():
    """``native.Lock`` stands in for ``threading.Lock`` (the runtime's done lock, the futures'
    ``_LAZY``): the same answers to every call, mutual exclusion under contention, and
    ``threading.Condition`` on it."""
    import threading
    import time

    from streamdag.runtime import ops

    assert ops._LAZY.__class__ is native.load().Lock  # the runtime uses it where it is built
    for make in (threading.Lock, native.load().Lock):
        lock = make()
        answers = [lock.locked(), lock.acquire(), lock.locked(), lock.acquire(False),
                   lock.acquire(blocking=False), lock.acquire(timeout=0.01)]
        lock.release()
        answers.append(lock.locked())
        with pytest.raises(RuntimeError):
            lock.release()
        with lock:
            answers.append(lock.locked())
        answers.append(lock.locked())
        with pytest.raises(ValueError):
            lock.acquire(False, 1.0)
        assert answers == [False, True, True, False, False, False, False, True, False], make

    _excludes_under_contention(native.load().Lock())
    _condition_waits_on(native.load().Lock())
    held = native.load().Lock()
    held.acquire()  # another thread waits on it, with a timeout, and gets it once let go
    got = []
    waiter = threading.Thread(
        target=lambda: got.append((held.acquire(timeout=0.01), held.acquire(timeout=5))))
    waiter.start()
    time.sleep(0.1)
    held.release()
    waiter.join()
    assert got == [(False, True)]


@compiled
def test_the_compiled_rlock_behaves_as_threading_rlock():
    """``native.RLock`` stands in for ``threading.RLock`` as the runtime's central lock: the same
    answers to every call (re-entry, release by a thread that does not hold it), mutual exclusion
    under contention, and ``threading.Condition`` on it while it is held twice."""
    import threading

    import streamdag as sd

    with sd.Runtime(streams=2) as rt:
        assert rt._lock.__class__ is native.load().RLock  # the runtime uses it where it is built
    for make in (threading.RLock, native.load().RLock):
        lock, answers = make(), []
        answers += [lock.acquire(), lock.acquire(False), lock.acquire(timeout=0.01), lock._is_owned()]
        other = threading.Thread(target=lambda lock=lock, answers=answers: answers.append(
            (lock.acquire(False), lock.acquire(timeout=0.01), lock._is_owned())))
        other.start()
        other.join()
        for _ in range(3):
            lock.release()
        answers.append(lock._is_owned())
        with pytest.raises(RuntimeError):
            lock.release()
        with lock, lock:
            answers.append(lock._is_owned())
        answers.append(lock._is_owned())
        with pytest.raises(ValueError):
            lock.acquire(False, 1.0)
        assert answers == [True, True, True, True, (False, False, False), False, True, False], make

    _excludes_under_contention(native.load().RLock(), depth=2)
    rlock = native.load().RLock()
    _condition_waits_on(rlock, outer=rlock)  # held twice: the wait lets go of both, takes both back
    assert not rlock._is_owned()


@compiled
def test_a_wait_for_the_compiled_rlock_is_cut_short_by_ctrl_c():
    """A thread waiting for the runtime's lock (held by a long launch, say) still gets its
    KeyboardInterrupt, as with ``threading.RLock``."""
    import signal
    import threading
    import time

    lock, held, done = native.load().RLock(), threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            done.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(5)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    started = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            lock.acquire()
        assert time.perf_counter() - started < 5
        assert not lock._is_owned()
    finally:
        done.set()
        thread.join()
        timer.cancel()
    assert lock.acquire(timeout=5)  # and the lock still works
    lock.release()


def test_a_lock_left_by_a_killed_extension_build_is_dropped_not_waited_on_forever(tmp_path):
    """PyTorch's extension build waits while its ``lock`` file exists; a build killed midway leaves
    one, and every later import hung on the GPU machine. Under streamdag's own (flock) lock such a
    file is a dead build's, and goes; another process's build is waited for through the flock."""
    fcntl = pytest.importorskip("fcntl")
    (tmp_path / "lock").write_text("")
    with native._exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "streamdag.lock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: another process would wait
    with open(tmp_path / "streamdag.lock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go after the build
