"""Host lanes beside the GPU: a host op, a copy into pageable memory or a graph run after a long
kernel or a pending host op returns at once; large pageable copies go through the rings on the
lanes exactly; random programs of device and host-lane ops equal serial execution. Each test is
marked ``cuda``: skipped without a GPU. (Timing: see ``test_host_lanes.py``.)"""

import threading
import time

import numpy as np
import pytest

import streamdag as sd


@pytest.mark.cuda
def test_on_the_gpu_a_host_op_after_a_long_kernel_returns_at_once():
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        dev = torch.zeros(1 << 20, device="cuda")
        host = torch.empty(1 << 20).pin_memory()
        rt.submit(lambda: (torch.cuda._sleep(2_000_000_000), dev.fill_(3)), writes=[dev])  # ~1 s
        rt.copy(host, dev)
        started = time.perf_counter()
        total = rt.submit(lambda: float(host.sum()), reads=[host], run_on="host")
        # the device op reading what the host op wrote: waits for it, then runs on the GPU
        out = torch.empty(4, device="cuda")
        scratch = np.zeros(4, dtype=np.float32)
        rt.submit(lambda: scratch.fill(host[0].item()), reads=[host], writes=[scratch], run_on="host")
        submitted = time.perf_counter() - started
        assert submitted < 0.5, submitted  # neither submit waited for the kernel (see the module's note)
        assert not total.done()
        assert total.result(timeout=30) == 3.0 * (1 << 20)
        back = rt.submit(lambda: out.copy_(torch.from_numpy(scratch)), reads=[scratch], writes=[out])
        back.result(timeout=30)
        assert out.tolist() == [3.0] * 4


@pytest.mark.cuda
def test_on_the_gpu_a_copy_into_pageable_memory_returns_at_once():
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        dev = torch.zeros(1 << 22, device="cuda")
        pageable = torch.empty(1 << 22)
        rt.submit(lambda: (torch.cuda._sleep(2_000_000_000), dev.fill_(7)), writes=[dev])
        started = time.perf_counter()
        f = rt.copy(pageable, dev)
        assert time.perf_counter() - started < 0.5
        assert not f.done()
        f.result(timeout=30)
        assert bool((pageable == 7).all())


@pytest.mark.cuda
@pytest.mark.parametrize("callers_stream", ["default", "own"])
def test_on_the_gpu_a_held_op_follows_its_submitters_stream(callers_stream):
    """A held op launches later, from another thread; it still runs after the work its submitter
    enqueued on its current stream before the submit: on the default stream CUDA orders the
    runtime's blocking streams after it, on a stream of the caller's own an event marks it."""
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        made = torch.zeros(1 << 20, device="cuda")
        scale = torch.zeros(1, pin_memory=True)
        out = torch.empty_like(made)
        gate = threading.Event()
        rt.submit(lambda: (gate.wait(10), scale.fill_(3)), writes=[scale], run_on="host")
        side = torch.cuda.Stream() if callers_stream == "own" else torch.cuda.default_stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # ~1 s: the gate opens long before this ends
            made.fill_(2)  # not declared to the runtime: ordered by the caller's stream alone
            started = time.perf_counter()
            f = rt.submit(lambda: torch.mul(made, scale.item(), out=out), reads=[scale], writes=[out])
            assert time.perf_counter() - started < 0.5
        assert not f.done()
        gate.set()
        assert f.result(timeout=30) is out
        torch.cuda.synchronize()
        assert bool((out == 6).all())


@pytest.mark.cuda
def test_on_the_gpu_a_copy_of_what_a_host_op_writes_is_held_and_returns_at_once():
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        host = torch.zeros(1 << 20, pin_memory=True)
        gate = threading.Event()
        rt.submit(lambda: (gate.wait(10), host.fill_(4)), writes=[host], run_on="host")
        dev = torch.empty(1 << 20, device="cuda")
        started = time.perf_counter()
        copied = rt.copy(dev, host)
        doubled = rt.submit(torch.mul, dev, 2, reads=[dev])  # after the held copy: held too
        assert time.perf_counter() - started < 0.5 and not copied.done()
        gate.set()
        assert bool((doubled.result(timeout=30) == 8).all())


