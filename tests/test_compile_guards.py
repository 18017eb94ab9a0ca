"""streamdag.compile follows the module's state, on both engines: training mode, replaced
attributes, buffers updated once per call; safe first calls from several threads; outputs in the
model's own types; inference-tensor weights.

Each behaviour runs on the default engine (Dynamo, AOTAutograd and Inductor, where Dynamo's
guards follow the module) and on ``engine="aten"`` (the make_fx path, where streamdag guards the
module itself); the aten path's own options and messages (``batch=``, its warnings) are checked
on it alone. Inductor compiles C++ for the CPU, so its cases are marked ``slow``.
"""

import copy
import dataclasses
import functools
import threading
import warnings
from collections import OrderedDict, namedtuple

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")
nn = torch.nn

from internals import rerun_as_capture_timing_does  # noqa: E402
from streamdag.frontend import Compiled  # noqa: E402

ENGINES = [pytest.param("inductor", marks=pytest.mark.slow), "aten"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo keeps its compiled code per code object: each test starts from none."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ResourceWarning)  # (what an earlier test dropped, freed now)
        result = fn()
    return result, [str(w.message) for w in caught if "streamdag.compile" in str(w.message)]


def _compiles(c):
    """How often the model was compiled: traces on the aten engine, graphs Dynamo captured on inductor."""
    s = c.statistics()
    return s.traces if isinstance(c, Compiled) else s.graphs


# --- buffers a call updates in place ------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_one_compiled_call_updates_buffers_as_one_eager_call_does(engine):
    torch.manual_seed(0)
    m = nn.BatchNorm1d(4)
    ref = copy.deepcopy(m)
    c = sd.compile(m, engine=engine)
    with torch.no_grad():
        for calls in (1, 2, 3):
            x = torch.randn(8, 4)
            torch.testing.assert_close(c(x), ref(x))
            assert int(m.num_batches_tracked) == int(ref.num_batches_tracked) == calls
            torch.testing.assert_close(m.running_mean, ref.running_mean)
            torch.testing.assert_close(m.running_var, ref.running_var)


def test_the_runs_that_time_a_graph_before_its_capture_leave_the_running_statistics_as_they_were():
    # on CUDA a graph's ops run again to time them before its capture: the call that captures
    # must still update a training batch norm's statistics once, as an eager call does
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    c = sd.compile(m, engine="aten")
    with torch.no_grad():
        c(torch.randn(8, 4))
        before = {name: b.clone() for name, b in m.named_buffers()}
        rerun_as_capture_timing_does(c)
    for name, want in before.items():
        torch.testing.assert_close(dict(m.named_buffers())[name], want, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_first_call_updates_tensors_a_function_changes_in_place_once(engine):
    counter, total, steps = torch.zeros(()), torch.zeros(3), torch.zeros(2)

    def f(x):
        counter.add_(1)
        total.mul_(2).add_(1)
        torch.add(steps, 1, out=steps)
        return x + counter

    c = sd.compile(f, engine=engine)
    with torch.no_grad():
        c(torch.zeros(3))
    assert float(counter) == 1 and torch.equal(total, torch.ones(3)) and torch.equal(steps, torch.ones(2))


@pytest.mark.parametrize("engine", ENGINES)
def test_the_dynamo_backend_updates_batch_norm_statistics_as_eager_does(engine, monkeypatch):
    import streamdag.frontend.dynamo  # noqa: F401 - registers backend="streamdag"

    monkeypatch.setenv("STREAMDAG_COMPILE_ENGINE", engine)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    ref = copy.deepcopy(m)
    opt = torch.compile(m, backend="streamdag")
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(8, 4)
            torch.testing.assert_close(opt(x), ref(x))
            for name, want in ref.named_buffers():
                torch.testing.assert_close(dict(m.named_buffers())[name], want, msg=name)


# --- training mode -------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_a_compiled_module_stops_dropping_out_after_eval(engine):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5))
    c = sd.compile(m, engine=engine)
    x = torch.randn(8, 16)
    with torch.no_grad():
        assert (c(x) == 0).any()  # dropout in training mode
        m.eval()
        torch.testing.assert_close(c(x), m(x), rtol=0, atol=0)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_compiled_batch_norm_updates_its_statistics_after_train(engine):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    ref = copy.deepcopy(m)
    c = sd.compile(m, engine=engine)
    with torch.no_grad():
        for mode in (False, True, False, True):
            m.train(mode)
            ref.train(mode)
            x = torch.randn(8, 4)
            torch.testing.assert_close(c(x), ref(x))
            for name, want in ref.named_buffers():
                torch.testing.assert_close(dict(m.named_buffers())[name], want, msg=name)
    assert _compiles(c) == 2  # one compile per mode, kept while the mode alternates
    assert c.statistics().eager_calls == 0


# --- replaced parameters, buffers, submodules and attributes --------------------------------

class _Tagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.tag = "x1"

    def forward(self, x):
        return self.lin(x) * len(self.tag)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shift", torch.zeros(4))
        self.scale = 1.0
        self.offsets = [0.0, 0.0]

    def forward(self, x):
        return self.lin(x) * self.scale + self.shift + self.offsets[1]


_CHANGES = {
    "parameter": lambda m: setattr(m.lin, "weight", nn.Parameter(torch.ones(4, 4))),
    "buffer": lambda m: setattr(m, "shift", torch.full((4,), 3.0)),
    "buffer-registered-again": lambda m: m.register_buffer("shift", torch.full((4,), 3.0)),
    "submodule": lambda m: setattr(m, "lin", nn.Linear(4, 4)),
    "python-attribute": lambda m: setattr(m, "scale", 2.0),
    "item-inside-a-list-attribute": lambda m: m.offsets.__setitem__(1, 5.0),
    "parameter-in-place": lambda m: m.lin.weight.data.mul_(-2),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("change", _CHANGES.values(), ids=_CHANGES.keys())
def test_a_replaced_parameter_buffer_submodule_or_attribute_is_seen(engine, change):
    torch.manual_seed(0)
    m = _Scaled().eval()
    c = sd.compile(m, engine=engine)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x))
        change(m)
        torch.testing.assert_close(c(x), m(x))
    assert c.statistics().eager_calls == 0


class Config:
    scale = 2.0


class WithConfig(nn.Module):
    """A module whose forward reads a value inside a plain object it holds (its own ``Config``)."""

    def __init__(self):
        super().__init__()
        self.config = Config()

    def forward(self, x):
        return x * self.config.scale


def test_on_the_aten_engine_attributes_whose_insides_are_not_guarded_are_named_in_one_warning():
    c = sd.compile(WithConfig(), engine="aten")
    with torch.no_grad():
        _, caught = _warnings_of(lambda: (c(torch.ones(2)), c(torch.ones(2))))
    assert len(caught) == 1 and "WithConfig.config (Config)" in caught[0]
    assert "not seen" in caught[0] and "assign a new object" in caught[0]


@pytest.mark.slow
def test_on_the_inductor_engine_a_value_changed_inside_an_attribute_object_is_seen():
    m = WithConfig()
    c = sd.compile(m)

    def call_change_call():
        first = c(torch.ones(2))
        m.config.scale = 3.0  # Dynamo guards the value the forward read
        return first, c(torch.ones(2))

    with torch.no_grad():
        (first, second), caught = _warnings_of(call_change_call)
    torch.testing.assert_close(first, torch.full((2,), 2.0))
    torch.testing.assert_close(second, torch.full((2,), 3.0))
    assert not caught and c.statistics().eager_calls == 0


def test_on_the_aten_engine_a_module_whose_state_changes_every_call_warns_once_that_it_retraces():
    m = _Scaled().eval()
    c = sd.compile(m, engine="aten")
    x = torch.randn(2, 4)

    def calls():
        for i in range(12):
            m.scale = float(i)
            torch.testing.assert_close(c(x), m(x))

    with torch.no_grad():
        _, caught = _warnings_of(calls)
    assert len([w for w in caught if "re-traced" in w]) == 1
    assert any("_Scaled.scale" in w for w in caught)


@pytest.mark.slow
def test_on_the_inductor_engine_calls_past_dynamos_recompile_limit_run_eagerly_and_say_so_once():
    from streamdag.frontend import compiled_model

    m = _Tagged().eval()
    c = sd.compile(m)
    x = torch.randn(2, 4)
    calls, limit = 20, torch._dynamo.config.recompile_limit

    def call_with_a_new_scale_each_time():
        for i in range(calls):
            m.tag = f"x{i}"  # a string stays a constant, with symbolic shapes too: each new one compiles
            torch.testing.assert_close(c(x), m(x))

    with torch.no_grad():
        _, caught = _warnings_of(call_with_a_new_scale_each_time)
    symbolic = limit  # the symbolic wrapper's compiles (a string stays a constant there too), after
    if not compiled_model._OWN_RECOMPILE_LIMIT:  # its room to recompile, where torch cannot isolate
        symbolic *= min(compiled_model._compiles_made, compiled_model._ROOM_FOR)
    limit += symbolic  # the static wrapper's, as many as the limit
    s = c.statistics()
    assert (s.graphs, s.eager_calls) == (limit, calls - limit)
    assert len(caught) == 1 and "recompile_limit" in caught[0] and "TORCH_LOGS=recompiles" in caught[0]
    assert f"{calls - limit} calls ran no compiled graph" in c.explain()


@pytest.mark.parametrize("change", ["shape", "float attribute"])
def test_a_model_called_with_a_new_shape_or_value_each_time_compiles_with_symbolic_shapes_and_stays_compiled(
        change):

    m = _Scaled().eval()
    c = sd.compile(m)
    limit = torch._dynamo.config.recompile_limit
    calls = 3 * limit
    with torch.no_grad():
        for i in range(1, calls + 1):
            x = torch.randn(i if change == "shape" else 2, 4)
            m.scale = float(i) if change == "float attribute" else 1.0
            torch.testing.assert_close(c(x), m(x))
    s = c.statistics()
    assert s.eager_calls == 0 and s.graphs <= limit + 2, c.explain()
    assert f"compiles with symbolic shapes after {limit} calls compiled with static ones" in c.explain()


class _TakesAList(nn.Module):
    """A model called with a list: its arguments have no whole-call key."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 2)

    def forward(self, xs):
        return self.b(torch.relu(self.a(xs[0])))


def _mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, 2))  # (reads .training)


def _training_pair(device, make=_mlp):
    """A model, its eager twin, the model compiled, and a training step of both on a batch size
    (gradients compared with eager's, then cleared); ``step(batch, grad=False)`` calls without them."""
    torch.manual_seed(0)
    m = make().to(device)
    ref = copy.deepcopy(m)
    c = sd.compile(m)
    wrap = (lambda x: [x]) if isinstance(m, _TakesAList) else (lambda x: x)

    def step(batch, grad=True):
        x = torch.randn(batch, 4, device=device)
        torch.compiler.cudagraph_mark_step_begin()  # (a training step: the trees' outputs are free)
        if not grad:
            with torch.no_grad():
                torch.testing.assert_close(c(wrap(x)), ref(wrap(x)))
            return
        c(wrap(x)).square().sum().backward()
        ref(wrap(x)).square().sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            p.grad = q.grad = None
    return m, c, step


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_training_steps_over_more_shapes_than_the_recompile_limit_stay_compiled_with_eagers_gradients(
        device):
    """Past Dynamo's recompile limit, new shapes compile once with symbolic shapes (Dynamo would run
    them as written); a training call of a shape compiled before keeps its static graphs."""
    _, c, step = _training_pair(device)
    limit = torch._dynamo.config.recompile_limit
    for batch in range(1, limit + 5):
        step(batch)
    s = c.statistics()
    assert s.eager_calls == 0 and s.graphs <= limit + 2, c.explain()
    assert f"compiles with symbolic shapes after {limit} calls compiled with static ones" in c.explain()
    step(1)  # a shape of the static wrapper's: its graphs, none compiled
    assert c.statistics().graphs == s.graphs


@pytest.mark.parametrize("case", ["arguments without a key", "validation between steps",
                                  "eval with gradients on a known shape"])
def test_training_past_the_recompile_limit_never_runs_as_written(case):
    """Dynamo counts one limit for a wrapper, both grad modes together, and guards more than a
    call's key: a model called with a list, training steps with calls without gradients between,
    and a known shape called after eval() all go on compiled (one call may run as written where
    a guard the key does not hold fails on the full static wrapper)."""
    m, c, step = _training_pair("cpu", _TakesAList if case == "arguments without a key" else _mlp)
    limit = torch._dynamo.config.recompile_limit
    for batch in range(1, limit + 5):
        step(batch)
        if case == "validation between steps":
            step(batch, grad=False)
    allowed = 0
    if case == "eval with gradients on a known shape":
        m.eval()
        for _ in range(3):
            step(1)
        allowed = 1
    assert c.statistics().eager_calls <= allowed, c.explain()


def test_a_model_holding_a_torchscript_module_that_dynamo_runs_as_written_says_so_and_names_the_fix():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.scripted = torch.jit.script(nn.Linear(4, 4))
            self.tail = nn.Linear(4, 4)

        def forward(self, x):
            return self.tail(self.scripted(x))

    m = Holder().eval()
    c = sd.compile(m)
    x = torch.randn(2, 4)
    with torch.no_grad():
        got, caught = _warnings_of(lambda: c(x))
    torch.testing.assert_close(got, m(x))
    assert len(caught) == 1 and "Dynamo does not trace TorchScript modules (scripted)" in caught[0]
    assert "compile the eager modules they were scripted from" in c.explain()


def test_a_recurrent_model_that_dynamo_runs_as_written_says_so_and_names_the_switch():
    gru = nn.GRU(8, 16, batch_first=True).eval()
    c = sd.compile(gru)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        got, caught = _warnings_of(lambda: c(x))
    torch.testing.assert_close(got, gru(x))
    assert c.statistics().eager_calls == 1
    assert len(caught) == 1 and "GRU" in caught[0] and "torch._dynamo.config.allow_rnn" in caught[0]
    assert "allow_rnn" in c.explain()


@pytest.mark.parametrize("engine", ENGINES)
def test_each_compiled_instance_of_a_module_class_has_its_own_recompile_limit(engine):
    x = torch.randn(2, 4)
    compiled = [sd.compile(_Scaled().eval(), engine=engine)
                for _ in range(torch._dynamo.config.recompile_limit + 2)]
    with torch.no_grad():
        for c in compiled:
            torch.testing.assert_close(c(x), c.__wrapped__(x))
    assert [(_compiles(c), c.statistics().eager_calls) for c in compiled] == [(1, 0)] * len(compiled)


def _returns_tuple(forward):
    """A decorator around every model's ``forward``, as Hugging Face's are: one wrapper code object
    that every model class's call enters first."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)
    return wrapper


def _classes_sharing_a_wrapper(n):
    """``n`` module classes whose ``forward``s go through one wrapper (each adds its own constant)."""
    def make(k):
        @_returns_tuple
        def forward(self, x):
            return self.lin(x) + k
        return type(f"Family{k}", (nn.Module,), {
            "__init__": lambda self: (nn.Module.__init__(self), setattr(self, "lin", nn.Linear(4, 4)))[0],
            "forward": forward})
    return [make(k) for k in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ["torch's isolate_recompiles", "a frame of its own"])
def test_models_whose_forwards_share_a_wrapper_each_compile_in_one_process(isolation, monkeypatch):
    from streamdag.frontend import compiled_model

    if isolation == "a frame of its own":  # what runs on a PyTorch without isolate_recompiles
        monkeypatch.setattr(compiled_model, "_OWN_RECOMPILE_LIMIT", {})
    elif not compiled_model._OWN_RECOMPILE_LIMIT:
        pytest.skip("this torch has no isolate_recompiles")
    x = torch.randn(2, 4)
    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        compiled = [sd.compile(cls().eval()) for cls in _classes_sharing_a_wrapper(5)]
        for c in compiled:
            torch.testing.assert_close(c(x), c.__wrapped__(x))
    assert [(c.statistics().graphs, c.statistics().eager_calls) for c in compiled] == [(1, 0)] * 5


def _models_breaking_before_a_shared_wrapper(n):
    """``n`` models whose ``forward`` breaks Dynamo's graph and then calls a submodule through the
    wrapper all the classes share: Dynamo starts again at that wrapper's frame, as it does at
    Hugging Face's output wrapper after a graph break in an encoder-decoder's forward."""
    class Breaking(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            x = x * 2
            torch._dynamo.graph_break()
            return self.inner(x)
    return [Breaking(cls()).eval() for cls in _classes_sharing_a_wrapper(n)]


@pytest.mark.slow
@pytest.mark.parametrize("room", [True, False], ids=["with room to recompile", "negative control"])
def test_models_meeting_a_shared_wrapper_after_a_graph_break_each_compile_unisolated(room, monkeypatch):
    from streamdag.frontend import compiled_model

    monkeypatch.setattr(compiled_model, "_OWN_RECOMPILE_LIMIT", {})  # as on a PyTorch without it
    if not room:
        monkeypatch.setattr(compiled_model, "_with_room_to_recompile",
                            lambda f, args, kwargs: f(*args, **kwargs))
    x = torch.randn(2, 4)
    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        compiled = [sd.compile(m) for m in _models_breaking_before_a_shared_wrapper(5)]
        for c in compiled:
            torch.testing.assert_close(c(x), c.__wrapped__(x))
        assert torch._dynamo.config.recompile_limit == 2  # put back after the calls
    eager = [c.statistics().eager_calls for c in compiled]
    wrapper_graphs = [c.statistics().graphs for c in compiled]
    if room:
        assert eager == [0] * 5 and wrapper_graphs == [2] * 5
    else:
        assert sum(g < 2 for g in wrapper_graphs) >= 2


def test_the_recompile_limit_comes_back_after_a_call_unless_the_call_set_its_own(monkeypatch):
    from streamdag.frontend import compiled_model

    monkeypatch.setattr(compiled_model, "_OWN_RECOMPILE_LIMIT", {})  # as on a PyTorch without it

    def sets_a_limit(x):
        torch._dynamo.config.recompile_limit = 64
        return x + 1

    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        torch.testing.assert_close(sd.compile(lambda x: x * 2)(torch.ones(2)), torch.full((2,), 2.0))
        assert torch._dynamo.config.recompile_limit == 2
        sd.compile(sets_a_limit)(torch.ones(2))
        assert torch._dynamo.config.recompile_limit == 64  # the call's own setting stays


def test_without_isolation_models_sharing_a_wrapper_exhaust_one_recompile_limit():
    # the negative control: Dynamo alone, each model compiled at the shared frame
    x = torch.randn(2, 4)
    graphs = []

    def counting(gm, examples):
        graphs.append(gm)
        return gm.forward

    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        for cls in _classes_sharing_a_wrapper(5):
            m = cls().eval()
            torch.testing.assert_close(torch.compile(m, backend=counting)(x), m(x))
    assert len(graphs) < 5


# --- several threads ------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_first_calls_from_several_threads_compile_once_and_all_run_compiled(engine):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    c = sd.compile(m, engine=engine)
    threads, start = 6, threading.Barrier(6)
    xs = [torch.randn(4, 32) for _ in range(threads)]
    results: list = [None] * threads
    errors: list = []

    def call(i):
        try:
            start.wait()
            with torch.no_grad():
                results[i] = c(xs[i])
        except BaseException as exc:  # reported below
            errors.append(exc)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ResourceWarning)  # (what an earlier test dropped, freed now)
        workers = [threading.Thread(target=call, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert not errors and not [w for w in caught if "streamdag" in str(w.message)]
    with torch.no_grad():
        for x, got in zip(xs, results):
            torch.testing.assert_close(got, m(x))
    assert (_compiles(c), c.statistics().eager_calls) == (1, 0)


# --- output types ---------------------------------------------------------------------------

_Pair = namedtuple("_Pair", "a b")


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    hidden: list
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class _Frozen:
    value: torch.Tensor


@dataclasses.dataclass
class _ModelOutput(OrderedDict):
    """As ``transformers``' ``ModelOutput``: a dataclass that is also an ordered dict of its fields,
    registered with pytree."""

    logits: torch.Tensor = None
    hidden: torch.Tensor = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


torch.utils._pytree.register_pytree_node(
    _ModelOutput, lambda o: (list(o.values()), list(o.keys())),
    lambda values, keys: _ModelOutput(**dict(zip(keys, values))))


def _same(a, b):
    assert type(a) is type(b)
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name))
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _same(u, v)
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys())
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert type(a) is torch.Tensor
        torch.testing.assert_close(a, b)
    elif not dataclasses.is_dataclass(a):
        assert a == b


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("make", [
    lambda x: [x + 1, x * 2],
    lambda x: (x + 1, [x * 2, {"k": x - 1}]),
    lambda x: {"a": x + 1, "b": (x * 2,), "n": None, "s": "text"},
    lambda x: _Pair(x + 1, [x]),
    lambda x: _Output(x + 1, [x * 2, x * 3], steps=x.shape[0]),
    lambda x: _Frozen(x * 4),
    lambda x: _ModelOutput(logits=x + 1, hidden=x * 2),
], ids=["list", "tuple", "dict", "namedtuple", "dataclass", "frozen-dataclass", "model-output"])
def test_outputs_keep_the_models_own_container_types(engine, make):
    c = sd.compile(make, engine=engine)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3)
            _same(c(x), make(x))
    assert (_compiles(c), c.statistics().eager_calls) == (1, 0)


class _Cache:
    """A key/value cache as models return it: a plain object holding tensors."""

    def __init__(self, keys):
        self.keys = keys


def _returns_a_cache(x):
    return x + 1, _Cache([x * 2])


def test_on_the_aten_engine_an_output_object_it_cannot_rebuild_runs_eagerly_saying_why_once():
    c = sd.compile(_returns_a_cache, engine="aten")
    with torch.no_grad():
        (first, second), caught = _warnings_of(lambda: (c(torch.ones(2)), c(torch.ones(2))))
    assert isinstance(first[1], _Cache) and torch.equal(second[1].keys[0], torch.full((2,), 2.0))
    assert len(caught) == 1
    assert "_Cache" in caught[0] and "register_pytree_node" in caught[0]
    assert "_Cache" in c.explain() and "register_pytree_node" in c.explain()


@pytest.mark.slow
def test_on_the_inductor_engine_an_output_object_holding_tensors_comes_back_from_the_compiled_graph():
    c = sd.compile(_returns_a_cache)
    with torch.no_grad():
        (first, second), caught = _warnings_of(lambda: (c(torch.ones(2)), c(torch.full((2,), 3.0))))
    assert isinstance(first[1], _Cache) and torch.equal(first[1].keys[0], torch.full((2,), 2.0))
    assert torch.equal(second[1].keys[0], torch.full((2,), 6.0)) and second[1] is not first[1]
    assert not caught and (c.statistics().graphs, c.statistics().eager_calls) == (1, 0)


# --- inference tensors ----------------------------------------------------------------------

class _Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(8, 8) / 3) for _ in range(4)])

    def forward(self, x):
        return torch.stack([torch.relu(x @ w) for w in self.ws]).sum(0)


def _made_under_inference_mode():
    with torch.inference_mode():
        return _Wide()  # its parameters are inference tensors


def _cast_under_inference_mode():
    m = _Wide()
    with torch.inference_mode():
        m.double()  # its parameters hold inference tensors now
    return m


def _options(engine, **aten_only):
    return {"engine": engine, **(aten_only if engine == "aten" else {})}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("make", [_made_under_inference_mode, _cast_under_inference_mode],
                         ids=["made", "cast"])
def test_a_model_with_inference_tensor_weights_compiles_and_sees_in_place_updates(engine, make):
    torch.manual_seed(0)
    m = make()
    assert m.ws[0].is_inference()
    c = sd.compile(m, **_options(engine, batch=True))
    x = torch.randn(3, 8, dtype=m.ws[0].dtype)
    with torch.inference_mode():
        (got, _), caught = _warnings_of(lambda: (c(x), c(x)))
        torch.testing.assert_close(got, m(x))
        m.ws[1].mul_(-2)  # no version counter records this: the graph must read the weight itself
        torch.testing.assert_close(c(x), m(x))
    assert c.statistics().eager_calls == 0 and not caught
    if engine == "aten":
        text = c.explain()
        assert "4 weights left out: they are inference tensors" in text and "torch.no_grad()" in text


def test_batching_still_stacks_weights_that_are_not_inference_tensors():
    torch.manual_seed(0)
    m = _Wide()
    c = sd.compile(m, engine="aten", batch=True)
    with torch.inference_mode():
        x = torch.randn(3, 8)
        torch.testing.assert_close(c(x), m(x))
    assert "1 x matmul (sizes [4])" in c.explain() and "inference tensors" not in c.explain()


@pytest.mark.parametrize("engine, options", [
    pytest.param("inductor", {}, marks=pytest.mark.slow),
    ("aten", {"batch": False}),
    ("aten", {"batch": True}),
], ids=["inductor", "aten", "aten-batched"])
def test_a_module_first_called_in_inference_mode_runs_under_no_grad_too(engine, options):
    torch.manual_seed(0)
    m = _Wide()
    c = sd.compile(m, engine=engine, **options)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        c(x)
    with torch.no_grad():
        m.ws[0].mul_(2)  # copied into the stacked weights before the next call, outside inference mode
        torch.testing.assert_close(c(x), m(x))
    assert c.statistics().eager_calls == 0


# --- on a GPU -------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["inductor", "aten"])
def test_on_cuda_a_model_moved_under_inference_mode_replays_and_sees_in_place_updates(engine):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    m = _Wide()
    with torch.inference_mode():
        m.cuda()
    c = sd.compile(m, engine=engine)
    x = torch.randn(3, 8, device="cuda")
    with torch.inference_mode():
        for _ in range(8):
            torch.testing.assert_close(c(x), m(x))
        m.ws[2].mul_(-1)
        torch.testing.assert_close(c(x), m(x))
    s = c.statistics()
    assert s.eager_calls == 0 and s.replays >= 3
    if engine == "aten":
        assert "inference tensors" in c.explain()
    c.close()


@pytest.mark.cuda
@pytest.mark.parametrize("engine", ["inductor", "aten"])
def test_on_cuda_train_and_eval_each_compile_once_and_eval_replays(engine):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).cuda()
    ref = copy.deepcopy(m)
    c = sd.compile(m, engine=engine)
    with torch.no_grad():
        for mode in (True, False) * 6:
            m.train(mode)
            ref.train(mode)
            x = torch.randn(16, 8, device="cuda")
            torch.testing.assert_close(c(x), ref(x), rtol=1e-4, atol=1e-4)
            for name, want in ref.named_buffers():
                torch.testing.assert_close(dict(m.named_buffers())[name], want, rtol=1e-4, atol=1e-4)
    s = c.statistics()
    assert _compiles(c) == 2 and s.replays >= 6 and s.eager_calls == 0
    c.close()


def test_compiling_on_cpython_3_13_0_warns_that_dynamos_guards_can_miss_changes(monkeypatch):
    from streamdag.frontend import compiled_model

    monkeypatch.setattr(compiled_model, "_warned_of_stale_guards", False)
    monkeypatch.setattr(compiled_model, "_STALE_GUARDS", True)  # as on CPython 3.13.0
    with pytest.warns(sd.StreamdagWarning, match="3.13.1"):
        sd.compile(nn.Linear(2, 2))
    monkeypatch.setattr(compiled_model, "_warned_of_stale_guards", False)
    monkeypatch.setattr(compiled_model, "_STALE_GUARDS", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sd.StreamdagWarning)
        sd.compile(nn.Linear(2, 2))  # a fixed Python: no warning
