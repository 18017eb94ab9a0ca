"""A recorded graph of streamdag.ray fed and read through its Ray Compiled Graph's own channels:
``g.run(inputs={buf: array}, outputs=[buf])``, on a local two-node Ray cluster; and what an eager
submit sends."""

import sys

import numpy as np
import pytest

pytest.importorskip("ray", reason="streamdag.ray needs ray: pip install 'streamdag[ray]'")

import ray

import streamdag as sd
from streamdag.ray import Runtime

pytestmark = pytest.mark.ray
# the workers unpickle this module's functions by value: it is not importable where they run
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def rt(ray_cluster):
    with Runtime(3, num_cpus=0.25, timeout_s=60) as runtime:
        yield runtime


def _stage(x, w, out):
    np.tanh(x @ w, out=out)


def _pipeline(rt, rng, stages=(0, 1, 2, 0), batches=3):
    weights = [rng.standard_normal((8, 8)) / 3 for _ in stages]
    ws = [rt.put(w, on=s) for w, s in zip(weights, stages)]
    inputs = [rt.empty((4, 8), on=0) for _ in range(batches)]
    outs = [[rt.empty((4, 8), on=s) for _ in inputs] for s in stages]
    with rt.record() as g:
        for i, x in enumerate(inputs):
            h = x
            for s in range(len(stages)):
                rt.submit(_stage, sd.read(h), sd.read(ws[s]), sd.write(outs[s][i]), name=f"s{s}[{i}]")
                h = outs[s][i]
    return g, weights, inputs, outs


def _serial(batch, weights):
    for w in weights:
        batch = np.tanh(batch @ w)
    return batch


def test_a_run_fed_through_inputs_matches_serial_execution_run_after_run(rt):
    rng = np.random.default_rng(2)
    g, weights, inputs, outs = _pipeline(rt, rng)
    last = outs[-1]
    for _ in range(4):  # new micro-batches each run, in and out through the compiled graph
        batches = [rng.standard_normal((4, 8)) for _ in inputs]
        res = g.run(inputs=dict(zip(inputs, batches)), outputs=last).result(timeout=60)
        assert len(res.outputs) == len(last)
        for got, b in zip(res.outputs, batches):
            np.testing.assert_allclose(got, _serial(b, weights), rtol=1e-12)
    # the buffers hold what the last run left, as the outputs said
    for got, buf in zip(res.outputs, last):
        np.testing.assert_array_equal(rt.get(buf).result(timeout=60), got)
    assert g.compiles == 1


def test_runs_in_flight_each_get_their_own_inputs_and_outputs(rt):
    rng = np.random.default_rng(3)
    g, weights, inputs, outs = _pipeline(rt, rng, batches=2)
    feeds = [[rng.standard_normal((4, 8)) for _ in inputs] for _ in range(4)]
    futures = [g.run(inputs=dict(zip(inputs, f)), outputs=outs[-1]) for f in feeds]  # none waited for
    for future, feed in zip(futures, feeds):
        for got, b in zip(future.result(timeout=60).outputs, feed):
            np.testing.assert_allclose(got, _serial(b, weights), rtol=1e-12)


def test_outputs_are_the_buffers_after_the_run_on_every_worker_and_stay_valid(rt):
    x = rt.empty(4, on=0)
    y = rt.empty(4, on=1)
    z = rt.empty(4, on=2)
    with rt.record() as g:  # ray:0 has no op: it only sends x, fed through inputs
        rt.submit(np.multiply, sd.read(x), 2.0, out=sd.write(y))
        rt.submit(np.add, sd.read(y), sd.read(x), out=sd.write(z))
    kept = [g.run(inputs={x: np.arange(4.0) + k}, outputs=[z, x, y]).result(timeout=60).outputs
            for k in range(3)]  # a kept view of a channel would block the next run
    for k, (got_z, got_x, got_y) in enumerate(kept):
        np.testing.assert_array_equal(got_x, np.arange(4.0) + k)
        np.testing.assert_array_equal(got_y, 2 * (np.arange(4.0) + k))
        np.testing.assert_array_equal(got_z, 3 * (np.arange(4.0) + k))
    for buf, got in zip((z, x, y), kept[-1]):
        np.testing.assert_array_equal(rt.get(buf).result(timeout=60), got)
    # a run without inputs keeps the buffers' values
    np.testing.assert_array_equal(g.run(outputs=[z]).result(timeout=60).outputs[0], kept[-1][0])


