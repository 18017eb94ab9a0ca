"""What a CUDA runtime keeps alive and frees: inputs while ops use them, finished ops and their
events at once, a closed runtime with its events once dropped. Marked ``cuda``: skipped without a
GPU."""

import time

import pytest

import streamdag as sd
from programs import closed_runtime_freed_at_once, ops_left_to_the_cycle_collector

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.cuda


def test_lifetimes_survive_dropped_references():
    """The caller drops every tensor right after submit; the runtime must keep them alive."""
    n = 1 << 16
    with sd.Runtime("cuda", streams=4) as rt:
        futures = []
        for i in range(3000):
            a = torch.full((n,), float(i % 97), device="cuda")
            out = torch.empty((), device="cuda")
            futures.append((i, rt.submit(lambda a, out: torch.sum(a * 2, dim=0, out=out), a, out,
                                         reads=[a], writes=[out])))
            del a, out
            torch.empty(n, device="cuda").fill_(-1.0)  # churn the allocator
        for i, f in futures:
            assert f.result().item() == 2.0 * (i % 97) * n


def test_a_closed_runtime_is_freed_once_dropped_with_its_events():
    """Not at a later pass of the cycle collector: inside someone's CUDA graph capture, freeing
    CUDA objects can end it."""
    x = torch.zeros(1 << 10, device="cuda")

    def use(rt):
        for _ in range(50):
            rt.submit(x.add_, 1, writes=[x])
        rt.to_host(x).result()
        rt.synchronize()

    assert closed_runtime_freed_at_once(lambda: sd.Runtime("cuda", streams=4), use)
    assert x[0].item() == 50


def test_a_finished_event_goes_back_to_the_pool_unless_it_times():
    from streamdag.backends.cuda import CudaEvent

    with sd.Runtime("cuda", streams=2) as rt:
        backend = rt.backend
        stream = backend.streams[0]
        finished = []
        plain, timing = CudaEvent(False), CudaEvent(True)
        assert type(plain) is CudaEvent and not plain.timing
        assert type(timing) is not CudaEvent and timing.timing  # the pass tells them apart by type
        for ev in (plain, timing):
            ev.record(stream)
            backend.when_done(stream, ev, lambda error=None, ev=ev: finished.append((ev, error)))
        torch.cuda.synchronize()
        deadline = time.monotonic() + 10
        while len(finished) < 2 and time.monotonic() < deadline:  # our pass, or the completion thread's
            backend.finish_ready()
            time.sleep(1e-3)
        assert [f[0] for f in finished] == [plain, timing] and all(f[1] is None for f in finished)
        pool = backend._free_events
        assert any(e is plain for e in pool)
        assert not any(e is timing for e in pool)


def test_finished_ops_are_freed_at_once_not_left_to_the_cycle_collector():
    """An op, once finished, is freed by reference counting: a cycle through its future would
    leave thousands of ops per second for Python's cycle collector, whose passes stall submits."""
    a = torch.zeros(256, device="cuda")
    host, pinned = torch.ones(256), torch.ones(256).pin_memory()  # staged, and copied directly
    with sd.Runtime("cuda", streams=4) as rt:
        with rt.record() as g:
            rt.submit(a.add_, 1, writes=[a])

        def work():
            futures = [rt.submit(a.add_, 1, writes=[a]) for _ in range(100)]
            futures[-1].result()  # waiting (with a token) on one of them, as a user would
            futures += [g.run() for _ in range(3)]
            futures += [rt.to_device(host), rt.to_host(a), rt.to_device(pinned)]
            futures[-2].result()
            rt.synchronize()

        work()  # first runs (the graph's capture, the staging pool) may make one-time state
        assert ops_left_to_the_cycle_collector(work) == 0
    assert a[0].item() == 206
