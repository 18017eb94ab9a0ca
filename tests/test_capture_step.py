"""``streamdag.capture_step``: a whole training step (forward, backward, optimizer) as one CUDA graph.

Without a GPU: a step runs as written and says so, and bad arguments get errors that name the fix.
The ``cuda`` tests check captured steps against eager ones, step by step with new data each step
(a replay that missed its inputs' copy fails them): parameters, optimizer state, batch norm's
running statistics, gradient accumulation, a float lr changed by a scheduler (captured again) and a
tensor lr (read by the graph), a ``streamdag.compile``'d and a ``torch.compile``'d model inside, and
the errors of steps that cannot be captured.
"""

import copy
import functools
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


def test_on_the_cpu_a_step_is_refused_for_what_a_gpu_refuses():
    """A step written and tried on the CPU meets the rules of a captured step there: an argument
    that requires grad, an argument of another type, a result that is not tensors."""
    x, y = batches(1, "cpu")[0]
    with pytest.raises(ValueError, match="an argument requires grad"):
        sd.capture_step(lambda a: a.sum())(x.requires_grad_())
    with pytest.raises(TypeError, match="an argument of type object"):
        sd.capture_step(lambda a, b: a.sum())(y, object())
    ran = []
    with pytest.raises(TypeError, match=r"returns float: .*not loss.item\(\)"):
        sd.capture_step(lambda a: ran.append(1) or a.float().sum().item())(y)
    assert ran == [1]  # (as on a GPU: the first call runs the step, then refuses its result)
    out = sd.capture_step(lambda a: {"loss": a.float().sum(), "none": None, "n": 3 * a})(y)
    assert out["n"].shape == (8,) and out["none"] is None


@pytest.mark.parametrize("bad, error, words", [
    (lambda: sd.capture_step(3), TypeError, "needs a function"),
    (lambda: sd.capture_step(lambda: 0, warmup=0), ValueError, "at least 1"),
    (lambda: sd.capture_step(lambda: 0, max_signatures=0), ValueError, "max_signatures must be an int of at"),
    (lambda: sd.capture_step(max_signatures="4"), ValueError, "max_signatures must be an int of at"),
])
def test_bad_settings_are_refused_with_the_fix(bad, error, words):
    with pytest.raises(error, match=words):
        bad()


def test_capture_step_is_a_decorator_with_settings_or_without():
    @sd.capture_step(warmup=5)
    def step(x):
        return x + 1

    @sd.capture_step
    def plain(x):
        return x * 2

    assert step.warmup == 5 and step.fn(1) == 2
    assert plain.warmup == 3 and plain.fn(2) == 4


def test_the_watch_sees_what_a_replay_would_miss_and_not_what_it_reads_where_it_lies():
    """Baked (what a captured graph holds of the optimizers): a float lr changed, a .grad replaced,
    state replaced or cleared or a parameter's memory moved is a change; a tensor lr filled in
    place and gradients zeroed in place are not."""
    from streamdag.frontend.step_watch import Baked

    model = Net()
    for tensor_lr in (False, True):
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3) if tensor_lr else 1e-3)
        make_step(model, opt)(*batches(1, "cpu")[0])
        baked = Baked([opt], list(model.parameters()))
        assert baked.changed() == ("", False)
        if tensor_lr:
            opt.param_groups[0]["lr"].fill_(5e-4)  # a scheduler's update, read by the graph
            assert baked.changed() == ("", False)
        else:
            opt.param_groups[0]["lr"] = 5e-4
            why, replaced = baked.changed()
            assert "lr was 0.001, is 0.0005" in why and not replaced
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = make_step(model, opt)
    loss(*batches(1, "cpu")[0])
    model.head.weight.grad = torch.zeros_like(model.head.weight)
    baked = Baked([opt], list(model.parameters()))
    opt.zero_grad(set_to_none=False)
    assert baked.changed() == ("", False)
    opt.zero_grad(set_to_none=True)
    assert baked.changed() == ("a gradient the step adds to was replaced or set to None outside it "
                               "(zero it in place, or inside the step)", False)
    baked = Baked([opt], list(model.parameters()))
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # a checkpoint's state
    assert "state was replaced" in baked.changed()[0]
    baked = Baked([opt], list(model.parameters()))
    opt.state.clear()
    assert "state was replaced" in baked.changed()[0]
    baked = Baked([opt], list(model.parameters()))
    model.head.weight.data = model.head.weight.data.clone()
    assert "memory moved" in baked.changed()[0]


NEW_PRECISION = hasattr(torch.backends.cuda.matmul, "fp32_precision")


