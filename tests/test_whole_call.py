"""Whole-call graphs: a compiled model's whole call captured into one CUDA graph, replayed past Dynamo.

The key of a call, the model's state, and replaying, on the CPU: a stand-in for
the CUDA calls (``whole_call_stand_in``) "replays" by computing the model
eagerly into the captured outputs. What a replay returns is in
``test_whole_call_results``; the path through Dynamo and Inductor, and real CUDA
graphs, in ``test_whole_call_through_dynamo``.
"""

import copy
import gc
import itertools
import operator
import weakref

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
nn = torch.nn

from streamdag.frontend import state_watch  # noqa: E402
from streamdag.frontend import whole_call as wc  # noqa: E402
from streamdag.frontend.lent_outputs import LENT_SETS  # noqa: E402
from streamdag.frontend.whole_call import StateWatch, WholeCall, call_key  # noqa: E402
from whole_call_stand_in import MODES, Dynamo, FakeBackend, mlp, whole  # noqa: E402

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


def test_calls_on_the_cpu_with_a_number_that_changes_remember_a_bounded_number_of_keys(monkeypatch):
    """Each value of a number argument keys a call of its own; refused (on the CPU), the keys kept
    are bounded, the oldest going first, and ``explain()`` shows a few of each reason."""
    monkeypatch.setattr(wc, "MAX_REFUSED", 5)
    w, dynamo = WholeCall(operator.mul, FakeBackend()), Dynamo(operator.mul)
    x = torch.randn(2)
    with torch.no_grad():
        for i in range(12):
            torch.testing.assert_close(w((x, 0.5 + i), {}, dynamo), x * (0.5 + i))
    assert dynamo.calls == 12 and len(w.refused) == 5
    said = w.explain()
    assert said.count("whole-call graphs are CUDA graphs") == 3 and "(and 2 more calls)" in said, said
    with torch.no_grad():  # a key called again goes last: the next to go is the least recently called
        for value in (7.5, 12.5):
            w((x, value), {}, dynamo)
    assert call_key((x, 7.5), {}) in w.refused and call_key((x, 8.5), {}) not in w.refused


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
        self.kinds = {"relu"}
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
    "an item of a list attribute replaced": lambda m: m.scales.__setitem__(0, torch.ones(4)),
    "an item added to a list attribute": lambda m: m.scales.append(torch.ones(4)),
    "an item of a set attribute swapped": lambda m: (m.kinds.clear(), m.kinds.add("tanh")),
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


@given(contents=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 5), max_size=4)), max_size=6),
       change=st.tuples(st.sampled_from(["none", "swap", "append", "pop", "replace"]), st.integers(0, 9)))
def test_the_compiled_item_check_agrees_with_the_python_one(contents, change):
    """Lists and sets of objects, one changed or none: the compiled ``same_items`` says what the
    chain of identity comparisons says."""
    same_items = state_watch.items_check()
    if same_items is None:
        pytest.skip("no compiled module here")
    objects = [object() for _ in range(6)]
    containers = [set(objects[i] for i in items) if is_set else [objects[i] for i in items]
                  for is_set, items in contents]
    lengths, values = tuple(map(len, containers)), tuple(itertools.chain.from_iterable(containers))
    kind, which = change
    if containers and kind != "none":
        c = containers[which % len(containers)]
        if kind == "append":
            c.append(object()) if isinstance(c, list) else c.add(object())
        elif kind == "pop" and c:
            c.pop()
        elif kind in ("swap", "replace") and c:
            if isinstance(c, list):
                c[which % len(c)] = object() if kind == "replace" else c[which % len(c)]
            else:
                c.pop()
                c.add(object())
    python = (tuple(map(len, containers)) == lengths
              and all(map(operator.is_, itertools.chain.from_iterable(containers), values)))
    assert same_items(containers, lengths, values) == python


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
    if state_watch.dict_tags() is None:
        pytest.skip("no compiled dict-version check here")
    m = Scaled().eval()
    watch = StateWatch(m)

    def compared(*args):
        raise AssertionError("the fast check fell back to comparing every value")

    watch.modules.holds = compared
    for i in range(3):  # as a script's loop does, in the module that defines the model
        globals()["_loop_counter"] = i
        assert watch.holds()


