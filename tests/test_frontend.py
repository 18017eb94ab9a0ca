"""streamdag.compile on the CPU: schema-derived hazards, guards, fallbacks, models."""

import os
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streamdag as sd
from programs import wide_fn

torch = pytest.importorskip("torch")

DEVICES = ["cpu", "sim"]


@pytest.fixture(autouse=True)
def _make_fx_engine(monkeypatch):
    """These tests are of the make_fx path (the other test_compile_* modules test the Inductor one)."""
    monkeypatch.setenv("STREAMDAG_COMPILE_ENGINE", "aten")


def run_both(fn, *args, device="cpu", calls=3):
    compiled = sd.compile(fn, device=device, streams=4)
    with torch.no_grad():
        for _ in range(calls):
            eager_args = [a.clone() for a in args]
            compiled_args = [a.clone() for a in args]
            want = fn(*eager_args)
            got = compiled(*compiled_args)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            for e, c in zip(eager_args, compiled_args):
                assert torch.equal(e, c), "mutated inputs must be written back"
    return compiled


@pytest.mark.parametrize("device", DEVICES)
def test_write_after_read_through_a_view(device):
    """y reads x; then x is changed in place through a view: y must see the old x."""

    def f(x):
        y = x * 2
        x.view(-1)[:3].add_(10)
        return y + x

    run_both(f, torch.arange(12.0).reshape(3, 4), device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_in_place_on_an_input_is_written_back(device):
    def f(x, w):
        x.mul_(2)
        return torch.relu(x @ w)

    run_both(f, torch.randn(4, 4), torch.randn(4, 4), device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_out_variant_orders_its_output(device):
    def f(a, b):
        out = torch.empty(4)
        torch.add(a, b, out=out)
        c = out * 3
        torch.mul(a, b, out=out)
        return c, out

    run_both(f, torch.randn(4), torch.randn(4), device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_independent_branches_run_on_several_lanes(device):
    def f(x, ws):
        return torch.stack([torch.tanh(x @ w) for w in ws]).sum(0)

    ws = torch.randn(6, 8, 8)
    compiled = run_both(lambda x: f(x, ws), torch.randn(8, 8), device=device)
    text = compiled.explain()
    assert "width 6" in text


def test_small_cnn_and_recompile_on_a_new_shape():
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(inplace=True),
        torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 4),
    ).eval()
    c = sd.compile(m)
    with torch.inference_mode():
        for batch in (1, 1, 3, 3):
            x = torch.randn(batch, 3, 8, 8)
            torch.testing.assert_close(c(x), m(x))
    s = c.statistics()
    assert (s.calls, s.traces) == (4, 2)


def test_transformer_encoder_block_matches_eager():
    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval()
    c = sd.compile(enc)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 10, 64)
            torch.testing.assert_close(c(x), enc(x), rtol=1e-5, atol=1e-5)


def test_outputs_are_the_callers_to_keep():
    c = sd.compile(lambda x: x * 2)
    with torch.no_grad():
        a = c(torch.ones(3))
        b = c(torch.full((3,), 5.0))
    assert torch.equal(a, torch.full((3,), 2.0)) and torch.equal(b, torch.full((3,), 10.0))


def test_gradients_enabled_runs_eagerly_with_one_warning():
    lin = torch.nn.Linear(4, 4)
    c = sd.compile(lin)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1, y2 = c(x), c(x)
    assert y1.requires_grad and torch.equal(y1, y2)
    assert len([w for w in caught if "inference_mode" in str(w.message)]) == 1
    assert c.statistics().eager_calls == 2


def test_data_dependent_control_flow_falls_back_and_stays_right():
    def f(x):
        return x + 1 if x.sum() > 0 else x - 1

    c = sd.compile(f)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        pos, neg = c(torch.ones(3)), c(-torch.ones(3))
    assert torch.equal(pos, torch.full((3,), 2.0)) and torch.equal(neg, torch.full((3,), -2.0))
    assert any("tracing failed" in str(w.message) for w in caught)