@pytest.mark.parametrize("switch", [
    "cudnn.allow_tf32", "cudnn.deterministic", "cuda.matmul.allow_tf32",
    *(["cudnn.conv.fp32_precision", "cuda.matmul.fp32_precision"] if NEW_PRECISION else [])])
def test_the_watch_sees_a_precision_switch_turned_after_the_capture(no_tf32, switch):
    """A graph repeats the kernels its capture chose: a switch of what a convolution or a matmul
    computes, turned since (a flag, or a per-operator precision where PyTorch has them, after which
    the flags raise when read), is a change that asks for a warm-up (Dynamo may compile again)."""
    from streamdag.frontend.step_watch import Baked

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    make_step(model, opt)(*batches(1, "cpu")[0])
    *path, name = switch.split(".")
    where = functools.reduce(getattr, path, torch.backends)
    was = getattr(where, name)
    baked = Baked([opt], list(model.parameters()))
    try:
        setattr(where, name, ("ieee" if was == "tf32" else "tf32") if isinstance(was, str) else not was)
        why, replaced = baked.changed()
        assert "precision switch" in why and replaced
        setattr(where, name, was)
        assert baked.changed() == ("", False)
    finally:
        setattr(where, name, was)


def test_the_watch_finds_the_parameters_a_step_reaches_and_the_optimizers_that_step():
    from streamdag.frontend.step_watch import host_state, optimizers_stepping, reachable_params

    model, other = Net(), torch.nn.Linear(2, 2)

    class Trainer:
        def __init__(self):
            self.model = model

        def step(self, x):
            return self.model(x)

    def by_closure(x):
        return model(x)

    def through_a_helper(x):
        return by_closure(x)

    ids = {id(p) for p in model.parameters()}
    import functools

    class CallableTrainer:
        def __init__(self):
            self.model = model

        def __call__(self, x):
            return self.model(x)

    for fn in (by_closure, through_a_helper, Trainer().step, model, CallableTrainer(),
               functools.partial(lambda m, x: m(x), model), functools.partial(through_a_helper)):
        assert {id(p) for p in reachable_params(fn, [])} == ids
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    assert {id(p) for p in reachable_params(lambda x: x, [opt])} == {id(p) for p in other.parameters()}

    import threading

    with optimizers_stepping() as seen:
        elsewhere = threading.Thread(target=opt.step)  # another thread's step is not this step's
        elsewhere.start()
        elsewhere.join()
        mine = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        make_step(model, mine)(*batches(1, "cpu")[0])
    assert seen == [mine]
    assert host_state([mine], torch.device("cpu")) == ""
    lbfgs = torch.optim.LBFGS(other.parameters())
    lbfgs.step(lambda: other(torch.ones(1, 2)).sum())
    assert "as a Python number" in host_state([lbfgs], torch.device("cpu"))


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
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for x, y in batches(8, "cuda"):
                torch.testing.assert_close(step(x, y)["loss"], eager(x, y)["loss"], rtol=1e-4, atol=1e-5)
                sched.step()
                ref_sched.step()
        torch.cuda.synchronize()
        _same_state(model, ref, opt, ref_opt)
        # warm-ups at calls 1-2, the lr halves after calls 2, 4 and 6: a float lr is captured at
        # calls 3, 5 and 7 (and warns at the third capture); a tensor lr once
        assert step.statistics()["captures"] == (1 if tensor_lr else 3), step.explain()
        warned = [w for w in seen
                  if issubclass(w.category, sd.StreamdagWarning) and "lr as a tensor" in str(w.message)]
        assert len(warned) == (0 if tensor_lr else 1)


