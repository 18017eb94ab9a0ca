"""Failures in recorded graphs: which ops fail, how a run ends, and runs started where they could hang.

A recorded graph's run must fail exactly the ops that the same submits run
eagerly would fail: each op that touches memory a failed op wrote (or was to
write), transitively through every dependency, not only the few the schedule
keeps; an op that only overwrites what a failed op read still runs. Random
programs with injected failures, recorded into a graph and run several times
among eager ops on the same buffers, must give every op the outcome a serial
run gives it (its value, its own error, or DependencyFailed) and leave the
buffers as it does.
"""

import os

import numpy as np
import pytest
from hypothesis import settings

import streamdag as sd
from streamdag.backends.inline import InlineBackend

EXAMPLES = settings(max_examples=1000 if os.environ.get("CI") else 150)
KINDS = ["cpu", "sim", "inline"]  # "inline": each op runs inside its submit, as on CUDA
TWO_DEVICES = ["sim:0", "sim:1"]  # a graph over both runs as one host replay


def runtime(kind, streams=3, seed=0, max_inflight=None):
    made = {} if max_inflight is None else {"max_inflight": max_inflight}
    if kind == "inline":
        return sd.Runtime(backend=InlineBackend("cpu", streams), **made)
    if kind == "two devices":
        return sd.Runtime(devices=TWO_DEVICES, streams=streams, seed=seed, **made)
    return sd.Runtime(kind, streams=streams, seed=seed, **made)


def fail(*_args):
    raise ValueError("injected")


# ---------------------------------------------------------------- runs inside a recording
@pytest.mark.parametrize("kind", KINDS)
def test_a_graph_run_inside_another_recording_raises_and_runs_nothing(kind):
    a = np.zeros(2)
    with runtime(kind) as rt:
        with rt.record() as g:
            rt.submit(np.add, a, 1, out=a, writes=[a])
        with pytest.raises(RuntimeError, match=r"run it after the block"), rt.record() as h:
            rt.submit(np.add, a, 10, out=a, writes=[a])
            g.run()
        rt.synchronize()
        assert a.tolist() == [0.0, 0.0] and len(h) == 1
        g.run().result(timeout=10)
    assert a.tolist() == [1.0, 1.0]


