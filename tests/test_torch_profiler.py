"""PyTorch's profiler and ``rt.profile()`` together: torch's trace names streamdag's ops, and the
two traces of one run lie on the same clock and tracks, so that they can be opened side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import streamdag as sd
from streamdag.runtime.ops import Op

torch = pytest.importorskip("torch")
from torch.profiler import ProfilerActivity, profile  # noqa: E402

#: how far apart the two profilers may see the same moment (µs): each reads its own clock, and a
#: loaded machine can hold a thread between a read and the op it marks
TOLERANCE_US = 2_000.0


def _load(path: Path) -> tuple[list[dict[str, Any]], int]:
    trace = json.loads(path.read_text())
    return trace["traceEvents"], int(trace["baseTimeNanoseconds"])


def _absolute(event: dict[str, Any], base_ns: int) -> tuple[float, float]:
    """An event's start and end in µs of the Unix clock."""
    start = base_ns / 1e3 + float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def _all_threads() -> dict[str, Any]:
    """PyTorch's profiler records the ops of its own thread only, unless told to record all of them
    (streamdag's lanes are threads of their own)."""
    from torch._C._profiler import _ExperimentalConfig

    return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}


def _run_profiled(tmp_path: Path, device: str, activities: list[Any], **torch_options: Any):
    names = [f"matmul_{i}" for i in range(4)]
    x = torch.randn(192, 192, device=device)
    outs = [torch.empty(192, 192, device=device) for _ in names]
    with sd.Runtime(device, streams=2) as rt:
        with profile(activities=activities, **torch_options) as torch_prof, rt.profile() as prof:
            for name, out in zip(names, outs):
                rt.submit(torch.matmul, x, x, out=out, reads=[x], writes=[out], name=name)
        torch_prof.export_chrome_trace(str(tmp_path / "torch.json"))
        prof.timeline.save_trace(tmp_path / "streamdag.json")
    torch_events, torch_base = _load(tmp_path / "torch.json")
    ours, our_base = _load(tmp_path / "streamdag.json")
    return names, torch_events, torch_base, ours, our_base


def test_ops_on_cpu_lanes_appear_by_name_in_torchs_trace_on_the_same_clock_and_threads(tmp_path, path):
    names, torch_events, torch_base, ours, our_base = _run_profiled(
        tmp_path, "cpu", [ProfilerActivity.CPU], **_all_threads())
    for name in names:
        (mine,) = [e for e in ours if e.get("ph") == "X" and e["name"] == name]
        theirs = [e for e in torch_events if e.get("ph") == "X" and e["name"] == name]
        assert len(theirs) == 1, f"{name} is not in torch's trace"
        (theirs_event,) = theirs
        assert (mine["pid"], mine["tid"]) == (theirs_event["pid"], theirs_event["tid"]), \
            "the same process and lane thread"
        mine_start, mine_end = _absolute(mine, our_base)
        their_start, their_end = _absolute(theirs_event, torch_base)
        # torch's range is taken inside the op, streamdag's around it: it lies within, on one clock
        assert mine_start - TOLERANCE_US <= their_start <= their_end <= mine_end + TOLERANCE_US, \
            (name, mine_start, mine_end, their_start, their_end)
        # and both hold the op's own matmul
        inner = [e for e in torch_events if e.get("ph") == "X" and e["name"].startswith("aten::mm")
                 and e["tid"] == theirs_event["tid"]
                 and their_start <= _absolute(e, torch_base)[0] <= their_end]
        assert inner, f"torch's trace has no aten::mm inside {name}"


def test_lane_tracks_are_named_after_streamdag_not_a_main_thread(tmp_path):
    x = torch.ones(8)
    with sd.Runtime("cpu", streams=2) as rt:
        with rt.profile() as prof:
            rt.submit(torch.add, x, 1.0, reads=[x], name="add").result()
        trace = prof.timeline.to_chrome_trace()
    import os

    (span,) = prof.timeline.spans
    assert span.pid == os.getpid() and span.tid not in (None, 0, os.getpid())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {f"streamdag cpu lane {span.stream} (compute)"}
    assert trace["baseTimeNanoseconds"] % (7_889_238 * 10**9) == 0


def test_without_a_torch_profiler_ops_run_without_a_record_function(monkeypatch):
    seen = []
    monkeypatch.setattr("streamdag.backends.cpu.run_named", lambda work: seen.append(work) or work())
    x = torch.ones(8)
    with sd.Runtime("cpu", streams=2) as rt:
        rt.submit(torch.add, x, 1.0, reads=[x]).result()
        with profile(activities=[ProfilerActivity.CPU]):
            rt.submit(torch.add, x, 2.0, reads=[x], name="profiled").result()
    ops = [work.__self__ for work in seen if isinstance(getattr(work, "__self__", None), Op)]
    assert [op.name for op in ops] == ["profiled"]


@pytest.mark.cuda
def test_device_ops_appear_by_name_around_their_kernels_in_torchs_trace(tmp_path, path):
    names, torch_events, torch_base, ours, our_base = _run_profiled(
        tmp_path, "cuda", [ProfilerActivity.CPU, ProfilerActivity.CUDA])
    kernels = [e for e in torch_events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    for name in names:
        (mine,) = [e for e in ours if e.get("ph") == "X" and e["name"] == name]
        assert mine["pid"] == 0, "a CUDA stream's ops lie in the process of its device ordinal"
        cpu_side = [e for e in torch_events if e.get("ph") == "X" and e["name"] == name
                    and e.get("cat") == "user_annotation"]
        assert len(cpu_side) == 1, f"{name} is not in torch's trace"
        # Kineto carries a user annotation over to the GPU, spanning the kernels launched inside it
        gpu_side = [e for e in torch_events if e.get("ph") == "X" and e["name"] == name
                    and e.get("cat") == "gpu_user_annotation"]
        assert len(gpu_side) == 1, f"no GPU range of {name}: its kernels are not correlated"
        start, end = _absolute(gpu_side[0], torch_base)
        inside = [k for k in kernels if (k["pid"], k["tid"]) == (gpu_side[0]["pid"], gpu_side[0]["tid"])
                  and start <= _absolute(k, torch_base)[0] <= end]
        assert inside, f"no kernel of {name} in its GPU range"
        kernel_start, kernel_end = _absolute(inside[0], torch_base)
        mine_start, mine_end = _absolute(mine, our_base)
        assert mine_start - TOLERANCE_US <= kernel_start <= kernel_end <= mine_end + TOLERANCE_US
