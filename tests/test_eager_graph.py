"""Each whole-call graph against a plain CUDA graph of the eager call: the faster is kept.

On the CPU, the stand-in device of ``whole_call_stand_in`` captures and replays; it
says which graph is faster (``graph_ms``: streamdag's, then the eager call's)
and records which function each graph was captured from.
"""

import pytest

torch = pytest.importorskip("torch")

from streamdag.frontend import whole_call as wc  # noqa: E402
from streamdag.frontend.whole_call import WholeCall  # noqa: E402
from whole_call_stand_in import Dynamo, FakeBackend, FakeDevice, compiled_conv_net_on_cuda, mlp  # noqa: E402


class RecordingDevice(FakeDevice):
    """Remembers each capture's function and counts each graph's replays."""

    def __init__(self, eager, fail_eager=False):
        super().__init__(eager)
        self.graphs = []
        self.fail_eager = fail_eager

    def capture(self, fn, args, kwargs, private=False):
        if self.fail_eager and fn is self.eager:
            raise RuntimeError("operation not permitted when stream is capturing")
        graph, out = super().capture(fn, args, kwargs, private)
        graph.fn, graph.replays, inner = fn, 0, graph.replay

        def replay():
            graph.replays += 1
            inner()
        graph.replay = replay
        self.graphs.append(graph)
        return graph, out

    def capture_beside(self, graph, fn, args, kwargs):
        """A lent set's graph counts as one of the graph it is captured beside."""
        again, out = super().capture_beside(graph, fn, args, kwargs)
        again.fn = graph.fn
        return again, out


@pytest.fixture
def device(monkeypatch):
    def make(model, graph_ms=None, fail_eager=False):
        dev = RecordingDevice(model, fail_eager)
        dev.graph_ms = graph_ms
        monkeypatch.setattr(wc, "_device_for", lambda device, pool: dev)
        monkeypatch.setattr(wc, "_one_cuda_device", lambda args, kwargs: (torch.device("cpu"), ""))
        return dev
    return make


def calls(fn, model, n=4):
    w, dynamo = WholeCall(fn, FakeBackend()), Dynamo(fn)
    with torch.no_grad():
        for _ in range(n):
            x = torch.randn(2, 8)
            torch.testing.assert_close(w((x,), {}, dynamo), model(x))
    return w


def replays_by_source(dev, model):
    """Replays of the graphs captured from ``model`` itself, and of streamdag's (each source's lent
    sets' graphs with its own)."""
    counts = {}
    for g in dev.graphs:
        source = "eager" if g.fn is model else "streamdag"
        counts[source] = counts.get(source, 0) + g.replays
    return counts


def test_the_eager_calls_graph_is_kept_where_it_replays_faster(device):
    m = mlp()
    dev = device(m, graph_ms=[1.0, 0.5])
    w = calls(m, m)
    assert w.captures == 1 and replays_by_source(dev, m) == {"streamdag": 0, "eager": 3}, w.explain()
    assert "a plain CUDA graph of the eager call 0.5000 ms: the eager graph kept" in w.explain()


def test_an_eager_graph_one_percent_faster_is_kept(device):
    m = mlp()
    dev = device(m, graph_ms=[1.0, 0.99])
    w = calls(m, m)
    assert replays_by_source(dev, m) == {"streamdag": 0, "eager": 3}, w.explain()


def test_a_tie_keeps_streamdags_graph(device):
    m = mlp()
    dev = device(m, graph_ms=[1.0, 0.996])
    w = calls(m, m)
    assert replays_by_source(dev, m) == {"streamdag": 3, "eager": 0}, w.explain()
    assert "streamdag's graph kept" in w.explain()


def test_a_module_in_training_mode_is_not_warmed_up_again_eagerly(device):
    m = mlp().train()
    dev = device(m, graph_ms=[1.0, 0.5])
    w = calls(m, m)
    assert replays_by_source(dev, m) == {"streamdag": 3}
    assert "Sequential is in training mode" in w.explain()


def test_a_plain_function_is_not_captured_eagerly(device):
    m = mlp()
    dev = device(m, graph_ms=[1.0, 0.5])

    def forward(x):
        return m(x)
    w = calls(forward, m)
    assert replays_by_source(dev, forward) == {"streamdag": 3}
    assert "a function, not a module" in w.explain()