@pytest.mark.cuda
def test_on_the_gpu_a_graph_run_after_a_host_op_is_held_eager_and_captured():
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        host = torch.zeros(1 << 16, pin_memory=True)
        dev = torch.empty(1 << 16, device="cuda")
        out = torch.empty_like(dev)
        with rt.record() as g:
            rt.copy(dev, host)
            rt.submit(torch.mul, dev, 2, out=out, reads=[dev], writes=[out])
        for run in range(3):  # the first run op by op, the later ones replay a CUDA graph
            gate = threading.Event()
            rt.submit(lambda gate=gate, value=run + 1: (gate.wait(10), host.fill_(value)), writes=[host],
                      run_on="host")
            started = time.perf_counter()
            result = g.run()
            assert time.perf_counter() - started < 0.5 or run == 1  # (run 1 captures the graph first)
            assert not result.done()
            gate.set()
            result.result(timeout=30)
            assert bool((out == 2 * (run + 1)).all()), run
        assert g.captured and g.last_run_captured


@pytest.mark.cuda
def test_on_the_gpu_a_pageable_copy_of_what_a_host_op_writes_is_staged_on_a_lane_and_returns_at_once():
    import torch

    from streamdag.runtime.transfers import CHUNK_BYTES

    n = CHUNK_BYTES // 4 * 2 + 100  # three chunks of float32
    expected = torch.arange(n, dtype=torch.float32)
    with sd.Runtime("cuda", streams=2) as rt:
        src = torch.zeros(n)  # pageable
        dev = torch.empty(n, device="cuda")
        gate = threading.Event()
        rt.submit(lambda: (gate.wait(10), src.copy_(expected)), writes=[src], run_on="host")
        started = time.perf_counter()
        copied = rt.copy(dev, src)
        doubled = rt.submit(torch.mul, dev, 2, reads=[dev])
        assert time.perf_counter() - started < 0.5 and not copied.done()
        gate.set()
        assert copied.result(timeout=30) is dev
        assert torch.equal(doubled.result(timeout=30).cpu(), expected * 2)
        rt.synchronize()
        assert all(not ring.lock.locked() for ring in rt._rings.values()) and rt._rings


@pytest.mark.cuda
def test_on_the_gpu_large_pageable_copies_go_through_the_ring_exactly_and_return_at_once():
    """Copies of more chunks than the ring has buffers, both ways, with a ragged end: each buffer is
    refilled only once its DMA is done, and unstaged only once it has arrived. Both submits return
    while a host op that writes the source is held up."""
    import torch

    from streamdag.runtime import transfers

    n = transfers.CHUNK_BYTES // 4 * (transfers.RING_DEPTH + 2) + 777
    expected = torch.randn(n)
    with sd.Runtime("cuda", streams=2) as rt:
        src, back = torch.zeros(n), torch.full((n,), -1.0)  # pageable
        dev = torch.zeros(n, device="cuda")
        gate = threading.Event()
        rt.submit(lambda: (gate.wait(10), src.copy_(expected)), writes=[src], run_on="host")
        started = time.perf_counter()
        copied_in = rt.copy(dev, src)
        doubled = rt.submit(dev.mul_, 2, writes=[dev])
        copied_out = rt.copy(back, dev)
        assert time.perf_counter() - started < 0.5 and not copied_in.done() and not copied_out.done()
        gate.set()
        assert copied_out.result(timeout=30) is back
        assert copied_in.result(timeout=30) is dev and doubled.done()
        assert torch.equal(back, expected * 2)


