"""Submitting ops and waiting for them: futures, their done-callbacks, and every way of waiting that
asyncio and ``concurrent.futures`` offer, on the CPU lanes and the simulated device."""

import asyncio
import concurrent.futures
import threading
import time

import numpy as np
import pytest

import streamdag as sd
from internals import choose_stream
from programs import DEVICES

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def test_submit_returns_a_future_of_the_functions_value(rt):
    a = np.arange(4.0)
    f = rt.submit(np.sum, a, reads=[a])
    assert isinstance(f, sd.Future)
    assert f.result() == 6.0


@pytest.mark.parametrize("how", ["wait", "as_completed", "callback", "await", "weakref"])
def test_futures_work_with_concurrent_futures_helpers_asyncio_and_weak_references(rt, how):
    """A future keeps its state in slots and makes its condition and lists only when asked: every
    way of waiting on it, or of holding it, must still see the outcome."""
    import concurrent.futures
    import weakref

    a = np.zeros(4)
    fs = [rt.submit(lambda i=i: time.sleep(0.002) or i, writes=[a]) for i in range(5)]
    if how == "wait":
        done, _ = concurrent.futures.wait(fs, timeout=30)
        assert done == set(fs)
    elif how == "as_completed":
        assert sorted(f.result() for f in concurrent.futures.as_completed(fs, timeout=30)) == list(range(5))
    elif how == "callback":
        seen = []
        for f in fs:
            f.add_done_callback(lambda f: seen.append(f.result()))
        rt.synchronize()
        assert sorted(seen) == list(range(5))
    elif how == "await":
        async def main():
            return [await f for f in fs]
        assert asyncio.run(main()) == list(range(5))
    else:
        refs = [weakref.ref(f) for f in fs]
        rt.synchronize()
        assert [r().result() for r in refs] == list(range(5))
    assert all(f.done() and f.exception() is None for f in fs)
    assert "finished" in repr(fs[-1])


def test_keywords_other_than_the_runtimes_reach_the_function(rt):
    def f(x, fn=None, streams=None):
        return (x, fn, streams)

    assert rt.submit(f, 1, fn="kept", streams=2).result() == (1, "kept", 2)
    assert rt.submit_nowait(f, x=3, fn="too").result() == (3, "too", None)


def test_future_is_awaitable(rt):
    a = np.arange(4.0)

    async def main():
        return await rt.submit(np.sum, a, reads=[a])

    assert asyncio.run(main()) == 6.0


def test_inline_markers_declare_accesses_and_pass_the_value(rt):
    a = np.ones(1000)
    b = np.zeros(1000)
    rt.submit(np.multiply, sd.read(a), 3, out=sd.write(b))
    f = rt.submit(np.sum, sd.read(b))
    assert f.result() == 3000.0


def test_chain_through_views_runs_in_order(rt):
    buf = np.zeros(100)
    for i in range(50):
        rt.submit(np.add, buf[i:], 1.0, out=buf[i:], writes=[buf[i:]])
    rt.synchronize()
    assert np.array_equal(buf, np.minimum(np.arange(1, 101), 50).astype(float))


def test_independent_ops_run_concurrently_on_the_cpu():
    """Two ops that wait for each other can only finish if they run at the same time."""
    a, b = np.zeros(1), np.zeros(1)
    barrier = threading.Barrier(2, timeout=10)
    with sd.Runtime("cpu", streams=2) as rt:
        f1 = rt.submit(barrier.wait, writes=[a])
        f2 = rt.submit(barrier.wait, writes=[b])
        f1.result(timeout=20), f2.result(timeout=20)


def test_current_stream_wait_on_the_host_waits_for_the_ops(rt):
    a, b = np.zeros(3), np.zeros(3)
    f = rt.submit(lambda: (time.sleep(0.02), a.fill(1)), writes=[a])
    rt.current_stream_wait(f)
    assert f.done() and (a == 1).all()
    g = rt.submit(lambda: (time.sleep(0.02), b.fill(2)), writes=[b])
    rt.current_stream_wait()
    assert g.done() and (b == 2).all()
    with pytest.raises(TypeError, match="futures of ops"):
        rt.current_stream_wait(a)


def test_cancel_is_refused_and_the_op_still_runs_for_its_dependents(rt):
    a = np.zeros(3)
    f = rt.submit(time.sleep, 0.02, writes=[a])
    assert f.cancel() is False and not f.cancelled()
    g = rt.submit(np.add, a, 1, out=a, writes=[a])
    rt.synchronize()
    assert f.result() is None and (g.result() == 1).all()


def test_an_asyncio_timeout_leaves_the_op_and_the_runtime_working(rt):
    """``asyncio.wait_for`` cancels the future it gave up on: the runtime must carry on."""
    a = np.zeros(3)
    gate = threading.Event()

    async def main():
        slow = rt.submit(gate.wait, 10, writes=[a])
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slow, 0.01)
        gate.set()
        return slow, await rt.submit(np.add, a, 1, out=a, writes=[a])

    slow, added = asyncio.run(main())
    rt.synchronize()
    assert slow.result() is True and (added == 1).all()


