"""Several GPUs: placement, peer copies, recorded graphs and tensor-parallel chains on real devices.

Marked ``cuda``; skipped without two GPUs, and the tests of 4 or 8 GPUs without that many (each
says how many it needs and how many are visible).
"""

import textwrap

import pytest

import streamdag as sd
from programs import submitted_or_recorded
from sanitizer import reports_race

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two NVIDIA GPUs"),
]
DEVICES = ["cuda:0", "cuda:1"]


def test_ops_follow_their_data_and_remote_reads_get_peer_copies():
    a = torch.randn(256, 256, device="cuda:0")
    b = torch.randn(256, 256, device="cuda:1")
    out = torch.empty(256, 256, device="cuda:1")
    torch.cuda.set_device(0)
    with sd.Runtime(devices=DEVICES, streams=2) as rt, rt.profile() as prof:
        rt.submit(lambda: a.mul_(2), writes=[a], name="scale_a")
        f = rt.submit(torch.mm, a, b, out=out, reads=[a, b], writes=[out], name="mm_on_1")
        f.result()
        assert torch.cuda.current_device() == 0  # launching on cuda:1 left the caller's device alone
    by_name = {s.name: s for s in prof.timeline.spans}
    assert by_name["scale_a"].device == "cuda:0" and by_name["mm_on_1"].device == "cuda:1"
    copy = next(s for s in prof.timeline.spans if s.name.startswith("peer_copy"))
    assert copy.device == "cuda:1" and copy.kind == "p2p"
    torch.testing.assert_close(out, (a @ b.to("cuda:0")).to("cuda:1"))


@pytest.mark.parametrize("runtime_device", ["cuda:0", "cuda:1"])
def test_an_op_that_switches_devices_leaves_the_callers_device_as_it_was(runtime_device):
    """The submit puts back the caller's device whatever the op did: here it switches to the other
    GPU and launches there, on that device's current stream."""
    other = 1 - int(runtime_device[-1])
    x = torch.zeros(16, device=f"cuda:{other}")
    with sd.Runtime(runtime_device, streams=2) as rt:
        for caller in (0, 1):
            torch.cuda.set_device(caller)
            # (x is not the runtime's device's memory: no access declared, synchronized below)
            f = rt.submit(lambda: (torch.cuda.set_device(other), x.add_(1)))
            assert torch.cuda.current_device() == caller
            f.result()
            torch.cuda.synchronize(other)
            assert torch.cuda.current_device() == caller
    assert x.tolist() == [2.0] * 16
    torch.cuda.set_device(0)


def test_large_pageable_copies_to_and_from_each_gpu_go_through_its_own_ring_exactly():
    """Each device has its staging rings and streams: large pageable copies to both GPUs and back,
    submitted at once from the caller's device 0, round-trip every byte on the right device."""
    from streamdag.runtime import transfers

    n = transfers.CHUNK_BYTES // 4 * (transfers.RING_DEPTH + 1) + 333
    hosts = [torch.randn(n) for _ in DEVICES]
    backs = [torch.empty(n) for _ in DEVICES]
    devs = [torch.empty(n, device=d) for d in DEVICES]
    torch.cuda.set_device(0)
    with sd.Runtime(devices=DEVICES, streams=2) as rt:
        outs = []
        for host, dev, back in zip(hosts, devs, backs):
            rt.copy(dev, host)
            rt.submit(dev.mul_, 2, writes=[dev])
            outs.append(rt.copy(back, dev))
        assert all(f.result(timeout=60) is back for f, back in zip(outs, backs))
        assert {key[1] for key in rt._rings} == {torch.device(d) for d in DEVICES}
        assert torch.cuda.current_device() == 0
    for host, back in zip(hosts, backs):
        assert torch.equal(back, host * 2)


def test_many_peer_copies_in_flight_round_trip_exactly():
    srcs = [torch.randint(0, 1 << 30, (1 << 18,), device="cuda:0") for _ in range(32)]
    with sd.Runtime(devices=DEVICES, max_inflight=1000) as rt:
        there = [torch.empty_like(s, device="cuda:1") for s in srcs]
        back = [torch.empty_like(s) for s in srcs]
        for t, s in zip(there, srcs):
            rt.copy(t, s)
        for b, t in zip(back, there):
            rt.copy(b, t)
        del there  # the runtime keeps them alive until the copies complete
    for b, s in zip(back, srcs):
        assert torch.equal(b, s)


def submit_program(rt, prog, bufs, body):
    for w, rs in prog:
        ins = [bufs[r] for r in rs]
        rt.submit(body, bufs[w], *ins, reads=ins, writes=[bufs[w]])


