"""Training through the compile path: AOTAutograd's forward and backward, compiled, on regions.

The end-to-end tests compile with Inductor's CPU code generator and are marked
``slow``; each compiles one model (a forward and a backward), with regions forced
where the test is about them (on the CPU regions are not compiled by default).
The ``cuda`` tests need a GPU.
"""

import copy
import gc
import warnings
import weakref

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from streamdag.errors import StreamdagWarning  # noqa: E402
from streamdag.frontend.aten_facts import has_random, written_inputs  # noqa: E402
from streamdag.frontend.inductor_regions import CompiledRegion, RegionProgram, region_graph  # noqa: E402
from streamdag.frontend.regions import plan_regions  # noqa: E402

REGIONS = {"regions": "always", "candidates": ["regions"]}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class BranchyNet(torch.nn.Module):
    """Two convolution branches of one input, batch norm on their join, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(3, 8, 1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)
        return self.fc(torch.relu(self.bn(y)).mean((2, 3)))


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention (its q, k, v projections are independent) and an MLP."""

    def __init__(self, dim: int = 32, heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        # no key bias: its gradient is zero in exact arithmetic (softmax ignores a shift shared by
        # every key), so Adam would turn rounding noise into full-size updates
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim, bias=(i != 1)) for i in range(3))
        self.o = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(),
                                       torch.nn.Linear(2 * dim, dim))
        # (dropout at 0 still draws random numbers, which keeps a graph whole: leave it out)
        self.drop = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1)
        x = x + self.drop(self.o((att @ v).transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(self.ln2(x))


def train_steps(model, step_model, batches, make_opt, accumulate=1):
    """``len(batches)`` micro-batches, an optimizer step every ``accumulate``; the losses."""
    opt = make_opt(model.parameters())
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = torch.nn.functional.mse_loss(step_model(x), y) / accumulate
        loss.backward()
        losses.append(loss.detach())
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return losses


def assert_same_state(model, ref, rtol=1e-4, atol=1e-5):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def explained_chosen(fast) -> list[str]:
    """The chosen candidate's line of each training graph's explanation."""
    return [line.strip() for line in fast.explain().splitlines() if "<- chosen" in line]


# -- the pieces, without Inductor -----------------------------------------------------------------


def _run_owning_a_fresh_x(gm, plan, region_fn, args, refs):
    """Each region of ``plan`` compiled through ``region_fn``, run by a program that owns its inputs,
    the first a fresh copy of ``args[0]`` no one else holds (``refs[0]``: a weak reference to it)."""
    compiled = [CompiledRegion(r, region_fn(region_graph(gm, r, [n.meta["val"] for n in r.inputs])))
                for r in plan.regions]
    program = RegionProgram(gm, plan, compiled, owns_inputs=True)
    x = args[0].clone()
    refs.append(weakref.ref(x))
    inputs = [x, *args[1:]]
    del x
    return compiled, inputs, program.run(inputs, 1)


def _last_reader_of_the_first_input(gm, compiled):
    first = gm.graph.find_nodes(op="placeholder")[0]
    return max(i for i, c in enumerate(compiled) if first in c.region.inputs)


def test_a_program_that_owns_its_inputs_drops_each_after_its_last_reader():
    """A backward's saved activations are its inputs: kept to the end, they would outlive their
    last use, which Inductor's whole graph does not let them."""
    def fn(x, y, w):
        a = (x @ w).relu()  # x's last reader
        b = (y @ w).tanh()
        return (a @ w).sum() + (b @ w).sum()

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(16, 16, generator=g) for _ in range(3)]
    gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    plan = plan_regions(gm, 2, min_stream_share=0.0)
    assert len(plan.regions) >= 2
    alive_at = []
    refs: list[weakref.ref] = []

    def region_fn(sub):
        def run(inputs):
            gc.collect()
            alive_at.append(refs[0]() is not None)  # is x alive as this region starts?
            out = sub(*inputs)
            inputs.clear()
            return out
        return run

    compiled, inputs, out = _run_owning_a_fresh_x(gm, plan, region_fn, args, refs)
    assert inputs == []  # the boxed convention: the program took the inputs
    torch.testing.assert_close(out[0], fn(*args))
    readers_of_x = _last_reader_of_the_first_input(gm, compiled)
    assert readers_of_x < len(compiled) - 1, "the plan should read x before its last region"
    assert alive_at[readers_of_x] and not alive_at[-1]


def test_the_last_reader_of_an_owned_input_holds_its_only_reference_and_frees_it_itself():
    """As Inductor's whole graph frees a buffer after its last use inside its code, a region that
    is an input's last reader gets it as its only reference: its code (which clears the list it
    is handed, as Inductor's boxed call does) frees it before the region ends."""
    def fn(x, y, w):
        a = (x @ w).relu()  # x's last reader
        b = (y @ w).tanh()
        return (a @ w).sum() + (b @ w).sum()

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(16, 16, generator=g) for _ in range(3)]
    gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    plan = plan_regions(gm, 2, min_stream_share=0.0)
    freed_inside: list[bool] = []
    refs: list[weakref.ref] = []

    def region_fn(sub):
        def run(inputs):
            values = list(inputs)
            inputs.clear()
            out = sub(*values)
            del values
            gc.collect()
            freed_inside.append(refs[0]() is None)  # is x gone before this region returns?
            return out
        return run

    compiled, _, out = _run_owning_a_fresh_x(gm, plan, region_fn, args, refs)
    torch.testing.assert_close(out[0], fn(*args))
    readers_of_x = _last_reader_of_the_first_input(gm, compiled)
    assert freed_inside[readers_of_x] and not any(freed_inside[:readers_of_x])


