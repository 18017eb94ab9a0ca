"""Whole-call graphs through Dynamo and Inductor: on the CPU with Inductor's CPU code standing in for the
GPU's (``slow``), and real CUDA graphs (``cuda``)."""

import copy

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")
nn = torch.nn

from whole_call_stand_in import MODES  # noqa: E402

# -- through Dynamo and Inductor (CPU code; the device calls faked) ---------------------------------------

class Broken(nn.Module):
    """Two graphs with Python between them (a graph break)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(h + 1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_through_dynamo_a_model_with_a_graph_break_is_replayed_whole(fake_device, cpu_code_as_gpus, mode):
    torch.manual_seed(0)
    m = Broken().eval()
    fake_device(m)
    c = sd.compile(m)
    with MODES[mode]():
        for _ in range(3):
            x = torch.randn(2, 8)
            torch.testing.assert_close(c(x), m(x))
        graph_calls = c.statistics().calls
        for _ in range(3):
            x = torch.randn(2, 8)
            torch.testing.assert_close(c(x), m(x))
    stats = c.statistics()
    assert stats.graphs == 2 and stats.calls == graph_calls, "replays enter no graph"
    assert stats.whole_captures == 1 and stats.whole_replays >= 4
    assert "whole-call graphs: 1 captured" in c.explain()
    torch._dynamo.reset()


@pytest.mark.slow
def test_through_dynamo_a_whole_call_keeps_the_models_memory_not_its_graphs_own(
        fake_device, cpu_code_as_gpus):
    """What one graph makes and the next reads (``h`` past the graph break) is the whole call's own
    memory, written by every replay: keeping it allocated would only keep it from reuse."""
    m = Broken().eval()
    fake_device(m)
    c = sd.compile(m)
    with torch.no_grad():
        for _ in range(3):
            c(torch.randn(2, 8))
    entry = next(iter(c.whole.current.entries.values()))
    model = {t.untyped_storage().data_ptr() for t in m.parameters()}
    own = {s.untyped_storage().data_ptr() for s in entry.statics}
    assert {st.data_ptr() for st in entry.held} <= model | own
    torch._dynamo.reset()


@torch._dynamo.disable
def _count_eagerly(buf):
    buf.add_(1.0)


class CountsAtABreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        h = self.lin(x).relu()
        _count_eagerly(self.calls)  # eager code at a graph break: no compiled graph writes it
        return h * 2


@pytest.mark.slow
def test_through_dynamo_a_buffer_written_at_a_graph_break_is_updated_once_per_call(
        fake_device, cpu_code_as_gpus):
    m = CountsAtABreak().eval()
    fake_device(m)
    c = sd.compile(m)
    with torch.no_grad():
        for _ in range(4):
            c(torch.randn(2, 8))
        m.some_flag = True  # the check fails: Dynamo's path runs, and no replay before it
        c(torch.randn(2, 8))
    assert m.calls.item() == 5
    assert c.statistics().whole_replays >= 1
    torch._dynamo.reset()


# -- CUDA --------------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_on_cuda_a_model_with_a_graph_break_replays_one_graph_past_dynamo(no_tf32, fresh_dynamo):
    torch.manual_seed(0)
    m = Broken().eval().cuda()
    c = sd.compile(m)
    with torch.inference_mode():
        for _ in range(3):
            c(torch.randn(2, 8, device="cuda"))
        graph_calls = c.statistics().calls
        pairs = [(c(x), m(x)) for x in (torch.randn(2, 8, device="cuda") for _ in range(4))]
        for got, want in pairs:  # each output the caller's: later replays left it alone
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    stats = c.statistics()
    assert stats.whole_captures == 1 and stats.whole_replays >= 4, c.explain()
    assert stats.calls == graph_calls, "replays enter none of Dynamo's graphs"


@pytest.mark.cuda
def test_on_cuda_a_replaced_parameter_captures_the_whole_call_again(no_tf32, fresh_dynamo):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU()).eval().cuda()
    c = sd.compile(m)
    x = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            c(x)
        m[0].weight = nn.Parameter(torch.randn(64, 64, device="cuda"))
        for _ in range(3):
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            m[0].weight.mul_(3)  # read in place by the graph
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    stats = c.statistics()
    assert stats.whole_captures == 2 and stats.recaptures >= 1, c.explain()


@pytest.mark.cuda
def test_on_cuda_train_and_eval_each_replay_their_own_graph(no_tf32, fresh_dynamo):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)).cuda().eval()
    ref = copy.deepcopy(m)
    c = sd.compile(m)
    with torch.no_grad():
        for mode in ("eval", "train", "eval", "train"):
            getattr(m, mode)()
            getattr(ref, mode)()
            for _ in range(3):
                x = torch.randn(8, 16, device="cuda")
                torch.testing.assert_close(c(x), ref(x), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(m[1].running_mean, ref[1].running_mean, rtol=1e-4, atol=1e-4)
            assert int(m[1].num_batches_tracked) == int(ref[1].num_batches_tracked)
    assert c.statistics().whole_captures == 2, c.explain()


@pytest.mark.cuda
def test_on_cuda_a_new_input_shape_gets_a_graph_and_the_old_one_still_replays(no_tf32, fresh_dynamo):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.GELU()).eval().cuda()
    c = sd.compile(m)
    with torch.inference_mode():
        for batch in (2, 2, 2, 7, 7, 7, 2):
            x = torch.randn(batch, 32, device="cuda")
            torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    stats = c.statistics()
    assert stats.whole_captures == 2 and stats.whole_replays == 3, c.explain()


class Syncs(nn.Module):
    """``.item()`` breaks the graph, and Dynamo passes the number on to the code after the break,
    specialized: a new value compiles again, so every call compiles a graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if h.sum().item() > 1e9:  # a host synchronization: no capture
            h = h * 0
        return h.relu()