@pytest.mark.parametrize("record", [False, True])
def test_random_cross_device_programs_equal_one_device(record):
    import random

    rng = random.Random(7 + record)
    for _ in range(10):
        n = 6
        init = [torch.randn(64, 64, dtype=torch.float64) for _ in range(n)]
        prog = [(rng.randrange(n), [rng.randrange(n) for _ in range(rng.randint(1, 3))]) for _ in range(20)]
        ref = [t.clone().cuda(0) for t in init]
        for w, rs in prog:
            ref[w] = torch.tanh(ref[w] + sum(ref[r].sum() for r in rs) * 1e-3)
        bufs = [t.clone().to(DEVICES[i % 2]) for i, t in enumerate(init)]

        def body(out, *ins):
            out.copy_(torch.tanh(out + sum(x.sum() for x in ins) * 1e-3))

        with sd.Runtime(devices=DEVICES, streams=3) as rt:
            submitted_or_recorded(rt, record, submit_program, prog, bufs, body)
        for got, want in zip(bufs, ref):
            torch.testing.assert_close(got.to("cuda:0"), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("plan", "exchange"), [("split", "ksplit"), ("split", "gathered"),
                                               ("single", None), ("auto", None)])
def test_tensor_parallel_chain_equals_one_gpu(plan, exchange):
    from streamdag.parallel import LinearChain

    torch.manual_seed(0)
    weights = [torch.randn(512, 512, device="cuda:0", dtype=torch.float64) / 20 for _ in range(4)]
    x = torch.randn(64, 512, device="cuda:0", dtype=torch.float64)
    want = x
    for w in weights:
        want = torch.relu(want @ w)
    with sd.Runtime(devices=DEVICES, streams=2) as rt:
        chain = LinearChain(rt, weights, plan=plan, exchange=exchange, row_chunks=2 if exchange else None)
        for _ in range(3):
            got = chain(x)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        blocks = chain.input_blocks(x)
        for b in blocks:
            b.value.copy_(x[:, b.start:b.stop])
        torch.testing.assert_close(chain(blocks), want, rtol=1e-10, atol=1e-10)
        assert chain.explain()
        graphs = [g for g, _, _ in chain._graphs.values()]
        if plan == "split":  # one CUDA graph over both GPUs, replayed on the caller's stream
            assert graphs[0].captured and graphs[0].capture_fallback is None
            assert graphs[0].statistics().replays >= 1


SANITIZED = textwrap.dedent(
    """
    import torch, streamdag as sd
    from streamdag.parallel import LinearChain
    ws = [torch.randn(256, 256, device="cuda:0") / 16 for _ in range(3)]
    side0, side1 = torch.cuda.Stream(0), torch.cuda.Stream(1)
    side0.wait_stream(torch.cuda.current_stream(0))  # the weights were made on the default stream
    side1.wait_stream(torch.cuda.current_stream(1))
    with torch.cuda.stream(side0), torch.cuda.device(1), torch.cuda.stream(side1), torch.cuda.device(0):
        with sd.Runtime(devices=["cuda:0", "cuda:1"], streams=2) as rt:
            a = torch.randn(1 << 20, device="cuda:0")
            b = torch.empty(1 << 20, device="cuda:1")
            # a slow producer on cuda:0, read on cuda:1 through a peer copy
            rt.submit(lambda: (torch.cuda._sleep(1_000_000_000), a.mul_(2)), writes=[a])
            rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])
            chain = LinearChain(rt, ws, plan="split", capture=False)  # host replays: every kernel seen
            for _ in range(2):
                chain.run(torch.randn(32, 256, device="cuda:0"))
    print("done")
    """
)


@pytest.mark.parametrize("drop_waits", [False, True])
def test_stream_sanitizer_on_two_gpus(drop_waits):
    raced, text = reports_race(SANITIZED, drop_waits)
    assert raced == drop_waits, text[:6000]


def test_pipeline_over_two_gpus_equals_one_gpu():
    from streamdag.parallel import pipeline

    torch.manual_seed(1)
    w0 = torch.randn(64, 64, device="cuda:0", dtype=torch.float64) / 8
    w1 = w0.to("cuda:1")
    stages = [(lambda h: torch.tanh(h @ w0), "cuda:0"), (lambda h: torch.tanh(h @ w1), "cuda:1")]
    batches = [torch.randn(16, 64, device="cuda:0", dtype=torch.float64) for _ in range(8)]
    with sd.Runtime(devices=DEVICES) as rt:
        outs = pipeline(rt, stages, batches, max_in_flight=2)
    for x, y in zip(batches, outs):
        assert y.device == torch.device("cuda:1")
        torch.testing.assert_close(y.to("cuda:0"), torch.tanh(torch.tanh(x @ w0) @ w0))


