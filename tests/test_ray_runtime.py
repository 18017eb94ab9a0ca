"""streamdag.ray on a local two-node Ray cluster: placement, transfers, failures, recorded graphs as
Ray Compiled Graphs, the timeline, and random programs against serial execution."""

import random
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


def test_workers_spread_over_the_nodes(rt):
    assert len(set(rt.nodes)) == 2


def test_an_op_runs_where_it_writes_and_reads_other_workers_buffers_as_transfers(rt):
    a = rt.put(np.arange(4.0), on=0)
    b = rt.empty(4, on=1)
    where = rt.submit(lambda x, out: (np.multiply(x, 2.0, out=out), __import__("os").getpid())[1],
                      sd.read(a), sd.write(b)).result()
    assert where == ray.get(rt.worker(1).where.remote())[0]
    np.testing.assert_array_equal(rt.get(b).result(), [0.0, 2.0, 4.0, 6.0])
    # a later write of `a` does not change what the earlier read received
    rt.put(np.full(4, 9.0), out=a)
    np.testing.assert_array_equal(rt.get(b).result(), [0.0, 2.0, 4.0, 6.0])
    np.testing.assert_array_equal(rt.get(a).result(), np.full(4, 9.0))


def test_an_op_returning_its_buffer_gives_back_the_handle(rt):
    a = rt.put(np.ones(3), on=2)
    assert rt.submit(np.add, sd.read(a), 1.0, out=sd.write(a)).result() is a


class _CountsPickles:
    pickled = 0

    def __reduce__(self):
        _CountsPickles.pickled += 1
        return (_CountsPickles, ())


def test_an_eager_op_s_function_is_pickled_once_for_all_its_submits_on_every_worker(rt):
    token = _CountsPickles()

    def fill(value, out):  # a closure: sent by value, with what it captures
        assert isinstance(token, _CountsPickles)
        out[:] = value

    bufs = [rt.empty(2, on=w) for w in (0, 1, 0, 1)]
    for i, b in enumerate(bufs):
        rt.submit(fill, float(i), sd.write(b))
    got = [rt.get(b).result() for b in bufs]
    assert [g.tolist() for g in got] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    assert _CountsPickles.pickled == 1


def _refuse_to_load():
    raise RuntimeError("this argument cannot be unpickled here")


class _FailsToLoad:
    def __reduce__(self):
        return (_refuse_to_load, ())


def test_an_op_whose_call_cannot_be_unpickled_fails_alone_and_its_function_goes_again(rt):
    def fill(value, out):  # a new function: it goes with the call that cannot be unpickled first
        out[:] = 1.0 if value is None else 2.0

    buf = rt.empty(2, on=1)
    with pytest.raises(RuntimeError, match="cannot be unpickled here"):
        rt.submit(fill, _FailsToLoad(), sd.write(buf)).result()
    with pytest.raises(sd.ExceptionGroup):
        rt.synchronize()
    rt.submit(fill, None, sd.write(buf)).result()
    np.testing.assert_array_equal(rt.get(buf).result(), [1.0, 1.0])


def test_submit_refuses_what_is_not_a_function_with_the_fix(rt):
    with pytest.raises(TypeError, match="the function to run first"):
        rt.submit(sd.read(rt.empty(2)), 1.0)


def test_bad_buffers_are_refused_with_the_fix(rt):
    a = rt.put(np.ones(3), on=0)
    with pytest.raises(sd.InvalidBuffer, match="run it there"):
        rt.submit(np.add, sd.read(a), 1.0, out=sd.write(a), run_on=1)
    with pytest.raises(sd.InvalidBuffer, match="driver"):
        rt.submit(np.add, sd.read(a), 1.0, out=sd.write(np.zeros(3)))
    with pytest.raises(sd.InvalidBuffer, match="does not declare"):
        rt.submit(np.add, a, 1.0)
    with pytest.raises(ValueError, match="not a worker"):
        rt.empty(3, on="ray:7")
    rt.free(a)
    with pytest.raises(sd.InvalidBuffer, match="free"):
        rt.get(a)


def _answer(i):
    if i % 7 == 3:
        raise ValueError(f"op {i} fails")
    return None if i % 2 else i * 10