@cuda
def test_on_cuda_a_precision_switch_turned_after_the_capture_captures_the_step_again(no_tf32):
    step, _, _, eager, _, _ = _pair("cuda")
    data = batches(6, "cuda")
    torch.backends.cudnn.allow_tf32 = True
    for x, y in data[:3]:  # two warm-ups, the capture
        step(x, y)
        eager(x, y)
    torch.backends.cudnn.allow_tf32 = False
    for x, y in data[3:]:  # two warm-ups, the capture under the new switch
        torch.testing.assert_close(step(x, y)["loss"], eager(x, y)["loss"], rtol=1e-3, atol=1e-4)
    assert step.statistics()["captures"] == 2, step.explain()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("zero_after", [0, 1])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_on_cuda_gradients_accumulated_over_calls_with_the_optimizer_outside_match_eager(
        no_tf32, zero_after, set_to_none):
    """The step only runs forward and backward; an optimizer outside it steps and zeroes every
    second call. Zeroed to None, the .grad tensors the graph writes are replaced: the step is
    captured again. A capture that finds no .grad makes one (``zero_after=0``: the capture follows
    a zeroing): the gradients then start from zeros, so that later replays add to them as
    ``backward()`` does. Zeroed in place, the graph keeps its tensors: one capture."""
    torch.manual_seed(0)
    model = Net().cuda()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)

    def make(m):
        def accumulate(x, y):
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            return loss.detach()
        return accumulate

    step, eager = sd.capture_step(make(model), warmup=1), make(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (x, y) in enumerate(batches(9, "cuda")):
            torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-4, atol=1e-5)
            if i % 2 == zero_after:
                for o in (opt, ref_opt):
                    o.step()
                    o.zero_grad(set_to_none=set_to_none)
    torch.cuda.synchronize()
    _same_state(model, ref, opt, ref_opt)
    if not set_to_none:
        assert step.statistics()["captures"] == 1, step.explain()


@pytest.mark.cuda
@cuda
def test_on_cuda_a_new_batch_shape_is_a_signature_of_its_own(no_tf32):
    step, opt, model, eager, ref_opt, ref = _pair("cuda", lr=1e-2, sgd=True)
    for x, y in batches(4, "cuda", batch=8) + batches(4, "cuda", batch=4, seed=1) + batches(2, "cuda"):
        torch.testing.assert_close(step(x, y)["loss"], eager(x, y)["loss"], rtol=1e-4, atol=1e-5)
    torch.cuda.synchronize()
    _same_state(model, ref, opt, ref_opt)
    stats = step.statistics()
    assert stats["signatures"] == 2 and stats["captures"] == 2
    # each signature's graph owns the gradients it makes (the step zeroes them first): switching
    # back replays, without new warm-up calls
    assert stats["warmup_calls"] == 4 and stats["replays"] == 6, step.explain()


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

    opt = torch.optim.Adagrad(model.parameters(), lr=1e-3)  # its step count is a CPU tensor
    step = sd.capture_step(make_step(model, opt), warmup=1)
    step(x, y)
    with pytest.raises(RuntimeError, match="Adagrad keeps its state 'step' as a CPU tensor"):
        step(x, y)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)

    def reads_the_loss(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if loss.item() > 1e9:  # waits for the host: no CUDA graph holds it
            print("diverged")
        opt.step()
        opt.zero_grad()
        return loss.detach()

    step = sd.capture_step(reads_the_loss, warmup=1)
    step(x, y)
    with pytest.raises(RuntimeError, match="could not be captured") as failed:
        step(x, y)
    assert "captur" in str(failed.value.__cause__).lower()
    assert all(p.grad is None for p in model.parameters())  # none left pointing into the failed pool
    with pytest.raises(RuntimeError, match=r"capture failed .* call reset\(\)"):
        step(x, y)  # not captured again at every call

    def returns_a_number(x, y):
        return float(model(x).sum())

    with pytest.raises(TypeError, match="return tensors"):
        sd.capture_step(returns_a_number)(x, y)  # at the first call, before any capture
    with pytest.raises(ValueError, match="detached"):
        sd.capture_step(reads_the_loss)(x.clone().requires_grad_(), y)
    with pytest.raises(TypeError, match="plain values"):
        sd.capture_step(lambda x, obj: x)(y, object())


@pytest.mark.cuda
@cuda
def test_on_cuda_a_scheduler_stepped_inside_the_step_is_refused():
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True,
                            capturable=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    inner = make_step(model, opt)

    def step_and_schedule(x, y):
        out = inner(x, y)
        sched.step()
        return out

    step = sd.capture_step(step_and_schedule, warmup=1)
    x, y = batches(1, "cuda")[0]
    step(x, y)
    with pytest.raises(RuntimeError, match="scheduler outside the step"):
        step(x, y)


@pytest.mark.cuda
@cuda
def test_on_cuda_an_argument_the_step_writes_in_place_is_written_back_and_dropout_draws_anew():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x, seen):
        out = model(x)
        out.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seen.add_(1)  # a counter the caller keeps
        return out.detach()

    captured = sd.capture_step(step, warmup=1)
    x, seen = torch.ones(4, 16, device="cuda"), torch.zeros((), device="cuda")
    outs = [captured(x, seen) for _ in range(4)]
    assert int(seen) == 4
    assert captured.statistics()["replays"] == 3
    masks = [o == 0 for o in outs[1:]]  # (replays: each draws its own dropout mask)
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
