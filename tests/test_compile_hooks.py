"""Module hooks registered or removed after a compiled model's first calls run as eager runs them.

Dynamo does not guard module hooks by default: a compiled model compares its hooks with a snapshot
before each call on Dynamo's path and compiles again where they moved."""

import copy
import warnings

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")
nn = torch.nn

ENGINES = [pytest.param("inductor", marks=pytest.mark.slow), "aten"]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # (Dynamo's compiled code: none at each start)


def _model(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).to(device)


def _trained():
    """A model, its eager twin, the model compiled, an input: after two steps that agree."""
    m = _model()
    ref = copy.deepcopy(m)
    c = sd.compile(m)
    x = torch.randn(4, 8)
    _same_steps(c, m, ref, x)
    return m, ref, c, x


# --- calls without gradients ---------------------------------------------------------------------

def _hooked_calls(c, m, device, calls=4):
    """Calls before a forward hook, with it, and after its removal; each output against eager's."""
    x = torch.randn(4, 8, device=device)
    with torch.no_grad():
        for _ in range(calls):
            torch.testing.assert_close(c(x), m(x))
        handle = m[0].register_forward_hook(lambda module, args, out: out * 3)
        with_hook = [(c(x), m(x)) for _ in range(calls)]
        handle.remove()
        without = [(c(x), m(x)) for _ in range(calls)]
    return with_hook, without


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_forward_hook_added_after_the_first_calls_runs_from_the_next_call_and_stops_when_removed(
        engine, device):
    m = _model(device).eval()
    c = sd.compile(m, engine=engine)
    with_hook, without = _hooked_calls(c, m, device)
    for got, want in with_hook + without:
        torch.testing.assert_close(got, want)
    assert torch._dynamo.config.skip_nnmodule_hook_guards  # Dynamo's own setting, untouched


@pytest.mark.slow
def test_negative_control_without_the_hook_watch_a_hook_added_later_goes_unseen():
    m = _model().eval()
    c = sd.compile(m)
    c._hook_root = None  # Dynamo's default alone: hooks unguarded
    with_hook, _ = _hooked_calls(c, m, "cpu")
    assert all(not torch.allclose(got, want) for got, want in with_hook)


# --- calls with gradients (training) --------------------------------------------------------------

def _step(call, model, x):
    """One forward by ``call`` and backward: the output and ``model``'s gradients, then cleared."""
    out = call(x)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out.detach(), grads


def _same_steps(c, m, ref, x, steps=2):
    for _ in range(steps):
        (out, grads), (want, want_grads) = _step(c, m, x), _step(ref, ref, x)
        torch.testing.assert_close(out, want)
        for got, expected in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got, expected)


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    # (a ResourceWarning is the collector finding another test's unclosed runtime, whenever it runs)
    return [str(w.message) for w in caught
            if "streamdag.compile" in str(w.message) and not issubclass(w.category, ResourceWarning)]


def test_a_forward_hook_added_after_the_first_training_steps_runs_from_the_next_step_and_stops_when_removed():
    m, ref, c, x = _trained()
    handles = [mod[0].register_forward_hook(lambda module, args, out: out * 3) for mod in (m, ref)]
    said = _caught(lambda: _same_steps(c, m, ref, x))
    assert len(said) == 1 and "compiled again so that it runs" in said[0]
    for handle in handles:
        handle.remove()
    _same_steps(c, m, ref, x)
    assert c.statistics().eager_calls == 0


def test_a_backward_hook_added_after_the_first_training_steps_changes_the_gradients_as_in_eager():
    m, ref, c, x = _trained()
    for mod in (m, ref):
        mod[2].register_full_backward_pre_hook(lambda module, grad_out: (grad_out[0] * 0.5,))
    _caught(lambda: _same_steps(c, m, ref, x))


def test_a_hook_on_a_submodule_put_in_after_the_first_training_steps_runs():
    m, ref, c, x = _trained()
    m[2] = copy.deepcopy(ref[2])  # (Dynamo compiles the new submodule again; its hooks come after)
    _same_steps(c, m, ref, x)
    for mod in (m, ref):
        mod[2].register_forward_hook(lambda module, args, out: out - 1)
    _caught(lambda: _same_steps(c, m, ref, x))


