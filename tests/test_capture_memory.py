"""Captures on several streams reuse a block read across streams once the graph orders it free
(PyTorch's ``graph_capture_record_stream_reuse``), on only while a capture of streamdag's runs,
and never against the user's own allocator setting."""

import os
import subprocess
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

from streamdag.backends import capture_memory  # noqa: E402
from streamdag.backends.capture_memory import stream_reuse  # noqa: E402


@pytest.fixture
def settings(monkeypatch):
    """The allocator settings streamdag sets, in order; the module as on a fresh import."""
    calls: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(capture_memory, "_usable", None)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    return calls


def test_the_option_is_on_while_any_capture_runs_and_off_after_the_last(settings):
    with stream_reuse():
        assert settings[-1] == "graph_capture_record_stream_reuse:True"
        with stream_reuse():  # a capture nested in another (or of another thread meanwhile)
            pass
        assert settings[-1] == "graph_capture_record_stream_reuse:True"
    assert settings[-1] == "graph_capture_record_stream_reuse:False"
    assert settings.count("graph_capture_record_stream_reuse:True") == 1


def test_captures_of_several_threads_turn_it_off_only_when_all_have_ended(settings):
    entered, release = threading.Barrier(3), threading.Event()

    def capture():
        with stream_reuse():
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=capture) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait()
    assert settings[-1].endswith(":True")
    release.set()
    for t in threads:
        t.join()
    assert settings[-1].endswith(":False")
    assert settings.count("graph_capture_record_stream_reuse:True") == 1


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_the_users_own_setting_of_the_option_is_left_alone(settings, monkeypatch, name):
    monkeypatch.setenv(name, "expandable_segments:False,graph_capture_record_stream_reuse:False")
    with stream_reuse():
        pass
    assert settings == []


def test_a_pytorch_without_the_option_captures_as_before(monkeypatch):
    def refuse(_):
        raise RuntimeError("Unrecognized key 'graph_capture_record_stream_reuse'")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", refuse)
    monkeypatch.setattr(capture_memory, "_usable", None)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    ran = []
    with stream_reuse():
        ran.append(True)
    assert ran == [True]


def _crossing_values(side: torch.cuda.Stream, n: int) -> torch.Tensor:
    """``n`` values made on ``side``, each read on the current stream and dropped: 4 MiB each."""
    main = torch.cuda.current_stream()
    total = torch.zeros((), device="cuda")
    for i in range(n):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            v = torch.full((1 << 20,), float(i), device="cuda")
        main.wait_stream(side)
        total += v.sum()
        v.record_stream(main)
        del v
    return total


_REUSE_SCRIPT = """
import contextlib, sys
import torch
sys.path.insert(0, {tests!r})
from streamdag.backends.capture_memory import stream_reuse
from test_capture_memory import _crossing_values

side = torch.cuda.Stream()
for reuse in (False, True):
    pool = torch.cuda.graph_pool_handle()
    before = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with (stream_reuse() if reuse else contextlib.nullcontext()), torch.cuda.graph(graph, pool=pool):
        out = _crossing_values(side, 12)
    reserved = torch.cuda.memory_reserved() - before
    graph.replay()
    torch.cuda.synchronize()
    print(reuse, reserved, out.item())
    del graph, out
    torch.cuda.empty_cache()
"""


@pytest.mark.cuda
def test_a_capture_reuses_values_that_crossed_streams_and_replays_right():
    """Run in a fresh interpreter: in a process that ran other tests, the allocator's cached blocks
    and settings from before change what a capture reserves."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(tests, "..", "src"), tests,
                                                         os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    done = subprocess.run([sys.executable, "-c", _REUSE_SCRIPT.format(tests=tests)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    reserved = {}
    for line in done.stdout.strip().splitlines()[-2:]:
        reuse, size, total = line.split()
        assert float(total) == sum(range(12)) * (1 << 20)  # the replay read every value right
        reserved[reuse == "True"] = int(size)
    # without it every value keeps its block until the capture ends: 12 x 4 MiB, not one or two
    assert reserved[True] < reserved[False] / 2, reserved