@pytest.mark.parametrize("how", ["result", "wait", "as_completed"])
def test_waiting_without_a_timeout_inside_a_done_callback_raises_instead_of_hanging(how):
    gate = threading.Event()
    seen = []
    wait = {"result": lambda f: f.result(), "wait": lambda f: concurrent.futures.wait([f]),
            "as_completed": lambda f: list(concurrent.futures.as_completed([f]))}[how]
    with sd.Runtime("cpu", streams=2) as rt:  # two lanes: the awaited op is still running
        later = rt.submit(gate.wait, 10)

        def wait_inside(_f):
            try:
                seen.append(wait(later))
            except RuntimeError as exc:
                seen.append(exc)

        rt.submit(time.sleep, 0.001).add_done_callback(wait_inside)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        gate.set()
        rt.synchronize()
    assert isinstance(seen[0], RuntimeError), seen
    assert "inside a done-callback would hang" in str(seen[0]) and "Chain instead" in str(seen[0])


def test_a_wait_with_a_timeout_inside_a_done_callback_is_let_be():
    seen = []
    with sd.Runtime("cpu", streams=2) as rt:
        gate = threading.Event()
        later = rt.submit(gate.wait, 10)
        rt.submit(time.sleep, 0.001).add_done_callback(
            lambda _f: seen.append(concurrent.futures.wait([later], timeout=0.01)))
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
        gate.set()
        rt.synchronize()
    assert seen and later in seen[0].not_done


@pytest.mark.parametrize("how", ["wait", "as_completed"])
def test_a_wait_inside_a_done_callback_for_futures_all_done_returns(how):
    seen = []
    with sd.Runtime("cpu", streams=2) as rt:
        done = [rt.submit(len, [1]), rt.submit(len, [1, 2])]
        for f in done:
            f.result()
        wait = {"wait": lambda fs: concurrent.futures.wait(fs).done,
                "as_completed": lambda fs: set(concurrent.futures.as_completed(fs))}[how]
        rt.submit(time.sleep, 0.001).add_done_callback(lambda _f: seen.append(wait(done)))
        rt.synchronize()
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)
    assert seen == [set(done)], seen


def test_copy_between_an_array_and_a_tensor_works_both_ways():
    torch = pytest.importorskip("torch")
    with sd.Runtime("cpu", streams=2) as rt:
        array, tensor = np.arange(4.0), torch.zeros(4, dtype=torch.float64)
        assert rt.copy(tensor, array).result() is tensor
        assert torch.equal(tensor, torch.arange(4.0, dtype=torch.float64))
        back = np.zeros(4)
        assert rt.copy(back, tensor).result() is back
        assert (back == np.arange(4.0)).all()


def test_copy_is_an_op_ordered_like_any_other(rt):
    a = np.arange(1000.0)
    b = np.zeros(1000)
    rt.submit(np.multiply, a, 2, out=a, writes=[a])
    f = rt.copy(b, a)
    assert f.result() is b
    assert np.array_equal(b, np.arange(1000.0) * 2)


def test_a_future_derived_from_another_fails_when_its_function_raises():
    """``then`` futures (transfers, graph results) must finish even when the mapping raises."""
    from streamdag.runtime.ops import then

    with sd.Runtime("cpu", streams=1) as rt:
        source = rt.submit(time.sleep, 0.001)

        def broken(_value):
            raise ValueError("mapping failed")

        derived = then(source, broken, "derived")
        with pytest.raises(ValueError, match="mapping failed"):
            derived.result(timeout=5)
        assert then(source, lambda _v: 7, "fine").result(timeout=5) == 7


def test_the_runtimes_own_callbacks_do_not_ask_for_a_prompt_finish_but_users_do():
    """A user's callback or wait asks the finishing side to hurry; bookkeeping callbacks must not,
    or every copy would put the CUDA completion thread into its polling mode."""
    asked = []
    internal, user = sd.Future(), sd.Future()
    for f in (internal, user):
        f._hurry = lambda *args, **kwargs: asked.append(args or kwargs)
    internal._on_done(lambda _f: None)
    assert asked == []
    user.add_done_callback(lambda _f: None)
    assert len(asked) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_synchronize_waits_for_what_done_callbacks_submit(device):
    """A future is done before its callbacks run: synchronize() (and leaving ``with``) must still
    wait for them, or a callback's submit would meet a closed runtime."""
    a = np.zeros(3)
    follow_ups = []

    def continue_later(_f):
        time.sleep(0.05)
        follow_ups.append(rt.submit(np.add, a, 1, out=a, writes=[a]))

    with sd.Runtime(device, streams=2) as rt:
        rt.submit(time.sleep, 0.001).add_done_callback(continue_later)
        rt.synchronize()
        assert len(follow_ups) == 1 and follow_ups[0].done() and (a == 1).all()
        rt.submit(time.sleep, 0.001).add_done_callback(continue_later)
    assert len(follow_ups) == 2 and follow_ups[1].exception() is None and (a == 2).all()


