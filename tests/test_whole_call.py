"""Whole-call graphs: a compiled model's whole call captured into one CUDA graph, replayed past Dynamo.

On the CPU, a stand-in for the CUDA calls (:class:`FakeDevice`) "replays" by
computing the model eagerly into the captured outputs, so the key, the state
checks, the choice between replaying and Dynamo's path, and what the caller
gets back are checked here; ``dynamo`` stands for Dynamo's path and counts its
calls. The ``slow`` tests go through Dynamo and Inductor's CPU code; the
``cuda`` tests capture real CUDA graphs.
"""

import collections
import copy
import types

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")
nn = torch.nn

from torch.utils import _pytree as pytree  # noqa: E402

from stand_in_device import StandInDevice  # noqa: E402
from streamdag.frontend import state_watch  # noqa: E402
from streamdag.frontend import whole_call as wc  # noqa: E402
from streamdag.frontend.result_objects import template  # noqa: E402
from streamdag.frontend.whole_call import StateWatch, WholeCall, call_key  # noqa: E402


class FakeGraph:
    def __init__(self, replay):
        self.replay = replay


def _tensors(result):
    """Every tensor of a result, those inside plain objects (a cache) too: what a graph writes."""
    found = []
    for leaf in pytree.tree_leaves(result):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        else:
            template(leaf, lambda t: found.append(t) or 0)
    return found


class FakeDevice(StandInDevice):
    """A replay computes ``eager`` into the captured outputs."""

    def __init__(self, eager):
        super().__init__()
        self.eager = eager
        self.fail = None

    def capture(self, fn, args, kwargs, private=False):
        buffers = list(self.eager.buffers()) if isinstance(self.eager, nn.Module) else []
        saved = [b.clone() for b in buffers]
        out = fn(*args, **kwargs)
        with torch.no_grad():  # a capture runs nothing: what the call updated in place stays as it was
            for b, s in zip(buffers, saved):
                b.copy_(s)
        if self.fail:  # as CUDA's capture fails: at its end
            raise RuntimeError(self.fail)

        modules = list(self.eager.modules()) if isinstance(self.eager, nn.Module) else []
        modes = [m.training for m in modules]

        def replay():  # what the call computed at the capture: in the modules' modes of then
            self.replays += 1
            now = [m.training for m in modules]
            for m, mode in zip(modules, modes):
                m.training = mode
            try:
                fresh = self.eager(*args, **kwargs)
            finally:
                for m, mode in zip(modules, now):
                    m.training = mode
            for o, f in zip(_tensors(out), _tensors(fresh)):
                o.copy_(f)
        return FakeGraph(replay), out


class FakeStats:
    graphs = 0
    captures = 0


class FakeBackend:
    def __init__(self):
        self.stats = FakeStats()
        self.pool = None


@pytest.fixture
def fake_device(monkeypatch):
    """Whole-call graphs on the CPU through :class:`FakeDevice`; returns a function that makes one."""
    devices = []

    def make(eager):
        dev = FakeDevice(eager)
        devices.append(dev)
        monkeypatch.setattr(wc, "_device_for", lambda device, pool: dev)
        return dev

    monkeypatch.setattr(wc, "_one_cuda_device", lambda args, kwargs: (torch.device("cpu"), ""))
    return make


@pytest.fixture(params=["native", "python"])
def state_checks(request, monkeypatch):
    """Each state test runs with the compiled dict-version check and with the Python comparison alone."""
    if request.param == "python":
        monkeypatch.setattr(state_watch, "_native_tags", None)
        monkeypatch.setattr(state_watch, "_native_checked", True)
    elif state_watch._dict_tags() is None:
        pytest.skip("no compiled dict-version check here (no compiled module, or CPython 3.13 on)")
    return request.param


