"""Timelines: summary arithmetic, the Chrome trace's structure, the PNG, profiling a runtime."""

import json
import sys

import numpy as np
import pytest

import streamdag as sd
from streamdag import Span, Timeline


def hand_timeline():
    r"""
    s0: a [0,2]  c [3,5]         a -> c (same stream), b -> c (cross-stream)
    s1: b [1,2.5]
    s2 (h2d): copy [0.5,1.5]
    """
    return Timeline([
        Span(1, "a", "cpu", 0, "compute", 0.0, 2.0),
        Span(2, "b", "cpu", 1, "compute", 1.0, 2.5),
        Span(3, "copy", "cpu", 2, "h2d", 0.5, 1.5),
        Span(4, "c", "cpu", 0, "compute", 3.0, 5.0, deps=(1, 2)),
    ])


def test_summary_arithmetic():
    s = hand_timeline().summary()
    assert s.makespan_ms == 5.0
    assert s.busy_ms == 2.0 + 1.5 + 1.0 + 2.0
    assert s.concurrency == pytest.approx(6.5 / 5.0)
    assert s.critical_path == ("a", "c") and s.critical_path_ms == 4.0
    assert s.copy_compute_overlap_ms == pytest.approx(1.0)  # copy [0.5,1.5] under a and b
    assert s.idle_ms_per_stream["cpu/s0"] == 1.0
    assert "makespan" in str(s)


def check_trace(trace):
    """Required fields, proper nesting per track, and flows with both ends on slices."""
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert slices
    for e in slices:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert e["dur"] >= 0
    names = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    tracks: dict = {}
    for e in slices:
        assert (e["pid"], e["tid"]) in names, "every track is named"
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for spans in tracks.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in spans:
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1] + 1e-6, "slices on one track nest or follow"
            stack.append(end)
    flows = [e for e in events if e["ph"] in ("s", "f")]
    ids = {}
    for f in flows:
        ids.setdefault(f["id"], []).append(f["ph"])
        on = [e for e in tracks.get((f["pid"], f["tid"]), []) if e["ts"] <= f["ts"] <= e["ts"] + e["dur"]]
        assert on, f"flow {f['id']} end lies on no slice"
    assert all(sorted(v) == ["f", "s"] for v in ids.values())
    return slices, flows


def test_chrome_trace_is_well_formed():
    trace = json.loads(json.dumps(hand_timeline().to_chrome_trace()))
    slices, flows = check_trace(trace)
    assert len(slices) == 4
    assert len(flows) == 2  # only b -> c crosses streams


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_profiling_a_runtime_gives_a_timeline_of_every_op(device, tmp_path):
    x = np.random.default_rng(0).random((64, 64))
    outs = [np.empty_like(x) for _ in range(4)]
    total = np.empty_like(x)
    with sd.Runtime(device, streams=2) as rt:
        with rt.record() as g:
            for i, o in enumerate(outs):
                rt.submit(np.matmul, x, x, out=o, reads=[x], writes=[o], name=f"mm{i}")
            rt.submit(lambda: np.add.reduce(outs, out=total), reads=outs, writes=[total], name="join")
        with rt.profile() as prof:
            g.run().result()
            rt.submit(np.sum, total, reads=[total], name="after")
    tl = prof.timeline
    assert sorted(s.name for s in tl.spans) == ["after", "join", "mm0", "mm1", "mm2", "mm3"]
    assert all(s.end >= s.start >= 0 for s in tl.spans)
    by_name = {s.name: s for s in tl.spans}
    assert by_name["join"].start >= max(by_name[f"mm{i}"].end for i in range(4)) - 1e-6
    summary = tl.summary()
    assert summary.critical_path[-2:] == ("join", "after")
    check_trace(tl.to_chrome_trace())
    path = tl.save_png(tmp_path / "timeline.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    trace_path = tl.save_trace(tmp_path / "trace.json")
    assert json.loads(trace_path.read_text())["traceEvents"]


def test_profiling_twice_at_once_is_refused():
    with (
        sd.Runtime("cpu", streams=1) as rt,
        rt.profile(),
        pytest.raises(RuntimeError, match="already"),
        rt.profile(),
    ):
        pass


def test_cli_bench_and_doctor_run_on_the_cpu(tmp_path, capsys):
    from streamdag.cli import main

    assert main(["bench", "--quick", "--cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cpu_wide" in out and "makespan" in out
    for name in ("sched_scale.json", "cpu_wide.json", "trace.json", "timeline.png"):
        assert (tmp_path / name).stat().st_size > 0
    check_trace(json.loads((tmp_path / "trace.json").read_text()))
    assert main(["doctor"]) == 0
    assert "numpy" in capsys.readouterr().out


def test_cli_bench_without_matplotlib_keeps_its_results_and_says_how_to_get_the_png(
        tmp_path, capsys, monkeypatch):
    from streamdag.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    assert main(["bench", "--quick", "--cpu", "--out", str(tmp_path)]) == 0
    assert "pip install 'streamdag[plot]'" in capsys.readouterr().out
    for name in ("sched_scale.json", "cpu_wide.json", "trace.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert not (tmp_path / "timeline.png").exists()


def test_a_flow_starts_inside_its_slice_whatever_the_rounding_of_times():
    """Start and duration are rounded to the nanosecond apart: a flow placed at the exact end, rounded
    on its own, could fall past the slice as written, where a viewer binds it to no slice."""
    rng = np.random.default_rng(0)
    spans, free = [], [0.0, 0.0]  # two lanes, one op after another on each
    for seq in range(400):
        lane = seq % 2
        start = free[lane] + float(rng.uniform(0, 1e-3))
        end = start + float(rng.choice([0.0, 1e-6, 1.5e-6, rng.uniform(0, 0.01)]))
        free[lane] = end
        spans.append(Span(seq, f"op{seq}", "cpu", lane, "compute", start, end,
                          deps=(seq - 1,) if seq else ()))
    check_trace(Timeline(spans, origin_ns=1_700_000_000_123_456_789).to_chrome_trace())
