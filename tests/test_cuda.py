"""CUDA backend and capture. Marked ``cuda``: skipped without a GPU, run on the lent machine."""

import concurrent.futures
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

import streamdag as sd
from programs import closed_runtime_freed_at_once, ops_left_to_the_cycle_collector, wide_fn
from sanitizer import reports_race

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.cuda


def random_program(rng, n_ops, n_bufs=3, size=64):
    prog = []
    for _ in range(n_ops):
        def view():
            b = rng.randrange(n_bufs)
            lo = rng.randrange(size)
            hi = rng.randrange(lo, size) + 1
            return b, lo, hi
        prog.append(([view() for _ in range(rng.randrange(3))], view(), rng.randrange(100)))
    return prog


def apply(op, bufs):
    reads, (wb, wl, wh), k = op
    acc = torch.tensor(k, dtype=torch.int64, device=bufs[0].device)
    for b, lo, hi in reads:
        acc = acc + bufs[b][lo:hi].sum() % 1009
    w = bufs[wb][wl:wh]
    w.mul_(3).add_(acc).remainder_(1000003)


@pytest.mark.parametrize("streams", [1, 2, 4, 8])
def test_random_graphs_equal_serial(streams):
    rng = random.Random(streams)
    for _ in range(20):
        prog = random_program(rng, 40)
        host = [torch.arange(64, dtype=torch.int64) * (i + 3) for i in range(3)]
        for op in prog:
            apply(op, host)
        bufs = [(torch.arange(64, dtype=torch.int64) * (i + 3)).cuda() for i in range(3)]
        with sd.Runtime("cuda", streams=streams) as rt:
            for op in prog:
                reads = [bufs[b][lo:hi] for b, lo, hi in op[0]]
                wb, wl, wh = op[1]
                rt.submit(apply, op, bufs, reads=reads, writes=[bufs[wb][wl:wh]])
        for got, want in zip(bufs, host):
            assert torch.equal(got.cpu(), want)


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


def test_threads_that_wait_finish_ops_themselves_and_every_result_is_right():
    """Waiting threads finish completed ops beside the completion thread: nothing lost or twice."""
    errors = []
    with sd.Runtime("cuda", streams=4, max_inflight=64) as rt:
        def worker(k):
            try:
                x = torch.zeros(1 << 12, device="cuda")
                for i in range(300):
                    f = rt.submit(torch.add, x, 1, out=x, reads=[x], writes=[x])
                    if i % 3 == 0:  # now and then sleep on the GPU, so that waits are long too
                        rt.submit(lambda: torch.cuda._sleep(50_000), name="nap")
                    if i % 5 == k % 5:
                        assert f.result(timeout=60) is x
                        assert x[0].item() == i + 1
                rt.submit(lambda: None).result(timeout=60)
                assert torch.equal(x, torch.full_like(x, 300))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rt.synchronize()
        stats = rt.statistics()
    assert not errors, errors
    assert stats.inflight == 0 and stats.completed == stats.submitted and stats.failed == 0


