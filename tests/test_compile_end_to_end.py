"""streamdag.compile on whole models against eager: modes, parameters, output types, dtypes, shapes,
data-dependent ops and inputs changed in place.

The CPU tests compile with Inductor's CPU code generator, which calls a C++ compiler per graph:
they use tiny models and are marked ``slow``. The ``cuda`` tests need a GPU.
"""

import copy
import dataclasses
import warnings

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.slow
def test_a_sequential_model_equals_eager_and_compiles_no_regions():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                            torch.nn.Linear(32, 4)).eval()
    c = sd.compile(m)
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(c(x), m(x))
    sw = c.backend.runners[0].switch
    assert sw.program is None and c.statistics().graphs == 1
    assert "candidate inductor" in c.explain()


@pytest.mark.slow
def test_switching_between_train_and_eval_compiles_again_and_follows_the_mode():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).eval()
    ref = copy.deepcopy(m)
    c = sd.compile(m)
    x = torch.randn(6, 8)
    with torch.no_grad():
        torch.testing.assert_close(c(x), ref(x))
        m.train()
        ref.train()
        torch.testing.assert_close(c(x), ref(x))  # batch statistics, not the running ones
        torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)  # updated once, as eager
        m.eval()
        ref.eval()
        torch.testing.assert_close(c(x), ref(x))
    assert c.statistics().graphs == 2


@pytest.mark.slow
def test_a_replaced_parameter_is_read_at_the_next_call():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    c = sd.compile(m)
    x = torch.randn(2, 8)
    with torch.no_grad():
        c(x)
        m[0].weight = torch.nn.Parameter(torch.randn(8, 8))
        torch.testing.assert_close(c(x), m(x))
        m[0].weight.mul_(3)  # and an in-place update of it
        torch.testing.assert_close(c(x), m(x))


@dataclasses.dataclass
class Out:
    logits: "torch.Tensor"
    hidden: "torch.Tensor"


class Structured(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return {"dict": {"a": h, "b": h.relu()}, "list": [h.sum(), h * 2], "dataclass": Out(h.tanh(), h)}


@pytest.mark.slow
def test_dict_list_and_dataclass_outputs_keep_their_types():
    torch.manual_seed(0)
    m = Structured().eval()
    c = sd.compile(m)
    x = torch.randn(2, 8)
    with torch.no_grad():
        got, want = c(x), m(x)
    assert isinstance(got["dict"], dict) and set(got["dict"]) == {"a", "b"}
    assert isinstance(got["list"], list) and len(got["list"]) == 2
    assert isinstance(got["dataclass"], Out)
    torch.testing.assert_close(got["dict"]["b"], want["dict"]["b"])
    torch.testing.assert_close(got["list"][1], want["list"][1])
    torch.testing.assert_close(got["dataclass"].logits, want["dataclass"].logits)
    assert c.statistics().fallbacks == 0


@pytest.mark.slow
def test_parameters_made_under_inference_mode_compile_without_a_fallback():
    torch.manual_seed(0)
    with torch.inference_mode():
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
        x = torch.randn(2, 8)
        want = m(x)
    c = sd.compile(m)
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ResourceWarning)  # (what an earlier test dropped, freed now)
        got = c(x)
    torch.testing.assert_close(got, want)
    assert not [w for w in caught if "streamdag" in str(w.message)]
    assert c.statistics().fallbacks == 0 and c.statistics().graphs == 1


@pytest.mark.slow
def test_bfloat16_models_compile_and_match_eager():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8)).eval()
    m = m.to(torch.bfloat16)
    c = sd.compile(m)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        got = c(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, m(x), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_a_new_batch_size_compiles_a_new_specialization():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    c = sd.compile(m)
    with torch.no_grad():
        for batch in (1, 3, 1):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(c(x), m(x))
    assert c.statistics().graphs == 2


@pytest.mark.slow
def test_the_dynamo_backend_by_name_takes_the_inductor_path():
    import streamdag.frontend.dynamo  # noqa: F401 - registers the name
    from streamdag.frontend.inductor_backend import default_backend

    before = len(default_backend().runners)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Sigmoid()).eval()
    opt = torch.compile(m, backend="streamdag")
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x))
    assert len(default_backend().runners) == before + 1


