"""Finished ops and closed runtimes are freed by reference counting alone, not left in cycles for
the cycle collector, whose passes stall submits (and may fall inside a CUDA graph capture)."""

import numpy as np
import pytest

import streamdag as sd
from programs import closed_runtime_freed_at_once, ops_left_to_the_cycle_collector
from streamdag.backends.inline import InlineBackend

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def test_finished_ops_of_eager_work_and_graph_runs_are_freed_at_once(rt):
    """No cycle keeps a finished op alive for the cycle collector, whose passes stall submits."""
    a = np.zeros(8)
    with rt.record() as g:
        for _ in range(3):
            rt.submit(np.add, a, 1, out=a, writes=[a])
    g.run().result()  # the first run may make one-time state: not counted
    rt.synchronize()

    def work():
        futures = [rt.submit(np.add, a, 1, out=a, writes=[a]) for _ in range(50)]
        futures += [g.run() for _ in range(5)]
        futures[-1].result()
        rt.synchronize()

    assert ops_left_to_the_cycle_collector(work) == 0
    assert (a == 3 + 50 + 15).all()


class _HurryingInline(InlineBackend):
    """A backend with ``hurry``, as CUDA's: each future then holds a hurry that holds the runtime."""

    def hurry(self, waiter=None, seconds=None, wanted=None) -> None: ...


@pytest.mark.parametrize("device", ["cpu", "sim", "hurrying"])
def test_a_closed_runtime_is_freed_once_dropped_without_the_cycle_collector(device):
    x = np.zeros(4)

    def make():
        if device == "hurrying":
            return sd.Runtime(backend=_HurryingInline("cpu", 2))
        return sd.Runtime(device, streams=2)

    def use(rt):
        for _ in range(10):
            rt.submit(np.add, x, 1, out=x, reads=[x], writes=[x])
        rt.synchronize()

    assert closed_runtime_freed_at_once(make, use)
    assert x.tolist() == [10.0] * 4