def test_a_burst_of_ops_settles_each_future_with_its_own_answer(rt):
    futures = [rt.submit(_answer, i, run_on=i % 2) for i in range(60)]
    for i, f in enumerate(futures):
        if i % 7 == 3:
            with pytest.raises(ValueError, match=f"op {i} fails"):
                f.result(timeout=60)
        else:
            assert f.result(timeout=60) == (None if i % 2 else i * 10)
    with pytest.raises(sd.ExceptionGroup) as group:
        rt.synchronize()
    assert len(group.value.exceptions) == sum(i % 7 == 3 for i in range(60))


def test_a_burst_is_settled_by_reports_without_reading_each_op_s_own_answer(rt, monkeypatch):
    """The driver learns of many ops from one report; it reads an op's own answer only where a report
    cannot tell (here: the op whose call cannot be unpickled, which Ray answers)."""
    from streamdag.ray import _reports

    read = []
    real = _reports._answers
    monkeypatch.setattr(_reports, "_answers", lambda refs: read.extend(refs) or real(refs))
    rt.synchronize()
    buf = rt.put(np.zeros(2), on=1)
    futures = [rt.submit(_answer, i, run_on=1) for i in range(40)]
    futures.append(rt.submit(_answer, _FailsToLoad(), run_on=1))
    futures += [rt.submit(np.add, sd.read(buf), 1.0, out=sd.write(buf)) for _ in range(40)]
    for i, f in enumerate(futures[:40]):
        if i % 7 == 3:
            with pytest.raises(ValueError, match=f"op {i} fails"):
                f.result(timeout=60)
        else:
            assert f.result(timeout=60) == (None if i % 2 else i * 10)
    with pytest.raises(RuntimeError, match="cannot be unpickled here"):
        futures[40].result(timeout=60)
    assert all(f.result(timeout=60) is buf for f in futures[41:])
    np.testing.assert_array_equal(rt.get(buf).result(timeout=60), [40.0, 40.0])
    with pytest.raises(sd.ExceptionGroup):
        rt.synchronize()
    assert len(read) <= 2  # the op Ray answered (and at most one report's ops, after a failed report)


def _big(i):
    return np.full(10_000, float(i))  # 80 kB: near Ray's limit for a value sent inside its reply


def test_a_burst_of_ops_returning_large_arrays_gives_each_future_its_own(rt):
    futures = [rt.submit(_big, i, run_on=1) for i in range(6)]
    for i, f in enumerate(futures):
        np.testing.assert_array_equal(f.result(timeout=60), np.full(10_000, float(i)))
    rt.synchronize()