class DataDependentArange(torch.nn.Module):
    """``arange`` of a tensor's value (Longformer's global attention does it): the graph Dynamo hands
    over fails AOTAutograd's trace with a fake-tensor exception, which Dynamo turns into a graph break."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, is_global):
        num = is_global.long().sum(dim=1)
        top = num.max()
        local = torch.arange(top, device=x.device) < num.unsqueeze(-1)
        keys = x.new_zeros(x.shape[0], top, 8)  # (Dynamo breaks the graph here)
        return self.proj(x).sum() + keys.sum() + local.sum()


@pytest.mark.slow
@pytest.mark.parametrize("grad", [False, True])
def test_an_op_whose_output_depends_on_data_breaks_the_graph_as_under_torch_compile(grad):
    torch.manual_seed(0)
    m = DataDependentArange()
    x, is_global = torch.randn(2, 16, 8), torch.zeros(2, 16, dtype=torch.bool)
    is_global[:, :3] = True
    c = sd.compile(m)
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("error", sd.StreamdagWarning)
        for _ in range(2):
            torch.testing.assert_close(c(x, is_global), m(x, is_global))
    stats = c.statistics()
    assert stats.fallbacks == 0 and stats.eager_calls == 0 and stats.graphs >= 1, c.explain()
    said = c.explain().split("Dynamo split the model where it could not trace it")[1]
    assert "Data dependent operator; Operator `aten._local_scalar_dense.default`" in said, said
    assert "Backend compiler exception" not in said, said  # (Dynamo's note on the same operator)


class Printing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.first(x)
        print("between the layers")  # (Dynamo breaks the graph here)
        return self.second(h).relu()


@pytest.mark.slow
def test_explain_names_what_dynamo_could_not_trace_once_per_compile_and_not_where_it_traced_all(capsys):
    torch.manual_seed(0)
    m, x = Printing(), torch.randn(2, 8)
    c = sd.compile(m)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(c(x), m(x))
    said = [line for line in c.explain().splitlines() if "`print`" in line]
    assert len(said) == 1 and said[0].startswith("  - Failed to trace builtin operator"), c.explain()
    assert said[0].endswith("(x1)"), said  # the calls after the compile add nothing
    assert "object at 0x" not in c.explain() and c.statistics().graphs == 2
    whole = sd.compile(torch.nn.Sequential(torch.nn.Linear(8, 8)))  # (a model Dynamo traces whole)
    with torch.no_grad():
        whole(x)
    assert "Dynamo split" not in whole.explain(), whole.explain()


@pytest.mark.slow
def test_a_float_argument_that_changes_is_traced_again_by_dynamo_not_left_to_a_fallback():
    """Under torch.compile's default (dynamic=None) a float argument that changes becomes a symbolic
    input; where Inductor cannot keep it so (a scale an attention kernel takes as a number), it asks
    Dynamo, by an exception, to trace again with the number fixed. The backend passes that on: each
    call runs compiled, and nothing falls back or warns."""
    import streamdag.frontend.dynamo  # noqa: F401 - registers the name
    from streamdag.frontend.inductor_backend import default_backend

    def attend(t, scale):
        return torch.nn.functional.scaled_dot_product_attention(t, t, t, scale=scale) * 2

    opt = torch.compile(attend, backend="streamdag")
    t = torch.randn(1, 2, 4, 8)
    fallbacks = default_backend().stats.fallbacks
    with warnings.catch_warnings():
        warnings.simplefilter("error", sd.StreamdagWarning)
        for scale in (0.5, 0.25, 0.125):
            torch.testing.assert_close(opt(t, scale), attend(t, scale))
    assert default_backend().stats.fallbacks == fallbacks


@pytest.mark.slow
def test_inputs_the_model_changes_in_place_are_changed_as_eager_changes_them():
    def f(x, w1, w2):
        y = torch.tanh(x @ w1) + torch.relu(x @ w2)
        x.add_(1)
        return y + x

    w1, w2 = torch.randn(16, 16), torch.randn(16, 16)
    for options in ({}, {"regions": "always", "candidates": ["regions"]}):
        torch._dynamo.reset()
        c = sd.compile(f, **options)
        x_got = torch.randn(4, 16)
        x_want = x_got.clone()
        with torch.no_grad():
            torch.testing.assert_close(c(x_got, w1, w2), f(x_want, w1, w2))
        torch.testing.assert_close(x_got, x_want)
        if options:  # the write into x is in a region after both branches
            assert c.backend.runners[0].switch.program.plan.streams == 2


# -- CUDA --------------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_a_replaced_parameter_is_captured_again_on_cuda():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval().cuda()
    c = sd.compile(m)
    x = torch.randn(8, 64, device="cuda")
    with torch.inference_mode():
        c(x)
        c(x)
        with torch.inference_mode(False), torch.no_grad():
            m[0].weight = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
        torch.testing.assert_close(c(x), m(x))
    assert c.statistics().recaptures == 1


@pytest.mark.cuda
@pytest.mark.parametrize("whole_call", [True, False])
def test_on_cuda_a_convolution_captured_with_tf32_is_captured_again_when_cudnn_tf32_goes_off(whole_call):
    """cuDNN's TF32 switch, which Dynamo does not guard, reaches a compiled model as it reaches eager
    code: after it goes off, the outputs equal eager's without TF32 (bit for bit where both run the
    same algorithm, so compared closer than TF32's rounding)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU()).eval().cuda()
    c = sd.compile(m, whole_call=whole_call)
    x = torch.randn(8, 64, 32, 32, device="cuda")
    was = torch.backends.cudnn.allow_tf32

    def captures():
        stats = c.statistics()
        return stats.whole_captures if whole_call else stats.captures

    try:
        torch.backends.cudnn.allow_tf32 = True
        with torch.no_grad():
            for _ in range(3):
                c(x)
            before = captures()
            torch.backends.cudnn.allow_tf32 = False
            for _ in range(3):
                got, want = c(x), m(x)
    finally:
        torch.backends.cudnn.allow_tf32 = was
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert captures() == before + 1


