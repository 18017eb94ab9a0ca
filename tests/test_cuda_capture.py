"""Recorded graphs captured as CUDA graphs: a replay equals the eager run, a changed argument is
recaptured or refused, and a graph that cannot be captured runs eagerly with one warning.
Marked ``cuda``: skipped without a GPU."""

import threading
import time
import warnings

import pytest

import streamdag as sd
from programs import wide_fn

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.cuda


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