@pytest.mark.parametrize("waits_on", ["op", "graph"])
def test_an_op_waiting_on_another_gpu_while_its_done_callback_submits_does_not_hang(waits_on):
    """An op's function runs inside its submit, holding the runtime's lock. When it waits on work
    of the other GPU (an op, or a graph's run over both GPUs), and that GPU's completion thread
    meanwhile runs a done-callback that submits (and so needs the lock), the awaited work must
    still be finished: by the waiting thread itself."""
    a, b, c = (torch.zeros(8, device="cuda:1") for _ in range(3))
    d = torch.zeros(8, device="cuda:0")
    with sd.Runtime(devices=DEVICES, streams=2) as rt:
        if waits_on == "graph":
            with rt.record() as g:  # run over both GPUs as one op, finished on its last op's GPU
                rt.submit(d.add_, 1, writes=[d], name="on_0")
                rt.submit(lambda: (torch.cuda._sleep(600_000_000), c.add_(1)), writes=[c], name="y")
        rt.submit(lambda: (torch.cuda._sleep(1), a.add_(0), b.add_(0)), writes=[a, b]).result()  # loaded
        follow_ups = []
        x = rt.submit(lambda: (torch.cuda._sleep(200_000_000), a.add_(1)), writes=[a], name="x")  # ~0.1 s
        x.add_done_callback(lambda _f: follow_ups.append(rt.submit(b.add_, 1, writes=[b])))
        # done after x on cuda:1: its finish comes after x's callback has begun
        if waits_on == "graph":
            y = g.run()
        else:
            y = rt.submit(lambda: (torch.cuda._sleep(600_000_000), c.add_(1)), writes=[c], name="y")

        def wait_inside():
            y.result(timeout=20)
            return True

        z = rt.submit(wait_inside, run_on="cuda:0", name="z")
        assert z.result(timeout=30) is True
        rt.synchronize()
    assert a.tolist() == b.tolist() == c.tolist() == [1.0] * 8 and len(follow_ups) == 1
    assert d.tolist() == [float(waits_on == "graph")] * 8


def test_host_lanes_beside_two_gpus():
    """A host-lane op reads both GPUs' results after their ops, where they are; the device ops on
    each GPU that read what it writes are held behind it, then run on their own GPU."""
    import threading
    import time

    gate = threading.Event()
    with sd.Runtime(devices=DEVICES, streams=2) as rt:
        a = torch.ones(1 << 20, device="cuda:0")
        b = torch.ones(1 << 20, device="cuda:1")
        scale = torch.zeros(1, pin_memory=True)
        rt.submit(lambda: (torch.cuda._sleep(100_000_000), a.mul_(2)), writes=[a])
        rt.submit(lambda: b.mul_(3), writes=[b])

        def summed():
            gate.wait(10)
            scale[0] = float(a.sum().item() + b.sum().item())

        rt.submit(summed, reads=[a, b], writes=[scale], run_on="host")
        started = time.perf_counter()
        outs = [rt.submit(lambda t=t: t * scale.item(), reads=[t, scale]) for t in (a, b)]
        assert time.perf_counter() - started < 0.5 and not any(f.done() for f in outs)
        gate.set()
        total = 5.0 * (1 << 20)
        for f, t, factor in zip(outs, (a, b), (2, 3)):
            got = f.result(timeout=30)
            assert got.device == t.device
            assert bool((got == factor * total).all())


# ------------------------------------------------------------------ every visible GPU count: 2, 4, 8

VISIBLE = torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_counts(*counts):
    """One parameter per GPU count; a count above the GPUs visible skips, saying how many it needs."""
    return [pytest.param(n, marks=pytest.mark.skipif(n > VISIBLE, reason=f"needs {n} GPUs, {VISIBLE} "
                                                                          f"visible"))
            for n in counts]


@pytest.mark.parametrize("n", gpu_counts(2, 4, 8))
def test_tensor_parallel_chain_over_n_gpus_equals_one_gpu(n):
    from streamdag.parallel import LinearChain

    torch.manual_seed(n)
    weights = [torch.randn(512, 512, device="cuda:0", dtype=torch.float64) / 20 for _ in range(4)]
    x = torch.randn(64, 512, device="cuda:0", dtype=torch.float64)
    want = x
    for w in weights:
        want = torch.relu(want @ w)
    devices = [f"cuda:{g}" for g in range(n)]
    with sd.Runtime(devices=devices, streams=2) as rt:
        for plan in ("auto", f"split{n}", ["split2", f"split{n}", "single", f"split{n}"], f"rows{n}",
                     [f"rows{n}", f"split{n}", "rows2", "rows2"]):
            for exchange in (("ksplit", "gathered") if plan != "auto" else (None,)):
                chain = LinearChain(rt, weights, plan=plan, exchange=exchange)
                for _ in range(3):  # eager, captured, replayed
                    torch.testing.assert_close(chain(x), want, rtol=1e-10, atol=1e-10)
                blocks = chain.input_blocks(x)
                for b in blocks:
                    b.value.copy_(x[:, b.start:b.stop])
                torch.testing.assert_close(chain(blocks), want, rtol=1e-10, atol=1e-10)
                assert chain.explain()