def test_ops_settle_though_nobody_waits_on_them(rt):
    import time

    rt.synchronize()
    futures = [rt.submit(_answer, i * 2, run_on=2) for i in range(4)]
    deadline = time.monotonic() + 30
    while not all(f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [f.result(timeout=0) for f in futures] == [0, 20, 40, 60]


def test_a_failed_op_fails_its_dependents_on_other_workers_and_not_the_others(rt):
    def boom(out):
        raise ValueError("boom")

    a = rt.empty(4, on=0)
    b = rt.empty(4, on=1)
    ok = rt.put(np.ones(4), on=1)
    failed = rt.submit(boom, sd.write(a))
    dependent = rt.submit(np.add, sd.read(a), 1.0, out=sd.write(b))  # on ray:1, via a transfer
    second = rt.submit(np.add, sd.read(b), 1.0, out=sd.write(b))
    independent = rt.submit(np.add, sd.read(ok), 1.0, out=sd.write(ok))
    with pytest.raises(ValueError, match="boom"):
        failed.result()
    for f in (dependent, second):
        with pytest.raises(sd.DependencyFailed, match="boom"):
            f.result()
    assert independent.result() is ok
    with pytest.raises(sd.ExceptionGroup) as group:
        rt.synchronize()
    assert [type(e) for e in group.value.exceptions] == [ValueError]
    # the failure is reported once; later writes start afresh
    rt.put(np.zeros(4), out=a)
    rt.submit(np.add, sd.read(a), 2.0, out=sd.write(b)).result()
    np.testing.assert_array_equal(rt.get(b).result(), np.full(4, 2.0))


def test_a_recorded_graph_runs_as_one_compiled_graph_again_and_again(rt):
    a = rt.put(np.arange(4.0), on=0)
    b = rt.empty(4, on=1)
    c = rt.empty(4, on=0)
    with rt.record() as g:
        n0 = rt.submit(np.add, sd.read(a), 1.0, out=sd.write(c))
        rt.submit(np.multiply, sd.read(c), 3.0, out=sd.write(b))
        rt.submit(np.add, sd.read(b), sd.read(a), out=sd.write(c))
    assert "Ray Compiled Graph of 3 task(s)" in g.explain()
    for _ in range(3):
        result = g.run().result()
        np.testing.assert_array_equal(rt.get(c).result(), 3 * (np.arange(4.0) + 1) + np.arange(4.0))
    assert result[n0] is c
    assert g.compiles == 1
    g.release()  # its workers stop polling; the next run sets it up again
    rt.put(np.ones(4), out=a)
    g.run().result()
    np.testing.assert_array_equal(rt.get(c).result(), np.full(4, 7.0))
    assert g.compiles == 2


def _stage(x, w, out):
    np.tanh(x @ w, out=out)


def test_a_pipeline_of_micro_batches_over_the_nodes_matches_serial_execution(rt):
    rng = np.random.default_rng(1)
    stages = [0, 1, 2, 0]  # a stage per worker, back to the first: the workers are on both nodes
    assert len({rt.nodes[w] for w in stages}) == 2
    weights = [rng.standard_normal((8, 8)) / 3 for _ in stages]
    ws = [rt.put(w, on=s) for w, s in zip(weights, stages)]
    inputs = [rt.empty((4, 8), on=0) for _ in range(3)]
    outs = [[rt.empty((4, 8), on=s) for _ in inputs] for s in stages]
    with rt.record() as g:
        for i, x in enumerate(inputs):
            h = x
            for s in range(len(stages)):
                rt.submit(_stage, sd.read(h), sd.read(ws[s]), sd.write(outs[s][i]), name=f"s{s}[{i}]")
                h = outs[s][i]
    for _ in range(2):  # new micro-batches each run
        batches = [rng.standard_normal((4, 8)) for _ in inputs]
        for buf, b in zip(inputs, batches):
            rt.put(b, out=buf)
        g.run().result(timeout=60)
        for i, b in enumerate(batches):
            want = b
            for w in weights:
                want = np.tanh(want @ w)
            np.testing.assert_allclose(rt.get(outs[-1][i]).result(timeout=60), want, rtol=1e-12)
    assert g.compiles == 1


def test_a_pipeline_stage_sends_each_micro_batch_on_as_it_ends(rt):
    """Stage 0's ops wait for nothing, yet each is a task of its own: a task sends its values when it
    ends, and stage 1 is to begin after stage 0's first micro-batch, not after all of them."""
    ws = [rt.put(np.eye(8), on=s) for s in (0, 1)]
    inputs = [rt.put(np.full((2, 8), float(i)), on=0) for i in range(3)]
    outs = [[rt.empty((2, 8), on=s) for _ in inputs] for s in (0, 1)]
    with rt.record() as g:
        for i, x in enumerate(inputs):
            rt.submit(_stage, sd.read(x), sd.read(ws[0]), sd.write(outs[0][i]))
            rt.submit(_stage, sd.read(outs[0][i]), sd.read(ws[1]), sd.write(outs[1][i]))
    assert "Ray Compiled Graph of 6 task(s) (ray:0 3, ray:1 3)" in g.explain()
    g.run().result(timeout=60)
    for i in range(3):
        want = np.tanh(np.tanh(np.full((2, 8), float(i))))
        np.testing.assert_allclose(rt.get(outs[1][i]).result(timeout=60), want)


def _tagged_stage(x, w, out, tag):
    np.tanh(x @ w, out=out)
    return tag


def test_a_worker_of_two_stages_runs_every_first_stage_before_the_last_stages(rt):
    """A pipeline that comes back to its first worker: ray:0 runs each micro-batch's first stage
    before any last stage (recorded order would hold micro-batch 1 until micro-batch 0 came back),
    while results and the schedule keep the ops numbered as they were recorded."""
    stages = (0, 1, 0)
    ws = [rt.put(np.eye(8) / 2, on=s) for s in stages]
    inputs = [rt.put(np.full((2, 8), float(i)), on=0) for i in range(3)]
    outs = [[rt.empty((2, 8), on=s) for _ in inputs] for s in stages]
    nodes = {}
    with rt.record() as g:
        for i, x in enumerate(inputs):
            h = x
            for k in range(len(stages)):
                nodes[k, i] = rt.submit(_tagged_stage, sd.read(h), sd.read(ws[k]), sd.write(outs[k][i]),
                                        (k, i), name=f"s{k}[{i}]")
                h = outs[k][i]
    index = {node.index: key for key, node in nodes.items()}
    assert [index[v] for v in g.schedule.order[0]] == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2)]
    assert [index[v] for v in g.schedule.order[1]] == [(1, 0), (1, 1), (1, 2)]
    assert g.names == [f"s{k}[{i}]" for i in range(3) for k in range(3)]
    result = g.run().result(timeout=60)
    assert all(result[node] == key for key, node in nodes.items())
    for i in range(3):
        want = np.full((2, 8), float(i))
        for _ in stages:
            want = np.tanh(want @ (np.eye(8) / 2))
        np.testing.assert_allclose(rt.get(outs[-1][i]).result(timeout=60), want)