def test_the_watched_state_checks_no_dict_until_one_changes():
    if state_watch._dict_watcher() is None or state_watch.dict_tags() is None:
        pytest.skip("no compiled dict watcher and tags here (CPython 3.12 and 3.13 with a compiled module)")
    m, other = Scaled().eval(), Scaled().eval()
    watch, _ = StateWatch(m), StateWatch(other)
    tag_loops = []
    same = watch._native.same_dict_versions

    class Counted:  # the compiled module, with its tag loop counted
        def __getattr__(self, name):
            return getattr(state_watch._native_tags, name)

        def same_dict_versions(self, dicts, tags):
            tag_loops.append(len(dicts))
            return same(dicts, tags)

    watch._native = Counted()
    assert watch.holds() and watch.holds() and not tag_loops
    other.factor = 5.0  # another model's dict: its count moves, this model's tags hold
    assert watch.holds() and watch.holds() and len(tag_loops) == 1
    m.factor = 5.0  # this model's own (the negative control)
    assert not watch.holds()


def test_the_state_watch_of_a_function_guards_its_closure_and_globals(state_checks):
    w = torch.randn(3)

    def f(x):
        return x * w * SCALE

    watch = StateWatch(f)
    assert watch.holds()
    w = torch.randn(3)  # the closure's cell now holds another tensor
    assert not watch.holds() and "closure" in watch.changed()


# -- replaying --------------------------------------------------------------------------------------



@pytest.mark.parametrize("mode", list(MODES))
def test_calls_after_the_capture_replay_the_graph_without_entering_dynamo(fake_device, mode):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    with MODES[mode]():
        for _ in range(5):
            x = torch.randn(3, 8)
            torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert dynamo.calls == 2 + LENT_SETS, "one warm-up, one capture and one per lent set, then replays"
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


def _replaying(fake_device):
    """A model, its whole calls and Dynamo's path, and an input, after three calls: one capture, two
    replays."""
    m = mlp()
    w, dynamo = whole(m, fake_device)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(3):
            w((x,), {}, dynamo)
    assert w.captures == 1 and w.replays == 2
    return m, w, dynamo, x


def test_a_replaced_parameter_captures_again(fake_device, state_checks):
    m, w, dynamo, x = _replaying(fake_device)
    with torch.no_grad():
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
        w((x,), {}, dynamo)  # a replay: the next call tries its graph first
        assert w.current is not None and w.current.entries
        graph = weakref.ref(next(iter(w.current.entries.values())).graph)
        m.lin.weight.data = torch.randn(4, 8)
        torch.testing.assert_close(w((x,), {"note": ["unkeyed"]}, dynamo), m(x))
        assert w.states == [] and w.current is None, "the moved state's graphs keep the old weight's memory"
        gc.collect()
        assert graph() is None, "the moved state's graph is still held"
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert w.captures == 2 and w.replays == 2


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


CUDNN = torch.backends.cudnn
#: a switch, and how to turn it: the flags, and the per-operator precision where PyTorch has it
#: (``torch.backends.cudnn.conv.fp32_precision``; the flag of both then raises when read)
SWITCHES = {name: (lambda name=name: setattr(CUDNN, name, not getattr(CUDNN, name)))
            for name in ("allow_tf32", "deterministic", "enabled")}
if hasattr(getattr(CUDNN, "conv", None), "fp32_precision"):
    SWITCHES["conv.fp32_precision"] = lambda: setattr(CUDNN.conv, "fp32_precision", "ieee")


@pytest.fixture
def cudnn_switches():
    """cuDNN's switches as they were, after the test."""
    was = (CUDNN.allow_tf32, CUDNN.deterministic, CUDNN.enabled)
    precisions = ([(CUDNN.conv, CUDNN.conv.fp32_precision), (CUDNN.rnn, CUDNN.rnn.fp32_precision)]
                  if "conv.fp32_precision" in SWITCHES else [])
    yield
    for where, value in precisions:
        where.fp32_precision = value
    CUDNN.allow_tf32, CUDNN.deterministic, CUDNN.enabled = was


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_a_graph_captured_under_other_cudnn_switches_is_not_replayed(fake_device, cudnn_switches, switch):
    """Dynamo's global-state guard leaves cuDNN's switches out; a graph replays the convolutions
    chosen under those of its capture, so a call under others captures again."""
    m, w, dynamo, x = _replaying(fake_device)
    with torch.no_grad():
        SWITCHES[switch]()
        for _ in range(3):
            torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert w.captures == 2 and w.replays == 4, "the first graph is not replayed under the new switch"


