"""The bounds on work in flight: ops (``max_inflight``) and transfer bytes (``max_inflight_bytes``).
A submit at the bound waits (``submit_nowait`` raises ``WouldBlock``) and the bound is never
exceeded; yet a done-callback, run by the thread that frees slots, can always submit."""

import threading
import time

import numpy as np
import pytest

import streamdag as sd
from programs import DEVICES

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def test_in_flight_bound_blocks_and_is_never_exceeded():
    bufs = [np.zeros(1) for _ in range(40)]
    running = []
    with sd.Runtime("cpu", streams=4, max_inflight=3) as rt:
        for b in bufs:
            rt.submit(time.sleep, 0.002, writes=[b])
            running.append(rt.statistics().inflight)
        rt.synchronize()
        stats = rt.statistics()
    assert max(running) <= 3
    assert stats.peak_inflight <= 3
    assert stats.completed == 40 and stats.inflight == 0


@pytest.mark.parametrize("device", DEVICES)
def test_done_callbacks_that_submit_at_the_bound_do_not_hang(device):
    """A continuation submitted from a done-callback goes over the bound: its thread may be the finisher."""
    x = np.zeros(4)
    follow_ups = []
    with sd.Runtime(device, streams=1, max_inflight=2) as rt:
        def continue_with_two(_f):
            for _ in range(2):
                follow_ups.append(rt.submit(np.add, x, 1, out=x, writes=[x]))

        for _ in range(8):
            rt.submit(time.sleep, 0.001).add_done_callback(continue_with_two)
        rt.synchronize()
        assert rt.statistics().inflight == 0
        assert rt.submit(np.sum, x, reads=[x]).result() == 4 * 16  # the bound holds again after
    assert len(follow_ups) == 16 and all(f.done() and f.exception() is None for f in follow_ups)
    assert (x == 16).all()


def test_submit_nowait_raises_would_block_at_the_bound():
    gate = threading.Event()
    a, b = np.zeros(1), np.zeros(1)
    with sd.Runtime("cpu", streams=2, max_inflight=1) as rt:
        rt.submit(gate.wait, 10, writes=[a])
        with pytest.raises(sd.WouldBlock, match="max_inflight"):
            rt.submit_nowait(np.sum, b, reads=[b])
        gate.set()
        rt.synchronize()
        assert rt.submit_nowait(np.sum, b, reads=[b]).result() == 0.0


def test_byte_budget_blocks_until_earlier_transfers_complete():
    from streamdag.runtime.budgets import ByteBudget

    budget = ByteBudget(100)
    budget.acquire(60)
    got = threading.Event()

    def second():
        budget.acquire(60)
        got.set()

    t = threading.Thread(target=second)
    t.start()
    assert not got.wait(0.2)
    budget.release(60)
    assert got.wait(5)
    t.join()
    budget.release(60)
    budget.acquire(500)  # larger than the limit: runs alone once nothing else is in flight
    assert budget.used == 500 and budget.peak == 500


def test_byte_budget_takes_back_a_held_copys_bytes_once_its_future_is_done_or_dropped():
    from streamdag.runtime.budgets import ByteBudget
    from streamdag.runtime.ops import Future

    budget = ByteBudget(100)
    first = Future()
    budget.acquire(60)
    budget.hold(first, 60, stream=0)
    got = threading.Event()

    def second():
        budget.acquire(60)  # waits on the oldest copy held
        got.set()

    t = threading.Thread(target=second)
    t.start()
    assert not got.wait(0.2)
    first.set_result(None)
    assert got.wait(5)
    t.join()
    assert budget.reclaim() == 60 and budget.peak == 60  # the first came back; the second counts
    later = Future()
    budget.hold(later, 60, stream=1)
    assert budget.reclaim() == 60
    del later  # nobody holds its future: its op has finished (a pending op keeps its future)
    assert budget.reclaim() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_graph_run_waiting_for_slots_lets_done_callbacks_submit(device):
    """A graph's first run launches its ops under the runtime's lock; when it waits for a slot,
    the thread that frees slots may be running a callback that submits, which needs that lock."""
    a, b = np.zeros(3), np.zeros(3)
    follow_ups = []
    with sd.Runtime(device, streams=1, max_inflight=2) as rt:
        with rt.record() as g:
            for _ in range(6):
                rt.submit(np.add, a, 1, out=a, reads=[a], writes=[a])
        slow = rt.submit(time.sleep, 0.05)
        slow.add_done_callback(lambda _f: follow_ups.append(rt.submit(np.add, b, 1, out=b, writes=[b])))
        g.run().result(timeout=10)
        rt.synchronize()
    assert (a == 6).all() and (b == 1).all() and len(follow_ups) == 1