class Dynamo:
    """Stands for Dynamo's path: the model run eagerly, calls counted; in a whole call's warm-up it
    notes a write into a buffer, as the compiled graphs do."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        buffers = list(self.fn.buffers()) if isinstance(self.fn, nn.Module) else []
        versions = [b._version for b in buffers]
        out = self.fn(*args, **kwargs)
        if wc.ACTIVE.mode is not None and [b._version for b in buffers] != versions:
            wc.ACTIVE.updates_state = True
        return out


def whole(model, fake_device):
    fake_device(model)
    return WholeCall(model, FakeBackend()), Dynamo(model)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


# -- the key ------------------------------------------------------------------------------------------

def test_a_calls_key_tells_apart_shapes_strides_dtypes_devices_and_constants():
    x = torch.randn(4, 6)
    base = call_key((x, 2), {"scale": 1.5})
    assert call_key((torch.randn(4, 6), 2), {"scale": 1.5}) == base, "values of tensors are not keyed"
    others = [call_key((torch.randn(5, 6), 2), {"scale": 1.5}),
              call_key((torch.randn(6, 4).t(), 2), {"scale": 1.5}),
              call_key((x.double(), 2), {"scale": 1.5}),
              call_key((x, 3), {"scale": 1.5}),
              call_key((x, 2), {"scale": 2.5}),
              call_key((x, 2), {})]
    with torch.inference_mode():
        others.append(call_key((x, 2), {"scale": 1.5}))
    assert all(k != base for k in others) and len(set(others)) == len(others)


def test_a_parameter_passed_as_an_argument_is_keyed_by_its_address():
    p, q = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    assert call_key((p,), {}) != call_key((q,), {})
    assert call_key((torch.randn(3),), {}) == call_key((torch.randn(3),), {})


def test_a_call_on_the_cpu_stays_on_dynamos_path_and_says_why():
    m = mlp()
    w, dynamo = WholeCall(m, FakeBackend()), Dynamo(m)
    with torch.no_grad():
        for _ in range(3):
            w((torch.randn(2, 8),), {}, dynamo)
    assert dynamo.calls == 3 and w.states == [] and "whole-call graphs are CUDA graphs" in w.explain()


def test_a_call_with_an_argument_of_another_type_has_no_key_and_says_why():
    why = call_key(([torch.randn(2)],), {})
    assert isinstance(why, str) and "an argument is a list" in why


@pytest.mark.parametrize("compiling_calls", [1, 5])
def test_a_key_whose_calls_each_compile_a_graph_stays_on_dynamos_path_and_says_why(fake_device,
                                                                                  compiling_calls):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    calls = 0

    def compiling(*args, **kwargs):  # as Dynamo is where a guard fails at every call (a number from .item())
        nonlocal calls
        calls += 1
        if calls <= compiling_calls:
            w.backend.stats.graphs += 1
        return dynamo(*args, **kwargs)

    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(2, 8)
            torch.testing.assert_close(w((x,), {}, compiling), m(x))
    if compiling_calls == 1:  # the first call compiles, the second captures
        assert w.captures == 1 and w.replays == 3, w.explain()
    else:
        assert w.captures == 0 and dynamo.calls == 5
        assert "on Dynamo's path: Dynamo compiled a graph in each of 3 calls" in w.explain(), w.explain()


def test_a_sparse_argument_stays_on_dynamos_path_and_says_why(fake_device):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    x = torch.eye(3, 8).to_sparse()
    with torch.no_grad():
        for _ in range(2):
            w((x,), {}, dynamo)
    assert dynamo.calls == 2 and "an argument is a torch.sparse_coo tensor" in w.explain()


# -- the model's state --------------------------------------------------------------------------------

SCALE = 2.0


class Config:
    def __init__(self):
        self.relu = True


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.factor = 1.0
        self.scales = [torch.ones(4)]
        self.config = Config()

    def forward(self, x):
        y = self.bn(self.lin(x)) * self.factor * self.scales[0] * SCALE
        return y.relu() if self.config.relu else y


def _set_global(value):
    global SCALE
    SCALE = value


CHANGES = {
    "the root's training flag": lambda m: m.train(),
    "a submodule's training flag": lambda m: m.bn.train(),
    "a replaced parameter": lambda m: setattr(m.lin, "weight", nn.Parameter(torch.randn(4, 4))),
    "a parameter given other memory": lambda m: setattr(m.lin.weight, "data", torch.randn(4, 4)),
    "a buffer resized in place": lambda m: m.bn.running_mean.resize_(2),
    "a parameter put in the dict directly": lambda m: m.lin._parameters.__setitem__(
        "bias", nn.Parameter(torch.randn(4))),
    "a replaced buffer": lambda m: setattr(m.bn, "running_mean", torch.zeros(4)),
    "a replaced submodule": lambda m: setattr(m, "bn", nn.BatchNorm1d(4)),
    "a changed attribute": lambda m: setattr(m, "factor", 3.0),
    "an added attribute": lambda m: setattr(m.lin, "extra", 1),
    "a removed attribute": lambda m: delattr(m, "factor"),
    "a forward hook": lambda m: m.lin.register_forward_hook(lambda *a: None),
    "a global the forward reads": lambda m: _set_global(5.0),
    "a field of a config object": lambda m: setattr(m.config, "relu", False),
    "a tensor in a list attribute given other memory": lambda m: setattr(m.scales[0], "data", torch.ones(4)),
    "the module moved to another dtype": lambda m: m.double(),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_the_state_watch_sees_each_change_to_a_model(change, state_checks):
    m = Scaled().eval()
    watch = StateWatch(m)
    assert watch.holds()
    try:
        CHANGES[change](m)
        assert not watch.holds(), change
        assert watch.changed(), change
    finally:
        _set_global(2.0)


def test_the_state_watch_holds_through_in_place_updates_and_values_set_to_themselves(state_checks):
    m = Scaled().eval()
    watch = StateWatch(m)
    with torch.no_grad():
        m.lin.weight.mul_(2)
        m.bn.running_mean.add_(1)
    m.eval()
    m.factor = m.factor
    m.lin.weight = m.lin.weight
    assert watch.holds() and watch.holds() and watch.changed() == ""


def test_the_state_watch_stays_on_its_fast_check_while_a_script_assigns_other_globals():
    if state_watch._dict_tags() is None:
        pytest.skip("no compiled dict-version check here")
    m = Scaled().eval()
    watch = StateWatch(m)

    def compared(*args):
        raise AssertionError("the fast check fell back to comparing every value")

    watch.modules.holds = compared
    for i in range(3):  # as a script's loop does, in the module that defines the model
        globals()["_loop_counter"] = i
        assert watch.holds()


def test_the_state_watch_of_a_function_guards_its_closure_and_globals(state_checks):
    w = torch.randn(3)

    def f(x):
        return x * w * SCALE

    watch = StateWatch(f)
    assert watch.holds()
    w = torch.randn(3)  # the closure's cell now holds another tensor
    assert not watch.holds() and "closure" in watch.changed()


# -- replaying --------------------------------------------------------------------------------------

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("mode", list(MODES))
def test_calls_after_the_capture_replay_the_graph_without_entering_dynamo(fake_device, mode):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    with MODES[mode]():
        for _ in range(5):
            x = torch.randn(3, 8)
            torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert dynamo.calls == 2, "one warm-up and one capture, then replays"
    assert w.captures == 1 and w.replays == 4


@pytest.mark.parametrize("mode", list(MODES))
def test_replayed_outputs_belong_to_the_caller(fake_device, mode):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    with MODES[mode]():
        xs = [torch.randn(3, 8) for _ in range(4)]
        outs = [w((x,), {}, dynamo) for x in xs]
        for x, out in zip(xs, outs):  # later replays left earlier outputs alone
            torch.testing.assert_close(out, m(x))
    entry = next(iter(w.current.entries.values()))
    graph_memory = entry.outputs[0].untyped_storage().data_ptr()
    assert all(o.untyped_storage().data_ptr() != graph_memory for o in outs)


def test_a_replaced_parameter_captures_again(fake_device, state_checks):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(3):
            w((x,), {}, dynamo)
        m[0].weight = nn.Parameter(torch.randn(16, 8))
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert w.captures == 2 and len(w.states) == 1, "the old state read tensors the model no longer holds"
    assert w.recaptures == 1


def test_a_parameter_given_other_memory_captures_again(fake_device, state_checks):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    x = torch.randn(3, 8)
    with torch.no_grad():
        w((x,), {}, dynamo)
        m[2].weight.data = torch.randn(4, 16)
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert w.captures == 2


def test_a_replay_launched_before_a_check_that_fails_returns_dynamos_result(fake_device, state_checks):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(2):
            w((x,), {}, dynamo)
        entry = next(iter(w.current.entries.values()))
        assert entry.speculative and entry.held
        assert "call((3, 8) float32): 1 replays, launched before its state checks" in w.explain()
        calls, replays = dynamo.calls, w.replays
        m[0].bias.data.add_(1.0)  # in place: the graph reads it (and still replays)
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
        assert (dynamo.calls, w.replays) == (calls, replays + 1)
        m[0].some_flag = True  # a new attribute: the launched replay's result is dropped
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
        assert dynamo.calls > calls and w.replays == replays + 1


def test_a_graph_that_writes_its_input_is_checked_before_its_launch(fake_device):
    class AddsInPlace(nn.Module):
        def forward(self, x):
            return x.add_(1.0) * 2

    m = AddsInPlace()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(2):
            w((torch.zeros(3),), {}, dynamo)
    entry = next(iter(w.current.entries.values()))
    assert entry.write_back and not entry.speculative
    assert "call((3,) float32): 1 replays, checked before its launch: it writes its inputs" in w.explain()


class CountsOutsideGraphs(nn.Module):
    """Updates a buffer in place where no compiled graph sees it: the eager code Dynamo runs at a
    graph break (a ``torch._dynamo.disable``d helper, an op it cannot trace)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1.0)
        return x * 2


