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
    monkeypatch.delattr(SimBackend, "wall_of")
    ran_ns, placed_ns = _profile_behind_queued_work()
    assert ran_ns - placed_ns > 0.75 * QUEUED_S * 1e9, (placed_ns - ran_ns) / 1e6


def test_a_profile_left_inside_an_op_on_the_simulated_device_ends():
    # the op runs on the one thread that would run a clock mark: the profile keeps the wall clock
    # read beside its base instead of waiting on itself
    ended = threading.Event()
    rt = sd.Runtime("sim", streams=2)

    def op():
        with rt.profile():
            pass
        ended.set()

    rt.submit(op, name="outer")
    assert ended.wait(10), "a profile left inside an op did not end"  # (its runtime left open: stuck)
    rt.close()


@pytest.mark.cuda
def test_on_cuda_an_event_behind_queued_work_is_timed_when_it_ran():
    torch = pytest.importorskip("torch")
    from streamdag.backends.cuda import CLOCK_BRACKET_NS, CudaBackend, CudaEvent

    backend = CudaBackend("cuda", 2)
    try:
        busy = torch.cuda.Stream()
        a = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(busy):  # tens of ms of work ahead of the event
            for _ in range(20):
                a = a @ a
                a = a / a.norm()
        event = CudaEvent(True, backend.torch_device)
        recorded = time.time_ns()
        event.record(busy)
        pending = recorded  # a time before a query that found the event still pending
        while True:
            before = time.time_ns()
            if event.query():
                break
            pending = before
        seen = time.time_ns()
        wall = backend.wall_of(event)
        if wall is None:
            pytest.skip("no clock mark here (no torch extension, or every bracket too wide)")
        # the event completed between the last query that found it pending and the one that found it
        # done (a thread switch between them, on a loaded host, widens that window, not the error)
        assert pending - CLOCK_BRACKET_NS <= wall <= seen + CLOCK_BRACKET_NS, \
            ((wall - pending) / 1e6, (seen - wall) / 1e6)
        assert wall - recorded > (seen - recorded) / 2, "timed at its record, not when it ran"
    finally:
        backend.close()
