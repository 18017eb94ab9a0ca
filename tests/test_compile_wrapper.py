"""What ``streamdag.compile`` returns, as a user holds it: its module methods, its options, and a
compiled model called inside another compiled model (on the CPU)."""

import threading
import warnings

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")
nn = torch.nn


class Outer(nn.Module):
    def __init__(self, inner) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.first(x)) * 2


@pytest.mark.slow
def test_a_compiled_model_inside_another_is_traced_into_the_outer_graph():
    """Dynamo traces the inner model into the outer model's graph, as it traces a ``torch.compile``d
    one: the outer model compiles one graph, not streamdag's own Python split into several, and the
    inner model counts no call of its own as run eagerly."""
    torch.manual_seed(0)
    inner_module = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    inner = sd.compile(inner_module)
    outer_module = Outer(inner).eval()
    outer = sd.compile(outer_module)
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", sd.StreamdagWarning)
        expected = inner_module(outer_module.first(x)) * 2
        for _ in range(3):
            torch.testing.assert_close(outer(x), expected)
    assert outer.statistics().graphs == 1, outer.explain()
    assert outer.statistics().eager_calls == 0
    assert inner.statistics().eager_calls == 0
    assert inner.statistics().graphs == 0  # (never called on its own)


def test_eval_and_train_set_the_module_and_keep_the_model_compiled():
    module = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    compiled = sd.compile(module)
    assert compiled.eval() is compiled and not module.training
    assert not any(m.training for m in module.modules())
    assert compiled.train() is compiled and module.training
    assert compiled.train(False) is compiled and not module.training


def test_other_attributes_are_the_wrapped_models():
    module = nn.Sequential(nn.Linear(4, 3))
    compiled = sd.compile(module)
    assert [p.data_ptr() for p in compiled.parameters()] == [p.data_ptr() for p in module.parameters()]
    assert compiled.state_dict().keys() == module.state_dict().keys()
    with pytest.raises(AttributeError, match="no_such_thing"):
        compiled.no_such_thing  # noqa: B018
    # a method that returns the module returns the compiled model: model = model.to(...) keeps it
    assert compiled.to(torch.float64) is compiled and module[0].weight.dtype == torch.float64
    assert compiled.requires_grad_(False) is compiled and not module[0].weight.requires_grad


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.temperature = 1.0

    def forward(self, x):
        return self.lin(x) / self.temperature


@pytest.mark.slow
def test_attributes_set_on_a_compiled_module_are_set_on_the_model_and_followed():
    torch.manual_seed(0)
    module = Scaled().eval()
    compiled = sd.compile(module)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))
        compiled.temperature = 4.0
        assert module.temperature == 4.0
        torch.testing.assert_close(compiled(x), module.lin(x) / 4)
        compiled.lin = nn.Identity()
        assert isinstance(module.lin, nn.Identity)
        torch.testing.assert_close(compiled(x), x / 4)
        compiled.training = True
        assert module.training
        del compiled.temperature
        assert not hasattr(module, "temperature")


def test_a_compiled_module_is_a_module_that_takes_the_models_place_in_a_parent():
    """A compiled part put in its parent's place, or into an nn.Sequential: the parent's state_dict
    keeps the model's names (no wrapper's prefix), its parameters, dtype changes, mode switches and
    load_state_dict reach the model."""
    torch.manual_seed(0)
    parent = Outer(Scaled())
    names = list(parent.state_dict())
    compiled = sd.compile(parent.inner)
    parent.inner = compiled
    assert isinstance(compiled, nn.Module) and parent.inner is compiled
    assert list(parent.state_dict()) == names
    model_params = [*parent.first.parameters(), *compiled.__wrapped__.parameters()]
    assert [id(p) for p in parent.parameters()] == [id(p) for p in model_params]
    parent.to(torch.float64)
    assert compiled.__wrapped__.lin.weight.dtype == torch.float64
    parent.eval()
    assert not compiled.__wrapped__.training and not compiled.training
    state = {k: torch.zeros_like(v) for k, v in parent.state_dict().items()}
    parent.load_state_dict(state)
    assert not compiled.__wrapped__.lin.weight.any()
    listed = dict(parent.named_modules())  # (the model in its place: isinstance walks find it)
    assert listed["inner"] is compiled.__wrapped__ and compiled not in listed.values()
    assert listed["inner.lin"] is compiled.__wrapped__.lin and parent.get_submodule("inner") is compiled
    with pytest.raises(TypeError, match=r"compiled by streamdag\.compile already"):
        compiled.compile()
    seq = nn.Sequential(sd.compile(nn.Linear(4, 4)), nn.ReLU())
    assert seq(torch.randn(2, 4)).shape == (2, 4)
    assert repr(compiled).startswith("CompiledModule(Scaled(")