@pytest.mark.cuda
def test_on_the_gpu_a_burst_of_large_pageable_copies_one_way_queues_on_one_lane():
    """Copies through one staging ring queue on the lane of its newest pending copy, so a copy the
    other way takes another lane and runs meanwhile, instead of a second lane waiting there for the
    ring while the copy the other way waits for a lane."""
    import torch

    from streamdag.runtime import transfers

    n = transfers.CHUNK_BYTES // 4 * 4  # a few ms each
    with sd.Runtime("cuda", streams=2, host_lanes=2) as rt:
        srcs = [torch.randn(n) for _ in range(3)]
        devs = [torch.empty(n, device="cuda") for _ in range(3)]
        out_dev, back = torch.randn(n, device="cuda"), torch.empty(n)
        torch.cuda.synchronize()
        with rt.profile() as prof:
            ins = [rt.copy(d, s) for d, s in zip(devs, srcs)]
            out = rt.copy(back, out_dev)
            for f in [*ins, out]:
                f.result(timeout=60)
        spans = {s.seq: s for s in prof.timeline.spans}
        h2d = sorted((s for s in spans.values() if s.name == "copy_h2d"), key=lambda s: s.seq)
        (d2h,) = [s for s in spans.values() if s.name == "copy_d2h"]
        assert len(h2d) == 3 and len({s.stream for s in h2d}) == 1, h2d
        assert d2h.stream != h2d[0].stream and d2h.start < h2d[-1].start, (d2h, h2d)
    assert all(torch.equal(d.cpu(), s) for d, s in zip(devs, srcs)) and torch.equal(back, out_dev.cpu())


@pytest.mark.cuda
def test_on_the_gpu_pageable_copies_from_many_threads_share_the_rings_exactly():
    """Threads round-trip their own data through one runtime at once, large copies (the rings, one
    copy at a time each) and small ones (the pool) mixed: every byte comes back."""
    import torch

    from streamdag.runtime import transfers

    sizes = [transfers.CHUNK_BYTES // 4 * 2 + 5, 1000, transfers.LANE_STAGING_BYTES // 4 + 1, 77]
    failures: list[BaseException] = []
    with sd.Runtime("cuda", streams=2) as rt:
        def round_trips(seed: int) -> None:
            try:
                g = torch.Generator().manual_seed(seed)
                for k in range(6):
                    x = torch.randn(sizes[(seed + k) % len(sizes)], generator=g)
                    dev = rt.to_device(x).result(timeout=60)
                    back = torch.empty_like(x)
                    assert rt.copy(back, dev).result(timeout=60) is back
                    assert torch.equal(back, x), (seed, k)
            except BaseException as exc:  # (re-raised in the test's thread)
                failures.append(exc)

        threads = [threading.Thread(target=round_trips, args=(seed,)) for seed in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not failures, failures[0]


@pytest.mark.cuda
def test_on_the_gpu_a_large_pageable_copy_of_a_strided_view_is_refused_at_submit():
    import torch

    with sd.Runtime("cuda") as rt:
        src = torch.zeros(1024, 1024)
        with pytest.raises(ValueError, match="contiguous"):
            rt.copy(torch.empty(1024, 512, device="cuda"), src[:, ::2])


@pytest.mark.cuda
def test_on_the_gpu_a_recorded_graph_with_a_host_op_replays_its_device_parts_and_returns_at_once():
    """A graph holding a host-lane op runs in parts: the device ops before it and those after it
    are CUDA graphs of their own from the second run (which captures them), the host op runs on a
    lane after the kernel it reads, the part after it is held; ``g.run()`` returns while the GPU
    still sleeps; ``explain()`` says how it runs."""
    import torch

    x = torch.ones(1024, device="cuda")
    d, e = torch.empty_like(x), torch.empty_like(x)
    h = torch.zeros(1024, pin_memory=True)
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda: (torch.cuda._sleep(2_000_000_000), torch.mul(x, 2, out=d)), reads=[x],
                      writes=[d])
            rt.submit(lambda: h.copy_(d.cpu() + 1), reads=[d], writes=[h], run_on="host")
            rt.submit(lambda: e.copy_(h, non_blocking=True), reads=[h], writes=[e])
        for run in range(4):
            x.fill_(run + 1)  # on the caller's stream: the graph's first op follows it
            started = time.perf_counter()
            result = g.run()
            if run != 1:  # (the second run captures, after a synchronize)
                assert time.perf_counter() - started < 0.5 and not result.done()
            result.result(timeout=30)
            assert g.last_run_captured == (run >= 1)
            assert bool((e == 2 * (run + 1) + 1).all())
        assert "host lane" in g.explain()


@pytest.mark.cuda
def test_on_the_gpu_parts_that_cannot_be_captured_warn_once_for_their_graph():
    """Each device part of a graph with a host-lane op copies from pageable memory, which a CUDA
    graph cannot hold: both parts run eagerly, the graph warns once (not once per part), and
    ``explain()`` counts them."""
    import warnings

    import torch

    x = torch.zeros(1024, device="cuda")
    y = torch.zeros_like(x)
    first_in, second_in = torch.ones(1024), torch.full((1024,), 2.0)  # pageable
    h = torch.zeros(1024, pin_memory=True)
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda: x.copy_(first_in), reads=[first_in], writes=[x])
            rt.submit(lambda: h.copy_(x.cpu()), reads=[x], writes=[h], run_on="host")
            rt.submit(lambda: y.copy_(second_in).add_(h.to("cuda")), reads=[second_in, h], writes=[y])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                g.run().result(timeout=30)
        fallbacks = [str(w.message) for w in caught if "without a CUDA graph" in str(w.message)]
        assert len(fallbacks) == 1 and "a part of this graph's device ops" in fallbacks[0], fallbacks
        assert "device parts run eagerly: 2 of 2" in g.explain()
        assert bool((y == 3).all())