def test_a_buffer_written_outside_the_graphs_is_updated_once_per_call_even_when_a_check_fails(fake_device):
    m = CountsOutsideGraphs().eval()
    fake_device(m)
    w = WholeCall(m, FakeBackend())

    def dynamo(*args, **kwargs):  # Dynamo's path: no graph notes the eager write
        return m(*args, **kwargs)

    x = torch.randn(3)
    with torch.no_grad():
        for _ in range(3):
            w((x,), {}, dynamo)
        entry = next(iter(w.current.entries.values()))
        assert not entry.speculative, "the call writes a buffer: its replay must not run before the checks"
        assert "writes into a parameter or buffer" in w.baseline, "no warm-up of the eager call"
        m.some_flag = True  # the check fails: Dynamo's path runs, and no replay before it
        w((x,), {}, dynamo)
    assert m.calls.item() == 4


def test_an_input_written_outside_the_graphs_to_the_same_values_is_written_back(fake_device):
    class ClampsInPlace(nn.Module):
        def forward(self, x):
            return x.clamp_(min=0.0) * 2  # at the capture the input is already >= 0

    m = ClampsInPlace()
    fake_device(m)
    w = WholeCall(m, FakeBackend())
    with torch.no_grad():
        for _ in range(2):
            w((torch.ones(3),), {}, lambda *a: m(*a))
        x = torch.tensor([-1.0, 2.0, -3.0])
        torch.testing.assert_close(w((x,), {}, lambda *a: m(*a)), torch.tensor([0.0, 4.0, 0.0]))
    assert w.replays == 2
    torch.testing.assert_close(x, torch.tensor([0.0, 2.0, 0.0]))