@pytest.mark.parametrize("n", gpu_counts(2, 4, 8))
def test_a_chain_on_the_first_n_gpus_of_a_runtime_over_all_of_them_equals_one_gpu(n):
    from streamdag.parallel import LinearChain

    torch.manual_seed(10 + n)
    weights = [torch.randn(256, 256, device="cuda:0", dtype=torch.float64) / 16 for _ in range(3)]
    x = torch.randn(32, 256, device="cuda:0", dtype=torch.float64)
    want = x
    for w in weights:
        want = torch.relu(want @ w)
    with sd.Runtime(devices=[f"cuda:{g}" for g in range(VISIBLE)], streams=2) as rt:
        chain = LinearChain(rt, weights, plan="split", devices=n)
        torch.testing.assert_close(chain(x), want, rtol=1e-10, atol=1e-10)
        ((graph, _, _),) = chain._graphs.values()
        assert sorted(graph.touched_devices) == [f"cuda:{g}" for g in range(n)]


def test_measured_links_cover_every_ordered_pair_of_the_visible_gpus():
    from streamdag.parallel.measure import measure_links

    devices = [f"cuda:{g}" for g in range(VISIBLE)]
    links = measure_links(devices)
    assert links.n == VISIBLE and measure_links(devices) is links  # measured once per process
    for s in range(VISIBLE):
        for d in range(VISIBLE):
            if s != d:
                assert links(s, d).latency_ms > 0 and links(s, d).ms_per_mb > 0
    for k in range(1, VISIBLE + 1):
        group = links.group(k)
        assert group[0] == 0 and len(set(group)) == k


def test_a_chain_of_few_rows_stays_on_one_gpu_under_auto():
    from streamdag.parallel import LinearChain

    weights = [torch.randn(1024, 1024, device="cuda:0").bfloat16() / 32 for _ in range(4)]
    x = torch.randn(8, 1024, device="cuda:0").bfloat16()
    with sd.Runtime(devices=[f"cuda:{g}" for g in range(VISIBLE)], streams=2) as rt:
        chain = LinearChain(rt, weights)
        chain(x)
    assert chain._chosen[(8, "single")] == ("single",) * 4, chain.explain()


@pytest.mark.parametrize("n", gpu_counts(2, 4, 8))
def test_pipeline_placed_by_the_cost_model_over_n_gpus_equals_one_gpu(n):
    from streamdag.parallel import pipeline, place_stages

    torch.manual_seed(3)
    ws = [torch.randn(1024, 1024, dtype=torch.float64) / 32 for _ in range(2 * n)]

    def maker(w):
        def make(device):
            there = w.to(device)
            return lambda h: torch.tanh(h @ there)
        return make

    devices = [f"cuda:{g}" for g in range(n)]
    batches = [torch.randn(256, 1024, device="cuda:0", dtype=torch.float64) for _ in range(6)]
    stages, in_flight = place_stages([maker(w) for w in ws], devices, example=batches[0])
    with sd.Runtime(devices=devices, streams=2) as rt:
        outs = pipeline(rt, stages, batches, max_in_flight=in_flight)
    for x, y in zip(batches, outs):
        want = x
        for w in ws:
            want = torch.tanh(want @ w.to("cuda:0"))
        torch.testing.assert_close(y.to("cuda:0"), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("way", ["rows", "nccl"])
@pytest.mark.parametrize("n", gpu_counts(2, 4, 8))
def test_the_benchmarks_hand_made_chains_equal_one_gpu(n, way):
    from streamdag.suite import tp

    problem = tp.nccl_problem(n) if way == "nccl" else None
    if problem:
        pytest.skip(problem)
    torch.manual_seed(4)
    weights = [(torch.randn(tp.D, tp.D, device="cuda:0") / tp.D ** 0.5).bfloat16() for _ in range(2)]
    x = torch.randn(64, tp.D, device="cuda:0").bfloat16()
    want = x
    for w in weights:
        want = torch.relu(want @ w)
    run = tp.hand_made_nccl(weights, 64, n) if way == "nccl" else tp.hand_made_rows(weights, 64, n)
    for _ in range(2):
        got = run(x)
        torch.cuda.synchronize()
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 0.05 * want.float().abs().max().item() + 1e-3