def test_dynamo_backend_is_registered():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    # the installed entry point registers the backend; importing the module does too
    import streamdag.frontend.dynamo  # noqa: F401

    opt = torch.compile(m, backend="streamdag")
    with torch.no_grad():
        x = torch.randn(3, 8)
        torch.testing.assert_close(opt(x), m(x))


def test_parameters_passed_as_inputs_are_bound_not_copied():
    w = torch.nn.Parameter(torch.randn(4, 4))
    c = sd.compile(lambda x, w: x @ w)
    with torch.no_grad():
        x = torch.randn(2, 4)
        torch.testing.assert_close(c(x, w), x @ w)
        w.mul_(2)  # an in-place update of the parameter is seen: it is the graph's buffer
        torch.testing.assert_close(c(x, w), x @ w)
    entry = next(iter(c._entries.values())).entry
    assert entry.static_inputs[1] is w


@pytest.mark.parametrize("device", DEVICES)
def test_batching_turns_a_wide_graph_into_batched_ops_with_the_same_results(device):
    torch.manual_seed(0)
    ws = [[torch.randn(16, 16) / 4 for _ in range(3)] for _ in range(6)]

    wide = wide_fn(ws)

    c = sd.compile(wide, batch=True, device=device)
    with torch.no_grad():
        x = torch.randn(8, 16)
        torch.testing.assert_close(c(x), wide(x), rtol=1e-5, atol=1e-5)
        text = c.explain()
        assert "3 x matmul (sizes [6])" in text and "3 x relu" in text
        assert len(next(iter(c._entries.values())).entry.graph) <= 10  # from 37 ops


@pytest.mark.parametrize("device", DEVICES)
def test_two_operand_ops_over_batched_branches_become_one_op(device):
    torch.manual_seed(1)
    ws = [torch.randn(16, 16) / 4 for _ in range(5)]
    vs = [torch.randn(16, 16) / 4 for _ in range(5)]
    bias = torch.randn(16)

    def residual(x):  # per branch: (x @ w) * (x @ v), plus the shared x, minus a shared bias
        return torch.stack([(x @ w) * (x @ v) + x - bias for w, v in zip(ws, vs)]).sum(0)

    c = sd.compile(residual, batch=True, device=device)
    with torch.no_grad():
        x = torch.randn(8, 16)
        torch.testing.assert_close(c(x), residual(x), rtol=1e-5, atol=1e-5)
    text = c.explain()
    assert "1 x matmul (sizes [10])" in text  # the w and v products of all branches: one bmm
    assert "1 x mul (sizes [5])" in text and "1 x add (sizes [5])" in text and "1 x sub (sizes [5])" in text


def test_stacked_constants_follow_in_place_updates():
    """A weight changed in place after the graph was built: the batched graph must see it."""
    ws = [torch.randn(8, 8) for _ in range(4)]
    c = sd.compile(lambda x: [torch.tanh(x @ w) for w in ws], batch=True)
    with torch.no_grad():
        x = torch.randn(3, 8)
        c(x)
        ws[2].mul_(-1)
        ws[0].copy_(torch.randn(8, 8))
        for got, w in zip(c(x), ws):
            torch.testing.assert_close(got, torch.tanh(x @ w))


def test_ops_that_depend_on_each_other_are_not_batched():
    w1, w2 = torch.randn(8, 8), torch.randn(8, 8)
    c = sd.compile(lambda x: (x @ w1) @ w2, batch=True)
    with torch.no_grad():
        x = torch.randn(4, 8)
        torch.testing.assert_close(c(x), (x @ w1) @ w2)
    assert "no groups" in c.explain()


class _ConvBnRelu(torch.nn.Module):
    def __init__(self, cin, cout, k):
        super().__init__()
        self.conv = torch.nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
        self.bn = torch.nn.BatchNorm2d(cout, eps=1e-3)

    def forward(self, x):
        return torch.nn.functional.relu(self.bn(self.conv(x)), inplace=True)