def test_the_storages_a_capture_noted_are_held_by_its_graph_alone(fake_device):
    """What the graphs read in a capture (``ACTIVE.reads``) is the entry's to keep: the thread keeps
    none of it after the capture, or a dropped graph's memory would stay allocated."""
    m = mlp()
    w, dynamo = whole(m, fake_device)

    def reading(*args, **kwargs):  # as the compiled graphs do in a capture
        if wc.ACTIVE.mode == "capture":
            for p in m.parameters():
                wc.ACTIVE.reads.setdefault(p.untyped_storage().data_ptr(), p.untyped_storage())
        return dynamo(*args, **kwargs)

    with torch.no_grad():
        w((torch.randn(3, 8),), {}, reading)
    entry = next(iter(w.current.entries.values()))
    assert m[0].weight.untyped_storage().data_ptr() in {st.data_ptr() for st in entry.held}
    assert wc.ACTIVE.reads == {}


def test_a_state_whose_tensors_moved_goes_with_the_memory_its_graphs_keep(fake_device, state_checks):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    x = torch.randn(3, 8)
    with torch.no_grad():
        w((x,), {}, dynamo)
        old = w.current
        old_weight = m[2].weight.untyped_storage().data_ptr()
        assert old_weight in {st.data_ptr() for e in old.entries.values() for st in e.held}
        m[2].weight.data = torch.randn(4, 16)
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert old not in w.states and w.current is not old


