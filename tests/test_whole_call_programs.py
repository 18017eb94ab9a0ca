"""Random programs against eager: whatever a user does to a model between calls, a whole-call
graph's result equals the model's eager call.

A program mixes calls (two batch sizes, grad on or off, the result kept to the end or compared at
once and let go, so that replays lend their outputs from sets in turn or copy them) with what
users do to a model: set an
attribute its forward reads, swap a submodule, add and remove a forward hook, update a parameter
or buffer in place, give a parameter other memory (``.data = ...``), replace a buffer, switch
between train and eval. The stand-in device replays what the capture recorded, as a CUDA graph
would: the model as it was at the capture (a copy of its Python state), reading the parameters'
and buffers' memory of then in place. So a replay after a change the checks miss returns a
stale result, and the comparison with eager catches it (the negative control shows it does).
"""

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
nn = torch.nn

from stand_in_device import StandInDevice  # noqa: E402
from streamdag.frontend import whole_call as wc  # noqa: E402
from streamdag.frontend.whole_call import StateWatch, WholeCall  # noqa: E402
from whole_call_stand_in import Dynamo, FakeBackend, FakeGraph, tensors_of  # noqa: E402


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.register_buffer("offset", torch.zeros(8))
        self.scale = 1.0
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.norm(self.lin(x)) * self.scale + self.offset)


class RecordingDevice(StandInDevice):
    """A replay runs the model as it was at the capture, over the memory of then."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def capture(self, fn, args, kwargs, private=False):
        tensors = [*self.model.parameters(), *self.model.buffers()]
        saved = [t.detach().clone() for t in self.model.buffers()]
        out = fn(*args, **kwargs)
        with torch.no_grad():  # a capture runs nothing: what the call updated stays as it was
            for b, s in zip(self.model.buffers(), saved):
                b.copy_(s)
        # the Python state of now; each parameter and buffer a view of its memory of now
        frozen = copy.deepcopy(self.model, memo={id(t): t.detach() for t in tensors})

        def replay():
            self.replays += 1
            fresh = frozen(*args, **kwargs)
            for o, f in zip(tensors_of(out), tensors_of(fresh)):
                o.copy_(f)
        return FakeGraph(replay), out


def _double(module, inputs, output):
    return output * 2


STEPS = st.one_of(
    st.tuples(st.just("call"), st.sampled_from([3, 5]), st.booleans(), st.booleans()),
    st.tuples(st.just("scale"), st.sampled_from([0.5, 1.0, 2.0])),
    st.tuples(st.just("act"), st.sampled_from(["relu", "tanh"])),
    st.tuples(st.just("hook"), st.booleans()),
    st.tuples(st.just("bias_add"), st.sampled_from([0.25, -0.5])),
    st.tuples(st.just("weight_memory")),
    st.tuples(st.just("offset_fill"), st.sampled_from([0.0, 1.5])),
    st.tuples(st.just("offset_new"), st.sampled_from([0.0, -1.0])),
    st.tuples(st.just("mode"), st.sampled_from(["train", "eval"])),
    st.tuples(st.just("new_attribute")),
)


def run(program, monkeypatch, seed=0):
    """Each call's (whole-call result, eager result) along ``program``."""
    torch.manual_seed(seed)
    m = Model().eval()
    dev = RecordingDevice(m)
    monkeypatch.setattr(wc, "_device_for", lambda device, pool: dev)
    monkeypatch.setattr(wc, "_one_cuda_device", lambda args, kwargs: (torch.device("cpu"), ""))
    w, dynamo = WholeCall(m, FakeBackend()), Dynamo(m)
    hook = None
    pairs = []
    for step in program:
        kind = step[0]
        with torch.no_grad():
            if kind == "call":  # the result kept to the end, or compared now and let go
                x = torch.randn(step[1], 8)
                with torch.enable_grad() if step[2] else torch.no_grad():
                    got = w((x,), {}, dynamo).detach()
                    want = m(x).detach()
                if len(step) < 4 or step[3]:
                    pairs.append((got, want))
                else:
                    torch.testing.assert_close(got, want)
                    del got
            elif kind == "scale":
                m.scale = step[1]
            elif kind == "act":
                m.act = nn.ReLU() if step[1] == "relu" else nn.Tanh()
            elif kind == "hook":
                if step[1] and hook is None:
                    hook = m.lin.register_forward_hook(_double)
                elif not step[1] and hook is not None:
                    hook.remove()
                    hook = None
            elif kind == "bias_add":
                m.lin.bias.add_(step[1])
            elif kind == "weight_memory":
                m.lin.weight.data = torch.randn(8, 8)
            elif kind == "offset_fill":
                m.offset.fill_(step[1])
            elif kind == "offset_new":
                m.offset = torch.full((8,), step[1])
            elif kind == "mode":
                getattr(m, step[1])()
            elif kind == "new_attribute":
                m.note = len(pairs)
    return pairs, w


@given(program=st.lists(STEPS, min_size=4, max_size=24))
def test_a_random_program_of_calls_and_model_changes_gets_eagers_results(program, monkeypatch_module):
    pairs, _ = run(program + [("call", 3, False)] * 2, monkeypatch_module)
    for got, want in pairs:
        torch.testing.assert_close(got, want)


def test_a_program_replaying_graphs_it_finds_stale_would_be_caught(monkeypatch):
    """Negative control: with the state checks made to pass always, a changed attribute leaves the
    replay stale, and the comparison with eager sees it."""
    monkeypatch.setattr(StateWatch, "holds", lambda self: True)
    program = [("call", 3, False)] * 3 + [("scale", 2.0), ("call", 3, False)]
    pairs, w = run(program, monkeypatch)
    assert w.replays >= 1
    got, want = pairs[-1]
    assert not torch.allclose(got, want)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp
