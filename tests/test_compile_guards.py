"""streamdag.compile follows the module's state: training mode, replaced attributes, buffers
updated once per call; safe first calls from several threads; outputs in the model's own types."""

import copy
import warnings

import pytest

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
