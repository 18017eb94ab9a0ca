"""Random programs that nest: ops that submit ops and wait for them, done-callbacks that submit and
synchronize, and close() racing threads that submit.

Every future must end with the value a serial run gives, or with a clear error: a wait refused
because it could never end (``would wait forever``), or RuntimeClosed for a submit that came after
close(). Nothing may hang, and no thread may outlive the runtime. The waits inside ops have no
timeout on purpose (the runtime must refuse a wait that could never end, and does so only for
waits without one); every wait of the test's own is bounded, so a hang fails the example.
"""

import concurrent.futures
import os
import threading
from functools import partial

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import streamdag as sd
from streamdag.errors import BaseExceptionGroup
from test_lifecycle import finishes, threads_left

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")

EXAMPLES = settings(max_examples=1500 if os.environ.get("CI") else 300)
#: seconds the test waits for any one thing
PATIENCE = 30


# ----------------------------------------------------------------- nested submits and waits
def tree(children):
    return st.fixed_dictionaries({
        "k": st.integers(0, 100),
        "children": st.lists(children, max_size=3),
        "join": st.sampled_from(["result", "synchronize", "wait", "none"]),
        "callback": st.sampled_from(["none", "submit", "synchronize"]),
    })


leaf = st.fixed_dictionaries({"k": st.integers(0, 100), "children": st.just([]), "join": st.just("none"),
                              "callback": st.just("none")})
nodes = st.recursive(leaf, tree, max_leaves=8)
forests = st.lists(nodes, min_size=1, max_size=5)


def serial_value(node) -> int:
    """What an op of ``node`` returns: its ``k``, plus its children's values where it joins them."""
    joined = sum(serial_value(c) for c in node["children"]) if node["join"] != "none" else 0
    return node["k"] + joined


def follow_up_value(path) -> int:
    return 1000 + sum((i + 1) * 7 for i in path)


def refused_wait(exc: BaseException) -> bool:
    """Whether ``exc`` is a wait refused because it could never end (or a group of only those, as
    synchronize() raises the failures it saw; or an op's failure for a dependency's such)."""
    if isinstance(exc, BaseExceptionGroup):
        return all(refused_wait(e) for e in exc.exceptions)
    if isinstance(exc, sd.DependencyFailed):
        return refused_wait(exc.root_error)
    return isinstance(exc, RuntimeError) and "would wait forever" in str(exc)


class Forest:
    """A forest of ops run on one runtime: each op forks its children, maybe joins them (by
    ``result()``, ``rt.synchronize()`` or ``concurrent.futures.wait``), and maybe has a done-callback
    on each child that submits a follow-up op or calls ``rt.synchronize()``."""

    def __init__(self, rt, on):
        self.rt, self.on = rt, on
        self.futures = {}  # path -> (future, what it must return)
        self.callback_errors = []  # what the callbacks' synchronize() raised that it must not
        self._lock = threading.Lock()

    def keep(self, path, future, value):
        with self._lock:
            self.futures[path] = (future, value)

    def run(self, node, path):
        rt = self.rt
        forked = []
        for i, child in enumerate(node["children"]):
            f = rt.submit(self.run, child, (*path, i), name=f"op{(*path, i)}", **self.on)
            self.keep((*path, i), f, serial_value(child))
            if node["callback"] != "none":
                f.add_done_callback(partial(self.callback, node["callback"], (*path, i)))
            forked.append(f)
        total = node["k"]
        if node["join"] == "none":
            return total
        if node["join"] == "synchronize":
            rt.synchronize()
        elif node["join"] == "wait":
            concurrent.futures.wait(forked)
        return total + sum(f.result() for f in forked)

    def callback(self, how, path, _future):
        if how == "submit":
            value = follow_up_value(path)
            self.keep(("follow-up", *path), self.rt.submit(lambda: value, **self.on), value)
            return
        try:
            self.rt.synchronize()
        except RuntimeError as exc:  # ops are pending: a callback must not wait for them
            if "inside a done-callback" not in str(exc):
                self.callback_errors.append(exc)
        except BaseExceptionGroup as group:  # the failures so far: refused waits only
            if not refused_wait(group):
                self.callback_errors.append(group)


