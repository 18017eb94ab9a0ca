"""Several devices, simulated on the CPU: placement, automatic peer copies, waits, random programs.

Simulated devices (``"sim:N"``) run their streams in a seeded random
interleaving, and their memory (``SimArray``) lives in address spaces of their
own, so an op that reads another device's array without its peer copy would,
for some seed, read stale data.
"""

import itertools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streamdag as sd
from internals import copy_stream, stream_count, submit_on
from programs import submitted_or_recorded
from streamdag.backends.sim import SimArray
from streamdag.schedule.plan import build_schedule

EXAMPLES = settings(max_examples=300 if os.environ.get("CI") else 40, deadline=None)


def arr(values, device):
    return SimArray(np.asarray(values, dtype=np.float64), device)


def add_into(out, a, b):
    np.add(a.data, b.data, out=out.data)
    return out.device


def test_op_runs_on_the_device_of_what_it_writes():
    with sd.Runtime(devices=["sim:0", "sim:1"], streams=2) as rt, rt.profile() as prof:
        a, b = arr([1, 2], "sim:1"), arr([3, 4], "sim:1")
        out = arr([0, 0], "sim:1")
        rt.submit(add_into, out, a, b, reads=[a, b], writes=[out])
    (span,) = prof.timeline.spans
    assert span.device == "sim:1" and span.kind == "compute"
    np.testing.assert_array_equal(out.data, [4, 6])


def test_reading_another_device_inserts_a_peer_copy_on_the_destination():
    with sd.Runtime(devices=["sim:0", "sim:1"], streams=2, seed=3) as rt, rt.profile() as prof:
        a = arr([1.0, 2.0], "sim:0")
        rt.submit(lambda x: np.multiply(x.data, 10, out=x.data), a, writes=[a], name="scale_on_0")
        b, out = arr([3.0, 4.0], "sim:1"), arr([0.0, 0.0], "sim:1")
        seen = rt.submit(add_into, out, a, b, reads=[a, b], writes=[out], name="add_on_1").result()
    assert seen == "sim:1"  # the op got local arrays
    np.testing.assert_array_equal(out.data, [13.0, 24.0])
    by_name = {s.name: s for s in prof.timeline.spans}
    copy = next(s for s in prof.timeline.spans if s.name.startswith("peer_copy"))
    assert copy.device == "sim:1" and copy.kind == "p2p"
    assert by_name["scale_on_0"].seq in copy.deps  # after its producer
    assert by_name["add_on_1"].deps == (copy.seq,)  # the consumer waits on the copy only


def test_run_on_moves_an_op_and_its_inputs():
    with sd.Runtime(devices=["sim:0", "sim:1"]) as rt:
        a = arr([1.0, 2.0], "sim:0")
        got = rt.submit(lambda x: (x.device, x.data.sum()), a, reads=[a], run_on="sim:1").result()
    assert got == ("sim:1", 3.0)


def test_remote_writes_and_unknown_devices_are_refused_with_the_fix():
    with sd.Runtime(devices=["sim:0", "sim:1"]) as rt:
        a, b = arr([1.0], "sim:0"), arr([2.0], "sim:1")
        with pytest.raises(sd.InvalidBuffer, match="run_on='sim:0'"):
            rt.submit(add_into, b, a, b, reads=[a], writes=[b, a])
        with pytest.raises(ValueError, match="not a device of this runtime"):
            rt.submit(lambda: None, run_on="sim:7")
        with pytest.raises(sd.InvalidBuffer, match="pass that tensor as an argument"):
            rt.submit(lambda: a.data.sum(), reads=[a], run_on="sim:1")
    with pytest.raises(ValueError, match="twice"):
        sd.Runtime(devices=["sim:0", "sim:0"])
    with pytest.raises(ValueError, match="cuda:N"):
        sd.Runtime(devices=["sim:0", "tpu:1"])
    with sd.Runtime("cpu") as one, pytest.raises(ValueError, match="devices="):
        one.submit(lambda: None, run_on="cuda:1")


