"""Random programs over shared buffers and overlapping views, run concurrently.

Each program is a list of ops; every op reads a few views and updates one
view in place with a function of what it read. Run concurrently on 1 to 4
streams (CPU lanes, and the simulated device's random interleavings), the
buffers and return values must equal a serial run bit for bit; so they must
with some ops on the host lanes beside the device (``run_on="host"``). With
errors injected, exactly the ops that use memory a failed op wrote (or was to write)
must fail, transitively: not those that only overwrite what a failed op read. Several
threads submitting to one runtime at once, each over its own buffers, must each get
what their own program run serially gives. All of it on the compiled hot path and on its Python
reference, which runs where the package has no compiled module: both must be right.
"""

import os
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streamdag as sd
from programs import VIEW_KINDS, N, initial_bases, make_view, run_op, serial
from streamdag.backends.inline import InlineBackend

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")

EXAMPLES = settings(max_examples=1500 if os.environ.get("CI") else 100)


views = st.tuples(
    st.integers(0, 2), st.sampled_from(VIEW_KINDS), st.integers(0, N - 1), st.integers(0, N - 1)
)
ops = st.builds(
    lambda reads, write, k: {"reads": reads, "write": write, "k": k},
    st.lists(views, max_size=3),
    views,
    st.integers(0, 100),
)
programs = st.lists(ops, min_size=1, max_size=30)
# some ops on the host lanes beside the device (run_on="host")
host_programs = st.lists(st.builds(lambda op, host: {**op, "host": host}, ops, st.booleans()),
                         min_size=1, max_size=30)


def concurrent(program, device, streams, seed, failing=frozenset(), roots=frozenset()):
    bases = initial_bases()
    # "inline": each op runs inside its submit, as on CUDA (the runtime's non-deferred path);
    # "inline+host": the same beside a device, which has host lanes for run_on="host"
    backend = None
    if device.startswith("inline"):
        backend = InlineBackend("cpu" if device == "inline" else "sim", streams)
    made = ({"backend": backend} if backend is not None
            else {"device": device, "streams": streams, "seed": seed})
    with sd.Runtime(max_inflight=8, **made) as rt:
        futures = []
        for i, op in enumerate(program):
            reads = [make_view(bases, r) for r in op["reads"]]
            write = make_view(bases, op["write"])
            futures.append(rt.submit(run_op, op, bases, i in failing, reads=reads, writes=[write],
                                     name=f"op{i}", run_on="host" if op.get("host") else None))
        try:
            rt.synchronize()
        except sd.ExceptionGroup as group:
            assert {str(e) for e in group.exceptions} == {f"injected failure in op{i}" for i in roots}
        assert rt.statistics().peak_inflight <= 8
    return bases, futures


@EXAMPLES
@given(programs, st.sampled_from(["cpu", "sim"]), st.integers(1, 4), st.integers(0, 2**16))
def test_concurrent_run_equals_serial_bit_for_bit(program, device, streams, seed):
    check_equals_serial(program, device, streams, seed)


@EXAMPLES
@given(host_programs, st.sampled_from(["sim", "inline+host"]), st.integers(1, 4), st.integers(0, 2**16))
def test_host_lane_ops_mixed_in_equal_serial(program, device, streams, seed):
    check_equals_serial(program, device, streams, seed)


def check_equals_serial(program, device, streams, seed):
    expect_bases, expect_results, _, _ = serial(program)
    bases, futures = concurrent(program, device, streams, seed)
    assert [f.result() for f in futures] == expect_results
    for got, want in zip(bases, expect_bases):
        assert np.array_equal(got, want)


@EXAMPLES
@given(host_programs, st.data(), st.sampled_from(["sim", "inline+host"]), st.integers(1, 4),
       st.integers(0, 2**16))
def test_injected_errors_with_host_lane_ops_fail_exactly_the_dependents(program, data, device, streams, seed):
    check_injected_errors(program, data, device, streams, seed)


@EXAMPLES
@given(programs, st.data(), st.sampled_from(["sim", "inline"]), st.integers(1, 4), st.integers(0, 2**16))
def test_injected_errors_fail_exactly_the_dependents(program, data, device, streams, seed):
    check_injected_errors(program, data, device, streams, seed)


def check_injected_errors(program, data, device, streams, seed):
    failing = frozenset(data.draw(st.sets(st.integers(0, len(program) - 1), max_size=3)))
    _, expect_results, expect_failed, roots = serial(program, failing)
    _, futures = concurrent(program, device, streams, seed, failing, roots)
    failed = {i for i, f in enumerate(futures) if f.exception() is not None}
    assert failed == expect_failed
    for i, f in enumerate(futures):
        if i in roots:
            assert isinstance(f.exception(), RuntimeError)
        elif i in failed:
            err = f.exception()
            assert isinstance(err, sd.DependencyFailed)
            assert err.root_name in {f"op{j}" for j in roots}
        else:
            assert f.result() == expect_results[i]


