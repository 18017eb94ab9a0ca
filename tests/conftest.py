import os

import pytest
from hypothesis import HealthCheck, settings

from programs import DEVICES

#: the ``path`` fixture is function-scoped but holds for every example of a test alike
_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=_SUPPRESSED)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=_SUPPRESSED)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=["compiled", "python"])
def path(request):
    """The test runs on the compiled hot path, and again on its Python reference (what runs where
    the package was installed without its compiled module, or under ``STREAMDAG_NATIVE=0``): the
    runtimes it makes take the one chosen (see ``internals.python_reference``). Without the compiled
    module only the Python one runs. A test of one path alone asks for it with
    ``@pytest.mark.parametrize("path", ["python"], indirect=True)``."""
    from internals import use_python_reference
    from streamdag import native

    if request.param == "compiled":
        if native.load() is None:
            pytest.skip(f"no compiled hot path here: {native.status()}")
        yield request.param
        return
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_python_reference(monkeypatch, request.module)
        yield request.param


@pytest.fixture(params=DEVICES)
def rt(request, path):
    """A runtime of three streams, on the CPU lanes and on the simulated device, on each ``path``."""
    import streamdag as sd

    with sd.Runtime(request.param, streams=3) as runtime:
        yield runtime


@pytest.fixture
def no_tf32():
    """Full fp32 matmuls and convolutions (no TF32) for the test, so that results compare tightly."""
    import torch

    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster of two nodes (one CPU and 100 MB of object store each; the head has the
    GPU, if there is one), shared by every ``ray`` test: starting one takes seconds. Skips where ray
    is not installed."""
    ray = pytest.importorskip("ray", reason="streamdag.ray needs ray: pip install 'streamdag[ray]'")
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 100 * 2**20}
    # the head node has this machine's GPU, if any, for the cuda tests of GPU workers
    cluster = Cluster(initialize_head=True, head_node_args={**node, "num_gpus": int(_has_cuda())})
    cluster.add_node(**node)
    if ray.is_initialized():  # a test outside these started its own
        ray.shutdown()
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


# -- whole-call graphs on the CPU (see whole_call_stand_in.py) --------------------------------------------

@pytest.fixture
def fake_device(monkeypatch):
    """Whole-call graphs on the CPU through :class:`FakeDevice`; returns a function that makes one."""
    from streamdag.frontend import whole_call as wc
    from whole_call_stand_in import FakeDevice

    devices = []

    def make(eager):
        dev = FakeDevice(eager)
        devices.append(dev)
        monkeypatch.setattr(wc, "_device_for", lambda device, pool: dev)
        return dev

    import torch

    monkeypatch.setattr(wc, "_one_cuda_device", lambda args, kwargs: (torch.device("cpu"), ""))
    return make


@pytest.fixture(params=["watched", "native", "own dicts", "python"])
def state_checks(request, monkeypatch):
    """Each state test runs with the compiled dict watcher (CPython 3.12 on), with the compiled
    dict-version tags alone, with the tags after each object's dict is made its own (as CPython
    3.13 needs), and with the Python comparison alone."""
    from streamdag.frontend import state_watch

    if request.param != "watched":
        monkeypatch.setattr(state_watch, "_native_watch", None)
        monkeypatch.setattr(state_watch, "_watch_checked", True)
    elif state_watch._dict_watcher() is None:
        pytest.skip("no compiled dict watcher here (no compiled module, CPython before 3.12, or the "
                    "process's watchers taken)")
    if request.param == "python":
        monkeypatch.setattr(state_watch, "_native_tags", None)
        monkeypatch.setattr(state_watch, "_native_checked", True)
        monkeypatch.setattr(state_watch, "_native_items", None)
        monkeypatch.setattr(state_watch, "_items_checked", True)
    elif request.param in ("native", "own dicts") and state_watch.dict_tags() is None:
        pytest.skip("no compiled dict-version check here (no compiled module, or CPython 3.14 on)")
    if request.param == "own dicts":
        monkeypatch.setattr(state_watch, "_tags_need_own_dicts", True)
    return request.param


@pytest.fixture
def cpu_code_as_gpus(monkeypatch):
    """Inductor's CPU code stands for the GPU's in a whole call (a graph on the CPU is otherwise
    kept out of whole calls), with Dynamo's caches reset around the test."""
    import torch

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


@pytest.fixture
def fresh_dynamo():
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