def test_an_op_placed_on_a_copy_stream_runs_there_after_what_it_reads():
    """The transfers' path (``Runtime._submit_on``, compiled where the module builds): the given
    stream, ordered after the op that wrote its input."""
    with sd.Runtime(devices=["sim:0"], streams=2, seed=5) as rt, rt.profile() as prof:
        a, b = np.zeros(4), np.zeros(4)
        rt.submit(np.add, a, 1.0, out=a, writes=[a], name="fill")
        stream = copy_stream(rt, "p2p", "sim:0")
        assert submit_on(rt, stream, np.copyto, b, a, reads=[a], writes=[b], name="move").result() is None
        with pytest.raises(IndexError, match="out of range"):
            submit_on(rt, stream_count(rt), np.copyto, b, a, reads=[a], writes=[b])
    spans = {s.name: s for s in prof.timeline.spans}
    assert spans["move"].kind == "p2p" and spans["move"].deps == (spans["fill"].seq,)
    np.testing.assert_array_equal(b, np.ones(4))


def test_many_peer_copies_in_flight_without_waiting_on_the_host():
    with sd.Runtime(devices=["sim:0", "sim:1"], max_inflight=1000) as rt:
        srcs = [arr(np.full(8, i), "sim:0") for i in range(64)]
        dsts = [s.empty_on("sim:1") for s in srcs]
        futures = [rt.copy(d, s) for d, s in zip(dsts, srcs)]
        assert rt.statistics().peak_inflight > 1
    assert all(f.done() for f in futures)
    for i, d in enumerate(dsts):
        np.testing.assert_array_equal(d.data, np.full(8, i))


# ---------------------------------------------------------------- random programs
def program_strategy(devices):
    op = st.tuples(
        st.integers(0, 5),                     # written array
        st.lists(st.integers(0, 5), min_size=1, max_size=3),  # read arrays
        st.sampled_from(["add", "mul", "sub"]),
        st.one_of(st.none(), st.integers(0, devices - 1)),  # run_on, or placed by data
    )
    return st.lists(op, min_size=1, max_size=14)


def apply(kind, out, ins):
    acc = np.zeros_like(out)
    for x in ins:
        acc = {"add": acc + x, "mul": acc * 0.5 + x, "sub": acc - x}[kind]
    return acc + 1.0


def serial_result(program, initial):
    arrays = [a.copy() for a in initial]
    for w, rs, kind, _ in program:
        arrays[w] = apply(kind, arrays[w], [arrays[r] for r in rs])
    return arrays


def submit_program(rt, program, arrays, devices):
    def body(kind, out, *ins):
        out.data[:] = apply(kind, out.data, [x.data for x in ins])

    for w, rs, kind, on in program:
        out, ins = arrays[w], [arrays[r] for r in rs]
        # an op runs where its output lives; run_on only when it names that device
        run_on = devices[on] if on is not None and devices[on] == out.device else None
        rt.submit(body, kind, out, *ins, reads=ins, writes=[out], run_on=run_on)


@given(program_strategy(3), st.integers(0, 10_000), st.booleans())
@EXAMPLES
def test_random_programs_over_three_devices_equal_serial_execution(program, seed, record):
    devices = ["sim:0", "sim:1", "sim:2"]
    initial = [np.arange(4, dtype=np.float64) * (i + 1) for i in range(6)]
    expected = serial_result(program, initial)
    arrays = [SimArray(initial[i].copy(), devices[i % 3]) for i in range(6)]
    with sd.Runtime(devices=devices, streams=2, seed=seed) as rt:
        submitted_or_recorded(rt, record, submit_program, program, arrays, devices)
    for got, want in zip(arrays, expected):
        np.testing.assert_array_equal(got.data, want)


@given(program_strategy(3).flatmap(lambda p: st.tuples(st.just(p), st.lists(st.booleans(), min_size=len(p),
                                                                        max_size=len(p)))),
       st.integers(0, 10_000))
@EXAMPLES
def test_random_programs_with_host_lane_ops_over_three_devices_equal_serial_execution(program_hosts, seed):
    """Some ops run on the host lanes (``run_on="host"``), reading and writing the devices' arrays
    where they are: the device ops after them are held until they finish, and ops after those
    are held behind them in turn."""
    program, on_host = program_hosts
    devices = ["sim:0", "sim:1", "sim:2"]
    initial = [np.arange(4, dtype=np.float64) * (i + 1) for i in range(6)]
    expected = serial_result(program, initial)
    arrays = [SimArray(initial[i].copy(), devices[i % 3]) for i in range(6)]

    def body(kind, out, *ins):
        out.data[:] = apply(kind, out.data, [x.data for x in ins])

    with sd.Runtime(devices=devices, streams=2, seed=seed) as rt:
        for (w, rs, kind, _), host in zip(program, on_host):
            out, ins = arrays[w], [arrays[r] for r in rs]
            rt.submit(body, kind, out, *ins, reads=ins, writes=[out], run_on="host" if host else None)
    for got, want in zip(arrays, expected):
        np.testing.assert_array_equal(got.data, want)


