"""The CUDA completion thread's poll interval while nothing completes (a pure function: no GPU)."""

import pytest

pytest.importorskip("torch")
from streamdag.backends import cuda_completions as completions


def test_the_idle_poll_doubles_then_follows_the_time_waited_within_its_bounds():
    interval, steps = completions._Completions.POLL_SECONDS, []
    idle = 0.0
    for _ in range(200):  # as the completion thread does: wait the interval, then ask for the next
        idle += interval
        interval = completions._idle_poll(interval, idle)
        steps.append((idle, interval))
    intervals = [i for _, i in steps]
    assert intervals == sorted(intervals)  # never shorter while nothing completes
    assert intervals[0] == 2 * completions._Completions.POLL_SECONDS  # doubles at first
    assert max(intervals) == completions.LONG_IDLE_POLL_SECONDS  # and is capped
    # an op seen done at most a 25th of the time waited late, once past the short polls
    assert all(i <= max(completions.IDLE_POLL_SECONDS, t / 25) for t, i in steps)
    longest = completions.LONG_IDLE_POLL_SECONDS
    assert completions._idle_poll(longest, 3600.0) == longest
