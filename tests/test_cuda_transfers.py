"""Copies between the host and the GPU: pinned ones on the copy streams, pageable ones staged
(in chunks, or through a ring on a host lane), stream_map's pieces, all exact, ordered with the
ops around them and bounded in bytes in flight. Marked ``cuda``: skipped without a GPU."""

import random
import time
import warnings

import pytest

import streamdag as sd
from internals import copies_compiled, copy_pinned

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.cuda


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
            ours = [str(w.message) for w in warned if issubclass(w.category, sd.StreamdagWarning)]
            assert bool(ours) != pin, ours  # the pageable graph says why it runs op by op
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
        if not copies_compiled(rt):
            pytest.skip("no compiled hot path here")
        dev = torch.zeros(n, device="cuda")
        assert copy_pinned(rt, dev, torch.randn(n)) is None  # pageable: staged in Python
        assert copy_pinned(rt, dev, np.ones(n, np.float32)) is None
        assert copy_pinned(rt, dev, torch.ones(n, dtype=torch.float64).pin_memory()) is None
        assert copy_pinned(rt, torch.zeros(n).pin_memory(), torch.ones(n).pin_memory()) is None
        square = torch.ones(32, 32).pin_memory()  # the same bytes, another shape: refused by Python
        for dst, src in ((dev, square), (square, dev)):
            assert copy_pinned(rt, dst, src) is None
            with pytest.raises(ValueError, match="one dtype and shape"):
                rt.copy(dst, src)
        # memory pinned without PyTorch's allocator (page-locked in place) is pinned memory too
        registered = torch.randn(n)
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(registered.data_ptr(), n * 4, 0)) == 0
        try:
            assert registered.is_pinned()
            into = copy_pinned(rt, dev, registered)
            assert into is not None and into.result() is dev and torch.equal(dev.cpu(), registered)
        finally:
            rt.synchronize()
            assert int(cudart.cudaHostUnregister(registered.data_ptr())) == 0
        hosts = [torch.randn(n).pin_memory() for _ in range(copies)]
        backs = [torch.zeros(n).pin_memory() for _ in range(copies)]
        busy = rt.submit(torch.cuda._sleep, 100_000_000, name="busy", writes=[dev])  # tens of ms
        pairs = []
        for host, back in zip(hosts, backs):  # each in after the last out (it overwrites what that reads)
            into = copy_pinned(rt, dev, host)
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
        if not copies_compiled(rt):
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


def test_a_small_pageable_copy_in_behind_a_running_kernel_does_not_hold_the_submitter():
    """A pageable copy in of a few MiB whose destination a long kernel still reads returns at once:
    it is staged through the pool and its DMA waits for the reader on the GPU, where the CUDA
    driver's own copy from pageable memory would first wait in the submitting thread for
    everything queued on its stream (a 2 MiB copy the driver stages on an idle stream is slower
    than ours anyway: 0.27 against 0.20 ms). It lands exactly, after the reader read
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