def test_a_recorded_graph_over_devices_replays_many_times_and_orders_with_eager_work():
    with sd.Runtime(devices=["sim:0", "sim:1"], streams=2, seed=1) as rt:
        a, b = arr([1.0, 1.0], "sim:0"), arr([0.0, 0.0], "sim:1")
        with rt.record() as g:
            rt.submit(lambda x: np.add(x.data, 1, out=x.data), a, writes=[a], name="inc_a")
            rt.submit(lambda y, x: np.add(y.data, x.data, out=y.data), b, a, reads=[a], writes=[b],
                      name="acc_b")
        assert g.devices == ["sim:0", "sim:1"]
        assert "s0-s1 on sim:0, s2-s3 on sim:1" in g.explain()
        for _ in range(3):
            g.run()
            rt.submit(lambda x: np.multiply(x.data, 2, out=x.data), a, writes=[a])
        rt.synchronize()
    # a: 1 -> 2 -> 4 -> 5 -> 10 -> 11 -> 22; b accumulates a after each increment: 2 + 5 + 11
    np.testing.assert_array_equal(a.data, [22.0, 22.0])
    np.testing.assert_array_equal(b.data, [18.0, 18.0])


def test_a_failing_op_fails_the_graph_run_and_skips_its_dependents_only():
    with sd.Runtime(devices=["sim:0", "sim:1"], streams=2) as rt:
        a, b, c = arr([1.0], "sim:0"), arr([1.0], "sim:1"), arr([1.0], "sim:1")

        def boom(x):
            raise RuntimeError("injected")

        with rt.record() as g:
            rt.submit(boom, a, writes=[a], name="boom")
            rt.submit(lambda y, x: np.add(y.data, x.data, out=y.data), b, a, reads=[a], writes=[b],
                      name="dependent")
            rt.submit(lambda z: np.add(z.data, 5, out=z.data), c, writes=[c], name="independent")
        with pytest.raises(sd.ExceptionGroup) as info:
            g.run().result()
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
    assert "injected" in str(info.value.exceptions[0])
    np.testing.assert_array_equal(b.data, [1.0])  # skipped
    np.testing.assert_array_equal(c.data, [6.0])  # ran


# ---------------------------------------------------------------- waits: minimal and sufficient
def reaches(n, edges, src, dst):
    seen, todo = {src}, [src]
    while todo:
        u = todo.pop()
        for v in edges.get(u, ()):
            if v == dst:
                return True
            if v not in seen:
                seen.add(v)
                todo.append(v)
    return False


@given(st.integers(2, 18).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.lists(st.integers(0, n - 1), max_size=3), min_size=n, max_size=n),
    st.lists(st.integers(0, 2), min_size=n, max_size=n),
    st.integers(1, 3))))
@EXAMPLES
def test_grouped_schedules_keep_devices_apart_with_sufficient_and_minimal_waits(case):
    n, raw, groups, per = case
    preds = [sorted({u for u in ps if u < v}) for v, ps in enumerate(raw)]
    sched = build_schedule(preds, per, groups=groups)
    for v in range(n):
        assert sched.stream[v] // per == groups[v]  # each op on a stream of its device
    # happens-before: stream order plus waits
    edges: dict[int, set[int]] = {}
    for order in sched.order:
        for a, b in itertools.pairwise(order):
            edges.setdefault(a, set()).add(b)
    for v, ws in enumerate(sched.waits):
        for u in ws:
            edges.setdefault(u, set()).add(v)
    for v, ps in enumerate(preds):
        for u in ps:
            assert reaches(n, edges, u, v), f"dependency {u}->{v} not enforced"
    for v, ws in enumerate(sched.waits):
        for u in ws:  # dropping any one wait loses an order: none is redundant
            edges[u].discard(v)
            assert not reaches(n, edges, u, v), f"wait {u}->{v} is redundant"
            edges[u].add(v)


