"""A profile places each op at the wall-clock time it ran, also when its device had work queued at the
profile's start: the base event then runs late, and only a clock mark taken at the end (an event on
an idle stream and the wall clock when it ran) maps the device's events to the wall clock."""

import threading
import time

import pytest

import streamdag as sd
from streamdag.backends.sim import SimBackend

QUEUED_S = 0.08  # work on the op's stream when the profile begins


def _profile_behind_queued_work() -> tuple[int, int]:
    """(the wall clock at which a profiled op ran, the wall clock at which its span starts)."""
    ran = []
    go = threading.Event()
    with sd.Runtime("sim", streams=1) as rt:
        rt.submit(lambda: (go.wait(5), time.sleep(QUEUED_S)), name="queued")
        with rt.profile() as prof:
            go.set()  # the queued work runs from here on: the profile's base event is behind it
            rt.submit(lambda: ran.append(time.time_ns()), name="profiled")
    (span,) = [s for s in prof.timeline.spans if s.name == "profiled"]
    return ran[0], prof.timeline.origin_ns + round(span.start * 1e6)


def test_a_profiled_op_is_placed_at_the_wall_clock_time_it_ran_behind_queued_work():
    ran_ns, placed_ns = _profile_behind_queued_work()
    assert abs(placed_ns - ran_ns) < 0.25 * QUEUED_S * 1e9, (placed_ns - ran_ns) / 1e6


def test_without_a_clock_mark_the_op_is_placed_early_by_the_queued_work(monkeypatch):
    # the negative control: the base paired with the wall clock read beside its record
    monkeypatch.delattr(SimBackend, "clock_mark")
    ran_ns, placed_ns = _profile_behind_queued_work()
    assert ran_ns - placed_ns > 0.75 * QUEUED_S * 1e9, (placed_ns - ran_ns) / 1e6


@pytest.mark.cuda
def test_on_cuda_a_clock_mark_brackets_the_moment_its_event_ran():
    torch = pytest.importorskip("torch")
    from streamdag.backends.cuda import CLOCK_BRACKET_NS, CudaBackend

    backend = CudaBackend("cuda", 2)
    try:
        busy = torch.cuda.Stream()
        with torch.cuda.stream(busy):  # other work on the device does not hold the mark back
            a = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):
                a = a @ a
                a = a / a.norm()
        first = backend.clock_mark()
        time.sleep(0.05)
        second = backend.clock_mark()
        if first is None:
            pytest.skip("the torch extension did not build here")
        gpu_ms = first[0].elapsed_ms(second[0])
        wall_ms = (second[1] - first[1]) / 1e6
        assert abs(gpu_ms - wall_ms) < 5 * CLOCK_BRACKET_NS / 1e6, (gpu_ms, wall_ms)
        torch.cuda.synchronize()
    finally:
        backend.close()