def test_a_program_of_the_callers_inputs_keeps_them():
    def fn(x, w):
        return (x @ w).relu() + (x @ w.t()).tanh()

    args = [torch.randn(8, 8), torch.randn(8, 8)]
    gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    plan = plan_regions(gm, 2, min_stream_share=0.0)
    subs = [region_graph(gm, r, [n.meta["val"] for n in r.inputs]) for r in plan.regions]
    compiled = [CompiledRegion(r, lambda a, s=sub: s(*a)) for r, sub in zip(plan.regions, subs)]
    inputs = list(args)
    RegionProgram(gm, plan, compiled).run(inputs, 1)
    assert inputs == args


def test_written_inputs_are_the_placeholders_an_operator_writes_in_place():
    def fn(x, running, w):
        running.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x @ w

    gm = make_fx(fn)(torch.randn(4, 4), torch.zeros(4), torch.randn(4, 4))
    assert written_inputs(gm) == [1]


def test_graphs_with_random_operators_are_found():
    gm = make_fx(lambda x: torch.nn.functional.dropout(x, 0.5) + x)(torch.randn(4))
    assert has_random(gm)
    assert not has_random(make_fx(lambda x: x.relu() + x)(torch.randn(4)))


def test_attention_draws_random_numbers_only_with_dropout():
    """Attention kernels are tagged as seeded for their dropout: at 0 they draw nothing."""
    def attention_graph(dropout_p):
        graph = torch.fx.Graph()
        q = graph.placeholder("q")
        graph.output(graph.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                                          (q, q, q), {"dropout_p": dropout_p}))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    assert not has_random(attention_graph(0.0))
    assert has_random(attention_graph(0.1))


def test_the_cost_model_counts_a_convolutions_backward_as_its_gradients_forward_convolutions():
    """A backward's convolutions are its heavy operators: the planner must not take them for
    free pointwise work."""
    from streamdag.frontend.regions import _flops

    x, w = torch.randn(2, 4, 8, 8, requires_grad=True), torch.randn(6, 4, 3, 3, requires_grad=True)

    def fwd_bwd(x, w):
        out = torch.nn.functional.conv2d(x, w, padding=1)
        return torch.autograd.grad(out.sum(), (x, w))

    gm = make_fx(fwd_bwd, tracing_mode="fake", _allow_non_fake_inputs=True)(x, w)
    names = {n: getattr(n.target, "__name__", "") for n in gm.graph.nodes}
    (bwd,) = [n for n, name in names.items() if name.startswith("convolution_backward")]
    (fwd,) = [n for n, name in names.items() if name.startswith("convolution.")]
    assert _flops(bwd) == pytest.approx(2 * _flops(fwd))