@EXAMPLES
@given(programs, st.integers(1, 4), st.integers(0, 2**16))
def test_recorded_graph_runs_equal_serial(program, streams, seed):
    expect_bases, expect_results, _, _ = serial(program)
    bases = initial_bases()
    with sd.Runtime("sim", streams=streams, seed=seed) as rt:
        with rt.record() as g:
            for i, op in enumerate(program):
                reads = [make_view(bases, r) for r in op["reads"]]
                write = make_view(bases, op["write"])
                rt.submit(run_op, op, bases, reads=reads, writes=[write], name=f"op{i}")
        assert list(g.run().result()) == expect_results
    for got, want in zip(bases, expect_bases):
        assert np.array_equal(got, want)


@EXAMPLES
@given(host_programs, st.sampled_from(["sim", "inline+host"]), st.integers(1, 4), st.integers(0, 2**16))
def test_recorded_graphs_with_host_lane_ops_equal_serial(program, device, streams, seed):
    """A recorded graph with some ops on the host lanes, run twice without a wait in between."""
    expect_bases, expect_results, _, _ = serial([dict(op) for op in program + program])
    bases = initial_bases()
    made = ({"backend": InlineBackend("sim", streams)} if device == "inline+host"
            else {"device": device, "streams": streams, "seed": seed})
    with sd.Runtime(max_inflight=8, **made) as rt:
        with rt.record() as g:
            for i, op in enumerate(program):
                submit_op(rt, op, bases, f"op{i}", host=op["host"])
        first, second = g.run(), g.run()
        assert list(first.result(timeout=60)) + list(second.result(timeout=60)) == expect_results
    for got, want in zip(bases, expect_bases):
        assert np.array_equal(got, want)


@EXAMPLES
@given(programs, programs, st.integers(1, 4), st.integers(0, 2**16))
def test_graph_runs_and_eager_ops_interleaved_equal_serial(graph_program, eager_program, streams, seed):
    """g.run(); eager ops; g.run(), with nothing waited for in between: ordered as if serial."""
    sequence = graph_program + eager_program + graph_program
    expect_bases, expect_results, _, _ = serial([dict(op) for op in sequence])
    bases = initial_bases()
    with sd.Runtime("sim", streams=streams, seed=seed) as rt:
        with rt.record() as g:
            for i, op in enumerate(graph_program):
                rt.submit(run_op, op, bases, reads=[make_view(bases, r) for r in op["reads"]],
                          writes=[make_view(bases, op["write"])], name=f"g{i}")
        first = g.run()
        eager = [rt.submit(run_op, op, bases, reads=[make_view(bases, r) for r in op["reads"]],
                           writes=[make_view(bases, op["write"])], name=f"e{i}")
                 for i, op in enumerate(eager_program)]
        second = g.run()
        got = list(first.result()) + [f.result() for f in eager] + list(second.result())
    assert got == expect_results
    for g_base, want in zip(bases, expect_bases):
        assert np.array_equal(g_base, want)


def submit_op(rt, op, bases, name, host=False):
    return rt.submit(run_op, op, bases, reads=[make_view(bases, r) for r in op["reads"]],
                     writes=[make_view(bases, op["write"])], name=name, run_on="host" if host else None)


# per thread: its program (some ops on the host lanes), the ops of the graph it records, and how
# many of its ops come between two runs of that graph
threads_programs = st.lists(st.tuples(host_programs, host_programs.map(lambda p: p[:3]), st.integers(2, 6)),
                            min_size=2, max_size=3)


@EXAMPLES
@given(threads_programs, st.sampled_from(["cpu", "sim", "inline+host"]), st.integers(1, 4),
       st.integers(0, 2**16))
def test_threads_submitting_at_once_each_get_their_serial_result(threads, device, streams, seed):
    """Threads submit to one runtime at once, each over its own buffers: eager ops, host-lane ops
    and runs of a graph it recorded (some of its ops on the host lanes too), contending for a
    small in-flight bound and the runtime's locks. Each thread's buffers must end as its own
    program run serially leaves them."""
    expected = []
    for program, graph_ops, every in threads:
        bases = initial_bases()
        for i, op in enumerate(program):
            run_op(op, bases)
            if (i + 1) % every == 0:
                for graph_op in graph_ops:
                    run_op(graph_op, bases)
        expected.append(bases)
    made = ({"backend": InlineBackend("sim", streams)} if device == "inline+host"
            else {"device": device, "streams": streams, "seed": seed})
    got, errors = [None] * len(threads), []
    start = threading.Barrier(len(threads))
    with sd.Runtime(max_inflight=6, **made) as rt:

        def run_thread(t, program, graph_ops, every):
            try:
                bases = got[t] = initial_bases()
                with rt.record() as graph:
                    for j, op in enumerate(graph_ops):
                        submit_op(rt, op, bases, f"t{t}g{j}", host=op["host"])
                start.wait(timeout=30)
                futures = []
                for i, op in enumerate(program):
                    futures.append(submit_op(rt, op, bases, f"t{t}op{i}", host=op.get("host", False)))
                    if (i + 1) % every == 0:
                        futures.append(graph.run())
                for f in futures:
                    f.result(timeout=60)
            except BaseException as exc:  # reported by the test's thread
                errors.append(exc)

        workers = [threading.Thread(target=run_thread, args=(t, *spec), daemon=True)
                   for t, spec in enumerate(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
        assert not any(w.is_alive() for w in workers), "a submitting thread is stuck"
        assert not errors, errors
    for bases, want in zip(got, expected):
        for g_base, w_base in zip(bases, want):
            assert np.array_equal(g_base, w_base)

