"""streamdag.ray when a worker dies mid-run: its ops fail with WorkerLost, their dependents with
DependencyFailed, the rest run, and the runtime (and its recorded graphs) go on once Ray restarts it."""

import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="streamdag.ray needs ray: pip install 'streamdag[ray]'")

import streamdag as sd  # noqa: E402
from streamdag.ray import Runtime, WorkerLost  # noqa: E402

pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def rt(ray_cluster):
    with Runtime(2, num_cpus=0.25, timeout_s=60) as runtime:
        yield runtime


def _slow_fill(seconds, out):
    if seconds:
        time.sleep(seconds)
    out[:] = 7.0


def _kill_soon(rt, worker, after=1.0):
    time.sleep(after)
    ray.kill(rt.worker(worker), no_restart=False)


def test_a_worker_killed_mid_run_fails_its_ops_and_their_dependents_and_the_runtime_goes_on(rt):
    remote = rt.put(np.zeros(4), on=1)
    own = rt.put(np.ones(4), on=0)
    dst = rt.empty(4, on=0)
    slow = rt.submit(_slow_fill, 30.0, sd.write(remote))  # on ray:1
    behind = rt.submit(np.add, sd.read(remote), 1.0, out=sd.write(remote))  # queued behind it there
    dependent = rt.submit(np.add, sd.read(remote), sd.read(own), out=sd.write(dst))  # ray:0, a transfer
    independent = rt.submit(np.multiply, sd.read(own), 3.0, out=sd.write(own))  # ray:0
    _kill_soon(rt, 1)
    for f in (slow, behind):
        with pytest.raises(WorkerLost, match="ray:1"):
            f.result(timeout=60)
    with pytest.raises(sd.DependencyFailed) as dep:
        dependent.result(timeout=60)
    assert isinstance(dep.value.root_error, WorkerLost)
    assert independent.result(timeout=60) is own
    with pytest.raises(sd.ExceptionGroup) as group:
        rt.synchronize()
    assert {type(e) for e in group.value.exceptions} == {WorkerLost}

    # the restarted worker has lost its buffers: reading one says so; writing it again brings it back
    assert rt.wait_for_workers() == ["ray:1"]
    with pytest.raises(WorkerLost, match="restarted"):
        rt.get(remote).result(timeout=60)
    with pytest.raises(sd.ExceptionGroup):
        rt.synchronize()
    rt.put(np.full(4, 5.0), out=remote)
    rt.submit(np.add, sd.read(remote), sd.read(own), out=sd.write(dst)).result(timeout=60)
    np.testing.assert_array_equal(rt.get(dst).result(timeout=60), np.full(4, 8.0))


def test_a_worker_killed_during_a_compiled_run_fails_the_run_and_the_next_run_compiles_again(rt):
    seconds = rt.put(np.zeros(1), on=1)
    remote = rt.put(np.zeros(4), on=1)
    own = rt.put(np.ones(4), on=0)
    dst = rt.empty(4, on=0)

    def slow_fill(s, out):
        _slow_fill(float(s[0]), out)

    count = rt.put(np.zeros(1), on=0)
    with rt.record() as g:
        rt.submit(np.add, sd.read(count), 1.0, out=sd.write(count))  # ray:0, independent
        rt.submit(slow_fill, sd.read(seconds), sd.write(remote))  # ray:1
        rt.submit(np.add, sd.read(remote), sd.read(own), out=sd.write(dst))  # ray:0, dependent
    g.run().result(timeout=60)
    np.testing.assert_array_equal(rt.get(dst).result(timeout=60), np.full(4, 8.0))

    rt.put(np.full(1, 30.0), out=seconds)
    run = g.run()
    _kill_soon(rt, 1)
    with pytest.raises(sd.ExceptionGroup) as group:
        run.result(timeout=90)
    # the one root failure: the op on the lost worker; the independent op ran, the dependent did not
    (lost,) = group.value.exceptions
    assert isinstance(lost, WorkerLost) and lost.worker == "ray:1"
    np.testing.assert_array_equal(rt.get(count).result(timeout=60), [2.0])

    rt.wait_for_workers()
    rt.put(np.zeros(1), out=seconds)  # the restarted worker's buffers, written again
    rt.put(np.zeros(4), out=remote)
    g.run().result(timeout=90)
    np.testing.assert_array_equal(rt.get(dst).result(timeout=60), np.full(4, 8.0))
    assert g.compiles == 2


def _fill(value, out):
    out[:] = value


def test_a_restarted_worker_gets_the_functions_it_lost_again_without_a_wait_for_workers(rt):
    buf = rt.put(np.zeros(4), on=1)
    rt.submit(_fill, 1.0, sd.write(buf)).result(timeout=60)  # _fill goes to ray:1, then by number
    ray.kill(rt.worker(1), no_restart=False)
    # the ops sent while Ray restarts it, or that name a function the old worker held, fail with
    # WorkerLost; the runtime learns of it from them and sends the function again
    # (Ray may report the worker unavailable once more while it comes back: a read fails alike)
    deadline = time.monotonic() + 60
    while True:
        rt.put(np.zeros(4), out=buf)  # made again on the restarted worker
        try:
            rt.submit(_fill, 2.0, sd.write(buf)).result(timeout=60)
            got = rt.get(buf).result(timeout=60)
            break
        except (WorkerLost, sd.DependencyFailed):
            try:
                rt.synchronize()
            except sd.ExceptionGroup as group:
                assert {type(e) for e in group.exceptions} <= {WorkerLost, sd.DependencyFailed}
            assert time.monotonic() < deadline, "the restarted worker never ran the op"
            time.sleep(0.2)
    rt.synchronize()
    np.testing.assert_array_equal(got, np.full(4, 2.0))
    rt.wait_for_workers()