class Noted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x, note=None):
        return self.lin(x)


def test_a_state_whose_tensors_moved_goes_where_the_next_calls_take_dynamos_path(fake_device, state_checks):
    """As after ``model.cpu()``: the calls then have no graph, and the old memory must still go."""
    m = Noted().eval()
    w, dynamo = whole(m, fake_device)
    x = torch.randn(3, 8)
    with torch.no_grad():
        w((x,), {}, dynamo)
        assert w.current is not None and w.current.entries
        m.lin.weight.data = torch.randn(4, 8)
        torch.testing.assert_close(w((x,), {"note": ["unkeyed"]}, dynamo), m(x))
        assert w.states == [] and w.current is None, "the moved state's graphs keep the old weight's memory"
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert w.captures == 2 and w.replays == 1


def test_train_and_eval_keep_a_graph_each(fake_device, state_checks):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).eval()
    ref = copy.deepcopy(m)
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for mode in ("eval", "train", "eval", "train", "eval"):
            getattr(m, mode)()
            getattr(ref, mode)()
            for _ in range(2):
                x = torch.randn(6, 8)
                torch.testing.assert_close(w((x,), {}, dynamo), ref(x))
    assert w.captures == 2 and len(w.states) == 2 and w.recaptures == 0


def test_a_new_input_shape_captures_a_graph_of_its_own(fake_device):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for batch in (1, 1, 5, 5, 1, 5):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert w.captures == 2 and w.replays == 4 and w.recaptures == 0


def test_with_grad_enabled_every_call_takes_dynamos_path(fake_device):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    x = torch.randn(3, 8)
    for _ in range(3):
        w((x,), {}, dynamo)
    assert dynamo.calls == 3 and w.captures == 0


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)


def test_a_forward_that_changes_the_models_state_is_never_replayed(fake_device, state_checks):
    m = Counting().eval()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(6):
            w((torch.randn(2, 4),), {}, dynamo)
    assert w.captures == 0 and dynamo.calls == 6 and m.calls == 6
    assert "the call changes the model's state (Counting.calls)" in w.explain()


class Identity(nn.Module):
    def forward(self, x):
        return x, x * 2


def test_a_model_that_returns_its_input_stays_on_dynamos_path_and_says_why(fake_device):
    m = Identity()
    w, dynamo = whole(m, fake_device)
    x = torch.randn(3)
    with torch.no_grad():
        for _ in range(3):
            got = w((x,), {}, dynamo)
    assert got[0] is x and w.captures == 0
    assert "an output is an input or a view of one" in w.explain()


class AddsInPlace(nn.Module):
    def forward(self, x, y):
        x.add_(1)
        return x * y