def test_a_thread_that_keeps_submitting_finishes_completed_ops_itself():
    """With the completion thread stopped, ops still finish (and free their slots) as submits go on."""
    from streamdag.runtime.core import FINISH_EVERY

    x = torch.zeros(1024, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        rt.backend._completions.stop()
        first = [rt.submit(x.add_, 1, writes=[x]) for _ in range(FINISH_EVERY)]
        torch.cuda.synchronize()
        later = [rt.submit(x.add_, 1, writes=[x]) for _ in range(FINISH_EVERY)]
        assert all(f.done() for f in first) and rt.statistics().completed >= FINISH_EVERY
        torch.cuda.synchronize()
        assert later[-1].result(timeout=10) is x
    assert x[0].item() == FINISH_EVERY * 2


def test_a_long_op_nobody_waits_on_is_finished_and_its_callback_runs():
    """With nothing completing for a while, the completion thread polls ever less often, and still
    finishes an op nobody waits on (its done-callback runs) once the GPU is through with it."""
    import time

    x = torch.zeros(16, device="cuda")
    called = threading.Event()
    with sd.Runtime("cuda", streams=2) as rt:
        def long_op():
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: many idle polls
            x.add_(1)

        f = rt.submit(long_op, writes=[x])
        f.add_done_callback(lambda _: called.set())
        deadline = time.monotonic() + 30
        while not f.done() and time.monotonic() < deadline:
            time.sleep(0.005)  # looks without waiting on the future (which would help finish it)
        assert f.done() and called.wait(5)
    assert x.tolist() == [1.0] * 16


def test_done_callbacks_that_submit_at_the_bound_do_not_hang_on_cuda():
    x = torch.zeros(1024, device="cuda")
    follow_ups = []
    with sd.Runtime("cuda", streams=2, max_inflight=2) as rt:
        def continue_with_two(_f):
            for _ in range(2):
                follow_ups.append(rt.submit(x.add_, 1, writes=[x]))

        for _ in range(8):
            rt.submit(torch.cuda._sleep, 100_000).add_done_callback(continue_with_two)
        rt.synchronize()  # waits for the follow-ups too: they are pending before their trigger is done
    assert len(follow_ups) == 16 and all(f.exception(timeout=10) is None for f in follow_ups)
    assert x[0].item() == 16


def test_an_asyncio_timeout_on_a_cuda_future_leaves_the_runtime_working():
    import asyncio

    x = torch.zeros(1024, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        async def main():
            slow = rt.submit(torch.cuda._sleep, 200_000_000, name="slow")  # about 0.1 s
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(slow, 0.001)  # cancels the future it gave up on
            return slow, await rt.submit(x.add_, 1, writes=[x])

        slow, added = asyncio.run(main())
        assert slow.result(timeout=30) is None and added[0].item() == 1
        assert rt.submit(x.add_, 1, writes=[x]).result(timeout=30)[0].item() == 2


@pytest.mark.parametrize("how", ["result", "wait", "as_completed", "await"])
def test_waiting_on_the_last_of_a_burst_finishes_it_first_and_every_op_after(how):
    """A waiter's op is finished ahead of the ops queued before it; those still finish, in time."""
    import asyncio
    import concurrent.futures

    bufs = [torch.zeros(64, device="cuda") for _ in range(4)]
    with sd.Runtime("cuda", streams=4) as rt:
        for round_ in range(1, 21):
            futures = [rt.submit(b.add_, 1, writes=[b]) for _ in range(16) for b in bufs]
            last = futures[-1]
            if how == "result":
                assert last.result(timeout=30) is bufs[-1]
            elif how == "wait":
                done, _ = concurrent.futures.wait([last], timeout=30)
                assert last in done
            elif how == "as_completed":
                assert len(list(concurrent.futures.as_completed(futures, timeout=30))) == len(futures)
            else:
                async def waiting(last=last):
                    return await last
                assert asyncio.run(waiting()) is bufs[-1]
            assert bufs[-1][0].item() == 16 * round_
        rt.synchronize()
        stats = rt.statistics()
        assert all(f.done() and f.exception() is None for f in futures)
    assert stats.inflight == 0 and stats.completed == stats.submitted == 20 * 64
    assert all(b[0].item() == 320 for b in bufs)


@pytest.mark.parametrize("which", ["given", "all"])
def test_current_stream_wait_orders_pytorch_code_after_ops_without_blocking_the_host(which):
    out = torch.zeros(1 << 20, device="cuda")

    def slow_fill():
        torch.cuda._sleep(400_000_000)  # about 0.2 s (a host hiccup must not end it first), then the write
        out.fill_(7)

    with sd.Runtime("cuda", streams=4) as rt:
        for _ in range(3):
            out.zero_()
            torch.cuda.synchronize()
            f = rt.submit(slow_fill, writes=[out])
            rt.current_stream_wait(*([f] if which == "given" else []))
            assert not f.done()  # the host went on
            seen = out.clone()  # plain PyTorch on the caller's stream, ordered after the op
            assert seen.min().item() == 7


def test_a_submit_from_inside_an_op_on_its_stream_runs_in_program_order():
    """The outer op's function runs inside its submit, with its stream current: a nested op that
    touches its memory continues that stream, between the kernels enqueued before and after it."""
    x = torch.zeros(1024, device="cuda")
    inner = []

    def outer():
        torch.cuda._sleep(20_000_000)  # keeps the stream busy: order, not luck, must decide
        x.fill_(3)
        inner.append(rt.submit(x.add_, 1, writes=[x]))
        x.mul_(2)

    with sd.Runtime("cuda", streams=4) as rt:
        for _ in range(3):
            rt.submit(outer, writes=[x])
            rt.synchronize()
            assert x[0].item() == 8 and inner[-1].exception() is None


def test_result_with_a_timeout_gives_up_in_time_while_the_gpu_is_busy():
    import concurrent.futures
    import time

    with sd.Runtime("cuda", streams=2) as rt:
        f = rt.submit(lambda: torch.cuda._sleep(2_000_000_000), name="long")  # about a second
        started = time.perf_counter()
        with pytest.raises(concurrent.futures.TimeoutError):
            f.result(timeout=0.05)
        assert time.perf_counter() - started < 0.5  # the wait helped finish ops, within the timeout
        assert f.exception(timeout=60) is None


def test_transfers_round_trip_exactly_under_load():
    with sd.Runtime("cuda", streams=4) as rt:
        pairs = []
        for i in range(200):
            host = torch.randn(4096).pin_memory() if i % 2 else torch.randn(4096)
            dev = rt.to_device(host).result()
            busy = rt.submit(torch.matmul, dev.view(64, 64), dev.view(64, 64), reads=[dev])
            pairs.append((host, rt.to_host(dev), busy))
        for host, back, _ in pairs:
            assert torch.equal(back.result(), host)


@pytest.mark.parametrize("default_stream_sync", [True, False])
@pytest.mark.parametrize("caller", ["default", "side"])
@pytest.mark.parametrize("caller_busy", [False, True])
def test_ops_follow_work_the_caller_enqueued_on_its_stream(caller, caller_busy, default_stream_sync):
    """Inputs made on the caller's stream are ready when the op runs, busy caller stream or idle:
    ordered by CUDA itself (a blocking stream after the default stream) or by an event."""
    stream = torch.cuda.current_stream() if caller == "default" else torch.cuda.Stream()
    rt = sd.Runtime("cuda", streams=2, default_stream_sync=default_stream_sync)
    with rt, torch.cuda.stream(stream):
        for i in range(20):
            x = torch.zeros(1 << 16, device="cuda")
            if caller_busy:
                torch.cuda._sleep(2_000_000)  # the caller's stream is still busy when we submit
            x.fill_(i)  # on the caller's stream, after the sleep
            y = rt.submit(torch.add, x, 1, reads=[x], name="after_caller").result()
            assert torch.equal(y, torch.full_like(y, i + 1)), i


def test_default_stream_work_after_a_submit_follows_the_op_on_blocking_streams():
    """With ``default_stream_sync`` the runtime's streams are CUDA blocking streams: what the caller
    then puts on the default stream runs after the ops submitted before it, with no wait asked for,
    while the runtime's streams still run beside each other."""
    from streamdag import native

    if getattr(native.load_torch(), "new_stream", None) is None:
        pytest.skip("without the torch extension the compute streams are PyTorch's non-blocking ones")
    out = torch.zeros(1 << 20, device="cuda")
    side = torch.zeros(1 << 10, device="cuda")
    with sd.Runtime("cuda", streams=4) as rt:
        for i in range(3):
            torch.cuda.synchronize()
            # ~0.2 s of GPU time, then the write
            slow = rt.submit(lambda i=i: (torch.cuda._sleep(400_000_000), out.fill_(i + 7)), writes=[out])
            quick = rt.submit(side.add_, 1, writes=[side])  # another stream: not behind the slow one
            assert quick.result() is side and not slow.done()
            seen = out.clone()  # plain PyTorch on the default stream, after the submit
            assert seen.min().item() == i + 7
            slow.result()


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


def test_exception_fails_only_dependents_on_cuda():
    a = torch.zeros(8, device="cuda")
    b = torch.zeros(8, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        fa = rt.submit(lambda: 1 / 0, writes=[a], name="bad")
        fd = rt.submit(torch.add, a, 1, reads=[a])
        fi = rt.submit(b.add_, 1, writes=[b])
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
        assert isinstance(fa.exception(), ZeroDivisionError)
        assert isinstance(fd.exception(), sd.DependencyFailed)
        assert torch.equal(fi.result(), torch.ones(8, device="cuda"))


def test_an_unnamed_op_that_fails_is_named_after_its_function_in_its_dependents_error():
    a = torch.zeros(8, device="cuda")

    def broken():
        raise ValueError("broken on purpose")

    with sd.Runtime("cuda", streams=2) as rt:
        fa = rt.submit(broken, writes=[a])
        fd = rt.submit(torch.add, a, 1, reads=[a])
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
        err = fd.exception()
        assert isinstance(err, sd.DependencyFailed)
        assert fa.op_name.startswith("broken#") and repr(fa.op_name) in str(err)
        assert fd.op_name.startswith("add#") and fd.op_name != fa.op_name


def test_out_of_memory_fails_only_that_op_and_its_dependents():
    a = torch.zeros(8, device="cuda")
    b = torch.zeros(8, device="cuda")
    too_big = torch.cuda.get_device_properties(0).total_memory * 4  # bytes no GPU has

    def allocate_too_much(out):
        out.add_(torch.empty(too_big // 4, device="cuda").sum())

    with sd.Runtime("cuda", streams=2) as rt:
        oom = rt.submit(allocate_too_much, a, writes=[a], name="oom")
        dependent = rt.submit(torch.add, a, 1, reads=[a])
        independent = rt.submit(b.add_, 1, writes=[b])
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
        assert isinstance(oom.exception(), torch.cuda.OutOfMemoryError)
        assert isinstance(dependent.exception(), sd.DependencyFailed)
        assert torch.equal(independent.result(), torch.ones(8, device="cuda"))
        # not a lost device: later ops on the same buffers run
        later = rt.submit(torch.add, a, 2, reads=[a])
        assert torch.equal(later.result(), torch.full((8,), 2.0, device="cuda"))


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_an_op_that_runs_out_of_memory_frees_what_it_had_made_while_its_future_is_held(native):
    """The usual OOM: a function makes one large buffer, then fails to make the next. Its error is
    kept as long as its future (or a dependent's) is referenced; the buffer it made must be freed, or
    the memory stays taken and the user's retry with a smaller batch runs out too."""
    from streamdag.runtime import core

    a = torch.zeros(8, device="cuda")
    big = 256 << 20
    too_big = torch.cuda.get_device_properties(0).total_memory * 4

    def make_then_fail(out):
        scratch = torch.empty(big // 4, device="cuda")
        out.add_(scratch[:8] * 0 + torch.empty(too_big // 4, device="cuda").sum())

    compiled, core.COMPILED_SUBMIT = core.COMPILED_SUBMIT, native
    try:
        rt = sd.Runtime("cuda", streams=2)
    finally:
        core.COMPILED_SUBMIT = compiled
    with pytest.raises(sd.ExceptionGroup), rt:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        failed = rt.submit(make_then_fail, a, writes=[a])
        dependent = rt.submit(torch.add, a, 1, reads=[a])
        assert isinstance(failed.exception(), torch.cuda.OutOfMemoryError)
        assert isinstance(dependent.exception(), sd.DependencyFailed)
        assert torch.cuda.memory_allocated() - before < big, "the failed op's frames hold its buffer"


def wide_graph(rt, x, ws, hs, y):
    with rt.record() as g:
        for b in range(len(ws)):
            src = x
            for i, w in enumerate(ws[b]):
                rt.submit(lambda s, w, o: torch.relu_(torch.matmul(s, w, out=o)), src, w, hs[b][i],
                          reads=[src, w], writes=[hs[b][i]])
                src = hs[b][i]
        rt.submit(lambda: torch.sum(torch.stack([h[-1] for h in hs]), 0, out=y),
                  reads=[h[-1] for h in hs], writes=[y])
    return g


def test_captured_equals_eager_over_many_replays_with_new_inputs():
    torch.backends.cuda.matmul.allow_tf32 = False
    B, L, D = 8, 3, 64
    x = torch.randn(16, D, device="cuda")
    ws = [[torch.randn(D, D, device="cuda") / 8 for _ in range(L)] for _ in range(B)]
    hs = [[torch.empty(16, D, device="cuda") for _ in range(L)] for _ in range(B)]
    y = torch.empty(16, D, device="cuda")
    with sd.Runtime("cuda", streams=4) as rt:
        g = wide_graph(rt, x, ws, hs, y)
        for _ in range(300):
            new = torch.randn(16, D, device="cuda")
            rt.submit(x.copy_, new, reads=[new], writes=[x])
            g.run()
            got = rt.submit(y.clone, reads=[y]).result()
            h = [new] * B
            for layer in range(L):
                h = [torch.relu(h[b] @ ws[b][layer]) for b in range(B)]
            torch.testing.assert_close(got, torch.stack(h).sum(0), rtol=1e-5, atol=1e-5)
        stats = g.statistics()
        assert stats.replays >= 298 and stats.fallbacks == 0


def test_an_empty_recording_runs_nothing_on_the_gpu_too():
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            pass
        for _ in range(3):
            assert list(g.run().result()) == []
        x = torch.ones(4, device="cuda")
        assert torch.equal(rt.submit(torch.mul, x, 2, reads=[x]).result(timeout=30), x * 2)


def doubling_graph(rt, x, y):
    """A recorded graph writing 2 * x into y, run three times: captured and replayed."""
    with rt.record() as g:
        rt.submit(lambda a, o: torch.mul(a, 2, out=o), x, y, reads=[x], writes=[y])
    for _ in range(3):
        g.run().result()
    return g


def test_recapture_when_an_undeclared_argument_changes_address_and_shape():
    """An argument the op does not declare is no memory the graph orders: it may move, and the
    capture is made again for it."""
    x = torch.ones(4, 4, device="cuda")
    y = torch.empty(4, 4, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda a, o: o.copy_(a[:4, :4] * 2), x, y, writes=[y])
        for _ in range(3):
            g.run().result()
        x.set_(torch.full((8, 8), 3.0, device="cuda"))
        g.run().result()
        rt.synchronize()
        assert torch.equal(y, torch.full((4, 4), 6.0, device="cuda"))
        assert g.statistics().recaptures == 1


def test_a_captured_graph_refuses_to_run_once_a_declared_argument_has_other_memory():
    """Its dependencies were inferred from the memory it was recorded with (a recapture would not
    change them): recording it again is the fix."""
    x = torch.ones(4, 4, device="cuda")
    y = torch.empty(4, 4, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        g = doubling_graph(rt, x, y)
        x.set_(torch.full((8, 8), 3.0, device="cuda"))
        with pytest.raises(sd.InvalidBuffer, match="Record the graph again"):
            g.run()
        y.set_(torch.empty(8, 8, device="cuda"))
        g = doubling_graph(rt, x, y)
        rt.synchronize()
        assert torch.equal(y, torch.full((8, 8), 6.0, device="cuda"))


def test_recapture_when_an_argument_changes_strides_only():
    """A square ``t_()`` keeps address and shape: a stale capture would read the old layout."""
    x = torch.arange(16.0, device="cuda").view(4, 4)
    y = torch.empty(4, 4, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda a, o: o.copy_(a), x, y, reads=[x], writes=[y])
        for _ in range(3):
            g.run().result()
        x.t_()
        g.run().result()
        rt.synchronize()
        assert torch.equal(y, torch.arange(16.0, device="cuda").view(4, 4).t())
        assert g.statistics().recaptures == 1


def test_recapture_when_an_argument_changes_shape_only():
    """An in-place ``unsqueeze_`` keeps address and strides of the existing dimensions, and adds one."""
    x = torch.ones(4, 4, device="cuda")
    y = torch.empty(4, 4, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda a, o: o.copy_(a.reshape(o.shape) * 2), x, y, reads=[x], writes=[y])
        for _ in range(3):
            g.run().result()
        assert g.statistics().recaptures == 0
        x.unsqueeze_(0)
        x.fill_(5)
        g.run().result()
        rt.synchronize()
        assert torch.equal(y, torch.full((4, 4), 10.0, device="cuda"))
        assert g.statistics().recaptures == 1


def test_a_replay_in_inference_mode_neither_recaptures_nor_misses_a_change():
    """Replays check their arguments with PyTorch's C++ tensor guard, which also fails for what
    does not matter here (inference mode changes dispatch keys): then the exact check decides."""
    x = torch.ones(4, 4, device="cuda")
    y = torch.empty(4, 4, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        g = doubling_graph(rt, x, y)
        with torch.inference_mode():
            g.run().result()
        assert g.statistics().recaptures == 0 and torch.equal(y, torch.full((4, 4), 2.0, device="cuda"))
        x.t_().mul_(3)  # strides change: the guard sees it
        g.run().result()
        assert g.statistics().recaptures == 1 and torch.equal(y, torch.full((4, 4), 6.0, device="cuda"))


def test_captured_pipeline_of_copies_and_compute_equals_eager_run_after_run():
    """Copies in, compute, copies out, recorded once: captured with the copies on copy streams."""
    chunks, n = 4, 1 << 16
    host_in = [torch.empty(n).pin_memory() for _ in range(chunks)]
    host_out = [torch.empty(n).pin_memory() for _ in range(chunks)]
    dev_in = [torch.empty(n, device="cuda") for _ in range(chunks)]
    dev_out = [torch.empty(n, device="cuda") for _ in range(chunks)]
    with sd.Runtime("cuda", streams=4) as rt:
        with rt.record() as g:
            for i in range(chunks):
                rt.copy(dev_in[i], host_in[i])
                rt.submit(lambda a, o: torch.mul(a.sin(), 2, out=o), dev_in[i], dev_out[i],
                          reads=[dev_in[i]], writes=[dev_out[i]])
                rt.copy(host_out[i], dev_out[i])
        for step in range(5):
            for h in host_in:
                h.copy_(torch.randn(n))
            g.run().result()
            for h, o in zip(host_in, host_out):
                torch.testing.assert_close(o, h.sin() * 2, msg=f"run {step}")
        stats = g.statistics()
        assert stats.captures >= 1 and stats.fallbacks == 0 and stats.replays >= 3
        assert not stats.choice_ms or stats.chosen_streams in stats.choice_ms  # compute streams
        assert len(set(g.names)) == 3 * chunks


def test_capture_failure_falls_back_with_one_warning_and_streams_stay_usable():
    a = torch.ones(8, device="cuda")
    out = torch.zeros(8, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda: out.copy_(a * a.sum().item()), reads=[a], writes=[out], name="syncs")
        g.run().result()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            g.run().result()
            g.run().result()
        msgs = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
        assert len(msgs) == 1 and "syncs" in msgs[0]
        assert torch.equal(out, torch.full((8,), 8.0, device="cuda"))
        assert rt.submit(torch.add, a, 1, reads=[a]).result().sum().item() == 16.0
        assert "not used" in g.explain()


def test_another_threads_sync_during_a_graphs_first_run_does_not_keep_the_graph_from_capture():
    """The first run watches each op for host syncs; a sync that another thread
    makes meanwhile is not the op's."""
    x = torch.ones(1024, device="cuda")
    out = torch.empty_like(x)
    elsewhere = torch.ones(4, device="cuda")
    op_started, stop = threading.Event(), threading.Event()
    syncs = []

    def slow_first_time() -> None:
        if not op_started.is_set():
            op_started.set()
            deadline = time.monotonic() + 10
            while len(syncs) < 50 and time.monotonic() < deadline:
                time.sleep(0.001)
        torch.mul(x, 2, out=out)

    def syncing_thread() -> None:
        op_started.wait(10)
        while not stop.is_set():
            syncs.append(float(elsewhere[0]))

    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(slow_first_time, reads=[x], writes=[out], name="quiet")
        syncer = threading.Thread(target=syncing_thread)
        syncer.start()
        try:
            g.run().result()
        finally:
            stop.set()
            syncer.join(10)
        assert len(syncs) >= 50
        g.run().result()
        assert g.last_run_captured and g.statistics().captures >= 1
        assert torch.equal(out, x * 2)


SANITIZED = textwrap.dedent(
    """
    import torch, streamdag as sd
    x = torch.randn(1 << 20, device="cuda")
    outs = [torch.empty_like(x) for _ in range(4)]
    y = torch.empty_like(x)
    # submit from a side stream: the sanitizer takes the legacy default stream to
    # synchronize with every stream, which would hide the race we want it to see
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), sd.Runtime("cuda", streams=4) as rt:
        with rt.record() as g:  # a fork/join: the schedule puts the consumers on four streams
            # a slow producer, so that the consumers are launched while it still runs: the
            # sanitizer slows every launch down, and once the completion thread has seen the
            # producer finish, the sanitizer rightly orders every later kernel after it
            rt.submit(lambda: (torch.cuda._sleep(1_000_000_000), x.mul_(1.5)), writes=[x])
            for o in outs:
                rt.submit(torch.mul, x, 2, out=o, reads=[x], writes=[o])
            rt.submit(lambda: torch.sum(torch.stack(outs), 0, out=y), reads=outs, writes=[y])
        g.capture = False  # eager runs, so that the sanitizer sees every kernel
        print("streams:", sorted(set(g.schedule.stream)))
        for i in range(3):
            g.run()
    print("done")
    """
)


@pytest.mark.parametrize("drop_waits", [False, True])
def test_stream_sanitizer_finds_no_race_unless_waits_are_dropped(drop_waits):
    raced, text = reports_race(SANITIZED, drop_waits)
    assert raced == drop_waits, text[:6000]


def test_pageable_transfers_are_staged_in_chunks_and_round_trip():
    import numpy as np

    from streamdag.runtime import transfers

    n = (3 * transfers.CHUNK_BYTES) // 4 + 12345  # several chunks, a ragged end
    host = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    back = np.empty_like(host)
    with sd.Runtime("cuda", streams=2, staging_bytes=4 * transfers.CHUNK_BYTES) as rt:
        dev = rt.to_device(host).result()
        rt.submit(dev.mul_, 2, writes=[dev])
        rt.copy(back, dev).result()
    assert np.array_equal(back, host * 2)


@pytest.mark.parametrize("staged_here", ["up to a chunk", "every size"])
def test_pageable_copies_through_a_small_staging_pool_wait_for_its_buffers_and_land_exactly(
        monkeypatch, staged_here):
    """Pageable copies in, a device op on each, and copies out, submitted at once through a staging
    pool far smaller than their bytes: each copy waits for buffers that earlier ones return once
    the ops using them are done (none is refilled while a DMA still reads it or before its host op
    has unstaged it), every byte lands, and the pool holds no more than its limit (or one buffer,
    for a copy larger than the limit)."""
    from streamdag.runtime import transfers

    if staged_here == "every size":  # also the submit's staging of copies of several chunks
        monkeypatch.setattr(transfers, "LANE_STAGING_BYTES", 1 << 40)
    limit = 1 << 20
    g = torch.Generator().manual_seed(5)
    sizes = [1000, (1 << 18) // 4 + 7, 600_000, 70_000] * 6
    if staged_here == "every size":
        sizes += [transfers.CHUNK_BYTES // 4 + 4099]
    srcs = [torch.randn(n, generator=g) for n in sizes]
    backs = [torch.full((n,), -1.0) for n in sizes]
    with sd.Runtime("cuda", streams=2, staging_bytes=limit) as rt:
        devs = [torch.empty(n, device="cuda") for n in sizes]
        futures = []
        for src, dev, back in zip(srcs, devs, backs):
            rt.copy(dev, src)
            rt.submit(dev.add_, 1, writes=[dev])
            futures.append(rt.copy(back, dev))
        for f in futures:
            f.result(timeout=120)
        pool = rt._staging
        largest = 1 << (max(sizes) * 4 - 1).bit_length()
        assert pool._held <= max(limit, min(largest, transfers.CHUNK_BYTES)), pool._held
    for src, back in zip(srcs, backs):
        assert torch.equal(back, src + 1)


@pytest.mark.parametrize("seed", range(4))
def test_random_programs_of_copies_device_ops_and_host_ops_equal_serial(seed):
    """Random programs of copies both ways between slices of pinned and pageable host buffers and
    device buffers (small slices staged in the submit, large ones on a host lane through the ring,
    more chunks than it has buffers), device ops and host-lane ops on the same slices, submitted at
    once: every buffer must end as the program run serially on the CPU leaves it."""
    from streamdag.runtime import transfers

    rng = random.Random(seed)
    n = transfers.CHUNK_BYTES // 4 * (transfers.RING_DEPTH + 1) + 4099  # int32: past the ring
    small = transfers.LANE_STAGING_BYTES // 4

    def program(length):
        ops = []
        for _ in range(length):
            size = rng.choice([rng.randrange(1, small), rng.randrange(small, n)])
            lo = rng.randrange(n - size + 1)
            ops.append({"kind": rng.choice(["h2d", "d2h", "device", "host"]), "host": rng.randrange(3),
                        "dev": rng.randrange(2), "lo": lo, "hi": lo + size, "k": rng.randrange(1, 1000)})
        return ops

    def step(t, k):  # exact in int32: values stay below 3 * 1000003 + 1000
        t.mul_(3).add_(k).remainder_(1000003)

    def make(device):
        hosts = [torch.arange(n, dtype=torch.int32) * (i + 2) % 1000003 for i in range(3)]
        hosts[2] = hosts[2].pin_memory() if device == "cuda" else hosts[2]
        devs = [(torch.arange(n, dtype=torch.int32) * (i + 7) % 1000003).to(device) for i in range(2)]
        return hosts, devs

    ops = program(24)
    want_hosts, want_devs = make("cpu")
    for op in ops:
        h, d = want_hosts[op["host"]][op["lo"]:op["hi"]], want_devs[op["dev"]][op["lo"]:op["hi"]]
        if op["kind"] == "h2d":
            d.copy_(h)
        elif op["kind"] == "d2h":
            h.copy_(d)
        else:
            step(d if op["kind"] == "device" else h, op["k"])
    hosts, devs = make("cuda")
    with sd.Runtime("cuda", streams=3) as rt:
        futures = []
        for op in ops:
            h, d = hosts[op["host"]][op["lo"]:op["hi"]], devs[op["dev"]][op["lo"]:op["hi"]]
            if op["kind"] == "h2d":
                futures.append(rt.copy(d, h))
            elif op["kind"] == "d2h":
                futures.append(rt.copy(h, d))
            elif op["kind"] == "device":
                futures.append(rt.submit(step, d, op["k"], writes=[d]))
            else:
                futures.append(rt.submit(step, h, op["k"], writes=[h], run_on="host"))
        for f in futures:
            f.result(timeout=120)
        rt.synchronize()
    for got, want in zip(hosts + devs, want_hosts + want_devs):
        assert torch.equal(got.cpu(), want)


def test_a_copy_runs_on_its_copy_stream_beside_compute_and_after_its_producer():
    """The transfers' compiled path (``submit_on``): a copy of other data finishes while a slow op
    still runs (it is on a copy stream, not behind the op), and a copy of the op's output waits."""
    with sd.Runtime("cuda", streams=2) as rt:
        out = torch.zeros(1 << 16, device="cuda")
        host = torch.arange(1 << 16, dtype=torch.float32).pin_memory()
        dev = torch.empty(1 << 16, device="cuda")
        torch.cuda.synchronize()

        def slow_fill(t):
            torch.cuda._sleep(600_000_000)  # about 0.3 s of GPU time, then the write
            t.fill_(7.0)

        slow = rt.submit(slow_fill, out, writes=[out], name="slow")
        assert rt.copy(dev, host).result(timeout=60) is dev
        assert not slow.done()  # the copy did not queue behind the slow op
        back = rt.to_host(out)  # reads what the slow op writes: after it
        assert torch.equal(back.result(timeout=60), torch.full((1 << 16,), 7.0))
        assert slow.done()
        assert torch.equal(dev.cpu(), host)


@pytest.mark.parametrize("capture", [False, True])
def test_stream_map_on_the_gpu_equals_fn_from_pinned_and_pageable_memory_on_the_copy_streams(capture):
    """Pieces through the ring of device buffers, copies on the copy streams; outputs exact (the
    function is elementwise, so cutting the input into pieces cannot change a bit). Captured, a
    second call replays the first one's CUDA graphs on new data."""
    def fn(a):
        return torch.cat([a * 3, a.sin()], dim=1)

    g = torch.Generator().manual_seed(0)
    pinned = [torch.randn(n, 96, generator=g).pin_memory() for n in (1000, 37, 0, 2500)]
    pageable = [torch.randn(n, 96, generator=g) for n in (700, 1300)]
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.profile() as prof:
            made = rt.stream_map(fn, pinned, piece_bytes=96 * 4 * 64, buffers=3,  # outputs made, pinned
                                 capture=capture)
            given = [torch.full((x.shape[0], 192), -1.0) for x in pageable]
            into = rt.stream_map(fn, pageable, given, piece_bytes=96 * 4 * 100, capture=capture)
            results = [f.result(timeout=60) for f in made + into]
        for x, got in zip(pinned + pageable, results):
            assert torch.equal(got, fn(x.cuda()).cpu())
        assert all(r.is_pinned() for r in results[:4] if r.numel())
        assert all(r is o for r, o in zip(results[4:], given))
        again = [x * 2 for x in pinned]
        for x, f in zip(again, rt.stream_map(fn, again, piece_bytes=96 * 4 * 64, buffers=3, capture=capture)):
            assert torch.equal(f.result(timeout=60), fn(x.cuda()).cpu())
        if capture:  # replayed as CUDA graphs, none fell back to running eagerly
            graphs = [g for ring in rt._stream_maps[fn].values() for g in ring._graphs.values()]
            stats = [g.statistics() for g in graphs if g.statistics() is not None]  # (run twice or more)
            assert stats and sum(s.replays for s in stats) > 0 and not any(s.fallbacks for s in stats)
    kinds = {(s.name.split("#")[0], s.kind) for s in prof.timeline.spans}
    assert {("stream_map_in", "h2d"), ("stream_map", "compute"), ("stream_map_out", "d2h")} <= kinds


def test_stream_map_from_pageable_memory_by_its_default_pieces_equals_fn():
    """With pageable inputs or outputs the default pieces are larger (each piece's copy of more
    than 8 MiB is a host-lane op with a fixed cost), at most an eighth of the data: a 96 MiB input
    goes in 12 MiB pieces, through the host lanes' rings, and every row comes back as ``fn`` gives
    it; pinned, the same input goes in the usual 6 MiB pieces (a sixteenth)."""
    def fn(a):
        return a * 2 - 1

    x = torch.randn(96 << 8, 1024)  # 96 MiB of rows of 4 KiB, pageable
    with sd.Runtime("cuda", streams=2) as rt:
        for pin in (False, True):
            src = x.pin_memory() if pin else x
            with rt.profile() as prof:
                got = rt.stream_map(fn, src).result(timeout=120)
            assert torch.equal(got, fn(x))
            pieces = sum(1 for s in prof.timeline.spans if s.name.startswith("stream_map_in"))
            assert pieces == (16 if pin else 8), pieces


def test_a_recorded_stream_map_replays_as_one_cuda_graph_on_the_copy_streams():
    """stream_map inside ``rt.record()``: every piece's copies and compute in one captured graph,
    replayed on new data in the same pinned tensors; from pageable memory the graph cannot be
    captured (CUDA copies pageable memory through the host) and runs op by op, still exact."""
    def fn(a):
        return torch.cat([a * 3, a.sin()], dim=1)

    g = torch.Generator().manual_seed(1)
    with sd.Runtime("cuda", streams=2) as rt:
        for pin in (True, False):
            xs = [torch.randn(n, 96, generator=g) for n in (1000, 37)]
            outs = [torch.full((x.shape[0], 192), -1.0) for x in xs]
            if pin:
                xs, outs = [x.pin_memory() for x in xs], [o.pin_memory() for o in outs]
            with rt.record() as graph:
                rt.stream_map(fn, xs, outs, piece_bytes=96 * 4 * 64, buffers=3)
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                for _ in range(3):
                    for x in xs:
                        x.mul_(-1)
                    graph.run().result(timeout=60)
                    for x, o in zip(xs, outs):
                        assert torch.equal(o, fn(x.cuda()).cpu())
            assert graph.last_run_captured == pin
            assert bool(warned) != pin  # the pageable graph says why it runs op by op
            copies = sum(1 for op in graph._ops if op.stream is not None)  # on the copy streams
            assert copies == 2 * (16 + 1)


def test_stream_map_without_out_returns_before_the_device_has_run_the_first_piece():
    """Without ``out``, the first piece's shape makes the outputs: on CUDA its op makes them as fn's
    kernels are launched, so the call does not wait for the device (it did, 0.3-0.5 ms a call)."""
    sleepy = []

    def fn(a):
        if sleepy and sleepy.pop():  # about 1 s of GPU time before the first piece's result
            torch.cuda._sleep(2_000_000_000)
        return torch.cat([a * 2, a + 1], dim=1)

    x = torch.randn(256, 8).pin_memory()
    with sd.Runtime("cuda", streams=2) as rt:
        # warm: a first call's device allocations (cudaMalloc) may wait for running kernels
        for f in [rt.stream_map(fn, x, piece_bytes=8 * 4 * 32) for _ in range(3)]:
            f.result(timeout=60)
        sleepy.append(True)
        t0 = time.perf_counter()
        f = rt.stream_map(fn, x, piece_bytes=8 * 4 * 32)  # 8 pieces
        returned_after = time.perf_counter() - t0
        assert not f.done()
        got = f.result(timeout=60)
    assert returned_after < 0.5, f"stream_map waited {returned_after:.2f} s for the first piece"
    assert torch.equal(got, torch.cat([x * 2, x + 1], dim=1)) and got.is_pinned()


def test_a_copier_made_once_copies_pieces_as_rt_copy_does():
    """stream_map's copy function, decided once per input: pinned pieces go straight onto the copy
    stream of their direction, pageable ones through rt.copy's staging; every piece lands exactly."""
    from streamdag.runtime.transfers import copier

    n = 1 << 12
    with sd.Runtime("cuda", streams=2) as rt:
        for pinned in (True, False):
            src = torch.randn(4 * n)
            src = src.pin_memory() if pinned else src
            back = torch.zeros(4 * n).pin_memory() if pinned else torch.zeros(4 * n)
            dev = torch.zeros(4 * n, device="cuda")
            copy_in, copy_out = copier(rt, dev[:n], src[:n]), copier(rt, back[:n], dev[:n])
            with rt.profile() as prof:
                for i in range(4):
                    piece = slice(i * n, (i + 1) * n)
                    d = dev[piece]
                    copy_in(d, src[piece], "in")
                    rt.submit(torch.mul, d, 2, out=d, reads=[d], writes=[d])
                    copy_out(back[piece], d, "out")
                rt.synchronize()
            assert torch.equal(back, src * 2)
            kinds = {(s.name.split("#")[0], s.kind) for s in prof.timeline.spans}
            if pinned:
                assert kinds == {("in", "h2d"), ("mul", "compute"), ("out", "d2h")}
            else:  # staged through pinned buffers: the copies' names and streams are rt.copy's
                assert ("in", "h2d") in kinds and ("mul", "compute") in kinds


def test_a_copy_between_dtypes_is_refused_whether_pinned_or_pageable():
    """Staged through pinned buffers, a pageable copy moves bytes: float64 into float32 would be
    reinterpreted. Neither path converts; both say what to do instead."""
    import numpy as np

    with sd.Runtime("cuda", streams=2) as rt:
        dev = torch.zeros(64, device="cuda")
        for host in (torch.ones(64, dtype=torch.float64), torch.ones(64, dtype=torch.float64).pin_memory(),
                     np.ones(64)):
            with pytest.raises(ValueError, match="one dtype and shape"):
                rt.copy(dev, host)
            with pytest.raises(ValueError, match="one dtype and shape"):
                rt.copy(host, dev)
        assert rt.statistics().submitted == 0
        assert torch.equal(dev, torch.zeros(64, device="cuda"))


def test_a_pinned_copy_is_made_by_the_compiled_path_with_its_bytes_counted_until_done():
    """rt.copy between pinned host memory and the GPU is made in C; every other copy is left to the
    Python code (None back). The compiled copy is the same op: on its copy stream, after the ops it
    conflicts with (on the device, the host going on), its bytes counted until it completes."""
    import numpy as np

    n, copies = 1024, 6  # 4 KiB a copy
    with sd.Runtime("cuda", streams=2, max_inflight_bytes=64 << 10) as rt:
        if rt._copy_pinned is None:
            pytest.skip("no compiled hot path here")
        dev = torch.zeros(n, device="cuda")
        assert rt._copy_pinned(dev, torch.randn(n), None) is None  # pageable: staged in Python
        assert rt._copy_pinned(dev, np.ones(n, np.float32), None) is None
        assert rt._copy_pinned(dev, torch.ones(n, dtype=torch.float64).pin_memory(), None) is None
        assert rt._copy_pinned(torch.zeros(n).pin_memory(), torch.ones(n).pin_memory(), None) is None
        square = torch.ones(32, 32).pin_memory()  # the same bytes, another shape: refused by Python
        for dst, src in ((dev, square), (square, dev)):
            assert rt._copy_pinned(dst, src, None) is None
            with pytest.raises(ValueError, match="one dtype and shape"):
                rt.copy(dst, src)
        # memory pinned without PyTorch's allocator (page-locked in place) is pinned memory too
        registered = torch.randn(n)
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(registered.data_ptr(), n * 4, 0)) == 0
        try:
            assert registered.is_pinned()
            into = rt._copy_pinned(dev, registered, None)
            assert into is not None and into.result() is dev and torch.equal(dev.cpu(), registered)
        finally:
            rt.synchronize()
            assert int(cudart.cudaHostUnregister(registered.data_ptr())) == 0
        hosts = [torch.randn(n).pin_memory() for _ in range(copies)]
        backs = [torch.zeros(n).pin_memory() for _ in range(copies)]
        busy = rt.submit(torch.cuda._sleep, 100_000_000, name="busy", writes=[dev])  # tens of ms
        pairs = []
        for host, back in zip(hosts, backs):  # each in after the last out (it overwrites what that reads)
            into = rt._copy_pinned(dev, host, None)
            assert into is not None and into.op_name == "copy_h2d"
            pairs.append((into, rt.copy(back, dev, name="out")))
        assert not busy.done() and rt._bytes.used == 2 * copies * n * 4  # held, none waited for
        for (into, out), host, back in zip(pairs, hosts, backs):
            assert into.result() is dev and out.result() is back
            assert torch.equal(back, host)
        rt.synchronize()
        assert rt._bytes.reclaim() == 0
        assert rt.statistics().peak_inflight_bytes == 2 * copies * n * 4


def test_pinned_copies_past_the_byte_bound_wait_for_earlier_ones_and_every_byte_comes_back():
    """The compiled rt.copy counts a pinned copy's bytes itself, on the budget's own counts and lock
    (which the Python copies use too): 16 MiB of copies, the compiled ones and to_device's in turn,
    through a bound of 4 MiB while the first waits behind a long kernel. The submitter waits instead
    of passing the bound, every copy lands, and all bytes come back once they are done."""
    limit, n = 4 << 20, 1 << 18  # copies of 1 MiB
    with sd.Runtime("cuda", streams=2, max_inflight_bytes=limit) as rt:
        if rt._copy_pinned is None:
            pytest.skip("no compiled hot path here")
        assert type(rt._bytes._counts).__name__ == "BudgetCounts"  # counted in C
        hosts = [torch.full((n,), float(i)).pin_memory() for i in range(16)]
        devs = [torch.zeros(n, device="cuda") for _ in range(16)]
        busy = rt.submit(torch.cuda._sleep, 50_000_000, name="busy", writes=[devs[0]])
        futures = [rt.copy(d, h) if i % 2 == 0 else rt.to_device(h)
                   for i, (d, h) in enumerate(zip(devs, hosts))]
        # four copies fill the bound behind the kernel (tens of ms); the fifth waited for the first
        assert rt.statistics().peak_inflight_bytes == limit
        assert busy.result() is None
        for i, (f, h) in enumerate(zip(futures, hosts)):
            out = f.result()
            assert torch.equal(out.cpu(), h), i
            if i % 2 == 0:
                assert out is devs[i]
        rt.synchronize()
        assert rt._bytes.reclaim() == 0 and rt._bytes.used == 0


def test_transfer_bytes_in_flight_stay_bounded():
    limit = 4 << 20
    with sd.Runtime("cuda", streams=2, max_inflight_bytes=limit) as rt:
        hosts = [torch.randn(1 << 18).pin_memory() for _ in range(32)]  # 1 MiB each
        devs = [rt.to_device(h) for h in hosts]
        for h, d in zip(hosts, devs):
            assert torch.equal(d.result().cpu(), h)
        assert 0 < rt.statistics().peak_inflight_bytes <= limit


DEVICE_LOST = textwrap.dedent(
    """
    import torch, streamdag as sd
    a = torch.zeros(4, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        bad = rt.submit(lambda: a[torch.tensor([10], device="cuda")].sum().item(), reads=[a])
        print("bad:", type(bad.exception(timeout=60)).__name__)
        later = rt.submit(torch.add, a, 1, reads=[a])
        print("later:", type(later.exception(timeout=60)).__name__)
        try:
            rt.synchronize()
        except sd.ExceptionGroup as group:
            print("group:", sorted({type(e).__name__ for e in group.exceptions}))
    print("finished", flush=True)
    import os
    os._exit(0)  # a process whose CUDA context is broken may not exit cleanly
    """
)


DEVICE_LOST_WHILE_WAITING = textwrap.dedent(
    """
    import os, torch, streamdag as sd
    a = torch.zeros(4, device="cuda")
    index = torch.tensor([10], device="cuda")
    rt = sd.Runtime("cuda", streams=2)
    # the op returns at once; its kernel asserts on the device later, while the caller waits on it
    bad = rt.submit(lambda: a[index].sum(), reads=[a, index])
    print("bad:", type(bad.exception(timeout=60)).__name__)
    later = rt.submit(torch.add, a, 1, reads=[a])
    print("later:", type(later.exception(timeout=60)).__name__)
    print("finished", flush=True)
    os._exit(0)  # a process whose CUDA context is broken may not exit cleanly
    """
)


def test_a_sticky_error_seen_by_a_waiter_marks_the_device_lost():
    """The thread waiting on an op sees its event fail (in the torch extension's spin wait, or a
    query): the op and every later one fail with DeviceLost, and nothing hangs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", DEVICE_LOST_WHILE_WAITING], env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout
    assert "finished" in out, proc.stdout + proc.stderr[-3000:]
    assert "bad: DeviceLost" in out and "later: DeviceLost" in out, out


def test_a_cuda_error_that_is_not_sticky_fails_its_op_only():
    """A CUDA error that leaves the context usable (here an invalid device ordinal) fails its op
    and its dependents, as a Python exception does; it does not mark the device lost. PyTorch's
    advice after every CUDA error mentions "device-side assertions", which made every CUDA error
    count as sticky."""
    bad_index = torch.cuda.device_count() + 3
    x = torch.ones(4, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        bad = rt.submit(torch.cuda.set_device, bad_index)
        error = bad.exception(timeout=60)
        assert error is not None and not isinstance(error, sd.DeviceLost), error
        assert "device-side assert" in str(error)  # the advice that must not count
        assert rt.backend.lost is None
        assert torch.equal(rt.submit(torch.add, x, 1, reads=[x]).result(), x + 1)
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()  # which reports the failed op


def test_sticky_error_marks_the_device_lost_and_nothing_hangs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", DEVICE_LOST], env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout
    assert "finished" in out, proc.stdout + proc.stderr[-3000:]
    assert "later: DeviceLost" in out


def test_compiled_models_match_eager_on_cuda_and_replay_without_waiting():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torchvision = pytest.importorskip("torchvision")
    models = [
        (torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False), 224),
        (torch.nn.TransformerEncoderLayer(256, 8, 512, batch_first=True), None),
    ]
    for model, size in models:
        model = model.eval().cuda()
        fast = sd.compile(model)
        with torch.inference_mode():
            outs = []
            for _ in range(5):
                x = (torch.randn(1, 3, size, size, device="cuda") if size
                     else torch.randn(2, 16, 256, device="cuda"))
                outs.append((fast(x), model(x)))
            for got, want in outs:  # earlier outputs were not overwritten by later replays
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert fast.statistics().replays >= 3
        fast.close()


def test_profiling_on_cuda_with_nvtx_times_every_op_on_its_stream():
    x = torch.randn(256, 256, device="cuda")
    outs = [torch.empty_like(x) for _ in range(4)]
    with sd.Runtime("cuda", streams=4) as rt, rt.profile(nvtx=True) as prof:
        for o in outs:
            rt.submit(torch.matmul, x, x, out=o, reads=[x], writes=[o], name="mm")
        rt.to_host(outs[0])
    tl = prof.timeline
    assert len(tl) == 5
    assert {s.kind for s in tl.spans} == {"compute", "d2h"}
    assert all(s.end >= s.start >= 0 for s in tl.spans)
    copy = next(s for s in tl.spans if s.kind == "d2h")
    first = min((s for s in tl.spans if s.kind == "compute"), key=lambda s: s.seq)
    assert copy.start >= first.end - 1e-3  # the copy of outs[0] waited for its matmul
    trace = tl.to_chrome_trace()
    assert any(e["ph"] == "s" for e in trace["traceEvents"])


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


def test_explain_shows_the_cost_model_and_the_measured_choice():
    x = torch.randn(64, 64, device="cuda")
    outs = [torch.empty_like(x) for _ in range(8)]
    with sd.Runtime("cuda", streams=8) as rt:
        with rt.record() as g:
            for o in outs:
                rt.submit(torch.matmul, x, x, out=o, reads=[x], writes=[o])
        for _ in range(3):
            g.run().result()
        text = g.explain()
    assert "cost model estimate" in text and "chosen by measured replay" in text
    assert g.statistics().estimate_ms


def test_replays_launched_back_to_back_do_not_overlap_on_shared_buffers():
    """Fifty replays without waiting: each one accumulates into y, so any overlap would lose updates."""
    x = torch.randn(1 << 16, device="cuda")
    y = torch.zeros_like(x)
    with sd.Runtime("cuda", streams=4) as rt:
        with rt.record() as g:
            rt.submit(lambda: y.add_(x), reads=[x], writes=[y], name="accumulate")
            rt.submit(lambda: torch.cuda._sleep(20_000), name="slow_tail")
        futures = [g.run() for _ in range(50)]
        for f in futures:
            f.result()
        rt.synchronize()
        assert g.statistics().replays >= 48
    torch.testing.assert_close(y, 50 * x, rtol=1e-5, atol=1e-4)


def test_compiled_wide_graph_batches_on_cuda_and_matches_eager():
    torch.backends.cuda.matmul.allow_tf32 = False
    ws = [[torch.randn(64, 64, device="cuda") / 8 for _ in range(3)] for _ in range(8)]
    x = torch.randn(16, 64, device="cuda")

    wide = wide_fn(ws)

    fast = sd.compile(wide, engine="aten")
    with torch.no_grad():
        results = [(fast(x), wide(x)) for _ in range(24)]
        ws[3][1].mul_(0.5)  # a stacked weight changed in place: seen by the next call
        results.append((fast(x), wide(x)))
    for got, want in results:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    spec = next(iter(fast._entries.values()))
    assert len(spec.variants) in (2, 3) and spec.chosen is not None and spec.choice_ms
    # every group was estimated from measured op times, and explain() says so
    assert len(spec.group_estimates) == len(spec.variants[1].batch_report.groups)
    assert "cost model, per batched group" in fast.explain()
    fast.close()


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


def test_an_op_waiting_on_a_future_while_a_done_callback_submits_does_not_hang():
    """On CUDA an op's function runs inside its submit, holding the runtime's lock. If it waits on
    a future, and the completion thread meanwhile runs a done-callback that submits (and so needs
    that lock), the awaited op must still be finished."""
    a, b, c = (torch.zeros(8, device="cuda") for _ in range(3))
    with sd.Runtime("cuda", streams=2) as rt:
        rt.submit(lambda: (torch.cuda._sleep(1), a.add_(0), b.add_(0)), writes=[a, b]).result()  # loaded
        follow_ups = []
        x = rt.submit(lambda: (torch.cuda._sleep(200_000_000), a.add_(1)), writes=[a], name="x")  # ~0.1 s
        x.add_done_callback(lambda _f: follow_ups.append(rt.submit(b.add_, 1, writes=[b])))
        # on the other stream, done after x: its finish comes after x's callback has begun
        y = rt.submit(lambda: (torch.cuda._sleep(600_000_000), c.add_(1)), writes=[c], name="y")
        z = rt.submit(lambda: y.result(timeout=20) is not None, name="z")  # waits inside its submit
        assert z.result(timeout=30) is True
        rt.synchronize()
    assert a.tolist() == b.tolist() == c.tolist() == [1.0] * 8 and len(follow_ups) == 1


def test_a_done_callback_raising_system_exit_leaves_the_completion_thread_working(caplog):
    """The completion thread runs done-callbacks; one that raises what is no ``Exception`` must
    not end it, or every later op of the device that nobody helps finish would never finish."""
    a = torch.zeros(8, device="cuda")
    with sd.Runtime("cuda", streams=2) as rt:
        called = threading.Event()

        def exits(_f):
            called.set()
            raise SystemExit(4)

        rt.submit(lambda: (torch.cuda._sleep(20_000_000), a.add_(1)), writes=[a]).add_done_callback(exits)
        assert called.wait(10)
        slow = rt.submit(lambda: (torch.cuda._sleep(50_000_000), a.add_(1)), writes=[a])
        done, _ = concurrent.futures.wait([slow], timeout=10)  # only the completion thread finishes it
        assert slow in done and slow.exception() is None
    assert a.tolist() == [2.0] * 8
    assert any(r.exc_info and r.exc_info[0] is SystemExit for r in caplog.records)


@pytest.mark.skipif(os.environ.get("STREAMDAG_NATIVE") == "0",
                    reason="STREAMDAG_NATIVE=0 chooses the Python code")
def test_the_torch_extension_builds_here_and_reads_tensors_as_the_python_code():
    """On a GPU machine with a compiler the CUDA calls are made in C++ (native/_torch.cpp); its
    reads of tensors must equal the Python code's, for every layout and device."""
    from streamdag import native
    from streamdag.graph import buffers
    from streamdag.runtime import accel

    assert native.load_torch() is not None, native.torch_status()
    base = torch.arange(64, dtype=torch.float32, device="cuda")
    tensors = [base, base[8:24], base.view(8, 8).t(), base[::2], torch.zeros(0, device="cuda"),
               torch.nn.Parameter(torch.ones(4, device="cuda")), torch.ones(3, 4), torch.ones(3, 4)[:, 1],
               base.to(torch.bfloat16), torch.zeros(4, device="cuda").to_sparse()]
    for t in tensors:
        try:
            want = buffers._py_accesses([t], [t])
        except Exception as exc:
            with pytest.raises(type(exc)):
                accel.compiled_accesses([t], [t])
            continue
        assert accel.compiled_accesses([t], [t]) == want, t


def device_streams(rt):
    """The runtime's CUDA streams (its host lanes come after them)."""
    return [s for s, member in zip(rt._streams, rt._member) if member is rt.backend]


def test_a_runtime_has_cuda_streams_of_its_own_not_from_pytorchs_pool():
    """PyTorch hands out its streams from a pool of 32 per device: made from it, three runtimes'
    streams (14 each) and the user's would share CUDA streams, and so queues. A runtime's are its
    own (made by the torch extension), none shared with another runtime's or PyTorch's pool, and
    a closed runtime's are reused by the next. Each runtime still computes right on them."""
    from streamdag import native

    if getattr(native.load_torch(), "new_stream", None) is None:
        pytest.skip("without the torch extension a runtime's streams come from PyTorch's pool")

    def addresses(rt):
        return [s.cuda_stream for s in [*device_streams(rt), rt.backend.peer_out,
                                        *rt.backend.staging_streams.values()]]

    runtimes = [sd.Runtime("cuda", streams=8) for _ in range(3)]
    try:
        pool = {torch.cuda.Stream().cuda_stream for _ in range(64)}
        ours = [a for rt in runtimes for a in addresses(rt)]
        assert len(ours) == 3 * 14 and len(set(ours)) == len(ours)
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


@pytest.mark.parametrize("path", ["C++ calls", "PyTorch's bindings", "submit in Python"])
def test_an_op_submitted_inside_the_callers_own_capture_fails_with_what_to_do(path):
    """A runtime's stream that waited on an event recorded in the caller's capture would join that
    capture: the op's kernels would be captured, not run, its completion event could never be
    queried, and the capture could not end (a stream not joined back). So the op fails at once,
    saying what to do, and neither the caller's capture nor the runtime is disturbed."""
    from streamdag import native
    from streamdag.runtime import core

    torch_ext = native.load_torch()
    if path == "PyTorch's bindings":
        if torch_ext is None:
            pytest.skip("the torch extension is not built: the other cases take the bindings")
        native.load().use_torch(None)
    saved = core.COMPILED_SUBMIT
    core.COMPILED_SUBMIT = path != "submit in Python"
    try:
        rt = sd.Runtime("cuda", streams=2)
    finally:
        core.COMPILED_SUBMIT = saved
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


def test_a_small_pageable_copy_in_behind_a_running_kernel_does_not_hold_the_submitter():
    """A pageable copy in of a few MiB whose destination a long kernel still reads returns at once:
    it is staged through the pool and its DMA waits for the reader on the GPU, where the CUDA
    driver's own copy from pageable memory would first wait in the submitting thread for
    everything queued on its stream (a 2 MiB copy the driver staged on an idle stream was slower
    than ours anyway: 0.27 against 0.20 ms on the H100). It lands exactly, after the reader read
    the old data, and so does the next one, on an idle copy stream."""
    n = 1 << 19  # 2 MiB of floats
    with sd.Runtime("cuda", streams=2) as rt:
        dev = torch.zeros(n, device="cuda")
        out = torch.full((n,), -1.0, device="cuda")
        src = torch.randn(n)  # pageable
        torch.cuda.synchronize()

        def slow_read(o, d):
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time, then the read
            o.copy_(d)

        reading = rt.submit(slow_read, out, dev, reads=[dev], writes=[out])
        copied = rt.copy(dev, src)  # waits on the GPU for the reader (write after read)
        assert not reading._fence.query()  # the submit returned while the reader still ran
        assert copied.result(timeout=60) is dev
        assert torch.equal(dev.cpu(), src)
        assert torch.equal(out.cpu(), torch.zeros(n))  # the reader saw the data from before the copy
        again = torch.randn(n)
        assert torch.equal(rt.copy(dev, again).result(timeout=60).cpu(), again)


@pytest.mark.parametrize("mib", [1, 8])
def test_a_small_pageable_copy_out_is_one_op_ordered_after_its_producer_and_before_its_readers(mib):
    """Where the torch extension loads, a pageable copy out of one chunk (up to 8 MiB) is one op on
    the copy stream (its DMA, then a host copy the stream runs, over several threads from 256 KiB):
    no host-lane op. It follows a slow producer, and a host-lane op that reads the copy's
    destination sees every byte."""
    from streamdag import native
    from streamdag.runtime import transfers

    if native.load_torch() is None:
        pytest.skip("the torch extension is not loaded here (STREAMDAG_NATIVE=0, or it did not build)")
    n = mib << 18  # floats
    assert n * 4 <= transfers.STREAM_UNSTAGING_BYTES
    with sd.Runtime("cuda", streams=2) as rt:
        dev = torch.zeros(n, device="cuda")
        back = torch.full((n,), -1.0)  # pageable
        torch.cuda.synchronize()

        def slow_fill(t):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time, then the write
            t.copy_(torch.arange(n, dtype=torch.float32, device="cuda"))

        with rt.profile() as prof:
            rt.submit(slow_fill, dev, writes=[dev], name="slow_fill")
            copied = rt.copy(back, dev)
            total = rt.submit(lambda: float(back.double().sum()), reads=[back], run_on="host", name="read")
            assert total.result(timeout=60) == float(n * (n - 1) // 2)
            assert copied.result(timeout=60) is back
        names = sorted(s.name for s in prof.timeline.spans)
        assert names == ["copy_d2h", "read", "slow_fill"], names
    assert torch.equal(back, torch.arange(n, dtype=torch.float32))
