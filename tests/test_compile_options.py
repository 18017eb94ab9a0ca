"""streamdag.compile's entry points and options: the engines by name, settings passed on to
Inductor, refusals that name the fix, and the fallback where Inductor cannot compile a graph.

Tests that compile with Inductor's CPU code generator are marked ``slow``.
"""

import copy
import warnings

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")

from compile_models import inception, inception_args  # noqa: E402
from streamdag.frontend.compiled_model import CompiledModel  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


# -- the entry points and the fallback ----------------------------------------------------------------

def test_the_make_fx_path_stays_available_by_name():
    from streamdag.frontend import Compiled

    assert isinstance(sd.compile(torch.relu, engine="aten"), Compiled)
    assert isinstance(sd.compile(torch.relu), CompiledModel)


def test_options_of_the_make_fx_path_name_the_engine_that_takes_them():
    with pytest.raises(TypeError, match="engine='aten'"):
        sd.compile(torch.relu, device="cpu")
    with pytest.raises(ValueError, match="engine must be one of"):
        sd.compile(torch.relu, engine="triton")
    with pytest.raises(ValueError, match="regions must be"):
        sd.compile(torch.relu, regions="sometimes")


def test_a_misspelt_option_is_refused_by_streamdag_compile_listing_the_options_it_takes():
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'stream'; it takes streams, regions, "):
        sd.compile(torch.relu, stream=2)


def test_a_graph_inductor_cannot_compile_runs_on_the_make_fx_path_and_says_so(monkeypatch):
    import torch._inductor.compile_fx as cfx

    def broken(*args, **kwargs):
        raise RuntimeError("no kernels today")

    monkeypatch.setattr(cfx, "compile_fx", broken)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    c = sd.compile(m)
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(c(x), m(x))
    assert any("make_fx path" in str(w.message) for w in caught)
    said = c.explain()
    assert "graph 0: Inductor failed (RuntimeError: no kernels today)" in said, said
    assert "1 call(s) without gradients ran on the make_fx path" in said, said
    assert c.statistics().fallbacks == 1 and c.statistics().calls == 1


