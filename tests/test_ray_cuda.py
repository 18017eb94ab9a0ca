"""A GPU worker of streamdag.ray: its part of a recorded graph is recorded into a local CUDA
runtime on the worker, which captures it into a CUDA graph and replays it, as on one machine."""

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="streamdag.ray needs ray: pip install 'streamdag[ray]'")

import streamdag as sd  # noqa: E402
from streamdag.ray import Runtime  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.cuda]


def test_a_gpu_workers_recorded_graph_is_captured_and_replayed_as_on_a_local_runtime(ray_cluster):
    import torch

    x0 = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    with Runtime(1, num_cpus=0.25, num_gpus=1, timeout_s=120) as rt:
        x = rt.put(x0, on=0)  # a torch tensor on the worker's GPU
        y = rt.empty((64, 64), np.float32, on=0)
        with rt.record() as g:
            rt.submit(torch.matmul, sd.read(x), sd.read(x), out=sd.write(y))
            rt.submit(torch.tanh, sd.read(y), out=sd.write(y))
        for _ in range(4):
            g.run().result(timeout=120)
        np.testing.assert_allclose(rt.get(y).result(timeout=60), np.tanh(x0 @ x0), rtol=1e-3, atol=1e-3)
        ((captures, replays),) = ray.get(rt.worker(0).captured_statistics.remote(), timeout=60)
        assert captures >= 1 and replays >= 1  # the first run runs eagerly; later runs replay

        rt.put(2 * x0, out=x)  # refilled in place: the captured graph reads the new values
        g.run().result(timeout=120)
        np.testing.assert_allclose(rt.get(y).result(timeout=60), np.tanh(4 * x0 @ x0), rtol=1e-3, atol=1e-3)


def test_a_gpu_workers_captured_graph_reads_the_inputs_of_each_run_and_sends_its_outputs(ray_cluster):
    import torch

    x0 = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    with Runtime(1, num_cpus=0.25, num_gpus=1, timeout_s=120) as rt:
        x = rt.empty((64, 64), np.float32, on=0)
        y = rt.empty((64, 64), np.float32, on=0)
        with rt.record() as g:
            rt.submit(torch.matmul, sd.read(x), sd.read(x), out=sd.write(y))
            rt.submit(torch.tanh, sd.read(y), out=sd.write(y))
        for k in range(1, 5):  # stored in place: the captured graph reads each run's values
            xk = x0 * np.float32(k / 4)
            res = g.run(inputs={x: xk}, outputs=[y]).result(timeout=120)
            np.testing.assert_allclose(res.outputs[0], np.tanh(xk @ xk), rtol=1e-3, atol=1e-3)
        ((captures, replays),) = ray.get(rt.worker(0).captured_statistics.remote(), timeout=60)
        assert captures >= 1 and replays >= 1
