"""The compiled tracker and stream clocks (``native/_speedups.c``) against their Python references,
step by step: the same dependencies in the same order, the same records kept and dropped, the
same stamps and waits, and the same schedules planned on them."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamdag import native
from streamdag.graph import Access, Region, hazards
from streamdag.runtime import accel
from streamdag.schedule import plan, waits

compiled = pytest.mark.skipif(native.load() is None, reason=f"no compiled hot path: {native.status()}")


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