@EXAMPLES
@given(forests, st.sampled_from(["cpu", "host"]), st.integers(1, 4), st.integers(1, 4))
def test_ops_that_submit_and_wait_end_with_their_serial_values_or_a_refused_wait(
        forest, where, lanes, max_inflight):
    before = set(threading.enumerate())
    if where == "cpu":
        rt, on = sd.Runtime("cpu", streams=lanes, max_inflight=max_inflight), {}
    else:
        rt = sd.Runtime("sim", streams=2, host_lanes=lanes, max_inflight=max_inflight)
        on = {"run_on": "host"}
    run = Forest(rt, on)
    for i, node in enumerate(forest):
        run.keep((i,), rt.submit(run.run, node, (i,), name=f"op{(i,)}", **on), serial_value(node))
    finishes(rt.close, PATIENCE)  # waits for every op, and for what ops and callbacks submit
    assert run.callback_errors == []
    for path_, (future, value) in run.futures.items():
        exc = future.exception(timeout=0)
        assert (exc is None and future.result() == value) or (exc is not None and refused_wait(exc)), (
            path_, exc)
    refused = any(f.exception() is not None for f, _ in run.futures.values())
    event("a wait refused" if refused else "no wait refused")
    assert threads_left(before) == []


# ----------------------------------------------------------------- close racing submitters
submitted_ops = st.fixed_dictionaries({"k": st.integers(1, 50), "fork": st.booleans()})
submitter_programs = st.lists(st.lists(submitted_ops, min_size=1, max_size=12), min_size=1, max_size=4)


def serial_sums(program) -> list[int]:
    """What each op of one thread's program returns: the sum of its buffer after it, plus its
    forked child's value."""
    buf, sums = np.zeros(4, dtype=np.int64), []
    for op in program:
        buf += op["k"]
        sums.append(int(buf.sum()) + (2 * op["k"] if op["fork"] else 0))
    return sums


@EXAMPLES
@given(submitter_programs, st.integers(0, 20), st.sampled_from(["cpu", "sim"]), st.integers(1, 3),
       st.integers(1, 3))
def test_close_racing_submitters_leaves_every_future_completed_or_refused(
        programs, close_after, device, streams, max_inflight):
    """Threads submit ops over buffers of their own (some ops fork a child and join it) while
    another thread closes the runtime after ``close_after`` submits. Each submit returns a future
    that completes with the serial value, or raises RuntimeClosed, after which that thread stops.
    (Ops of two lanes that fork onto each other's lane and join: one join is refused, and the ops
    after it on its buffer fail for it.)"""
    before = set(threading.enumerate())
    # an op waits for its child only where that runs elsewhere: not on its own lane, nor on the
    # simulated device, which runs its ops on one thread
    forks = device == "cpu" and streams > 1
    submitted, enough = [0], threading.Event()
    close_after = min(close_after, sum(map(len, programs)))
    count = threading.Lock()
    got = [[] for _ in programs]
    errors = []

    def op(rt, buf, k, fork):
        buf += k
        child = rt.submit(lambda: 2 * k).result() if fork else 0
        return int(buf.sum()) + child

    def submit_all(rt, t, program):
        buf = np.zeros(4, dtype=np.int64)
        try:
            for spec in program:
                fork = spec["fork"] and forks
                try:
                    got[t].append(rt.submit(op, rt, buf, spec["k"], fork, writes=[buf]))
                except sd.RuntimeClosed:
                    return
                with count:
                    submitted[0] += 1
                    if submitted[0] >= close_after:
                        enough.set()
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)
            enough.set()

    rt = sd.Runtime(device, streams=streams, max_inflight=max_inflight)
    threads = [threading.Thread(target=submit_all, args=(rt, t, program), daemon=True)
               for t, program in enumerate(programs)]
    for t in threads:
        t.start()
    enough.wait(PATIENCE if close_after else 0)
    finishes(rt.close, PATIENCE)
    for t in threads:
        t.join(PATIENCE)
    assert not any(t.is_alive() for t in threads), "a submitter is stuck"
    assert errors == []
    for futures, program in zip(got, programs):
        want = serial_sums([{**spec, "fork": spec["fork"] and forks} for spec in program])
        failed = [f.exception(timeout=PATIENCE) is not None for f in futures]
        ran = failed.index(True) if any(failed) else len(futures)
        assert [f.result() for f in futures[:ran]] == want[:ran]
        assert all(refused_wait(f.exception()) for f in futures[ran:])
    ran, submits = sum(map(len, got)), sum(map(len, programs))
    event("every submit ran" if ran == submits else "some submits ran" if ran else "every submit refused")
    assert threads_left(before) == []