def test_an_eager_call_that_cannot_be_captured_keeps_streamdags_graph_and_says_why(device):
    m = mlp()
    dev = device(m, graph_ms=[1.0, 0.5], fail_eager=True)
    w = calls(m, m)
    assert replays_by_source(dev, m) == {"streamdag": 3}
    assert "the eager call cannot be captured (RuntimeError: operation not permitted" in w.explain()


@pytest.mark.cuda
def test_on_cuda_the_whole_call_is_timed_against_the_eager_calls_graph_and_replays_eagers_results(no_tf32):
    m, c = compiled_conv_net_on_cuda()
    with torch.inference_mode():
        xs = [torch.randn(2, 3, 32, 32, device="cuda") for _ in range(4)]
        pairs = [(c(x), m(x)) for x in xs]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert c.statistics().whole_replays >= 4, c.explain()
    assert "a plain CUDA graph of the eager call" in c.explain() and " kept" in c.explain(), c.explain()


def test_a_call_whose_graphs_write_a_buffer_is_not_warmed_up_again_eagerly(device):
    m = mlp()
    dev = device(m, graph_ms=[1.0, 0.5])
    w, dynamo = WholeCall(m, FakeBackend()), Dynamo(m)

    def writing(*args, **kwargs):  # as a compiled graph that updates a buffer in place tells the call
        wc.ACTIVE.updates_state = wc.ACTIVE.mode is not None
        return dynamo(*args, **kwargs)
    with torch.no_grad():
        for _ in range(3):
            w((torch.randn(2, 8),), {}, writing)
    assert replays_by_source(dev, m) == {"streamdag": 2}, w.explain()
    assert "writes into a parameter or buffer" in w.explain(), w.explain()


def test_a_call_that_writes_a_tensor_outside_its_inputs_and_module_is_not_warmed_up_again(device):
    m = mlp()
    dev = device(m, graph_ms=[1.0, 0.5])
    w, dynamo = WholeCall(m, FakeBackend()), Dynamo(m)
    elsewhere = torch.zeros(3)  # a global's storage, as a graph that writes into it reports it

    def writing(*args, **kwargs):
        if wc.ACTIVE.mode is not None:
            wc.ACTIVE.mutated.add(elsewhere.untyped_storage().data_ptr())
        return dynamo(*args, **kwargs)
    with torch.no_grad():
        for _ in range(3):
            w((torch.randn(2, 8),), {}, writing)
    assert replays_by_source(dev, m) == {"streamdag": 2}, w.explain()
    assert "writes into a parameter or buffer" in w.explain(), w.explain()


def test_an_eager_call_whose_outputs_differ_from_the_compiled_calls_keeps_streamdags_graph(device):
    m = mlp()

    def narrow(x):  # the compiled path returns other shapes than forward does
        return m(x)[:, :2]
    dev = device(narrow, graph_ms=[1.0, 0.5])  # its replays compute what the compiled path returns
    w, narrower = WholeCall(m, FakeBackend()), Dynamo(narrow)
    with torch.no_grad():
        for _ in range(4):
            w((torch.randn(2, 8),), {}, narrower)
    assert replays_by_source(dev, m) == {"streamdag": 3, "eager": 0}, w.explain()
    assert "the eager call's result differs from the compiled call's" in w.explain()


def test_a_hugging_face_cache_in_the_result_comes_back_new_at_each_replay(device):
    cache_utils = pytest.importorskip("transformers.cache_utils")
    m = mlp()

    class WithCache(torch.nn.Module):
        def forward(self, x):
            cache = cache_utils.DynamicCache()
            cache.update(x[None, None] * 2, x[None, None] * 3, 0)
            return m(x), cache

    model = WithCache().eval()
    device(model)
    w, dynamo = WholeCall(model, FakeBackend()), Dynamo(model)
    results = []
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 8)
            results.append((x, w((x,), {}, dynamo)))
    assert w.replays == 3, w.explain()
    for x, (out, cache) in results:
        assert isinstance(cache, cache_utils.DynamicCache) and cache.get_seq_length() == 2
        torch.testing.assert_close(cache.layers[0].keys, x[None, None] * 2)
        torch.testing.assert_close(cache.layers[0].values, x[None, None] * 3)
        torch.testing.assert_close(out, m(x))
    assert results[-1][1][1].layers[0] is not results[-2][1][1].layers[0]