# -- end to end, with Inductor's CPU code generator ------------------------------------------------


@pytest.mark.slow
def test_a_branchy_conv_net_with_batch_norm_trains_on_regions_as_eager_does():
    """Forward and backward both cut into regions; SGD with momentum (foreach), gradient
    accumulation over two micro-batches, batch norm's running statistics: as eager, step by step."""
    torch.manual_seed(0)
    ref = BranchyNet()
    model = copy.deepcopy(ref)
    fast = sd.compile(model, **REGIONS)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(6)]

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)

    losses = train_steps(model, fast, batches, sgd, accumulate=2)
    ref_losses = train_steps(ref, ref, batches, sgd, accumulate=2)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    assert_same_state(model, ref)
    chosen = explained_chosen(fast)
    assert any(c.startswith("candidate regions") for c in chosen), fast.explain()
    assert "backward (training)" in fast.explain()
    assert fast.statistics().eager_calls == 0


class PooledGates(torch.nn.Module):
    """A convolution whose output three branches read (one through a pooled convolution), gated
    together: Inductor's whole forward saves it contiguous, a region alone would make it
    channels-last for the convolution that reads it."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.g1 = torch.nn.GroupNorm(1, c)
        self.pool = torch.nn.Sequential(torch.nn.AvgPool2d(3, 1, 1), torch.nn.Conv2d(c, c, 1))
        self.g2 = torch.nn.GroupNorm(1, c)
        self.head = torch.nn.Linear(c, 5)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        z = self.g1(h) * torch.sigmoid(self.pool(h)) * torch.sigmoid(self.g2(h))
        return self.head(z.mean((2, 3)))


@pytest.mark.slow
@pytest.mark.parametrize("size_asserts", [True, False])
def test_a_forwards_regions_save_activations_with_the_strides_its_backward_was_compiled_for(
        size_asserts):
    """Each saved activation a region outputs is forced to the whole forward's strides, whatever its
    metadata says; without Inductor's stride asserts a wrong one would give wrong gradients."""
    torch.manual_seed(0)
    ref = PooledGates()
    model = copy.deepcopy(ref)
    fast = sd.compile(model, regions="always", candidates=["regions"],
                      inductor={"size_asserts": size_asserts})
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randn(4, 5, generator=g)) for _ in range(2)]

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)

    train_steps(model, fast, batches, sgd)
    train_steps(ref, ref, batches, sgd)
    assert_same_state(model, ref)
    assert fast.statistics().eager_calls == 0
    chosen = explained_chosen(fast)
    assert len(chosen) == 2 and all(c.startswith("candidate regions") for c in chosen), fast.explain()


@pytest.mark.slow
@pytest.mark.parametrize("min_gain", [None, 0.15])
def test_a_backward_compiles_regions_from_a_lower_predicted_gain_than_a_forward(monkeypatch, min_gain):
    """By default a backward's regions are compiled from BACKWARD_MIN_GAIN, a forward's from
    MIN_GAIN; a min_gain asked for holds for both. The planner's estimate is set to 10% here."""
    import dataclasses

    from streamdag.frontend import inner_compile

    assert inner_compile.BACKWARD_MIN_GAIN < 0.10 < inner_compile.MIN_GAIN
    plan_for_real = inner_compile.plan_regions

    def ten_percent(gm, streams):
        plan = plan_for_real(gm, streams)
        return dataclasses.replace(plan, estimate_ms=plan.one_stream_ms * 0.9)

    monkeypatch.setattr(inner_compile, "plan_regions", ten_percent)
    torch.manual_seed(0)
    model = BranchyNet()
    # (candidates named: on the CPU regions are otherwise not compiled)
    fast = sd.compile(model, candidates=["inductor", "regions"],
                      **({} if min_gain is None else {"min_gain": min_gain}))
    x, y = torch.randn(4, 3, 8, 8), torch.randn(4, 4)
    torch.nn.functional.mse_loss(fast(x), y).backward()
    graphs = {t.kind: t for r in fast.backend.runners for t in getattr(r, "training", ())}
    assert set(graphs) == {"forward", "backward"}, fast.explain()
    assert graphs["forward"].program is None
    assert "the cost model's gain 10.0% is under 15%" in graphs["forward"].region_note
    if min_gain is None:
        assert graphs["backward"].program is not None, fast.explain()
    else:
        assert graphs["backward"].program is None
        assert "the cost model's gain 10.0% is under 15%" in graphs["backward"].region_note