class SyncsOnABranch(Syncs):
    """A branch on a tensor breaks the graph too, and Python's ``bool()`` of it synchronizes between
    the graphs; the same branch is taken at every call, so Dynamo compiles once and a capture is tried."""

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 1e9:
            h = h * 0
        return h.relu()


@pytest.mark.cuda
@pytest.mark.parametrize("model, why", [(Syncs, "Dynamo compiled a graph in each of 3 calls"),
                                        (SyncsOnABranch, "the call cannot be captured")])
def test_on_cuda_a_forward_that_synchronizes_stays_on_dynamos_path_and_says_why(fresh_dynamo, model, why):
    torch.manual_seed(0)
    m = model().eval().cuda()
    c = sd.compile(m)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8, device="cuda")
            torch.testing.assert_close(c(x), m(x), rtol=1e-3, atol=1e-3)
        torch.randn(2, device="cuda")  # the random generator still works after the failed capture
    assert c.statistics().whole_captures == 0
    assert f"on Dynamo's path: {why}" in c.explain(), c.explain()


def _calls_equal_eager(compiled, model, inputs):
    """Each compiled call's result, all of them kept until the end, equals the model's own."""
    with torch.inference_mode():
        pairs = [(compiled(x), model(x)) for x in inputs]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_on_cuda_a_whole_call_with_regions_on_several_streams_equals_eager(no_tf32, fresh_dynamo):
    from compile_models import Inception

    torch.manual_seed(0)
    m = Inception(c=64).eval().cuda()
    c = sd.compile(m, regions="always", candidates=["regions"])
    _calls_equal_eager(c, m, [torch.randn(1, 64, 28, 28, device="cuda") for _ in range(5)])
    assert c.statistics().whole_replays >= 3, c.explain()


