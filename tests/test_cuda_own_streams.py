"""A runtime's CUDA streams, and the streams a graph is captured on, are its own: not PyTorch's
pool, which the caller's work and captures use. An op submitted inside the caller's capture fails
clearly; the caller's captures, and the collector during them, leave the runtime unharmed.
Marked ``cuda``: skipped without a GPU."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest

import streamdag as sd
from internals import use_python_reference

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.cuda


def device_streams(rt):
    """The runtime's CUDA streams (its host lanes come after them)."""
    return [s for s, member in zip(rt._streams, rt._member) if member is rt.backend]


def test_a_runtime_has_cuda_streams_of_its_own_not_from_pytorchs_pool():
    """PyTorch hands out its streams from a pool of 32 per device: made from it, three runtimes'
    streams (15 each) and the user's would share CUDA streams, and so queues. A runtime's are its
    own (made by the torch extension), none shared with another runtime's or PyTorch's pool, and
    a closed runtime's are reused by the next. Each runtime still computes right on them."""
    from streamdag import native

    if getattr(native.load_torch(), "new_stream", None) is None:
        pytest.skip("without the torch extension a runtime's streams come from PyTorch's pool")

    def addresses(rt):
        return [s.cuda_stream for s in [*device_streams(rt), rt.backend.peer_out,
                                        *rt.backend.staging_streams.values(), rt.backend.clock_stream]]

    runtimes = [sd.Runtime("cuda", streams=8) for _ in range(3)]
    try:
        pool = {torch.cuda.Stream().cuda_stream for _ in range(64)}
        ours = [a for rt in runtimes for a in addresses(rt)]
        assert len(ours) == 3 * 15 and len(set(ours)) == len(ours)
        assert not set(ours) & pool
        x = torch.arange(1 << 16, device="cuda", dtype=torch.float32)
        for k, rt in enumerate(runtimes):
            ys = [rt.submit(torch.mul, x, k + i, reads=[x]) for i in range(16)]
            assert all(torch.equal(y.result(), x * (k + i)) for i, y in enumerate(ys))
    finally:
        for rt in runtimes:
            rt.close()
    with sd.Runtime("cuda", streams=8) as again:
        assert set(addresses(again)) <= set(ours)  # given back at close, taken again
        assert again.submit(torch.add, x, 1, reads=[x]).result().sum().item() == x.sum().item() + x.numel()


def test_a_graph_is_captured_on_cuda_streams_of_its_own():
    """Any ``torch.cuda.Stream()`` may hand out a stream of PyTorch's pool again: work another
    thread put on it during a capture would be captured instead of run. A graph is captured on
    streams that neither PyTorch's pool nor a runtime hands out, and they are given back once
    the graph is gone."""
    import gc

    from streamdag import native
    from streamdag.backends.cuda import _OwnStreams

    if getattr(native.load_torch(), "new_stream", None) is None:
        pytest.skip("without the torch extension a graph is captured on PyTorch's pooled streams")
    seen = set()
    a = torch.arange(1 << 10, device="cuda", dtype=torch.float32)
    outs = [torch.zeros_like(a) for _ in range(4)]

    def scaled(a, out, k):
        if torch.cuda.is_current_stream_capturing():
            seen.add(torch.cuda.current_stream().cuda_stream)
        torch.mul(a, k, out=out)

    with sd.Runtime("cuda", streams=4) as rt:
        with rt.record() as g:
            for k, o in enumerate(outs):
                rt.submit(scaled, a, o, k, reads=[a], writes=[o])
        for _ in range(3):
            for o in outs:
                o.zero_()
            g.run().result()
            assert all(torch.equal(o, a * k) for k, o in enumerate(outs))
        stats = g.statistics()
        assert stats.captures >= 1 and stats.fallbacks == 0 and stats.replays >= 1
        runtime_streams = {s.cuda_stream for s in device_streams(rt)}
    pool = {torch.cuda.Stream().cuda_stream for _ in range(64)}
    assert seen and not seen & pool and not seen & runtime_streams
    del g
    gc.collect()
    assert seen <= set(_OwnStreams._free.get((torch.cuda.current_device(), False), []))  # non-blocking


