"""Bad input, bad settings and a closed runtime are refused at once, with an error that names the fix."""

import numpy as np
import pytest

import streamdag as sd

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def test_submit_after_close_says_what_to_do():
    rt = sd.Runtime("cpu", streams=1)
    rt.close()
    with pytest.raises(sd.RuntimeClosed, match="create a new one"):
        rt.submit(print)


def test_non_buffer_in_reads_is_refused(rt):
    with pytest.raises(sd.InvalidBuffer, match="numpy arrays or torch tensors"):
        rt.submit(print, reads=[[1, 2]])


def test_single_buffer_instead_of_a_list_is_refused(rt):
    with pytest.raises(TypeError, match="reads=\\[a, b\\]"):
        rt.submit(print, reads=np.zeros(3))


def test_wrong_device_is_refused_with_the_fix():
    from streamdag.graph import Region

    with sd.Runtime("cpu", streams=1) as rt, pytest.raises(sd.InvalidBuffer, match="device="):
        rt.submit(print, reads=[Region("cuda:0", 0, 8)])  # a GPU's memory, given as its byte range


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="unknown device"):
        sd.Runtime("tpu")


@pytest.mark.parametrize(("settings", "error", "message"), [
    ({"streams": 0}, ValueError, "streams must be at least 1"),
    ({"streams": 2.5}, TypeError, "streams must be a whole number"),
    ({"max_inflight": 0}, ValueError, "max_inflight must be at least 1"),
    ({"max_inflight": "8"}, TypeError, "max_inflight must be a whole number"),
    ({"max_inflight_bytes": -1}, ValueError, "max_inflight_bytes must be at least 0"),
    ({"staging_bytes": 1.5e9}, TypeError, "staging_bytes must be a whole number"),
])
def test_bad_settings_are_refused_with_what_is_expected(settings, error, message):
    with pytest.raises(error, match=message):
        sd.Runtime("cpu", **settings)


@pytest.mark.parametrize("settings", [
    {"device": "cuda"}, {"streams": 4}, {"seed": 3}, {"default_stream_sync": False},
])
def test_settings_a_given_backend_would_ignore_are_refused(settings):
    from streamdag.backends.inline import InlineBackend

    backend = InlineBackend("cpu", 2)
    with pytest.raises(ValueError, match=f"{next(iter(settings))}=.*would be ignored.*make the backend"):
        sd.Runtime(backend=backend, **settings)
    with sd.Runtime(backend=backend) as rt:  # the same backend, left to bring its own settings
        assert rt.submit(lambda: 7).result() == 7


def test_a_host_device_copy_needs_one_dtype_and_shape():
    """Through staging buffers a pageable copy moves bytes: no copy converts, so none silently
    reinterprets them."""
    import torch

    from streamdag.runtime.transfers import _check_layouts

    _check_layouts("h2d", torch.zeros(4), torch.ones(4))  # the same layout: nothing to say
    with pytest.raises(ValueError, match=r"from torch.float32 \(2, 2\) into torch.float32 \(4,\).*to_device"):
        _check_layouts("h2d", torch.zeros(4), torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"from torch.float64 \(4,\) into torch.float32 \(4,\).*Convert"):
        _check_layouts("d2h", torch.zeros(4), torch.zeros(4, dtype=torch.float64))


def test_asking_for_cuda_without_a_gpu_says_what_to_do():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="use device='cpu'"):
        sd.Runtime("cuda")


@pytest.mark.parametrize("run_on", ["gpu", "cuda", 0])
def test_a_run_on_this_runtime_does_not_have_names_what_it_takes(run_on):
    said = r"run_on takes None, 'host' or 'cpu' here; for a GPU, create a runtime with device='cuda'"
    with sd.Runtime("cpu", streams=1) as rt, pytest.raises(ValueError, match=said):
        rt.submit(len, [1], run_on=run_on)
