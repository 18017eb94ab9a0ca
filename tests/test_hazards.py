"""Dependency inference, one test per hazard."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamdag.graph import Access, region_of
from streamdag.runtime.accel import DepsTracker  # the runtime's (the Python one on the Python path)

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def acc(x, write=False):
    return Access(region_of(x), write)


def submit(tracker, node, *accesses):
    deps = tracker.depends_on(accesses)
    tracker.add(node, accesses)
    return deps


def test_order_write_read_same_buf():
    a = np.zeros(8)
    t = DepsTracker()
    submit(t, "w", acc(a, True))
    assert submit(t, "r", acc(a)) == ["w"]


def test_reads_never_wait_for_reads():
    a = np.zeros(8)
    t = DepsTracker()
    submit(t, "r1", acc(a))
    assert submit(t, "r2", acc(a)) == []


def test_write_after_read_through_a_view():
    a = np.zeros((4, 4))
    t = DepsTracker()
    submit(t, "r", acc(a[1]))
    assert submit(t, "w", acc(a.T, True)) == ["r"]


def test_write_after_write_through_a_reshape():
    a = np.zeros(16)
    t = DepsTracker()
    submit(t, "w1", acc(a.reshape(4, 4)[2:], True))
    assert submit(t, "w2", acc(a[10:12], True)) == ["w1"]


def test_read_after_write_of_an_overlapping_slice():
    a = np.zeros(100)
    t = DepsTracker()
    submit(t, "w", acc(a[40:60], True))
    assert submit(t, "r_left", acc(a[:40])) == []
    assert submit(t, "r_mid", acc(a[59:70])) == ["w"]


def test_write_waits_for_every_reader_since_the_last_write():
    a = np.zeros(8)
    t = DepsTracker()
    submit(t, "w", acc(a, True))
    submit(t, "r1", acc(a))
    submit(t, "r2", acc(a[:2]))
    # w itself is listed too; the implied edge w -> w2 is removed by the scheduler
    assert submit(t, "w2", acc(a, True)) == ["w", "r1", "r2"]


def test_covering_write_retires_older_entries():
    """w1 -> r -> w2: after w2 covers a, a reader needs only w2 (w2 already follows w1 and r)."""
    a = np.zeros(8)
    t = DepsTracker()
    submit(t, "w1", acc(a, True))
    submit(t, "r", acc(a))
    submit(t, "w2", acc(a, True))
    assert submit(t, "r2", acc(a)) == ["w2"]
    assert len(t) == 2


def test_partial_write_keeps_older_writer():
    a = np.zeros(8)
    t = DepsTracker()
    submit(t, "w1", acc(a, True))
    submit(t, "w2", acc(a[:4], True))
    assert submit(t, "r", acc(a)) == ["w1", "w2"]


def test_buffers_in_different_spaces_never_conflict():
    from streamdag.graph import Region

    t = DepsTracker()
    submit(t, "w", Access(Region("cpu", 0, 100), True))
    assert submit(t, "r", Access(Region("cuda:0", 0, 100), False)) == []


def test_an_op_reading_and_writing_one_buffer_never_depends_on_itself():
    a = np.zeros(8)
    t = DepsTracker()
    assert t.link("w1", [acc(a), acc(a, True)]) == []
    assert t.link("w2", [acc(a, True), acc(a[:2])]) == ["w1"]
    assert t.link("r", [acc(a[1:])]) == ["w2"]  # w2 rewrote all of a, after w1


def test_retired_nodes_are_dropped_as_records_grow():
    a = np.zeros(8)
    done = set()
    t = DepsTracker(retired=done.__contains__)
    for i in range(100):
        t.link(i, [acc(a)])  # readers pile up on one range until compaction drops the finished
        done.add(i)
    assert len(t) < 40
    assert set(t.link("w", [acc(a, True)])) <= done  # what is left is finished: the owner skips it


def test_forget_drops_finished_nodes():
    a = np.zeros(8)
    t = DepsTracker()
    submit(t, "w", acc(a, True))
    t.forget(lambda n: n == "w")
    assert submit(t, "r", acc(a)) == []


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20), st.booleans()), max_size=40))
def test_matches_a_brute_force_oracle(ops):
    """Every overlapping earlier access is found (directly or through a covering write)."""
    from streamdag.graph import Region

    t, linked = DepsTracker(), DepsTracker()
    history = []
    for i, (start, length, is_write) in enumerate(ops):
        acc = Access(Region("cpu", start, start + length), is_write)
        in_order = t.depends_on([acc])
        t.add(i, [acc])
        assert linked.link(i, [acc]) == in_order  # the runtime's one-pass path finds the same
        deps = set(in_order)
        direct = {j for j, (s, n, w) in enumerate(ops[:i])
                  if s < start + length and start < s + n and (w or is_write)}
        assert deps <= direct  # nothing spurious
        for j in direct - deps:  # anything left out is ordered through a later dependency
            assert any(j in history[k] or _reaches(history, k, j) for k in deps), (i, j)
        history.append(deps)


def _reaches(history, k, j):
    stack, seen = [k], set()
    while stack:
        n = stack.pop()
        if n == j:
            return True
        if n not in seen:
            seen.add(n)
            stack.extend(history[n])
    return False


@pytest.mark.parametrize("n_bufs", [64, 400])
def test_ranges_used_in_turn_keep_their_records_while_ops_finish(monkeypatch, n_bufs):
    """Ops on buffers in turn, each finished at once: compaction must not drop and remake records.

    400 buffers is a working set larger than the records visited between two
    compactions (a wide graph run again and again): the records may be made
    again while the tracker learns how long to keep them, but not after.
    """
    made = []
    space_type = DepsTracker.space_type

    class Counted(space_type.record_type):
        __slots__ = ()

        def __init__(self, start, end):
            made.append((start, end))
            super().__init__(start, end)

    monkeypatch.setattr(space_type, "record_type", Counted)
    bufs = [np.zeros(8) for _ in range(n_bufs)]
    done = set()
    t = DepsTracker(retired=done.__contains__)
    for cycle in range(20):
        if cycle == 10:
            made_while_learning = len(made)
        for i in range(cycle * n_bufs, (cycle + 1) * n_bufs):
            t.link(i, [acc(bufs[i % n_bufs]), acc(bufs[(i + 1) % n_bufs], True)])
            done.add(i)
    assert len(made) == made_while_learning <= 2 * n_bufs  # and none made in the last ten cycles


def test_records_of_ranges_no_longer_used_are_dropped():
    from streamdag.graph import Region

    done = set()
    t = DepsTracker(retired=done.__contains__)
    for i in range(5000):  # a fresh range every op, as with new allocations that never repeat
        t.link(i, [Access(Region("cpu", 64 * i, 64 * i + 8), True)])
        done.add(i)
    assert len(t._spaces["cpu"].records) < 600


def test_fresh_ranges_with_a_few_that_recur_keep_the_records_few():
    """Mostly new allocations, one in ten at an address seen before: records must not pile up."""
    from streamdag.graph import Region

    done = set()
    t = DepsTracker(retired=done.__contains__)
    for i in range(20000):
        # one op in ten uses one of 100 recurring ranges (each every 1,000 ops); the rest, new ones
        start = 64 * ((i // 10) % 100) if i % 10 == 0 else 64 * (100 + i)
        t.link(i, [Access(Region("cpu", start, start + 8), True)])
        done.add(i)
    assert len(t._spaces["cpu"].records) < 1000


def test_a_wide_range_over_many_idle_small_ones_stops_scanning_them():
    """A recorded graph runs op by op once (one record per buffer), then as one op whose access
    spans all its buffers. Every later run searched all those idle records; a search is work
    that brings compaction, which drops them once they are idle for long."""
    from streamdag.graph import Region

    done = set()
    t = DepsTracker(retired=done.__contains__)
    for i in range(258):  # the first run, op by op: 258 buffers side by side
        t.link(i, [Access(Region("cuda:0", 1024 * i, 1024 * i + 1000), i % 2 == 0)])
        done.add(i)
    whole = Region("cuda:0", 0, 1024 * 258)
    for run in range(200):  # later runs: one op each, over the whole span
        deps = t.link(("run", run), [Access(whole, True)])
        done.add(("run", run))
        assert set(deps) <= done  # what it follows is finished (the owner skips it) or the last run
    space = t._spaces["cuda:0"]
    assert len(space.overlapping(whole.start, whole.end)) <= 2


@settings(max_examples=120 if os.environ.get("CI") else 40, deadline=None,
          suppress_health_check=[HealthCheck.large_base_example, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.lists(st.tuples(st.integers(0, 1000), st.integers(1, 40), st.booleans()),
                             min_size=1, max_size=3), min_size=120, max_size=200),
       data=st.data())
def test_ops_of_several_accesses_follow_every_unfinished_conflicting_op_while_ops_retire(ops, data):
    """The runtime's path: one ``link`` per op of several ranges, while earlier ops finish and the
    records compact (within a link too). Every earlier op that touched an overlapping range (one of
    the two writing) and has not finished must be reached through the deps."""
    from streamdag.graph import Region

    finished: set[int] = set()
    t = DepsTracker(retired=finished.__contains__)
    accesses, ancestors = [], []
    for i, spec in enumerate(ops):
        mine = [Access(Region("cpu", s, s + n), w) for s, n, w in spec]
        deps = t.link(i, mine)
        ancestors.append(set(deps).union(*(ancestors[d] for d in deps)))
        for j, theirs in enumerate(accesses):
            conflict = any(a.region.start < b.region.end and b.region.start < a.region.end
                           and (a.write or b.write) for a in mine for b in theirs)
            assert not conflict or j in finished or j in ancestors[i], (i, j)
        accesses.append(mine)
        for j in range(i + 1):  # ops finish once what they follow has (as on a device), some now
            if j not in finished and ancestors[j] <= finished and data.draw(st.booleans()):
                finished.add(j)