@pytest.mark.slow
def test_a_transformer_block_trains_on_regions_with_adam_as_eager_does():
    torch.manual_seed(0)
    ref = Block()
    model = copy.deepcopy(ref)
    fast = sd.compile(model, **REGIONS)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g)) for _ in range(3)]

    def adam(params):
        return torch.optim.Adam(params, lr=1e-2, foreach=True)

    losses = train_steps(model, fast, batches, adam)
    ref_losses = train_steps(ref, ref, batches, adam)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=1e-4, atol=1e-5)
    assert_same_state(model, ref, rtol=1e-3, atol=1e-4)
    text = fast.explain()
    assert "forward (training)" in text and "backward (training)" in text
    assert sum(c.startswith("candidate regions") for c in explained_chosen(fast)) == 2, text


@pytest.mark.slow
def test_dropout_draws_the_numbers_torch_compile_draws_for_the_same_seed():
    """Inductor's random kernels are not eager's, so the reference is ``torch.compile``: with the
    same seed, the same masks, so the same outputs and gradients."""
    torch.manual_seed(0)
    ref = Block(dropout=0.3)
    model = copy.deepcopy(ref)
    fast = torch.compile(model, backend="streamdag")
    default = torch.compile(ref)
    x = torch.randn(2, 8, 32)
    for _ in range(2):
        torch.manual_seed(3)
        out = fast(x)
        out.square().sum().backward()
        torch.manual_seed(3)
        ref_out = default(x)
        ref_out.square().sum().backward()
        torch.testing.assert_close(out, ref_out)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.slow
def test_autocast_bf16_on_the_cpu_trains_as_eager_autocast_does():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    model = copy.deepcopy(ref)
    fast = sd.compile(model)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    for f in (fast, ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = f(x)
        assert out.dtype == torch.bfloat16
        torch.nn.functional.mse_loss(out.float(), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2)


def falls_back_at_double_backward(fast, model, ref, x):
    """The first create_graph backward through ``fast`` warns and gives eager's first gradients (a
    second backward through them raises torch's error); from the next call the model runs eagerly,
    so double backward gives eager's gradients."""
    def penalty(f):
        (gx,) = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        return gx

    with pytest.warns(StreamdagWarning, match="create_graph=True"):
        gx = penalty(fast)
    torch.testing.assert_close(gx, penalty(ref))
    with pytest.raises(RuntimeError, match="double backward"):
        gx.square().sum().backward()
    model.zero_grad()
    ref.zero_grad()
    penalty(fast).square().sum().backward()
    penalty(ref).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert fast.statistics().eager_calls >= 1


@pytest.mark.slow
def test_double_backward_after_plain_steps_raises_pytorchs_error_naming_donated_buffers_then_falls_back():
    """A backward compiled with donated buffers (PyTorch's default) cannot run under create_graph:
    PyTorch refuses before streamdag's backward sees the call, naming the setting; with donated
    buffers off, the create_graph backward warns and the model runs eagerly from its next call."""
    import torch._functorch.config as functorch_config

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8, requires_grad=True)
    for donated in (True, False):
        with functorch_config.patch(donated_buffer=donated):
            torch._dynamo.reset()
            model = copy.deepcopy(ref)
            fast = sd.compile(model)
            for _ in range(2):  # plain steps first: the backward is compiled for them
                fast(x).sum().backward()
            if donated:
                with pytest.raises(RuntimeError, match="donated_buffer=False"):
                    torch.autograd.grad(fast(x).sum(), x, create_graph=True)
            else:
                falls_back_at_double_backward(fast, model, ref, x)