def test_a_compiled_module_keeps_no_attribute_of_its_own_but_the_compiled_calls():
    """Any attribute set on a compiled module is the model's, but for those of the compiled call:
    an attribute a compiled module adds must be listed there, or it would be set on the model."""
    from streamdag.frontend.compiled_module import _OWN_ATTRIBUTES

    compiled = sd.compile(Scaled())
    assert set(vars(compiled)) <= _OWN_ATTRIBUTES
    assert not set(vars(compiled.__wrapped__)) & (_OWN_ATTRIBUTES - set(vars(nn.Module())))


def test_a_compiled_parents_state_check_watches_its_compiled_parts_model_not_the_wrapper():
    """What an outer whole-call graph's state check reads of a parent holding a compiled part: the
    part's model (an attribute set on it through the wrapper is a change), not the wrapper (whose
    own calls change its attributes, not the model's state)."""
    from streamdag.frontend.state_watch import StateWatch

    parent = Outer(Scaled()).eval()
    parent.inner = sd.compile(parent.inner)
    watch = StateWatch(parent)
    with torch.no_grad():
        parent.inner(torch.randn(2, 8))  # the part called alone
    assert watch.holds()
    parent.inner.temperature = 3.0
    assert not watch.holds()


def test_parametrize_through_the_compiled_module_is_refused_before_it_changes_the_model():
    parametrize = torch.nn.utils.parametrize

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

    model = nn.Linear(4, 4)
    compiled, other = sd.compile(model), sd.compile(nn.Linear(4, 4))
    with pytest.raises(TypeError, match=r"compiled\.__wrapped__, the model itself"):
        parametrize.register_parametrization(compiled, "weight", Doubled())
    assert isinstance(model.weight, nn.Parameter) and type(model) is nn.Linear
    assert "weight" not in vars(type(compiled)) and isinstance(other.weight, nn.Parameter)
    parametrize.register_parametrization(compiled.__wrapped__, "weight", Doubled())  # the way named
    before = compiled.weight.clone()
    torch.testing.assert_close(before, 2 * model.parametrizations.weight.original)
    with pytest.raises(TypeError, match="parametrize"):
        parametrize.remove_parametrizations(compiled, "weight")
    assert parametrize.is_parametrized(model, "weight")
    torch.testing.assert_close(model.weight, before)
    plain = nn.Linear(4, 4)
    normed = sd.compile(plain)
    torch.nn.utils.spectral_norm(normed)  # (a forward pre-hook and tensors of the model's: these work)
    assert "weight_orig" in dict(plain.named_parameters())
    torch.nn.utils.remove_spectral_norm(normed)
    assert isinstance(plain.weight, nn.Parameter) and "weight_orig" not in dict(plain.named_parameters())


def test_reading_parametrizations_of_a_compiled_module_answers_as_the_model_would():
    """``hasattr``, ``is_parametrized`` and quantization's walk over a parent probe the attribute
    with a default: they get none where the model has none, and the model's where it has some."""
    parametrize = torch.nn.utils.parametrize
    model = nn.Linear(4, 4)
    compiled = sd.compile(model)
    assert not hasattr(compiled, "parametrizations") and getattr(compiled, "parametrizations", None) is None
    assert not parametrize.is_parametrized(compiled)
    assert parametrize.type_before_parametrizations(compiled) is type(compiled)
    parent = nn.Sequential(compiled, nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.ao.quantization's notice that it moves to torchao)
        quantized = torch.ao.quantization.quantize_dynamic(parent, {nn.Linear})
    assert type(quantized[1]) is not nn.Linear
    normed = nn.Linear(4, 4)
    torch.nn.utils.parametrizations.weight_norm(normed)
    assert sd.compile(normed).parametrizations is normed.parametrizations


def test_a_hook_dict_assigned_through_the_compiled_module_is_the_models_and_the_next_call_follows_it():
    from collections import OrderedDict

    model = nn.Linear(4, 4)
    compiled, ran = sd.compile(model), []
    compiled.register_forward_hook(lambda *args: ran.append(1))
    x = torch.randn(2, 4)
    compiled(x)
    assert ran == [1]
    compiled._forward_hooks = OrderedDict()  # (the usual way to drop every forward hook)
    assert len(model._forward_hooks) == 0 and compiled._forward_hooks is model._forward_hooks
    torch.testing.assert_close(compiled(x), model(x))
    assert ran == [1]


def test_a_models_attribute_that_the_compiled_module_keeps_for_itself_is_named_at_compile():
    class Clashing(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.backend, self._hooks = "cudnn", []

        def close(self) -> None:
            pass

    with pytest.warns(sd.StreamdagWarning, match=r"\(backend, close\).*compiled\.__wrapped__\.<name>"):
        compiled = sd.compile(Clashing())
    compiled._hooks.append("handle")  # (a name the compiled call does not use is the model's)
    assert compiled.__wrapped__._hooks == ["handle"] and compiled.__wrapped__.backend == "cudnn"
    with warnings.catch_warnings():
        warnings.simplefilter("error", sd.StreamdagWarning)
        sd.compile(nn.Linear(4, 4))  # (no clash, no warning)


@pytest.mark.slow
def test_a_parent_holding_a_compiled_part_is_saved_and_loaded_with_the_part_compiled_again(tmp_path):
    torch.manual_seed(0)
    parent = Outer(Scaled()).eval()
    parent.inner = sd.compile(parent.inner, min_gain=0.3)
    torch.save(parent, tmp_path / "parent.pt")
    loaded = torch.load(tmp_path / "parent.pt", weights_only=False)
    assert type(loaded.inner) is type(parent.inner) and loaded.inner.backend.options.min_gain == 0.3
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), parent(x))