def test_calls_that_alternate_global_settings_replay_a_graph_of_each_and_capture_once_each(fake_device):
    """A graph captured under other global settings (here autocast) is kept for calls under them:
    calls that alternate settings replay, where they used to capture at every call."""
    m = mlp()
    w, dynamo = whole(m, fake_device)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for i in range(10):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(i % 2)):
                out = w((x,), {}, dynamo)
                torch.testing.assert_close(out, m(x))
    assert (w.captures, w.replays) == (2, 8), w.explain()
    assert "captured under other global settings" in w.explain()
    key = next(iter(w.current.others))
    w._refuse(key, "refused for a test")  # (a key refused later: its kept graphs' memory goes back)
    assert not w.current.others


SETTINGS = [torch.float32, torch.float64, torch.float16]


def test_calls_under_more_settings_than_the_compile_limit_each_compile_once_and_capture(fake_device):
    """Dynamo compiles a key's graphs again for each new global setting (default dtype, autocast):
    a compile then a capture per setting is no compile loop, so the key is not refused."""
    m = mlp()
    w, dynamo = whole(m, fake_device)
    seen = set()

    def compiling(*args, **kwargs):  # as Dynamo is: the first call under a setting compiles
        if torch.get_default_dtype() not in seen:
            seen.add(torch.get_default_dtype())
            w.backend.stats.graphs += 1
        return dynamo(*args, **kwargs)

    x = torch.randn(3, 8)
    before = torch.get_default_dtype()
    try:
        with torch.no_grad():
            for i in range(4 * len(SETTINGS)):
                torch.set_default_dtype(SETTINGS[i % len(SETTINGS)])
                w((x,), {}, compiling)
    finally:
        torch.set_default_dtype(before)
    assert not w.refused and w.captures == len(SETTINGS), w.explain()


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


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _calls_from_threads(w, dynamo, m, threads=4, calls=120):
    """Each thread's calls, two batch sizes in turn, with the GIL handed over every microsecond:
    how many results differ from the thread's own eager call."""
    import sys
    import threading

    wrong = []

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for i in range(calls):
                x = torch.randn(3 if i % 2 else 5, 8, generator=g)
                if not torch.allclose(w((x,), {}, dynamo), m(x)):
                    wrong.append(i)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        pool = [threading.Thread(target=work, args=(s,)) for s in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    return len(wrong)


def test_calls_from_several_threads_each_get_the_result_of_their_own_arguments(fake_device):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    assert _calls_from_threads(w, dynamo, m) == 0
    assert w.replays > 100, w.explain()


def test_calls_from_several_threads_without_the_replay_lock_would_be_caught(fake_device):
    """Negative control: replays that share the graph's inputs and outputs without the lock read
    each other's inputs, and the comparison with eager sees it."""
    m = mlp()
    w, dynamo = whole(m, fake_device)
    w._lock = _NoLock()
    # a race needs a thread switch inside a replay: on a loaded machine one round may see none
    assert any(_calls_from_threads(w, dynamo, m) > 0 for _ in range(5))


def test_a_state_watch_and_a_compiled_model_go_with_their_last_reference():
    """Neither refers to itself, so dropping one frees what it holds (a watch: the model's tensors; a
    compiled model: its graphs and their memory pools) at once, not at the cyclic collector's turn."""
    import streamdag as sd

    m = mlp()
    with torch.inference_mode():
        c = sd.compile(m)
        c(torch.randn(2, 8))
    watches = [weakref.ref(StateWatch(m)), weakref.ref(c)]
    gc.collect()
    gc.disable()
    try:
        del c
        assert [w() for w in watches] == [None, None]
    finally:
        gc.enable()
        torch._dynamo.reset()


def test_an_object_given_its_own_dict_keeps_the_same_dict_and_values_and_its_stores_reach_it():
    m = Scaled().eval()
    d, before = m.__dict__, dict(m.__dict__)
    assert state_watch._own_dict(m)
    assert m.__dict__ is d and d == before
    m.factor = 4.0
    m.extra = 1
    assert d["factor"] == 4.0 and d["extra"] == 1 and m.factor == 4.0
    assert not state_watch._own_dict(1)  # an int has no dict to set: the watch compares values