@pytest.mark.cuda
def test_on_the_gpu_a_captured_part_waits_only_for_the_host_lane_ops_its_ops_follow():
    """Two host-lane ops side by side, each followed by a device op: replayed as CUDA graphs, the
    part after the quick one runs while the other is still held up (one part for both would be
    one op that waits for both)."""
    import torch

    slow_in, quick_in = torch.zeros(1024, pin_memory=True), torch.zeros(1024, pin_memory=True)
    slow_out, quick_out, both = (torch.zeros(1024, device="cuda") for _ in range(3))
    gate = threading.Event()
    with sd.Runtime("cuda", streams=2) as rt:
        with rt.record() as g:
            rt.submit(lambda: (gate.wait(30), slow_in.fill_(1)), writes=[slow_in], run_on="host", name="slow")
            rt.submit(lambda: quick_in.fill_(2), writes=[quick_in], run_on="host", name="quick")
            rt.submit(lambda: torch.add(slow_in.to("cuda", non_blocking=True), 10, out=slow_out),
                      reads=[slow_in], writes=[slow_out])
            rt.submit(lambda: torch.add(quick_in.to("cuda", non_blocking=True), 10, out=quick_out),
                      reads=[quick_in], writes=[quick_out])
            rt.submit(torch.add, slow_out, quick_out, out=both, reads=[slow_out, quick_out], writes=[both])
        for run in range(3):  # eager, captured, replayed
            gate.clear()
            quick_out.zero_()  # on the caller's stream: before the graph's ops
            result = g.run()
            deadline = time.monotonic() + 10
            while float(quick_out[0]) != 12.0 and time.monotonic() < deadline:  # the GPU's work, read
                time.sleep(0.001)
            assert float(quick_out[0]) == 12.0 and not result.done(), run
            gate.set()
            result.result(timeout=30)
            assert bool((both == 23).all())
        assert g.last_run_captured