def test_hooks_that_change_at_every_step_end_in_steps_run_as_written_that_say_why():
    from streamdag.frontend.compiled_model import _HOOK_COMPILES

    m = _model()
    ref = copy.deepcopy(m)
    c = sd.compile(m)
    x = torch.randn(4, 8)
    _same_steps(c, m, ref, x, steps=1)
    said = []
    for scale in range(2, _HOOK_COMPILES + 4):
        handles = [mod[0].register_forward_hook(lambda module, args, out, s=scale: out * s)
                   for mod in (m, ref)]
        said += _caught(lambda: _same_steps(c, m, ref, x, steps=1))
        for handle in handles:
            handle.remove()
    assert any("run as written" in s for s in said)
    assert c.statistics().eager_calls >= 1
    assert "register hooks before the first call" in c.explain()


def test_negative_control_without_the_hook_watch_a_training_step_misses_a_hook_added_later():
    m = _model()
    c = sd.compile(m)
    x = torch.randn(4, 8)
    _step(c, m, x)
    c._hook_root, c._hook_watch = None, None  # Dynamo's default alone
    m[0].register_forward_hook(lambda module, args, out: out * 3)
    assert not torch.allclose(_step(c, m, x)[0], _step(m, m, x)[0])


def test_hooks_registered_between_compile_and_the_first_step_compile_once_and_warn_of_nothing():
    m = _model()
    ref = copy.deepcopy(m)
    c = sd.compile(m)
    for mod in (m, ref):
        mod[0].register_forward_hook(lambda module, args, out: out + 1)
    said = _caught(lambda: _same_steps(c, m, ref, torch.randn(4, 8)))
    assert said == [] and c.statistics().graphs == 1


def test_a_model_holding_a_scripted_submodule_trains_and_sees_a_hook_added_later():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.scripted = torch.jit.script(nn.Linear(8, 8))  # (its submodules are no plain dict)
            self.tail = nn.Linear(8, 8)

        def forward(self, x):
            return self.tail(self.scripted(x))

    torch.manual_seed(0)
    m = Holder()
    torch.manual_seed(0)
    ref = Holder()  # (a deep copy of a scripted module leaves its parameters without gradients)
    c = sd.compile(m)
    x = torch.randn(4, 8)
    _same_steps(c, m, ref, x)
    for mod in (m, ref):
        mod.tail.register_forward_hook(lambda module, args, out: out * 2)
    _caught(lambda: _same_steps(c, m, ref, x))


def test_a_submodule_put_in_with_a_hook_already_on_it_runs_the_hook():
    m, ref, c, x = _trained()
    for mod in (m, ref):
        hooked = nn.Linear(8, 8)
        hooked.load_state_dict(mod[2].state_dict())
        hooked.register_forward_hook(lambda module, args, out: out - 1)
        mod[2] = hooked  # (the same class: Dynamo's guards alone would keep the old code)
    _caught(lambda: _same_steps(c, m, ref, x))


def test_threads_that_call_after_a_hook_change_all_run_the_hook_and_the_model_compiles_once_for_it():
    import sys
    import threading

    m = _model().eval()
    c = sd.compile(m, whole_call=False)
    x = torch.randn(4, 8)
    with torch.no_grad():
        c(x)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads take turns often: the window between check and compile)
    try:
        graphs = c.statistics().graphs
        m[2].register_forward_hook(lambda module, args, out: out * 3)
        with torch.no_grad():
            want = m(x)
        results, start = [], threading.Barrier(6)

        def call():
            with torch.no_grad():
                start.wait()
                results.append(c(x))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            threads = [threading.Thread(target=call) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(switch)
    assert len(results) == 6 and all(torch.allclose(r, want) for r in results)
    # one compile for the change; Dynamo itself may compile a frame twice where threads miss its
    # cache at once (seen in a full suite run), so its graph count only has to move
    assert c._hook_compiles == 1 and c.statistics().graphs > graphs


def test_a_lazy_module_compiles_once_and_warns_of_no_hook():
    torch.manual_seed(0)
    m = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 8))
    c = sd.compile(m)
    x = torch.randn(4, 8)
    said = _caught(lambda: [c(x).sum().backward() for _ in range(3)])
    assert said == [] and c.statistics().graphs == 1