@pytest.mark.cuda
def test_on_cuda_a_replay_on_a_side_stream_follows_the_callers_work(no_tf32, fresh_dynamo):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).eval().cuda()
    c = sd.compile(m)
    side = torch.cuda.Stream()
    with torch.inference_mode():
        for _ in range(3):
            c(torch.randn(64, 256, device="cuda"))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x = torch.randn(64, 256, device="cuda") * 3
            got = c(x) + 0
        torch.cuda.current_stream().wait_stream(side)
        torch.testing.assert_close(got, m(x), rtol=1e-4, atol=1e-4)
    assert c.statistics().whole_replays >= 2


@pytest.mark.cuda
@pytest.mark.parametrize("whole_call", [True, False])
def test_on_cuda_a_call_on_another_stream_writes_the_inputs_only_after_the_last_replay_read_them(
        whole_call, no_tf32, fresh_dynamo):
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(12)]).eval().cuda()
    c = sd.compile(m, whole_call=whole_call)
    side = torch.cuda.Stream()
    with torch.inference_mode():
        for _ in range(3):
            c(torch.randn(64, 2048, device="cuda"))
        torch.cuda.synchronize()
        x1 = torch.randn(64, 2048, device="cuda")
        got1 = c(x1)  # a long replay on the caller's stream
        with torch.cuda.stream(side):  # at once on another stream, with no wait of the caller's own
            x2 = torch.randn(64, 2048, device="cuda")
            got2 = c(x2)
        torch.cuda.synchronize()
        torch.testing.assert_close(got1, m(x1), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got2, m(x2), rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_on_cuda_whole_call_false_keeps_every_call_on_dynamos_path(fresh_dynamo):
    m = nn.Linear(8, 8).eval().cuda()
    c = sd.compile(m, whole_call=False)
    with torch.no_grad():
        for _ in range(3):
            c(torch.randn(2, 8, device="cuda"))
    assert c.statistics().whole_captures == 0 and c.whole is None


class Pointwise(nn.Module):
    """A chain of pointwise ops: Inductor fuses it into one kernel, far faster than eager's five, so
    the whole call keeps streamdag's graph, and the graph's memory is its 32 MiB result."""

    def forward(self, x):
        return ((x * 2 + 1).relu() * 3 - 1).sigmoid()


def _held_mib(whole_call, x):
    """What a compiled Pointwise keeps reserved after its calls."""
    m = Pointwise().eval().cuda()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    c = sd.compile(m, whole_call=whole_call)
    with torch.inference_mode():
        for _ in range(4):
            y = c(x)
        torch.testing.assert_close(y, m(x))
    del y
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return (torch.cuda.memory_reserved() - before) / 2**20, c


@pytest.mark.cuda
def test_on_cuda_a_whole_call_holds_one_graphs_memory_not_its_graphs_and_its_own(fresh_dynamo):
    x = torch.randn(2048, 4096, device="cuda")
    per_graph, _ = _held_mib(False, x)
    torch._dynamo.reset()
    whole, c = _held_mib(True, x)
    assert c.statistics().whole_replays >= 1 and "streamdag's graph kept" in c.explain(), c.explain()
    # the graph's own CUDA graph goes before the whole call's capture, which reuses its memory
    assert whole <= per_graph + 16, f"whole call {whole:.0f} MiB against {per_graph:.0f} MiB per graph"


@pytest.mark.cuda
def test_on_cuda_copy_into_copies_dense_pairs_and_leaves_the_others_to_copy_(no_tf32):
    from streamdag.native import load_torch

    ext = load_torch()
    if ext is None or not hasattr(ext, "copy_into"):
        pytest.skip("no torch extension here")
    src = torch.randn(4, 6, device="cuda")
    dst = torch.empty_like(src)
    assert ext.copy_into([dst], [src]) and torch.equal((torch.cuda.synchronize(), dst)[1], src)
    t_src, t_dst = src.t(), torch.empty(6, 4, device="cuda").t().t()  # other strides
    assert not ext.copy_into([t_dst], [t_src])
    sliced = src[:, ::2]
    assert not ext.copy_into([torch.empty_strided(sliced.shape, sliced.stride(), device="cuda")], [sliced])
    assert not ext.copy_into([dst.double()], [src])  # another dtype
    assert not ext.copy_into([dst, dst], [src])


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
def test_on_cuda_replays_copy_inputs_of_any_layout(no_tf32, fresh_dynamo, layout):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval().cuda()
    c = sd.compile(m)

    def make():
        x = torch.randn(12, 16, device="cuda")
        return {"contiguous": x, "transposed": x.t().contiguous().t(), "sliced": torch.randn(
            12, 32, device="cuda")[:, ::2]}[layout]

    _calls_equal_eager(c, m, [make() for _ in range(5)])
    assert c.statistics().whole_replays >= 2, c.explain()


@pytest.mark.cuda
def test_on_cuda_a_parameter_replaced_and_its_memory_released_is_read_by_no_replay(no_tf32, fresh_dynamo):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval().cuda()
    c = sd.compile(m)
    x = torch.randn(4, 64, device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            c(x)
        for _ in range(3):  # the graph launches before its checks find the new memory
            m[0].weight.data = torch.randn(64, 64, device="cuda")
            torch.cuda.empty_cache()
            got = c(x)
            torch.testing.assert_close(got, m(x), rtol=1e-4, atol=1e-4)
        torch.cuda.synchronize()
    assert len(c.whole.states) <= 2, c.explain()



@pytest.mark.cuda
def test_on_cuda_a_decoder_returning_its_kv_cache_replays_whole_with_a_new_cache_each_call(
        no_tf32, fresh_dynamo):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    m = transformers.LlamaForCausalLM(cfg).eval().cuda()
    c = sd.compile(m)
    with torch.inference_mode():
        results = []
        for _ in range(5):
            ids = torch.randint(0, 100, (1, 12), device="cuda")
            results.append((c(ids), m(ids)))
    for got, want in results:
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
        got_cache, want_cache = got.past_key_values, want.past_key_values
        assert type(got_cache) is type(want_cache) and got_cache.get_seq_length() == 12
        for g, w in zip(got_cache.layers, want_cache.layers):
            torch.testing.assert_close(g.keys, w.keys, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(g.values, w.values, rtol=1e-4, atol=1e-4)
    assert results[-1][0].past_key_values.layers[0].keys is not results[-2][0].past_key_values.layers[0].keys
    assert c.statistics().whole_replays >= 2, c.explain()


def _capture_that_fails(dev, private):
    """A capture whose call allocates 64 MiB and then synchronizes (``.item()``): it fails."""

    def syncs():
        t = torch.ones(64 * 2**20, dtype=torch.uint8, device="cuda")
        return t.sum().item()

    try:
        dev.capture(syncs, (), {}, private=private)
    except Exception:  # (leaving the except clause drops the traceback, and the 64 MiB with it)
        return
    raise AssertionError("a synchronization inside a capture did not fail it")


@pytest.mark.cuda
def test_on_cuda_a_failed_capture_in_a_pool_of_its_own_gives_its_memory_back():
    """As a plain CUDA graph of the eager call that cannot be captured: its pool stops taking
    allocations and goes back to the device, and the next capture works."""
    from streamdag.frontend.candidates import SharedPool
    from streamdag.frontend.whole_replay import CudaCalls

    dev = CudaCalls(torch.device("cuda"), SharedPool())
    x = torch.randn(8, device="cuda")
    graph, out = dev.capture(lambda: x * 2, (), {}, private=True)  # a capture's one-time setup
    del graph, out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    _capture_that_fails(dev, private=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - before < 32 * 2**20, "the failed capture's pool kept its memory"
    graph, out = dev.capture(lambda: x * 2, (), {}, private=True)
    graph.replay()
    torch.testing.assert_close(out, x * 2)