@pytest.mark.cuda
@pytest.mark.parametrize("seed", range(6))
def test_on_the_gpu_random_programs_of_device_and_host_lane_ops_equal_serial(seed):
    """Random programs over device buffers and host buffers: device ops that read host memory and
    host-lane ops that read device memory (after the kernels writing it) and write host memory,
    which later device ops read (held until they have finished), some recorded as a graph and run
    twice. Some host-lane ops nap first, so that later submits (the graph's second run, which
    captures it) come while they are still pending. The buffers must end as the same program run
    serially on the CPU leaves them."""
    import random

    import torch

    rng = random.Random(seed)
    n = 64

    def program(length):
        ops = []
        for _ in range(length):
            host = rng.random() < 0.35
            ops.append({"host": host, "dev": rng.randrange(3), "src": rng.randrange(2),
                        "out": rng.randrange(2) if host else rng.randrange(3),
                        "k": rng.randrange(1, 50), "lo": rng.randrange(n // 2),
                        "hi": rng.randrange(n // 2, n) + 1, "nap": host and rng.random() < 0.3})
        return ops

    def run(op, dev, hosts, device):
        lo, hi = op["lo"], op["hi"]
        if op["host"]:  # host code: reads a device buffer where it is, writes a host buffer
            if op["nap"] and device != "cpu":
                time.sleep(0.002)
            seen = dev[op["dev"]][lo:hi].cpu().numpy()
            out = hosts[op["out"]][lo:hi]
            out[:] = (out * 7 + seen + hosts[op["src"]][lo:hi] + op["k"]) % 1000003
        else:  # device code: reads a host buffer (copied in) and a device buffer
            src = torch.as_tensor(hosts[op["src"]][lo:hi], device=device)
            out = dev[op["out"]][lo:hi]
            extra = dev[op["dev"]][lo:hi].sum() % 1009 + op["k"]
            out.mul_(3).add_(src).add_(extra).remainder_(1000003)

    def make(device):
        dev = [torch.arange(n, dtype=torch.int64, device=device) * (i + 2) for i in range(3)]
        hosts = [np.arange(n, dtype=np.int64) * (i + 5) for i in range(2)]
        return dev, hosts

    def submit(rt, op, dev, hosts):
        lo, hi = op["lo"], op["hi"]
        reads = [dev[op["dev"]][lo:hi], hosts[op["src"]][lo:hi]]
        if op["host"]:
            return rt.submit(run, op, dev, hosts, "cuda", reads=reads, writes=[hosts[op["out"]][lo:hi]],
                             run_on="host")
        return rt.submit(run, op, dev, hosts, "cuda", reads=reads, writes=[dev[op["out"]][lo:hi]])

    eager, graph_ops, after = program(30), program(8), program(10)
    want_dev, want_hosts = make("cpu")
    for op in eager + graph_ops + graph_ops + after:
        run(op, want_dev, want_hosts, "cpu")
    dev, hosts = make("cuda")
    with sd.Runtime("cuda", streams=3, max_inflight=16) as rt:
        with rt.record() as g:
            for op in graph_ops:
                submit(rt, op, dev, hosts)
        for op in eager:
            submit(rt, op, dev, hosts)
        runs = [g.run(), g.run()]
        for op in after:
            submit(rt, op, dev, hosts)
        rt.synchronize()
        for r in runs:
            r.result(timeout=30)
    for got, want in zip(dev, want_dev):
        assert torch.equal(got.cpu(), want)
    for got, want in zip(hosts, want_hosts):
        np.testing.assert_array_equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("host_part", [False, True])
def test_on_the_gpu_a_graphs_capture_waits_for_an_earlier_host_op_reading_what_it_writes(host_part):
    """A graph's second run captures it, timing candidate graphs by running its ops, which write
    its buffers before putting them back. A host-lane op submitted before that run, and reading a
    buffer the graph writes, must never see those writes: it reads the buffer over and over while
    the run is being set up. (``host_part``: the graph has a host-lane op, so its device ops are
    captured as parts.)"""
    import torch

    with sd.Runtime("cuda", streams=2) as rt:
        a = torch.zeros(1 << 16, device="cuda")
        b = torch.zeros(1 << 16, device="cuda")
        tail = np.zeros(1)
        with rt.record() as g:  # two independent ops: a capture times one stream against two
            rt.submit(lambda: a.add_(1), writes=[a])
            rt.submit(lambda: b.add_(1), writes=[b])
            if host_part:
                rt.submit(lambda: tail.__iadd__(1), writes=[tail], run_on="host")
        g.run().result(timeout=30)
        changes = []

        def watch():
            first = a.cpu()
            stop = time.perf_counter() + 0.5
            while time.perf_counter() < stop:
                if not torch.equal(a.cpu(), first):
                    changes.append(float(a[0]))
            return float(first[0])

        seen = rt.submit(watch, reads=[a], run_on="host")
        run = g.run()
        assert seen.result(timeout=30) == 1.0
        run.result(timeout=30)
        rt.synchronize()
    assert not changes, f"an earlier host op saw the graph's writes while it was captured: {changes[:5]}"
    assert float(a[0]) == 2.0 and float(b[0]) == 2.0
    assert tail[0] == (2.0 if host_part else 0.0)