@pytest.mark.slow
def test_double_backward_warns_then_runs_eagerly_with_eagers_gradients():
    """The compiled backward is not differentiable: the first create_graph backward warns (its
    first-order gradients are right, a second backward through them raises torch's error), and
    from the next call the model runs eagerly, so double backward is right."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = copy.deepcopy(ref)
    fast = sd.compile(model)
    x = torch.randn(4, 8, requires_grad=True)

    falls_back_at_double_backward(fast, model, ref, x)
    assert "create_graph=True" in fast.explain()


@pytest.mark.slow
def test_module_backward_hooks_fire_as_in_eager():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model = copy.deepcopy(ref)
    seen: dict[str, list[torch.Tensor]] = {"eager": [], "compiled": []}
    ref[2].register_full_backward_hook(lambda m, gi, go: seen["eager"].append(go[0].clone()))
    model[2].register_full_backward_hook(lambda m, gi, go: seen["compiled"].append(go[0].clone()))
    fast = sd.compile(model)
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note on full backward hooks' inputs
        for f in (fast, ref):
            f(x).square().sum().backward()
    assert len(seen["compiled"]) == len(seen["eager"]) == 1
    torch.testing.assert_close(seen["compiled"][0], seen["eager"][0])
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class _MaskedEmbedding(torch.nn.Module):
    """A learned vector written where a mask says, as speech models mask their features."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.fill = torch.nn.Parameter(torch.randn(8))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h[mask] = self.fill
        return self.head(torch.relu(h))


@pytest.mark.slow
def test_a_write_through_a_boolean_mask_trains_in_one_compiled_graph_as_eager():
    """The masked write's backward gathers by the mask (a shape that depends on the data, which
    AOTAutograd cannot trace): made a select, the whole forward and backward compile as one graph,
    nothing falls back or warns, and the gradients are eager's."""
    torch.manual_seed(0)
    ref = _MaskedEmbedding()
    model = copy.deepcopy(ref)
    fast = sd.compile(model)
    x, mask = torch.randn(4, 6, 8), torch.rand(4, 6) < 0.3
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamdagWarning)
        for f in (fast, ref):
            f(x, mask).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    stats = fast.statistics()
    assert (stats.graphs, stats.fallbacks, stats.eager_calls) == (1, 0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
], ids=["sgd-foreach", "adamw-foreach"])
def test_an_optimizer_step_compiled_by_streamdag_updates_the_parameters_as_eagers_step(make_opt):
    """``streamdag.compile(opt.step)`` beside ``streamdag.compile(model)``: four steps leave the
    parameters and the optimizer's state as eager's, each step a compiled graph. (A fused step is
    Dynamo's to skip: ``torch.compile`` makes no graph of it either.)"""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    model = copy.deepcopy(ref)
    fast, opt, ref_opt = sd.compile(model), make_opt(model.parameters()), make_opt(ref.parameters())
    step = sd.compile(opt.step)
    data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(4)]
    for x, y in data:
        torch.nn.functional.mse_loss(fast(x), y).backward()
        step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_state(model, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        for key, value in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=1e-5, atol=1e-6)
    assert step.statistics().eager_calls == 0, step.explain()


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_on_cuda_the_backward_runs_its_regions_on_streams_with_eagers_gradients():
    torch.manual_seed(0)
    ref = BranchyNet().cuda()
    model = copy.deepcopy(ref)
    fast = sd.compile(model, regions="always", candidates=["regions x2"])
    x, y = torch.randn(8, 3, 32, 32, device="cuda"), torch.randn(8, 4, device="cuda")

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)

    train_steps(model, fast, [(x, y)] * 3, sgd)
    train_steps(ref, ref, [(x, y)] * 3, sgd)
    torch.cuda.synchronize()
    assert_same_state(model, ref, rtol=1e-3, atol=1e-4)
    chosen = explained_chosen(fast)
    assert len(chosen) == 2 and all(c.startswith("candidate regions x2") for c in chosen), fast.explain()


