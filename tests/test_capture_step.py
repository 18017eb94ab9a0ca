"""``streamdag.capture_step``: a whole training step (forward, backward, optimizer) as one CUDA graph.

Without a GPU: a step runs as written and says so, and bad arguments get errors that name the fix.
The ``cuda`` tests check captured steps against eager ones, step by step with new data each step
(a replay that missed its inputs' copy fails them): parameters, optimizer state, batch norm's
running statistics, gradient accumulation, a float lr changed by a scheduler (captured again) and a
tensor lr (read by the graph), a ``streamdag.compile``'d and a ``torch.compile``'d model inside, and
the errors of steps that cannot be captured.
"""

import copy
import warnings

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Net(torch.nn.Module):
    """Two convolution branches of one input, batch norm, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        # (no biases before batch norm: their gradient is zero but for rounding, which AdamW's
        # normalised step would turn into steps of lr in directions that differ between kernels)
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.b = torch.nn.Conv2d(3, 8, 1, bias=False)
        self.bn = torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(torch.cat([self.a(x), self.b(x)], 1)))
        return self.head(h.mean((2, 3)))


def make_step(model, opt, micro_batches=1):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        total = 0
        for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            loss = torch.nn.functional.cross_entropy(model(xs), ys) / micro_batches
            loss.backward()
            total = total + loss.detach()
        opt.step()
        return {"loss": total}
    return step


def batches(n, device, batch=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, 12, 12, generator=g).to(device),
             torch.randint(0, 5, (batch,), generator=g).to(device)) for _ in range(n)]


# -- without a GPU ----------------------------------------------------------------------------------


def test_on_the_cpu_a_step_runs_as_written_and_explain_says_so():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    step = sd.capture_step(make_step(model, opt))
    eager = make_step(ref, ref_opt)
    for x, y in batches(3, "cpu"):
        torch.testing.assert_close(step(x, y)["loss"], eager(x, y)["loss"])
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert step.statistics()["eager_calls"] == 3 and step.statistics()["captures"] == 0
    assert "off CUDA ran the step as written" in step.explain()


@pytest.mark.parametrize("bad, error, words", [
    (lambda: sd.capture_step(3), TypeError, "needs a function"),
    (lambda: sd.capture_step(lambda: 0, warmup=0), ValueError, "at least 1"),
])
def test_bad_settings_are_refused_with_the_fix(bad, error, words):
    with pytest.raises(error, match=words):
        bad()


# -- on a GPU ---------------------------------------------------------------------------------------


def _pair(device, compile_with=None, lr=1e-3, tensor_lr=False, micro_batches=1, sgd=False):
    torch.manual_seed(0)
    model = Net().to(device)
    ref = copy.deepcopy(model)
    lr_value = torch.tensor(lr, device=device) if tensor_lr else lr
    if sgd:  # (no capturable setting: SGD keeps no step count)
        opt = torch.optim.SGD(model.parameters(), lr=lr_value, momentum=0.9, foreach=True)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9, foreach=False)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr_value, fused=True, capturable=True)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, foreach=False)
    run = model if compile_with is None else compile_with(model)
    return (sd.capture_step(make_step(run, opt, micro_batches), warmup=2), opt, model,
            make_step(ref, ref_opt, micro_batches), ref_opt, ref)


def _same_state(model, ref, opt, ref_opt, tol=1e-4):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol / 10, msg=n)
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, dict(ref.named_buffers())[n], rtol=tol, atol=tol / 10, msg=n)
    for p, q in zip(model.parameters(), ref.parameters()):
        for key in opt.state[p].keys() - {"step"}:
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], rtol=tol, atol=tol / 100)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("how", ["eager", "streamdag", "inductor"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_on_cuda_captured_steps_match_eager_steps_on_new_data_each_step(no_tf32, how, micro_batches):
    compile_with = {"eager": None, "streamdag": sd.compile, "inductor": torch.compile}[how]
    tol = 1e-4 if how == "eager" else 1e-3  # (the same kernels as eager's, or Inductor's fused ones)
    step, opt, model, eager, ref_opt, ref = _pair("cuda", compile_with, micro_batches=micro_batches)
    for x, y in batches(7, "cuda"):
        torch.testing.assert_close(step(x, y)["loss"], eager(x, y)["loss"], rtol=tol, atol=tol / 10)
    torch.cuda.synchronize()
    _same_state(model, ref, opt, ref_opt, tol)
    stats = step.statistics()
    assert stats["warmup_calls"] == 2 and stats["captures"] == 1 and stats["replays"] == 5


@pytest.mark.cuda
@cuda
def test_on_cuda_a_streamdag_compiled_model_inside_a_captured_step_stays_off_the_trees():
    torch.manual_seed(0)
    model = Net().cuda()
    fast = sd.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    step = sd.capture_step(make_step(fast, opt), warmup=2)
    for x, y in batches(4, "cuda"):
        step(x, y)
    text = fast.explain()
    assert "inside streamdag.capture_step" in text, text
    assert "under Inductor's CUDA graph trees (they warm up" not in text, text
    assert step.statistics()["replays"] == 2


@pytest.mark.cuda
@cuda
def test_on_cuda_a_float_lr_changed_by_a_scheduler_captures_again_and_a_tensor_lr_does_not(no_tf32):
    for tensor_lr in (False, True):
        step, opt, model, eager, ref_opt, ref = _pair("cuda", tensor_lr=tensor_lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for x, y in batches(8, "cuda"):
                torch.testing.assert_close(step(x, y)["loss"], eager(x, y)["loss"], rtol=1e-4, atol=1e-5)
                sched.step()
                ref_sched.step()
        torch.cuda.synchronize()
        _same_state(model, ref, opt, ref_opt)
        captures = step.statistics()["captures"]
        assert captures == 1 if tensor_lr else captures > 1, (tensor_lr, step.explain())


@pytest.mark.cuda
@cuda
def test_on_cuda_a_new_batch_shape_is_a_signature_of_its_own(no_tf32):
    step, opt, model, eager, ref_opt, ref = _pair("cuda", lr=1e-2, sgd=True)
    for x, y in batches(4, "cuda", batch=8) + batches(4, "cuda", batch=4, seed=1) + batches(2, "cuda"):
        torch.testing.assert_close(step(x, y)["loss"], eager(x, y)["loss"], rtol=1e-4, atol=1e-5)
    torch.cuda.synchronize()
    _same_state(model, ref, opt, ref_opt)
    assert step.statistics()["signatures"] == 2 and step.statistics()["captures"] == 2


@pytest.mark.cuda
@cuda
def test_on_cuda_steps_that_cannot_be_captured_raise_errors_that_name_the_fix():
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # not capturable
    step = sd.capture_step(make_step(model, opt), warmup=1)
    x, y = batches(1, "cuda")[0]
    step(x, y)
    with pytest.raises(RuntimeError, match="capturable=True"):
        step(x, y)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)

    def reads_the_loss(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    step = sd.capture_step(reads_the_loss, warmup=1)
    step(x, y)
    with pytest.raises(RuntimeError, match=r"\.item\(\)"):
        step(x, y)
    with pytest.raises(ValueError, match="detached"):
        sd.capture_step(reads_the_loss)(x.requires_grad_(), y)
    with pytest.raises(TypeError, match="plain values"):
        sd.capture_step(lambda x, obj: x)(y, object())