def test_a_graph_inductor_fails_on_itself_runs_on_the_make_fx_path():
    """Inductor wraps its own failures (here: no working C++ compiler, as on a slim container) in an
    exception that is also one of Dynamo's; the backend still takes it for a failure of Inductor's,
    not for a signal to Dynamo."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    c = sd.compile(m, inductor={"cpp.cxx": (None, "/no/such/c++"), "fx_graph_cache": False})
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(c(x), m(x))
        torch.testing.assert_close(c(x), m(x))
    assert any("make_fx path" in str(w.message) for w in caught)
    said = c.explain()
    assert "graph 0: Inductor failed (InductorError: InvalidCxxCompiler" in said, said
    assert c.statistics().fallbacks == 1


def test_dynamos_signals_pass_on_and_inductors_failures_fall_back_however_they_are_wrapped():
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    from streamdag.frontend.inductor_backend import _signal_in

    skip = dynamo_exc.SkipFrame("run the frame as written")
    assert _signal_in(skip) is skip
    assert _signal_in(inductor_exc.InductorError(skip, None)) is skip  # (wrapped past Inductor's cache)
    assert _signal_in(inductor_exc.InductorError(RuntimeError("no compiler"), None)) is None
    for failure in ("TritonMissing", "GPUTooOldForTriton"):  # (Dynamo's ShortenTraceback, not signals)
        kind = getattr(inductor_exc, failure, None)
        if kind is not None:
            assert _signal_in(kind.__new__(kind)) is None


def test_a_training_call_of_a_graph_inductor_cannot_compile_runs_the_traced_graph_with_its_gradients(
        monkeypatch):
    import torch._inductor.compile_fx as cfx

    def broken(*args, **kwargs):
        raise RuntimeError("no kernels today")

    monkeypatch.setattr(cfx, "compile_fx", broken)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(m)
    c = sd.compile(m)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    said = [str(w.message) for w in caught if issubclass(w.category, sd.StreamdagWarning)]
    assert any("runs as Dynamo traced it, op by op, where it needs gradients" in w for w in said), said
    assert not any("runs inference graphs" in w for w in said), said
    stats = c.statistics()
    assert stats.calls == 1 and stats.uncaptured_calls == 1 and stats.eager_calls == 0, stats
    assert "1 call(s) with gradients ran it as Dynamo traced it" in c.explain(), c.explain()


# -- options and Inductor's settings ------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(candidates=["inductr"]), "unknown candidates \\['inductr'\\]: name some of 'eager', 'inductor'"),
    (dict(candidates=["regions x0"]), "a label such as 'regions x2'"),
    (dict(min_gain=-0.1), "min_gain .* at least 0"),
    (dict(min_gain=float("nan")), "min_gain .* at least 0"),
])
def test_a_misspelt_candidate_or_a_negative_min_gain_is_refused_at_compile_naming_the_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sd.compile(torch.nn.Linear(4, 4), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(streams="2"), "streams takes a number of streams, e.g. streams=2"),
    (dict(clone_outputs="no"), "clone_outputs takes True or False"),
    (dict(min_gain="15%"), "min_gain takes a fraction, e.g. min_gain=0.15"),
])
def test_an_option_of_the_wrong_type_is_refused_at_compile_naming_what_it_takes(kwargs, match):
    with pytest.raises(TypeError, match=match):
        sd.compile(torch.nn.Linear(4, 4), **kwargs)


@pytest.mark.parametrize("inductor, error, match", [
    ({"combo_kernel": True}, ValueError, "no Inductor setting named 'combo_kernel'"),
    ({"triton.cudagraph": True}, ValueError, "nested ones by dotted name"),
    (["combo_kernels"], TypeError, "a dict of Inductor settings by name"),
    ({"combo_kernels": "no"}, TypeError, "Inductor's combo_kernels takes a bool .*, got 'no'"),
])
def test_an_unknown_inductor_setting_is_refused_at_compile_not_at_the_first_call(inductor, error, match):
    with pytest.raises(error, match=match):
        sd.compile(torch.nn.Linear(4, 4), inductor=inductor)


class _SeenPass:
    """An Inductor graph pass that counts the graphs it sees (only a compile under the setting runs it)."""

    def __init__(self):
        from torch._inductor.custom_graph_pass import CustomGraphPass

        seen = self.seen = []

        class Count(CustomGraphPass):
            def __call__(self, graph):
                seen.append(len(graph.nodes))

            def uuid(self):
                return None  # (no cache entry: every compile runs the pass)

        self.graph_pass = Count()


def test_inductor_settings_read_dashes_as_underscores_as_torch_compile_does():
    fast = sd.compile(torch.nn.Linear(4, 4), inductor={"combo-kernels": True})
    assert fast.backend.options.inductor == {"combo_kernels": True}


def test_the_aten_engine_refuses_inductor_settings_naming_the_engine():
    with pytest.raises(TypeError, match="the aten engine runs no Inductor"):
        sd.compile(torch.nn.Linear(4, 4), engine="aten", inductor={"combo_kernels": True})


def test_models_compiled_by_name_with_equal_settings_share_a_backend_and_other_objects_do_not():
    from streamdag.frontend.inductor_backend import default_backend

    class Pass:  # equal-looking objects that are not equal: two passes
        def __repr__(self):
            return "Pass()"

    a, b = Pass(), Pass()
    assert default_backend({"post_grad_custom_post_pass": a}) is default_backend(
        {"post_grad_custom_post_pass": a})
    assert default_backend({"post_grad_custom_post_pass": a}) is not default_backend(
        {"post_grad_custom_post_pass": b})
    assert default_backend({"combo-kernels": True}) is default_backend({"combo_kernels": True})
    assert default_backend({"combo_kernels": True}) is not default_backend()


@pytest.mark.slow
def test_inductor_settings_reach_every_region_a_graph_is_cut_into():
    seen = _SeenPass()
    args = inception_args()
    fast = sd.compile(inception, regions="always", inductor={"post_grad_custom_post_pass": seen.graph_pass})
    with torch.no_grad():
        torch.testing.assert_close(fast(*args), inception(*args))
    text = fast.explain()
    assert "regions" in text
    assert len(seen.seen) > 1, text  # the whole graph, then each region


@pytest.mark.slow
def test_inductor_settings_reach_the_forward_and_the_backward_compiled_later():
    seen = _SeenPass()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    fast = sd.compile(model, inductor={"post_grad_custom_post_pass": seen.graph_pass})
    x = torch.randn(4, 8)
    out = fast(x)
    assert len(seen.seen) == 1  # the forward
    out.sum().backward()
    assert len(seen.seen) == 2  # the backward, compiled at the first backward() (outside the compile call)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want)
    plain = sd.compile(torch.nn.Linear(8, 2).eval())
    with torch.no_grad():
        plain(x)
    assert len(seen.seen) == 2  # a model compiled without the settings does not get them


@pytest.mark.slow
def test_the_dynamo_backend_by_name_takes_inductor_settings_as_options_and_refuses_a_mode():
    import streamdag.frontend.dynamo  # noqa: F401 - registers the name

    seen = _SeenPass()
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Sigmoid()).eval()
    opt = torch.compile(m, backend="streamdag", options={"post_grad_custom_post_pass": seen.graph_pass})
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x))
    assert len(seen.seen) == 1
    torch._dynamo.reset()
    no_mode = r"takes no mode .* pass Inductor settings as options"
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=no_mode) as failed, torch.no_grad():
        torch.compile(m, backend="streamdag", mode="max-autotune")(x)
    assert isinstance(failed.value.inner_exception, TypeError)
    torch._dynamo.reset()
    unknown = "no Inductor setting named 'combo_kernel'"
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=unknown) as failed, torch.no_grad():
        torch.compile(m, backend="streamdag", options={"combo_kernel": True})(x)
    assert isinstance(failed.value.inner_exception, ValueError)