def test_negative_control_without_event_waits_the_random_programs_go_wrong(monkeypatch):
    """The random-program check can fail: with the waits dropped, some program differs from serial."""
    import random

    from streamdag.runtime import replay, submitting

    monkeypatch.setattr(submitting, "_DROP_WAITS", True)
    monkeypatch.setattr(replay, "_DROP_WAITS", True)
    devices = ["sim:0", "sim:1", "sim:2"]
    wrong = 0
    for trial in range(60):
        r = random.Random(trial)
        program = [(r.randrange(6), [r.randrange(6) for _ in range(r.randint(1, 3))],
                     r.choice(["add", "mul", "sub"]), None) for _ in range(r.randint(4, 14))]
        initial = [np.arange(4, dtype=np.float64) * (i + 1) for i in range(6)]
        expected = serial_result(program, initial)
        arrays = [SimArray(initial[i].copy(), devices[i % 3]) for i in range(6)]
        with sd.Runtime(devices=devices, streams=2, seed=trial) as rt:
            with rt.record() as g:
                submit_program(rt, program, arrays, devices)
            g.run().result()
        wrong += any(not np.array_equal(a.data, e) for a, e in zip(arrays, expected))
    assert wrong > 0


@given(st.integers(2, 16).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.lists(st.integers(0, n - 1), max_size=3), min_size=n, max_size=n),
    st.lists(st.integers(0, 3), min_size=n, max_size=n))))
@EXAMPLES
def test_waits_for_any_placement_are_sufficient_and_minimal(case):
    from streamdag.schedule.waits import plan_waits

    n, raw, streams = case
    preds = [sorted({u for u in ps if u < v}) for v, ps in enumerate(raw)]
    waits = plan_waits(preds, streams, 4)
    edges: dict[int, set[int]] = {}
    for s in range(4):
        order = [v for v in range(n) if streams[v] == s]
        for a, b in itertools.pairwise(order):
            edges.setdefault(a, set()).add(b)
    for v, ws in enumerate(waits):
        for u in ws:
            edges.setdefault(u, set()).add(v)
    for v, ps in enumerate(preds):
        for u in ps:
            assert reaches(n, edges, u, v)
    for v, ws in enumerate(waits):
        for u in ws:
            edges[u].discard(v)
            assert not reaches(n, edges, u, v)
            edges[u].add(v)


def test_a_failure_on_one_device_fails_its_dependents_on_the_other_only():
    with sd.Runtime(devices=["sim:0", "sim:1"], streams=2, seed=2) as rt:
        a, b, c = arr([1.0], "sim:0"), arr([0.0], "sim:1"), arr([0.0], "sim:1")

        def boom(x):
            raise ValueError("injected on sim:0")

        root = rt.submit(boom, a, writes=[a], name="boom")
        dependent = rt.submit(add_into, b, a, a, reads=[a], writes=[b], name="reads_a_on_1")
        independent = rt.submit(lambda z: np.add(z.data, 1, out=z.data), c, writes=[c], name="free")
        with pytest.raises(ValueError):
            root.result()
        with pytest.raises(sd.DependencyFailed, match="boom"):
            dependent.result()
        independent.result()
        with pytest.raises(sd.ExceptionGroup) as info:
            rt.synchronize()
    assert [type(e) for e in info.value.exceptions] == [ValueError]  # the root only
    np.testing.assert_array_equal(c.data, [1.0])


def test_a_timeline_over_two_devices_has_a_track_per_device_and_stream():
    with sd.Runtime(devices=["sim:0", "sim:1"], streams=2, seed=4) as rt, rt.profile() as prof:
        a, b = arr(np.ones(4), "sim:0"), arr(np.zeros(4), "sim:1")
        rt.submit(lambda x: np.multiply(x.data, 3, out=x.data), a, writes=[a], name="on0")
        rt.submit(add_into, b, a, a, reads=[a], writes=[b], name="on1")
    trace = prof.timeline.to_chrome_trace()
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"streamdag sim:0", "streamdag sim:1"} <= processes
    spans = {s.name: s for s in prof.timeline.spans}
    assert spans["on0"].device == "sim:0" and spans["on1"].device == "sim:1"
    np.testing.assert_array_equal(b.data, np.full(4, 6.0))