@pytest.mark.slow
def test_a_call_through_nn_modules_own_call_path_runs_the_models_hooks_once():
    torch.manual_seed(0)
    compiled = sd.compile(Scaled().eval())
    calls = []
    compiled.register_forward_hook(lambda module, args, out: calls.append(type(module).__name__))
    with torch.no_grad():
        nn.Module.__call__(compiled, torch.randn(2, 8))
    assert calls == ["Scaled"]


@pytest.mark.slow
def test_a_deep_copy_of_a_compiled_model_is_the_models_copy_compiled_afresh_with_its_options():
    import copy

    torch.manual_seed(0)
    compiled = sd.compile(Scaled().eval(), whole_call=False, min_gain=0.3)
    x = torch.randn(4, 8)
    with torch.no_grad():
        compiled(x)
        twin = copy.deepcopy(compiled)
        assert type(twin) is type(compiled) and twin.backend is not compiled.backend
        assert twin.whole is None and twin.backend.options.min_gain == 0.3
        assert all(p is not q for p, q in zip(twin.parameters(), compiled.parameters()))
        torch.testing.assert_close(twin(x), compiled(x))
        twin.lin.weight.zero_()
        assert compiled.lin.weight.any()


@pytest.mark.slow
def test_a_compiled_part_in_a_compiled_parent_runs_its_hooks_once_per_call():
    torch.manual_seed(0)
    parent = Outer(Scaled()).eval()
    parent.inner = sd.compile(parent.inner)
    calls = []
    parent.inner.register_forward_hook(lambda module, args, out: calls.append(module))
    outer = sd.compile(parent)
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = parent.inner.__wrapped__(parent.first(x)) * 2
        calls.clear()
        torch.testing.assert_close(outer(x), want)
    assert calls == [parent.inner.__wrapped__]


@pytest.mark.slow
def test_forward_is_the_compiled_call():
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval()
    compiled = sd.compile(module)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(compiled.forward(x), module(x))
    assert compiled.statistics().graphs == 1


def test_eval_of_a_compiled_function_says_where_the_mode_lives():
    compiled = sd.compile(torch.relu)
    with pytest.raises(TypeError, match="set the mode on the module it calls"):
        compiled.eval()


def test_whole_call_takes_a_bool():
    with pytest.raises(TypeError, match="whole_call takes True or False, got 'no'"):
        sd.compile(nn.Linear(2, 2), whole_call="no")


LOCK = threading.Lock()


class Locked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        with LOCK:  # a context manager Dynamo cannot enter: it runs the whole frame as written
            h = self.linear(x)
        return h.relu()


@pytest.mark.slow
def test_a_frame_dynamo_runs_as_written_warns_with_dynamos_reason():
    module = Locked().eval()
    compiled = sd.compile(module)
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(compiled(x), module(x))
    said = [str(w.message) for w in caught if issubclass(w.category, sd.StreamdagWarning)]
    assert len(said) == 1 and "Dynamo could not trace the code" in said[0], said
    assert "recompile_limit" not in said[0], said
    assert "TORCH_LOGS=graph_breaks" in compiled.explain()
    assert compiled.statistics().eager_calls == 1


def test_a_compiled_container_indexes_counts_and_iterates_as_its_model():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled = sd.compile(seq)
    assert len(compiled) == 3 and compiled[0] is seq[0] and compiled[-1] is seq[2]
    assert list(compiled) == list(seq) and seq[1] in compiled and bool(compiled)
    assert not sd.compile(nn.Sequential()) and "a" in sd.compile(nn.ModuleDict({"a": nn.ReLU()}))
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), seq(x))
    plain = sd.compile(nn.Linear(4, 4))
    assert bool(plain)  # (a module without a length is true, as the model is)
    with pytest.raises(TypeError, match="has no len"):
        len(plain)
    with pytest.raises(TypeError, match="not iterable"):
        iter(plain)
    parent = Outer(sd.compile(nn.Sequential(nn.Linear(8, 8), nn.Tanh())))
    fast, ones = sd.compile(parent), torch.ones(2, 8)  # (a compiled container inside a compiled parent)
    torch.testing.assert_close(fast(ones), parent(ones))