@pytest.mark.cuda
def test_on_cuda_timing_the_candidates_leaves_batch_norm_and_the_generator_as_one_call_would():
    """The first call times each candidate by running it: the running statistics it updates and the
    random generators' states are put back, so one step equals eager's (and draws what it would)."""
    torch.manual_seed(0)
    ref = BranchyNet().cuda()
    model = copy.deepcopy(ref)
    fast = sd.compile(model, regions="always")
    x = torch.randn(8, 3, 32, 32, device="cuda")
    torch.cuda.manual_seed(5)
    fast(x).sum().backward()
    after = torch.cuda.get_rng_state()
    torch.cuda.manual_seed(5)
    ref(x).sum().backward()
    assert torch.equal(after, torch.cuda.get_rng_state())
    assert_same_state(model, ref, rtol=1e-3, atol=1e-4)
    text = fast.explain()
    # the one-stream graph (under Inductor's CUDA graph trees) is always a candidate
    assert "candidate cudagraphs on 1 stream(s)" in text
    assert text.count(" ms") >= 2  # timed


@pytest.mark.cuda
@pytest.mark.xfail(strict=True, reason="a step on regions peaks above the rule: a concatenation's inputs, "
                   "made in other regions, live longer than on one stream")
def test_on_cuda_a_step_on_regions_peaks_within_the_memory_rule_of_one_stream():
    """Regions free what they made and the saved activations after their last readers: a step on
    them holds no more than the rule lets a candidate hold over Inductor's one-stream graph."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(BranchyNet(), torch.nn.Linear(4, 4)).cuda()
    x = torch.randn(64, 3, 64, 64, device="cuda")
    peaks, explained = {}, {}
    for label in ("inductor", "regions"):
        model = copy.deepcopy(ref)
        fast = sd.compile(model, regions="always", candidates=[label])
        for _ in range(2):
            fast(x).sum().backward()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=False)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fast(x).sum().backward()
        torch.cuda.synchronize()
        peaks[label] = (torch.cuda.max_memory_allocated() - base) / 2**20
        explained[label] = fast.explain()
        if label == "regions":
            assert sum(c.startswith("candidate regions") for c in explained_chosen(fast)) == 2
    assert peaks["regions"] <= 1.1 * peaks["inductor"] + 8, (peaks, explained["regions"])


@pytest.mark.cuda
def test_on_cuda_training_runs_under_the_trees_and_inference_still_captures_the_whole_call():
    """Training graphs run under Inductor's CUDA graph trees (which keep a forward's activations
    from the next replay until the backward has read them), not in streamdag's own captures; the
    same model in inference captures its whole call as before."""
    torch.manual_seed(0)
    model = BranchyNet().cuda()
    fast = sd.compile(model)
    x = torch.randn(8, 3, 32, 32, device="cuda")
    for _ in range(3):
        fast(x).sum().backward()
    assert fast.statistics().captures == 0
    assert fast.statistics().tree_calls >= 3  # (the forward under the trees ran, timed or chosen)
    model.eval()
    with torch.inference_mode():
        for _ in range(3):
            out = fast(x)
        torch.testing.assert_close(out, model(x), rtol=1e-3, atol=1e-3)
    assert fast.statistics().whole_captures >= 1


def test_a_layout_check_ignores_dimensions_of_one_element_and_empty_tensors():
    from streamdag.frontend.inductor_regions import _same_layout

    assert not _same_layout((4, 8, 8, 8), (512, 1, 64, 8), (512, 64, 8, 1))
    assert _same_layout((4, 8, 1, 1), (8, 1, 8, 8), (8, 1, 1, 1))
    assert _same_layout((0, 8), (1, 0), (8, 1))
    assert _same_layout((4, 8), (1, 4), None)


@pytest.mark.slow
@pytest.mark.parametrize("wanted, why", [("cudagraphs", "CUDA graph trees take training graphs on one CUDA"),
                                         ("eager", "a training graph's candidates are Inductor's code")])
def test_a_candidate_a_training_graph_cannot_have_is_explained_by_its_kind(wanted, why):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fast = sd.compile(model, candidates=[wanted])
    fast(torch.randn(4, 8)).sum().backward()
    said = fast.explain()
    assert said.count(f"no candidate of ('{wanted}',) for this graph ({wanted}: ") == 2, said
    assert why in said, said


def test_strides_with_gaps_are_not_dense():
    from streamdag.frontend.lent_outputs import dense_strides

    assert dense_strides((4, 8, 8, 8), (512, 1, 64, 8)) and dense_strides((4, 8, 1), (8, 1, 99))
    assert not dense_strides((4, 8, 8), (72, 9, 1))  # (a row padded to 9)