def test_a_model_compiled_again_for_its_hooks_counts_dynamos_limit_from_none():
    """A hook change compiles the model again by a new wrapper, whose recompile limit starts over:
    the shapes before the change do not count towards the switch to symbolic shapes after it."""
    from streamdag.frontend import compiled_model

    if not compiled_model._OWN_RECOMPILE_LIMIT:
        pytest.skip("without isolate_recompiles a hook change runs the model as written")
    m = _model().eval()
    c = sd.compile(m)
    limit = torch._dynamo.config.recompile_limit
    before = limit // 2 + 1
    with torch.no_grad():
        for batch in range(1, before + 1):
            c(torch.randn(batch, 8))
        m[0].register_forward_hook(lambda module, args, out: out * 3)
        for batch in range(1, limit - 1):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(c(x), m(x))
    assert "symbolic shapes" not in c.explain() and c.statistics().eager_calls == 0


@pytest.mark.slow
def test_a_hook_added_for_a_few_calls_and_removed_again_and_again_compiles_for_the_hook_alone():
    """Hooks put back as they were (a hook that grabs activations for a few calls, then goes) find
    the code compiled for them: each cycle compiles once, for its hook, and the model never runs
    as written where it would have after two cycles."""
    from streamdag.frontend.compiled_model import _HOOK_COMPILES

    m = _model().eval()
    c = sd.compile(m)
    x = torch.randn(4, 8)
    seen = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", sd.StreamdagWarning)
        torch.testing.assert_close(c(x), m(x))
        for cycle in range(_HOOK_COMPILES):
            handle = m[0].register_forward_hook(lambda module, args, out: seen.append(out.shape) or None)
            torch.testing.assert_close(c(x), m(x))
            handle.remove()
            before = c.statistics().graphs
            for _ in range(2):
                torch.testing.assert_close(c(x), m(x))
            assert c.statistics().graphs == before, f"cycle {cycle}: the hook's removal compiled again"
    assert len(seen) == 2 * _HOOK_COMPILES  # (compiled and eager, each cycle)
    assert c.statistics().eager_calls == 0, c.explain()
    with torch.no_grad(), warnings.catch_warnings():  # past the limit: the new hook's calls run as
        warnings.simplefilter("ignore", sd.StreamdagWarning)  # written, the model's own compiled again
        handle = m[0].register_forward_hook(lambda module, args, out: out * 2)
        torch.testing.assert_close(c(x), m(x))
        eager = c.statistics().eager_calls
        assert eager == 1, c.explain()
        handle.remove()
        for _ in range(2):
            torch.testing.assert_close(c(x), m(x))
    assert c.statistics().eager_calls == eager and len(c._wrappers_by_hooks) == 1


@pytest.mark.slow
def test_calls_run_as_written_for_changing_hooks_are_explained_by_the_hooks():
    from streamdag.frontend.compiled_model import _HOOK_COMPILES

    m = _model().eval()
    c = sd.compile(m)
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", sd.StreamdagWarning)
        c(x)
        for scale in range(2, _HOOK_COMPILES + 4):  # a new hook each time, never removed
            m[0].register_forward_hook(lambda module, args, out, s=scale: out * s)
            torch.testing.assert_close(c(x), m(x))
    said = [line for line in c.explain().splitlines() if "ran no compiled graph" in line]
    assert len(said) == 1 and "the hooks of Sequential changed" in said[0], c.explain()
    assert "recompile_limit" not in said[0]


@pytest.mark.slow
def test_a_call_that_raises_under_new_hooks_leaves_their_compile_filed_under_them():
    """The compile for a hook whose first call raised serves that hook, not the hooks before it:
    once the hook goes, the model's first compile serves again."""
    m = _model().eval()
    c = sd.compile(m)
    x = torch.randn(4, 8)
    failing = [True]

    def hook(module, args, out):
        if failing[0]:
            raise RuntimeError("the hook failed")
        return out * 10

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", sd.StreamdagWarning)
        c(x)
        first = c._compiled
        handle = m[0].register_forward_hook(hook)
        with pytest.raises(RuntimeError, match="the hook failed"):
            c(x)
        failing[0] = False
        torch.testing.assert_close(c(x), m(x))
        handle.remove()
        torch.testing.assert_close(c(x), m(x))
    assert c._compiled is first