def test_a_recorded_graph_returns_arrays_that_stay_valid_across_runs(rt):
    a = rt.put(np.arange(3.0), on=0)
    with rt.record() as g:
        node = rt.submit(lambda x: x * 2, sd.read(a), run_on=1)  # reads a transfer, returns an array
    kept = [g.run().result(timeout=60)[node] for _ in range(3)]  # a kept view would block the next run
    for got in kept:
        np.testing.assert_array_equal(got, [0.0, 2.0, 4.0])


def test_a_graph_run_follows_eager_writes_on_a_worker_that_only_sends_it_values(rt):
    a = rt.put(np.zeros(2), on=0)
    with rt.record() as g:  # ray:0 has no op of the graph: it only sends `a`
        node = rt.submit(lambda x: x.copy(), sd.read(a), run_on=1)
    got = []
    for i in range(20):
        rt.put(np.full(2, float(i)), out=a)
        got.append(g.run().result(timeout=60)[node][0])
    assert got == [float(i) for i in range(20)]


def test_a_failed_op_in_a_recorded_graph_fails_its_dependents_and_the_run(rt):
    def maybe_boom(x, out):
        if x[0] < 0:
            raise ValueError("negative")
        np.copyto(out, x)

    a = rt.put(np.ones(2), on=0)
    b = rt.empty(2, on=1)
    other = rt.put(np.zeros(2), on=2)
    with rt.record() as g:
        rt.submit(maybe_boom, sd.read(a), sd.write(b))
        rt.submit(np.add, sd.read(b), 1.0, out=sd.write(b))
        rt.submit(np.add, sd.read(other), 1.0, out=sd.write(other))
    g.run().result()
    rt.put(-np.ones(2), out=a)
    with pytest.raises(sd.ExceptionGroup) as group:
        g.run().result()
    assert [type(e) for e in group.value.exceptions] == [ValueError]
    np.testing.assert_array_equal(rt.get(other).result(), [2.0, 2.0])  # the independent op ran
    rt.put(np.ones(2), out=a)
    g.run().result()
    np.testing.assert_array_equal(rt.get(b).result(), [2.0, 2.0])


def test_the_timeline_has_every_worker_and_its_transfers(rt):
    a = rt.put(np.ones(1000), on=0)
    b = rt.empty(1000, on=1)
    with rt.record() as g:
        rt.submit(np.add, sd.read(a), 1.0, out=sd.write(a), name="inc")
        rt.submit(np.multiply, sd.read(a), 2.0, out=sd.write(b), name="double")
    with rt.profile() as prof:
        g.run().result()
        rt.submit(np.add, sd.read(b), sd.read(a), out=sd.write(b), name="eager_add").result()
    spans = {s.name: s for s in prof.timeline.spans}
    assert {"inc", "double", "eager_add", "transfer_for_eager_add"} <= set(spans)
    assert spans["inc"].device == "ray:0" and spans["double"].device == "ray:1"
    assert spans["inc"].end <= spans["double"].start + 1e-3
    assert spans["transfer_for_eager_add"].kind == "copy"
    assert spans["double"].deps == (spans["inc"].seq,)  # numbered apart from the eager ops
    assert spans["eager_add"].seq not in {spans["inc"].seq, spans["double"].seq}
    events = prof.timeline.to_chrome_trace()["traceEvents"]
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {
        "streamdag ray:0", "streamdag ray:1"}
    assert any(e["ph"] == "s" for e in events)  # the dependency across workers, as a flow arrow