@pytest.mark.cuda
def test_the_dynamo_backend_by_name_replays_a_cuda_graph():
    import streamdag.frontend.dynamo  # noqa: F401
    from streamdag.frontend.inductor_backend import default_backend

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).eval().cuda()
    opt = torch.compile(m, backend="streamdag")
    x = torch.randn(4, 64, device="cuda")
    before = default_backend().statistics().replays
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(opt(x), m(x), rtol=1e-3, atol=1e-3)
    assert default_backend().statistics().replays >= before + 2


@pytest.mark.cuda
def test_inputs_changed_in_place_are_written_back_after_a_replay():
    def f(x, w):
        y = x @ w
        x.add_(1)
        return y + x

    w = torch.randn(16, 16, device="cuda")
    c = sd.compile(f)
    with torch.no_grad():
        for _ in range(3):
            x_got = torch.randn(4, 16, device="cuda")
            x_want = x_got.clone()
            torch.testing.assert_close(c(x_got, w), f(x_want, w), rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(x_got, x_want)


@pytest.mark.cuda
def test_bfloat16_and_dict_outputs_on_cuda():
    torch.manual_seed(0)
    m = Structured().eval().cuda().to(torch.bfloat16)
    c = sd.compile(m)
    x = torch.randn(2, 8, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got, want = c(x), m(x)
        got2 = c(x)
    assert isinstance(got["dataclass"], Out) and got["dict"]["a"].dtype == torch.bfloat16
    torch.testing.assert_close(got["dict"]["b"], want["dict"]["b"], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got2["list"][1], want["list"][1], rtol=2e-2, atol=2e-2)