def _check_input_written_back(fake_device, mode):
    """Three calls of ``AddsInPlace`` under ``mode``: each result, and each input it writes into,
    equal eager's; the second and third calls replay."""
    m = AddsInPlace()
    w, dynamo = whole(m, fake_device)
    with mode():
        for _ in range(3):
            x, y = torch.randn(4), torch.randn(4)
            x_want = x.clone()
            want = m(x_want, y)
            torch.testing.assert_close(w((x, y), {}, dynamo), want)
            torch.testing.assert_close(x, x_want)
    assert w.replays == 2


def test_an_input_the_call_writes_into_is_written_back_after_each_replay(fake_device):
    _check_input_written_back(fake_device, torch.no_grad)


def test_an_inference_tensor_the_call_writes_into_is_written_back_too(fake_device):
    _check_input_written_back(fake_device, torch.inference_mode)


def test_a_capture_that_fails_leaves_the_key_on_dynamos_path_and_says_why(fake_device):
    m = mlp()
    dev = fake_device(m)
    dev.fail = "operation not permitted when stream is capturing"
    w, dynamo = WholeCall(m, FakeBackend()), Dynamo(m)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert w.captures == 0 and dynamo.calls == 4, "one warm-up, one failed capture, two calls through Dynamo"
    assert "the call cannot be captured (RuntimeError: operation not permitted" in w.explain()


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        h = self.lin(x) * scale
        return {"h": h, "both": (h, h.relu()), "n": 3, "none": None}


@pytest.mark.parametrize("mode", list(MODES))
def test_containers_constants_and_keyword_arguments_come_back_as_the_model_returns_them(fake_device, mode):
    m = Structured().eval()
    w, dynamo = whole(m, fake_device)
    with MODES[mode]():
        for _ in range(3):
            x = torch.randn(2, 4)
            got, want = w((x,), {"scale": 2.0}, dynamo), m(x, scale=2.0)
            assert got["n"] == 3 and got["none"] is None and isinstance(got["both"], tuple)
            torch.testing.assert_close(got["both"][1], want["both"][1])
            assert got["h"] is got["both"][0], "one tensor returned twice stays one tensor"
    assert w.replays == 2


class Box:
    """A plain object holding tensors, as a model's cache is."""

    def __init__(self, t, extra):
        self.t, self.extra, self.label = t, extra, "box"


def test_a_plain_object_in_the_result_comes_back_new_at_each_replay_holding_its_tensors(fake_device):
    class Boxed(nn.Module):
        def forward(self, x):
            return x + 1, Box(x * 2, [x * 3, {"n": 4}])

    m = Boxed()
    w, dynamo = whole(m, fake_device)
    got = []
    with torch.no_grad():
        for i in range(4):
            x = torch.full((2,), float(i))
            got.append((x, w((x,), {}, dynamo)))
    assert w.replays == 3 and w.captures == 1, w.explain()
    for x, (plus, box) in got:
        assert isinstance(box, Box) and box.label == "box" and box.extra[1] == {"n": 4}
        torch.testing.assert_close(box.t, x * 2)
        torch.testing.assert_close(box.extra[0], x * 3)
        torch.testing.assert_close(plus, x + 1)
    assert got[2][1][1] is not got[3][1][1] and got[2][1][1].t is not got[3][1][1].t


class _Holder:
    def __init__(self, value):
        self.value = value


@pytest.mark.parametrize("inner, named", [
    (lambda x: (i for i in range(2)), "a generator"),
    (lambda x: nn.Linear(2, 2), "a Linear"),
    (lambda x: _Holder(None), "a _Holder that holds itself"),
])
def test_a_result_object_that_cannot_be_rebuilt_stays_on_dynamos_path_and_says_why(fake_device, inner, named):
    class Odd(nn.Module):
        def forward(self, x):
            held = _Holder(inner(x))
            if isinstance(held.value, _Holder):
                held.value = held
            return x * 2, held

    m = Odd()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            w((torch.randn(2),), {}, dynamo)
    assert w.captures == 0 and f"the result holds a _Holder that holds {named}" in w.explain(), w.explain()


class _Tagged(dict):
    """A dict subclass with attributes: its items live in the dict, not in its ``__dict__``."""


