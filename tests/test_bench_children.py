"""bench/children.py: a benchmark's child process ends at its time limit, with all it started."""

import sys
import time

import pytest

from bench_scripts import bench_script


@pytest.fixture(scope="module")
def children():
    with bench_script("children") as module:
        yield module


# a child that starts a grandchild holding the child's output open for 30 s (as Inductor's compile
# workers do), then either exits at once or sleeps past its limit
_GRANDCHILD = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
               "time.sleep(30)']); print('started', flush=True); time.sleep(float(sys.argv[1]))")


def test_a_child_that_exits_is_not_waited_for_past_its_grandchildren(children):
    t0 = time.perf_counter()
    done = children.run_child([sys.executable, "-c", _GRANDCHILD, "0"], timeout=20)
    assert done.returncode == 0 and not done.timed_out
    assert "started" in done.output
    assert time.perf_counter() - t0 < 15


def test_a_child_over_its_time_limit_is_killed_with_its_grandchildren(children):
    t0 = time.perf_counter()
    done = children.run_child([sys.executable, "-c", _GRANDCHILD, "60"], timeout=2)
    assert done.timed_out and done.returncode is None
    assert "started" in done.output
    assert time.perf_counter() - t0 < 15


def test_a_failing_child_reports_its_status_and_the_end_of_its_output(children):
    done = children.run_child([sys.executable, "-c", "import sys; print('x' * 5000 + 'why'); sys.exit(3)"],
                              timeout=20, tail=100)
    assert done.returncode == 3 and len(done.output) == 100 and done.output.rstrip().endswith("why")


def test_negative_control_reading_through_pipes_waits_for_the_grandchild(children):
    """What run_child avoids: subprocess.run with captured output waits for the grandchild's 30 s."""
    import subprocess

    t0 = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", _GRANDCHILD, "0"], capture_output=True, timeout=3)
    assert time.perf_counter() - t0 >= 3


# a served child: it echoes each request, after its output has gone to its log (as Inductor's
# warnings would), and raises on {"raise": true}
_SERVED = ("import os, sys; sys.path.insert(0, sys.argv[1]); from children import serve\n"
           "def answer(m):\n"
           "    print('log line', flush=True)\n"
           "    if m.get('raise'): raise RuntimeError('asked to')\n"
           "    return {'echo': m}\n"
           "serve(sys.argv[-1], {'ready': True, 'pid': os.getpid()}, answer)\n")


def _served(children):
    from bench_scripts import BENCH

    return children.ServedChild([sys.executable, "-c", _SERVED, str(BENCH)])


def test_a_served_child_answers_requests_on_its_own_pipes_and_ends_when_told(children):
    child = _served(children)
    assert child.receive(30)["ready"]
    assert child.request({"steps": 3}, 30) == {"echo": {"steps": 3}}
    assert child.request({"steps": 1}, 30) == {"echo": {"steps": 1}}
    done = child.finish(30)
    assert done.returncode == 0 and "log line" in done.output


def test_a_served_child_that_fails_gives_no_answer_and_its_error_comes_back(children):
    child = _served(children)
    assert child.receive(30)["ready"]
    t0 = time.perf_counter()
    assert child.request({"raise": True}, 30) is None  # (its pipe closed: no wait for the limit)
    assert time.perf_counter() - t0 < 20
    assert child.request({"steps": 1}, 5) is None
    done = child.finish(30)
    assert done.returncode == 1 and "asked to" in done.output


def test_a_served_child_that_does_not_answer_in_time_is_ended(children):
    child = children.ServedChild([sys.executable, "-c", "import time; time.sleep(60)"])
    t0 = time.perf_counter()
    assert child.receive(1) is None
    done = child.finish(1)
    assert done.returncode is None and time.perf_counter() - t0 < 15
