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


def test_merged_traces_keep_each_events_moment_and_track(tmp_path, path):
    names, torch_events, torch_base, ours, our_base = _run_profiled(
        tmp_path, "cpu", [ProfilerActivity.CPU], **_all_threads())
    merged = sd.merge_traces(tmp_path / "torch.json", tmp_path / "streamdag.json", out=tmp_path / "both.json")
    base = merged["baseTimeNanoseconds"]
    assert base == min(torch_base, our_base)
    assert json.loads((tmp_path / "both.json").read_text())["traceEvents"] == merged["traceEvents"]
    for name in names:
        (mine,) = [e for e in ours if e.get("ph") == "X" and e["name"] == name]
        (theirs,) = [e for e in torch_events if e.get("ph") == "X" and e["name"] == name]
        both = [e for e in merged["traceEvents"] if e.get("ph") == "X" and e["name"] == name]
        assert len(both) == 2 and len({(e["pid"], e["tid"]) for e in both}) == 1, "one track, both events"
        for original, original_base in ((mine, our_base), (theirs, torch_base)):
            (moved,) = [e for e in both if e.get("cat") == original.get("cat")]
            assert _absolute(moved, base)[0] == pytest.approx(_absolute(original, original_base)[0], abs=0.01)


def test_a_trace_without_a_clock_is_not_merged_with_one_that_has_it():
    with pytest.raises(ValueError, match="baseTimeNanoseconds"):
        sd.merge_traces({"traceEvents": [], "baseTimeNanoseconds": 5}, {"traceEvents": []})
    with pytest.raises(ValueError, match="not a Chrome trace"):
        sd.merge_traces(Path(__file__))


def test_a_merged_trace_draws_as_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from streamdag.observe.plot import trace_png

    trace = sd.merge_traces(
        {"baseTimeNanoseconds": 1_000_000, "traceEvents": [
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "streamdag cpu lane 0"}},
            {"ph": "X", "name": "op", "cat": "streamdag compute", "pid": 1, "tid": 2, "ts": 0.0,
             "dur": 50.0}]},
        {"baseTimeNanoseconds": 1_010_000, "traceEvents": [
            {"ph": "X", "name": "aten::mm", "cat": "cpu_op", "pid": 1, "tid": 2, "ts": 0.0, "dur": 30.0}]})
    (inner,) = [e for e in trace["traceEvents"] if e.get("name") == "aten::mm"]
    assert inner["ts"] == 10.0, "the later base's times move by the bases' difference"
    png = trace_png(trace, tmp_path / "merged.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _stream_trace(base: int, events: list[tuple[str, str, int, int]]) -> dict[str, Any]:
    return {"baseTimeNanoseconds": base, "traceEvents": [
        {"ph": "X", "name": name, "cat": cat, "pid": 0, "tid": tid, "ts": float(ts), "dur": 5.0}
        for name, cat, tid, ts in events]}


def test_merging_moves_each_streamdag_stream_row_onto_the_kineto_stream_its_ops_ran_on():
    ours = _stream_trace(1_000, [("a", "streamdag compute", 0xAA00, 0),
                                 ("b", "streamdag compute", 0xAA00, 10),
                                 ("c", "streamdag compute", 0xBB00, 0)])
    ours["traceEvents"].append({"ph": "M", "name": "thread_name", "pid": 0, "tid": 0xAA00,
                                "args": {"name": "streamdag cuda:0 stream 0 (compute)"}})
    kineto = _stream_trace(1_000, [("a", "gpu_user_annotation", 13, 1), ("b", "gpu_user_annotation", 13, 11),
                                   ("c", "gpu_user_annotation", 14, 1), ("k", "kernel", 13, 2)])
    merged = sd.merge_traces(kineto, ours)
    rows = {(e["name"], e["cat"]): e["tid"] for e in merged["traceEvents"] if e.get("ph") == "X"}
    assert rows[("a", "streamdag compute")] == rows[("b", "streamdag compute")] == 13
    assert rows[("c", "streamdag compute")] == 14
    from streamdag.observe.merge import track_names

    assert track_names(merged)[(0, 13)] == "streamdag cuda:0 stream 0 (compute)"
    assert ours["traceEvents"][0]["tid"] == 0xAA00, "the traces passed in are left as they were"


def test_a_stream_row_whose_ops_lie_on_two_kineto_rows_stays_where_it_is():
    ours = _stream_trace(1_000, [("a", "streamdag compute", 0xAA00, 0),
                                 ("b", "streamdag compute", 0xAA00, 10),
                                 ("c", "streamdag compute", 0xBB00, 20)])
    kineto = _stream_trace(1_000, [("a", "gpu_user_annotation", 13, 1), ("b", "gpu_user_annotation", 14, 11),
                                   ("c", "gpu_user_annotation", 14, 21)])
    rows = {(e["name"], e["cat"]): e["tid"] for e in sd.merge_traces(kineto, ours)["traceEvents"]}
    assert rows[("a", "streamdag compute")] == rows[("b", "streamdag compute")] == 0xAA00
    assert rows[("c", "streamdag compute")] == 14


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
    merged = sd.merge_traces(tmp_path / "torch.json", tmp_path / "streamdag.json")
    for name in names:
        (mine,) = [e for e in merged["traceEvents"] if e.get("ph") == "X" and e["name"] == name
                   and str(e.get("cat")).startswith("streamdag")]
        (gpu_side,) = [e for e in merged["traceEvents"] if e.get("ph") == "X" and e["name"] == name
                       and e.get("cat") == "gpu_user_annotation"]
        assert (mine["pid"], mine["tid"]) == (gpu_side["pid"], gpu_side["tid"]), \
            f"{name}: merged, the op lies on the row of the stream its kernels ran on"