def _program(seed: int, n_bufs: int = 6, n_ops: int = 24, workers: int = 3):
    """A random program over small buffers on random workers: (owner of each buffer, ops), each op
    ``(kind, out, x, y, k)``; kinds ``axpy`` (out = x * k + y), ``scale`` (out *= k), ``boom`` (raises)."""
    rng = random.Random(seed)
    owner = [rng.randrange(workers) for _ in range(n_bufs)]
    ops = []
    for _ in range(n_ops):
        kind = rng.choices(["axpy", "scale", "boom"], [6, 3, 1 if seed % 2 else 0])[0]
        ops.append((kind, rng.randrange(n_bufs), rng.randrange(n_bufs), rng.randrange(n_bufs),
                    rng.choice([0.5, 2.0, -1.0])))
    return owner, ops


def _axpy(x, y, k, out):
    np.add(x * k, y, out=out)


def _scale(k, out):
    out *= k


def _boom(out):
    raise ArithmeticError("boom")


def _serial(ops, values, poisoned):
    """The program run op by op on numpy arrays; which ops fail (root or inherited)."""
    outcome = []
    for kind, o, x, y, k in ops:
        touched = {o} if kind in ("scale", "boom") else {o, x, y}
        if touched & poisoned:
            outcome.append("dep")
            poisoned.add(o)
        elif kind == "boom":
            outcome.append("err")
            poisoned.add(o)
        else:
            if kind == "axpy":
                values[o] = values[x] * k + values[y]
            else:
                values[o] = values[o] * k
            outcome.append("ok")
    return outcome


def _submit_all(rt, ops, bufs):
    out = []
    for kind, o, x, y, k in ops:
        if kind == "axpy":
            out.append(rt.submit(_axpy, sd.read(bufs[x]), sd.read(bufs[y]), k, sd.write(bufs[o])))
        elif kind == "scale":
            out.append(rt.submit(_scale, k, sd.write(bufs[o])))
        else:
            out.append(rt.submit(_boom, sd.write(bufs[o])))
    return out


def _status(future):
    try:
        future.result(timeout=60)
    except sd.DependencyFailed:
        return "dep"
    except ArithmeticError:
        return "err"
    return "ok"


# on 12 buffers most ops are independent: a recorded graph's workers run them in an order of their
# own (by level), far from the recorded one
@pytest.mark.parametrize("seed, n_bufs", [(s, 6) for s in range(6)] + [(s, 12) for s in range(6, 9)])
def test_random_programs_match_serial_execution_eagerly_and_recorded(rt, seed, n_bufs):
    owner, ops = _program(seed, n_bufs=n_bufs, n_ops=24 if n_bufs == 6 else 30)
    start = [np.arange(4.0) + i for i in range(len(owner))]
    bufs = [rt.put(v, on=w) for v, w in zip(start, owner)]
    expected = [v.copy() for v in start]
    poisoned: set[int] = set()
    outcome = _serial(ops, expected, poisoned)
    assert [_status(f) for f in _submit_all(rt, ops, bufs)] == outcome
    for i, buf in enumerate(bufs):
        if i not in poisoned:
            np.testing.assert_allclose(rt.get(buf).result(), expected[i])
    with pytest.raises(sd.ExceptionGroup) if "err" in outcome else _nothing():
        rt.synchronize()

    # recorded: the same program, run twice from fresh values (the second run continues the first)
    for buf, v in zip(bufs, start):
        rt.put(v, out=buf)
    with rt.record() as g:
        _submit_all(rt, ops, bufs)
    expected = [v.copy() for v in start]
    for _ in range(2):
        poisoned = set()
        outcome = _serial(ops, expected, poisoned)
        run = g.run()
        if "err" in outcome:
            with pytest.raises(sd.ExceptionGroup):
                run.result(timeout=60)
        else:
            run.result(timeout=60)
        for i, buf in enumerate(bufs):
            if i not in poisoned:
                np.testing.assert_allclose(rt.get(buf).result(), expected[i])
        if poisoned:
            break


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