def test_an_eager_transfer_after_a_graph_run_reads_what_the_run_wrote(rt):
    a = rt.put(np.zeros(3), on=0)
    b = rt.empty(3, on=1)
    rt.submit(np.copyto, sd.write(b), sd.read(a)).result(timeout=60)  # a transfer of `a` to ray:1
    with rt.record() as g:
        rt.submit(np.add, sd.read(a), 1.0, out=sd.write(a))
    g.run().result(timeout=60)
    rt.submit(np.copyto, sd.write(b), sd.read(a)).result(timeout=60)  # not the earlier transfer
    np.testing.assert_array_equal(rt.get(b).result(timeout=60), np.ones(3))
    g.run(inputs={a: np.full(3, 5.0)}).result(timeout=60)
    rt.submit(np.copyto, sd.write(b), sd.read(a)).result(timeout=60)
    np.testing.assert_array_equal(rt.get(b).result(timeout=60), np.full(3, 6.0))


def test_bad_inputs_and_outputs_are_refused_with_the_fix(rt):
    a = rt.put(np.zeros(3), on=0)
    other = rt.empty(3, on=0)
    unused_worker = rt.empty(3, on=2)
    with rt.record() as g:
        rt.submit(np.add, sd.read(a), 1.0, out=sd.write(a))
    with pytest.raises(sd.InvalidBuffer, match=r"rt.put\(value, out=buf\)"):
        g.run(inputs={other: np.zeros(3)})
    with pytest.raises(ValueError, match=r"buffer's shape \(3,\)"):
        g.run(inputs={a: np.zeros(4)})
    with pytest.raises(TypeError, match=r"astype\(np.float64\)"):
        g.run(inputs={a: np.zeros(3, np.float32)})
    with pytest.raises(TypeError, match="key each value by the buffer"):
        g.run(inputs={"a": np.zeros(3)})
    with pytest.raises(TypeError, match=r"outputs=\[buf\]"):
        g.run(outputs=a)
    with pytest.raises(sd.InvalidBuffer, match=r"rt.get\(buf\)"):
        g.run(outputs=[unused_worker])
    rt.free(other)
    with pytest.raises(sd.InvalidBuffer, match="free"):
        g.run(inputs={other: np.zeros(3)})
    # nothing ran: the refused runs left the buffer as it was
    np.testing.assert_array_equal(g.run(outputs=[a]).result(timeout=60).outputs[0], np.ones(3))


def test_an_eager_ops_function_and_arguments_go_as_they_are_at_the_submit(rt):
    a = rt.put(np.ones(3), on=0)
    scale = 2.0
    by_value = [rt.submit(lambda x: x * scale, sd.read(a))]  # a closure: pickled by value
    scale = 3.0
    by_value.append(rt.submit(lambda x: x * scale, sd.read(a)))
    offsets = np.zeros(3)
    by_name = [rt.submit(np.add, sd.read(a), offsets)]  # numpy's function: pickled by name
    offsets += 1.0
    by_name.append(rt.submit(np.add, sd.read(a), offsets))
    assert [f.result(timeout=60)[0] for f in by_value] == [2.0, 3.0]
    assert [f.result(timeout=60)[0] for f in by_name] == [1.0, 2.0]


def test_each_run_may_ask_back_other_buffers_written_on_any_stage_or_only_read(rt):
    rng = np.random.default_rng(4)
    g, weights, inputs, outs = _pipeline(rt, rng, stages=(0, 1, 0))
    g.run(inputs={x: rng.standard_normal((4, 8)) for x in inputs}).result(timeout=60)
    # each run asks for other buffers: some written on each stage's worker, some only read
    for asked in (outs[-1], [*outs[0], *inputs], [*outs[-1], *outs[0]]):
        batches = [rng.standard_normal((4, 8)) for _ in inputs]
        got = g.run(inputs=dict(zip(inputs, batches)), outputs=asked).result(timeout=60).outputs
        want = dict(zip(inputs, batches))
        for i, b in enumerate(batches):
            want[outs[0][i]] = np.tanh(b @ weights[0])
            want[outs[-1][i]] = _serial(b, weights)
        assert len(got) == len(asked)
        for buf, value in zip(asked, got):
            np.testing.assert_allclose(value, want[buf], rtol=1e-12)
    assert g.compiles == 1


def test_a_buffer_written_again_after_another_worker_read_it_comes_back_as_written_last(rt):
    x = rt.empty(4, on=0)
    acc = rt.empty(4, on=0)
    y = rt.empty(4, on=1)
    with rt.record() as g:  # ray:0 writes acc, ray:1 reads it, then ray:0 writes it again
        rt.submit(np.add, sd.read(x), 1.0, out=sd.write(acc))
        rt.submit(np.multiply, sd.read(acc), 2.0, out=sd.write(y))
        rt.submit(np.add, sd.read(y), sd.read(acc), out=sd.write(acc))
    for k in range(3):
        v = np.arange(4.0) + k
        got_acc, got_y = g.run(inputs={x: v}, outputs=[acc, y]).result(timeout=60).outputs
        np.testing.assert_array_equal(got_y, 2 * (v + 1))
        np.testing.assert_array_equal(got_acc, 3 * (v + 1))
