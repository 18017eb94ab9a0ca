"""Ops on CUDA streams: ordered as the program says (with each other and with the caller's own
stream work), finished and waited for by whichever thread gets there first, never racing
(PyTorch's stream sanitizer). Marked ``cuda``: skipped without a GPU."""

import os
import random
import textwrap
import threading

import pytest

import streamdag as sd
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
