"""streamdag.compile follows the module's state: training mode, replaced attributes, buffers
updated once per call; safe first calls from several threads; outputs in the model's own types."""

import copy
import warnings

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")
nn = torch.nn


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if "streamdag.compile" in str(w.message)]


# --- buffers a call updates in place ------------------------------------------------------

def test_the_dynamo_backend_updates_batch_norm_statistics_as_eager_does():
    import streamdag.frontend.dynamo  # noqa: F401 - registers backend="streamdag"

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


@pytest.mark.parametrize("make", [_made_under_inference_mode, _cast_under_inference_mode],
                         ids=["made", "cast"])
def test_a_model_with_inference_tensor_weights_compiles_and_sees_in_place_updates(make):
    torch.manual_seed(0)
    m = make()
    assert m.ws[0].is_inference()
    c = sd.compile(m, batch=True)
    x = torch.randn(3, 8, dtype=m.ws[0].dtype)
    with torch.inference_mode():
        (got, _), caught = _warnings_of(lambda: (c(x), c(x)))
        torch.testing.assert_close(got, m(x))
        m.ws[1].mul_(-2)  # no version counter records this: the graph must read the weight itself
        torch.testing.assert_close(c(x), m(x))
    assert c.statistics().eager_calls == 0 and not caught
    text = c.explain()
    assert "4 weights left out: they are inference tensors" in text and "torch.no_grad()" in text


def test_batching_still_stacks_weights_that_are_not_inference_tensors():
    torch.manual_seed(0)
    m = _Wide()
    c = sd.compile(m, batch=True)
    with torch.inference_mode():
        x = torch.randn(3, 8)
        torch.testing.assert_close(c(x), m(x))
    assert "1 x matmul (sizes [4])" in c.explain() and "inference tensors" not in c.explain()


@pytest.mark.parametrize("batch", [False, True])
def test_a_module_first_called_in_inference_mode_runs_under_no_grad_too(batch):
    torch.manual_seed(0)
    m = _Wide()
    c = sd.compile(m, batch=batch)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        c(x)
    with torch.no_grad():
        m.ws[0].mul_(2)  # copied into the stacked weights before the next call, outside inference mode
        torch.testing.assert_close(c(x), m(x))
    assert c.statistics().eager_calls == 0