@pytest.mark.parametrize("calls", ["C++ calls", "PyTorch's bindings", "submit in Python"])
def test_an_op_submitted_inside_the_callers_own_capture_fails_with_what_to_do(calls, monkeypatch):
    """A runtime's stream that waited on an event recorded in the caller's capture would join that
    capture: the op's kernels would be captured, not run, its completion event could never be
    queried, and the capture could not end (a stream not joined back). So the op fails at once,
    saying what to do, and neither the caller's capture nor the runtime is disturbed."""
    from streamdag import native

    torch_ext = native.load_torch()
    if calls == "PyTorch's bindings":
        if torch_ext is None:
            pytest.skip("the torch extension is not built: the other cases take the bindings")
        native.load().use_torch(None)
    if calls == "submit in Python":
        use_python_reference(monkeypatch)
    try:
        rt = sd.Runtime("cuda", streams=2)
    finally:
        if torch_ext is not None:
            native.load().use_torch(torch_ext)
    x = torch.ones(8, device="cuda")
    with rt:
        assert torch.equal(rt.submit(torch.mul, x, 2, reads=[x]).result(), x * 2)  # caller stream seen
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = x * 2
            inside = rt.submit(torch.mul, x, 3, reads=[x])
            y.add_(1)
        error = inside.exception(timeout=60)
        assert isinstance(error, sd.SubmittedInCapture) and "rt.record()" in str(error), error
        g.replay()
        assert torch.equal(y, x * 2 + 1)  # the caller's capture is whole
        assert rt.backend.lost is None
        assert torch.equal(rt.submit(torch.mul, x, 3, reads=[x]).result(), x * 3)
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()  # which reports the failed op


def test_a_users_capture_in_global_mode_survives_large_pageable_copies_staged_meanwhile():
    """A host lane's staging makes CUDA calls that global capture mode refuses from any thread in
    that mode (a pinned allocation for its ring, event waits), and so does a small copy staged in
    the submit (the staging pool's first pinned allocation): they are made in relaxed mode, so the
    user's capture on the main thread neither fails nor is lost, and the copies are exact."""
    import gc

    from streamdag.runtime import transfers

    n = transfers.CHUNK_BYTES // 4 * (transfers.RING_DEPTH + 1) + 17
    src, back = torch.randn(n), torch.empty(n)  # pageable
    x = torch.ones(1 << 10, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:  # its rings are made inside the capture
        dev = torch.empty(n, device="cuda")
        inside, done = threading.Event(), []

        small, small_dev = torch.randn(1 << 18), torch.empty(1 << 18, device="cuda")  # 1 MiB, pageable

        def meanwhile():
            inside.wait()
            done.append(rt.copy(small_dev, small).result(timeout=60))  # staged here, the pool made now
            rt.copy(dev, src)
            done.append(rt.copy(back, dev).result(timeout=60))

        thread = threading.Thread(target=meanwhile)
        thread.start()
        g = torch.cuda.CUDAGraph()
        gc.disable()  # (see the test below)
        try:
            with torch.cuda.graph(g):  # capture_error_mode="global", PyTorch's default
                y = x
                for i in range(20000):
                    y = y * 1.0
                    if i == 100:
                        inside.set()
                thread.join(timeout=60)
        finally:
            gc.enable()
        assert len(done) == 2 and done[1] is back and torch.equal(back, src)
        assert done[0] is small_dev and torch.equal(small_dev.cpu(), small)
        g.replay()
        assert torch.equal(y, x) and rt.backend.lost is None


@pytest.mark.parametrize("calls", ["C++", "PyTorch's bindings"])
def test_a_users_capture_in_global_mode_meanwhile_neither_fails_nor_loses_the_device(calls):
    """PyTorch captures a CUDA graph in CUDA's global mode by default, in which CUDA refuses an
    event query from any thread in global mode, and the refusal ends the capture in an error.
    The runtime queries events all the while: its completion thread polls those of pending ops, a
    thread that submits passes between its submits, and a thread that waits on a future polls its
    event. None of them may end the user's capture or be taken for a lost device (every pending
    and later op failed with DeviceLost). Through PyTorch's bindings (no torch extension) the
    submitting thread's passes and the waiter's polls did end it."""
    import gc
    import time

    from streamdag import native

    speedups, ext = native.load(), native.load_torch()
    if calls == "C++" and ext is None:
        pytest.skip("the torch extension did not build here")
    if calls != "C++" and speedups is not None:
        speedups.use_torch(None)  # runtimes made from now on call through PyTorch's bindings
    x = torch.ones(1 << 10, device="cuda")
    flag = torch.zeros(1, device="cuda")
    other = torch.zeros(1 << 10, device="cuda")
    try:
        with sd.Runtime("cuda", streams=2) as rt:
            for round_ in range(2):
                # a long GPU op: its event stays pending, polled, through the capture
                slow = rt.submit(lambda: (torch.cuda._sleep(int(2e9)), flag.add_(1)), writes=[flag])
                time.sleep(0.02)
                inside, waited = threading.Event(), []

                def meanwhile(inside, waited):  # another thread submits, then waits, during the capture
                    inside.wait()
                    for _ in range(200):  # it passes over the completed ops every few submits
                        rt.submit(other.add_, 1, writes=[other])
                    last = rt.submit(lambda: torch.cuda._sleep(int(5e7)), writes=[other])
                    waited.append(last.result(timeout=60))  # polls the event itself for a while

                thread = threading.Thread(target=meanwhile, args=(inside, waited))
                thread.start()
                g = torch.cuda.CUDAGraph()
                # no automatic collection inside the capture (as streamdag's own captures do): it could
                # free an earlier CUDA graph there, which CUDA refuses, ending the capture. In a
                # selection of 13 cuda tests it did: the graph of the test before last, kept alive
                # by the traceback of an op's error until then, cyclic garbage from then on
                gc.disable()
                try:
                    with torch.cuda.graph(g):  # capture_error_mode="global", PyTorch's default
                        y = x
                        for i in range(20000):  # long enough to span many of the completion thread's polls
                            y = y * 1.0
                            if i == 100:
                                inside.set()
                        thread.join(timeout=60)  # the other thread's queries all happen inside the capture
                finally:
                    gc.enable()
                assert waited == [None]
                slow.result(timeout=60)
                g.replay()
                assert torch.equal(y, x)
                assert torch.equal(other, torch.full_like(other, 200.0 * (round_ + 1)))
            assert flag.item() == 2 and rt.backend.lost is None
            assert torch.equal(rt.submit(torch.add, x, 1, reads=[x]).result(), x + 1)
    finally:
        if calls != "C++" and speedups is not None and ext is not None:
            speedups.use_torch(ext)


FREED_DURING_CAPTURE = textwrap.dedent(
    """
    import contextlib, gc, json, sys, warnings, torch, streamdag as sd
    from streamdag.runtime import capture
    if sys.argv[1] == "unpaused":  # the negative control: the collector may run during a capture
        capture._collector_paused = contextlib.nullcontext
    x, out = torch.ones(8, device="cuda"), torch.zeros(8, device="cuda")
    earlier = torch.cuda.CUDAGraph()
    with torch.cuda.graph(earlier):
        x.add_(0)
    left = [earlier]
    del earlier

    class Cycle:
        def __init__(self, graph):
            self.graph, self.me = graph, self

    def op(out):
        if left and torch.cuda.is_current_stream_capturing():
            Cycle(left.pop())  # the earlier graph becomes cyclic garbage during the capture,
            threshold = gc.get_threshold()
            gc.set_threshold(1)  # and the next allocations start a collection, if one may run
            _ = [[] for _ in range(100)]
            gc.set_threshold(*threshold)
        torch.mul(x, 2, out=out)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sd.Runtime("cuda", streams=2) as rt:
            with rt.record() as g:
                rt.submit(op, out, writes=[out])
            for _ in range(4):
                g.run().result()
    stats = g.statistics()
    torch.manual_seed(0)
    a = torch.rand(4, device="cuda")  # random numbers still work after a failed capture
    torch.manual_seed(0)
    print(json.dumps(dict(captures=stats.captures, fallbacks=stats.fallbacks,
                          failed=any("cannot be captured" in str(w.message) for w in caught),
                          doubled=bool((out == 2).all()),
                          random_ok=bool(torch.equal(a, torch.rand(4, device="cuda"))))))
    """
)


@pytest.mark.parametrize("paused", [True, False])
def test_a_graph_the_collector_frees_during_a_capture_does_not_fail_it(paused):
    """An earlier CUDA graph freed by a collection during a capture would invalidate it (its
    ``reset`` makes a CUDA call a capture forbids): the collector is paused while a graph is
    captured. The negative control drops the pause and sees the capture fail; either way the
    results are right and PyTorch's random generator still works afterwards."""
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", FREED_DURING_CAPTURE, "paused" if paused else "unpaused"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if paused:
        assert result["captures"] >= 1 and result["fallbacks"] == 0 and not result["failed"], result
    else:
        assert result["fallbacks"] == 1 and result["failed"], result
    assert result["doubled"] and result["random_ok"], result


def test_no_garbage_collection_runs_in_the_capturing_thread_while_a_graph_is_captured():
    """A collection runs the finalizers of what it frees in the thread that triggers it; a PyTorch
    object freed during a capture (a CUDA event, an earlier CUDA graph) would make CUDA calls that
    the capture forbids. So the collector is paused while a graph is captured, and only then."""
    import gc

    seen = []
    a = torch.ones(8, device="cuda")
    out = torch.zeros(8, device="cuda")

    def op(a, out):
        seen.append((torch.cuda.is_current_stream_capturing(), gc.isenabled()))
        torch.mul(a, 2, out=out)

    assert gc.isenabled()
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(op, a, out, reads=[a], writes=[out])
        for _ in range(4):
            g.run().result()
        assert g.statistics().captures >= 1
    assert (True, False) in seen  # captured with the collector paused
    assert all(enabled for capturing, enabled in seen if not capturing)
    assert gc.isenabled() and torch.equal(out, torch.full((8,), 2.0, device="cuda"))
