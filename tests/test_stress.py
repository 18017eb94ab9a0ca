"""Several threads use one runtime at once, in every way the API allows, with failures injected.

Each thread submits ops (some failing, some with done-callbacks that submit
more, some on the host lanes beside the device, ``run_on="host"``, over host
buffers that other ops read), cancels, waits with and without timeouts, synchronizes, records and
runs small graphs (some with a host-lane op), orders its stream after futures, and tries non-blocking
submits, under a small in-flight bound. Nothing may hang (pytest-timeout
turns a hang into a failure), no call may raise what the API does not
promise, and every op must end finished or failed.
"""

import contextlib
import os
import random
import threading

import numpy as np
import pytest

import streamdag as sd

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")

SEEDS = range(20 if os.environ.get("CI") else 5)


def _worker(rt, bufs, hbufs, seed, futures, unexpected):
    rng = random.Random(seed)

    def op(i, fail, host_input=None):
        def run():
            if fail:
                raise ValueError("injected")
            bufs[i] += 1 if host_input is None else 1 + 0 * float(hbufs[host_input][0])
        return run

    def host_op(i, j, fail):
        def run():
            if fail:
                raise ValueError("injected")
            hbufs[i] += hbufs[j][0] % 3
        return run

    for _ in range(200):
        i, j, action = rng.randrange(len(bufs)), rng.randrange(len(bufs)), rng.random()
        try:
            if action < 0.15:  # on a host lane, after the ops that wrote what it reads
                futures.append(rt.submit(host_op(i, j, rng.random() < 0.1), reads=[hbufs[j]],
                                         writes=[hbufs[i]], run_on="host"))
            elif action < 0.3:  # a device op reading a host buffer: after the host-lane ops writing it
                futures.append(rt.submit(op(i, rng.random() < 0.1, j), reads=[hbufs[j]], writes=[bufs[i]]))
            elif action < 0.5:
                f = rt.submit(op(i, rng.random() < 0.1), reads=[bufs[j]], writes=[bufs[i]])
                futures.append(f)
                if rng.random() < 0.2:  # a continuation, submitted by the thread that finishes ``f``
                    f.add_done_callback(
                        lambda _f, i=i: futures.append(rt.submit(op(i, False), writes=[bufs[i]])))
            elif action < 0.6 and futures:
                assert rng.choice(futures).cancel() is False
            elif action < 0.75 and futures:
                with contextlib.suppress(ValueError, sd.DependencyFailed, TimeoutError):
                    rng.choice(futures).result(timeout=rng.choice([0, 0.001, 1]))
            elif action < 0.8:
                with contextlib.suppress(sd.ExceptionGroup):
                    rt.synchronize()
            elif action < 0.85:
                with rt.record() as g:
                    rt.submit(op(i, False), writes=[bufs[i]])
                    rt.submit(op(j, rng.random() < 0.2), reads=[bufs[i]], writes=[bufs[j]])
                    if rng.random() < 0.5:  # a host-lane op in the graph, and a device op after it
                        rt.submit(host_op(i, j, rng.random() < 0.2), reads=[hbufs[j]], writes=[hbufs[i]],
                                  run_on="host")
                        rt.submit(op(j, False, i), reads=[hbufs[i]], writes=[bufs[j]])
                with contextlib.suppress(sd.ExceptionGroup):
                    g.run().result(timeout=30)
            elif action < 0.9:
                rt.current_stream_wait(*rng.sample(futures, min(3, len(futures))))
            else:
                with contextlib.suppress(sd.WouldBlock):
                    futures.append(rt.submit_nowait(op(i, False), writes=[bufs[i]]))
        except Exception as exc:  # anything else is a bug
            unexpected.append(repr(exc))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("device", ["cpu", "sim", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_threads_using_every_api_at_once_never_hang_and_every_op_ends(device, seed):
    if device == "cuda":
        torch = pytest.importorskip("torch")  # the cuda mark skips it without a GPU (conftest)
        bufs = [torch.zeros(16, device="cuda") for _ in range(6)]
    else:
        bufs = [np.zeros(16) for _ in range(6)]
    hbufs = [np.zeros(16) for _ in range(6)]
    futures, unexpected = [], []
    with sd.Runtime(device, streams=3, max_inflight=8, seed=seed) as rt:
        threads = [threading.Thread(target=_worker,
                                    args=(rt, bufs, hbufs, seed * 10 + k, futures, unexpected))
                   for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with contextlib.suppress(sd.ExceptionGroup):
            rt.synchronize()
        stats = rt.statistics()
    assert not unexpected, unexpected[:5]
    assert stats.inflight == 0 and stats.completed + stats.failed == stats.submitted > 0
    assert all(f.done() for f in futures)