class _Pair(collections.namedtuple("_Pair", "a b")):
    """A namedtuple subclass without ``__slots__``: it has a ``__dict__`` and a ``__new__`` of its own."""


@pytest.mark.parametrize("inner, contents, named", [
    (lambda x: _Tagged(t=x * 3), lambda v: list(v.values()), "a _Tagged"),
    (lambda x: _Pair(x * 3, 1), list, "a _Pair"),
])
def test_a_result_object_made_by_its_own_new_stays_on_dynamos_path_not_rebuilt_empty(fake_device, inner,
                                                                                       contents, named):
    class Odd(nn.Module):
        def forward(self, x):
            return x * 2, _Holder(inner(x))

    m = Odd()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2)
            got, want = w((x,), {}, dynamo)[1].value, m(x)[1].value
            assert type(got) is type(want)
            torch.testing.assert_close(contents(got), contents(want))
    assert w.captures == 0 and f"the result holds a _Holder that holds {named}" in w.explain(), w.explain()


class WritesOnly(nn.Module):
    def forward(self, x):
        x.mul_(2.0)  # the caller's tensor holds the result; nothing is returned


def test_a_call_that_returns_no_tensor_replays(fake_device):
    m = WritesOnly()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for i in range(3):
            x = torch.full((2,), float(i))
            assert w((x,), {}, dynamo) is None
            torch.testing.assert_close(x, torch.full((2,), 2.0 * i))
    assert w.replays == 2, w.explain()


class _Private:
    """Its slot's name is mangled: the attribute is ``_Private__t``."""

    __slots__ = ("__t",)

    def __init__(self, t):
        self.__t = t

    def value(self):
        return self.__t


def test_a_result_object_with_a_private_slot_comes_back_holding_it(fake_device):
    class Hidden(nn.Module):
        def forward(self, x):
            return _Private(x * 2)

    m = Hidden()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2)
            torch.testing.assert_close(w((x,), {}, dynamo).value(), x * 2)
    assert w.replays == 2, w.explain()


def test_an_object_the_result_holds_twice_comes_back_as_one_object(fake_device):
    class Shares(nn.Module):
        def forward(self, x):
            box = Box(x * 2, [x * 3])
            box.again = box.extra  # one list under two names, as deepcopy keeps it
            box.space = types.SimpleNamespace(t=x * 4)
            return box, box

    m = Shares()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2)
            first, second = w((x,), {}, dynamo)
            assert first is second and first.again is first.extra
            torch.testing.assert_close(first.extra[0], x * 3)
            torch.testing.assert_close(first.space.t, x * 4)
    assert w.replays == 2, w.explain()


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


@pytest.fixture
def cpu_code_as_gpus(monkeypatch):
    """Inductor's CPU code stands for the GPU's in a whole call (a graph on the CPU is otherwise
    kept out of whole calls), with Dynamo's caches reset around the test."""
    from streamdag.frontend.inductor_backend import GraphRunner

    pick = GraphRunner._uncaptured_pick

    def as_if_on_a_gpu(self, *args):
        run = pick(self, *args)
        self.not_whole = ""
        return run

    monkeypatch.setattr(GraphRunner, "_uncaptured_pick", as_if_on_a_gpu)
    torch._dynamo.reset()
    yield
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

@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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


@pytest.mark.cuda
def test_on_cuda_a_whole_call_with_regions_on_several_streams_equals_eager(no_tf32, fresh_dynamo):
    from test_compile_v2 import Inception

    torch.manual_seed(0)
    m = Inception(c=64).eval().cuda()
    c = sd.compile(m, regions="always", candidates=["regions"])
    with torch.inference_mode():
        pairs = [(c(x), m(x)) for x in (torch.randn(1, 64, 28, 28, device="cuda") for _ in range(5))]
        for got, want in pairs:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
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

    with torch.inference_mode():
        pairs = [(c(x), m(x)) for x in (make() for _ in range(5))]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
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