def test_synchronize_waits_for_callbacks_of_an_op_just_taken_off_pending(path, monkeypatch):
    """Finishing an op takes it off the pending ops and then settles its future: synchronize() must
    count it as calling back from the moment it is off, or it returns (and ``close()`` refuses the
    callbacks' submits) in between. The gap is widened here by a slow settle."""
    settle = sd.Runtime._settle

    def slow_settle(self, *args):
        time.sleep(0.2)
        settle(self, *args)

    monkeypatch.setattr(sd.Runtime, "_settle", slow_settle)
    ran = []
    with sd.Runtime("cpu", streams=2) as rt:
        f = rt.submit(time.sleep, 0.001)
        f.add_done_callback(lambda _f: ran.append(True))
        time.sleep(0.05)  # finished and off pending: settling
        rt.synchronize()
        assert ran == [True]


def test_futures_work_with_concurrent_futures_helpers(rt):
    """wait(), as_completed() and done-callbacks use the base class's waiter and callback lists,
    which a streamdag future makes only when first asked for."""
    import concurrent.futures as cf

    a = np.zeros(4)
    slow = rt.submit(time.sleep, 0.05)
    done_first = rt.submit(np.add, a, 1, out=a, writes=[a])
    done_first.result()
    later = [rt.submit(np.add, a, 1, out=a, writes=[a]) for _ in range(5)]
    seen = []
    later[-1].add_done_callback(lambda f: seen.append(f.result() is a))
    finished, pending = cf.wait([slow, done_first, *later], timeout=10)
    assert not pending and len(finished) == 7
    assert set(cf.as_completed([slow, done_first, *later], timeout=10)) == {slow, done_first, *later}
    rt.synchronize()
    assert seen == [True] and (a == 6).all()


def test_a_future_whose_waiter_list_is_read_first_is_watched_and_wakes_its_waiters():
    """The condition and the base class's lists are made together, whichever is asked for first:
    a future whose list was read before anyone waited still settles through its condition and
    wakes a wait from another thread."""
    f = sd.Future()
    assert not f._has_callbacks() and f._waiters == [] and f._watched
    threading.Timer(0.05, f.set_result, ("set",)).start()
    finished, pending = concurrent.futures.wait([f], timeout=10)
    assert (finished, pending, f.result()) == ({f}, set(), "set")
    unwatched = sd.Future()
    unwatched.set_result(1)  # settled without a condition, nobody waiting
    assert not unwatched._watched and concurrent.futures.wait([unwatched], timeout=0).done == {unwatched}


def test_await_finishes_its_op_itself_for_a_while_then_waits_to_be_woken():
    """``await`` polls (as ``result()`` helps) before handing over to a cross-thread wake-up."""
    polls = []

    def finishes_on_third_poll(waiter=None, seconds=None, wanted=None):
        if waiter is not None:
            polls.append(seconds)
            if len(polls) == 3:
                waiter.set_result(42)

    quick = sd.Future()
    quick._hurry = finishes_on_third_poll
    assert asyncio.run(asyncio.wait_for(_await(quick), 5)) == 42
    assert polls == [0.0, 0.0, 0.0]

    slow = sd.Future()  # never finished by polling: another thread sets it later
    slow._hurry = lambda *args, **kwargs: None
    threading.Timer(0.05, slow.set_result, (7,)).start()
    assert asyncio.run(asyncio.wait_for(_await(slow), 5)) == 7


async def _await(f):
    return await f


@pytest.mark.parametrize("path", ["python"], indirect=True)  # the compiled submit chooses in C
def test_the_stream_choice_ends_when_a_finish_lowers_a_count_as_it_reads_them():
    """The Python submit reads the streams' counts of pending ops under the runtime's lock, but a
    finish lowers them under another: here the least busy stream finishes an op right after the
    counts are read. The choice must still end, on a stream least busy when read."""

    class FinishingAsRead(list):
        def __getitem__(self, key):
            got = super().__getitem__(key)
            if isinstance(key, slice) and self[0] > 0:
                self[0] -= 1  # stream 0's op finishes: its count drops below what was read
            return got

    with sd.Runtime("cpu", streams=2) as rt:
        rt._busy = FinishingAsRead([1, 2])
        chosen: list[int] = []
        thread = threading.Thread(target=lambda: chosen.append(choose_stream(rt, "cpu")), daemon=True)
        thread.start()
        thread.join(timeout=5)
        rt._busy = [0, 0]  # (nothing pending: the runtime closes)
        assert chosen == [0]