class _Inception(torch.nn.Module):
    """Three branches open with 1x1 convolutions of the same input, as in GoogLeNet."""

    def __init__(self, c):
        super().__init__()
        self.b1 = _ConvBnRelu(c, 8, 1)
        self.b2 = torch.nn.Sequential(_ConvBnRelu(c, 6, 1), _ConvBnRelu(6, 8, 3))
        self.b3 = torch.nn.Sequential(_ConvBnRelu(c, 4, 1), _ConvBnRelu(4, 8, 3))
        self.b4 = torch.nn.Sequential(torch.nn.MaxPool2d(3, 1, 1), _ConvBnRelu(c, 8, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


def _inception_net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(_ConvBnRelu(3, 16, 3), _Inception(16), _Inception(32)).eval()
    for mod in net.modules():
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.uniform_(-1, 1)
            mod.running_var.uniform_(0.5, 2)
            mod.weight.data.uniform_(0.5, 1.5)
            mod.bias.data.uniform_(-0.5, 0.5)
    return net


@pytest.mark.parametrize("device", DEVICES)
def test_convolutions_of_one_input_are_batched_with_their_norms(device):
    net = _inception_net()
    c = sd.compile(net, batch=True, device=device)
    with torch.inference_mode():
        for _ in range(2):
            x = torch.randn(2, 3, 16, 16)
            torch.testing.assert_close(c(x), net(x), rtol=1e-5, atol=1e-5)
    text = c.explain()
    assert "2 x convolution (sizes [3])" in text and "2 x batch_norm (sizes [3])" in text


def test_batched_norms_follow_in_place_updates_of_running_stats():
    net = _inception_net()
    c = sd.compile(net, batch=True)
    with torch.inference_mode():
        x = torch.randn(1, 3, 16, 16)
        c(x)
    with torch.no_grad():
        net[1].b2[0].bn.running_mean.add_(0.3)
        net[2].b1.conv.weight.mul_(-1)
    with torch.inference_mode():
        torch.testing.assert_close(c(x), net(x), rtol=1e-5, atol=1e-5)


@st.composite
def matmul_programs(draw):
    """Random graphs of matmuls with constant weights, unary ops and sums over earlier values."""
    n_weights = draw(st.integers(1, 4))
    steps = []
    for i in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["mm", "mm", "relu", "tanh", "add"]))
        a = draw(st.integers(0, i))  # value 0 is the input; value k is step k-1's result
        b = draw(st.integers(0, i))
        steps.append((kind, a, b, draw(st.integers(0, n_weights - 1))))
    return n_weights, steps


@settings(max_examples=150 if os.environ.get("CI") else 40, deadline=None)
@given(matmul_programs(), st.integers(0, 2**16))
def test_batching_random_graphs_equals_eager(program, seed):
    n_weights, steps = program
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(6, 6, generator=gen) / 3 for _ in range(n_weights)]

    def f(x):
        values = [x]
        for kind, a, b, w in steps:
            if kind == "mm":
                values.append(values[a] @ ws[w])
            elif kind == "add":
                values.append(values[a] + values[b])
            else:
                values.append(getattr(torch, kind)(values[a]))
        return torch.stack(values).sum(0)

    c = sd.compile(f, batch=True, device="sim", streams=3)
    with torch.no_grad():
        x = torch.randn(4, 6, generator=gen)
        torch.testing.assert_close(c(x), f(x), rtol=1e-5, atol=1e-5)
        assert c.statistics().eager_calls == 0



@pytest.mark.parametrize("device", DEVICES)
def test_one_op_on_independent_tensors_becomes_one_multi_tensor_kernel(device):
    """tanh and relu of separate tensors of different shapes: one _foreach_ kernel each."""
    ws = [torch.randn(8, n) for n in (4, 6, 8)]

    def branches(x):
        outs = [torch.tanh(x @ w) for w in ws]  # different shapes: not one bmm
        return [torch.relu(o - 0.1) for o in outs], torch.relu(x)

    c = sd.compile(branches, batch=True, device=device)
    with torch.no_grad():
        x = torch.randn(5, 8)
        x[0, 0] = float("nan")  # relu keeps NaN, and so must its multi-tensor form
        got, want = c(x), branches(x)
    torch.testing.assert_close(got, want, equal_nan=True)
    text = c.explain()
    assert "1 x foreach tanh (sizes [3])" in text and "1 x foreach relu (sizes [4])" in text
