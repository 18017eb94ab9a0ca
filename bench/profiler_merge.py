"""One timeline with PyTorch's profiler: a wide graph run under ``torch.profiler`` and
``rt.profile()`` at once, the two traces merged (``streamdag.merge_traces``) and drawn.

On the CPU the ops run on streamdag's lanes (PyTorch's profiler records every
thread); on a GPU on CUDA streams, and the merged trace also holds their
kernels. Writes ``bench/results/trace_merged_<device>.json`` (open it in
Perfetto: streamdag's op and the PyTorch ops and kernels it ran share one
clock and one row per lane or stream) and ``timeline_merged_<device>.png``,
and prints how many of streamdag's ops PyTorch's trace holds and how far
apart the two profilers place them.

    PYTHONPATH=src python bench/profiler_merge.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import streamdag as sd
from streamdag.observe.merge import complete_events
from streamdag.observe.plot import trace_png
from streamdag.suite.report import environment

RESULTS = Path(__file__).parent / "results"


def _matmul_relu(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.relu_(torch.matmul(x, w, out=out))


def wide_graph(rt: sd.Runtime, device: str, branches: int, layers: int, size: int) -> None:
    """``branches`` chains of ``layers`` matmul+relu from one input, joined by a sum."""
    x = torch.randn(size, size, device=device)
    weights = [[torch.randn(size, size, device=device) / size ** 0.5 for _ in range(layers)]
               for _ in range(branches)]
    acts = [[torch.empty(size, size, device=device) for _ in range(layers)] for _ in range(branches)]
    for b in range(branches):
        src = x
        for layer in range(layers):
            out, w = acts[b][layer], weights[b][layer]
            rt.submit(_matmul_relu, src, w, out, reads=[src, w], writes=[out], name=f"b{b}.l{layer}")
            src = out
    total = torch.zeros(size, size, device=device)
    ends = [acts[b][-1] for b in range(branches)]
    rt.submit(lambda t, *xs: t.copy_(torch.stack(xs).sum(0)), total, *ends, reads=ends, writes=[total],
              name="join").result()


def run(device: str, branches: int, layers: int, size: int) -> dict[str, Any]:
    from torch._C._profiler import _ExperimentalConfig

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with sd.Runtime(device, streams=min(branches, 4)) as rt, tempfile.TemporaryDirectory() as tmp:
        wide_graph(rt, device, branches, layers, size)  # warm up: the lanes, the kernels, the profiler
        with profile(activities=activities,
                     experimental_config=_ExperimentalConfig(profile_all_threads=True)) as torch_prof, \
                rt.profile() as prof:
            wide_graph(rt, device, branches, layers, size)
        torch_prof.export_chrome_trace(f"{tmp}/torch.json")
        prof.timeline.save_trace(f"{tmp}/streamdag.json")
        merged = sd.merge_traces(f"{tmp}/torch.json", f"{tmp}/streamdag.json")
    ours = [e for e in complete_events(merged) if str(e.get("cat", "")).startswith("streamdag")]
    theirs = {(e["name"], e["pid"], e["tid"]): e for e in complete_events(merged)
              if not str(e.get("cat", "")).startswith("streamdag")}
    found, offsets = 0, []
    for e in ours:
        twin = theirs.get((e["name"], e["pid"], e["tid"]))
        if twin is not None:
            found += 1
            offsets.append(abs(float(twin["ts"]) - float(e["ts"])))
    kernels = sum(1 for e in complete_events(merged) if e.get("cat") == "kernel")
    merged["otherData"] = {"environment": environment(), "device": device, "branches": branches,
                           "layers": layers, "size": size, "streamdag_ops": len(ours),
                           "ops_in_torch_trace": found, "kernels": kernels,
                           "max_start_offset_us": max(offsets, default=None)}
    return merged


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    merged = run(args.device, args.branches, args.layers, args.size)
    tag = "cpu" if args.device == "cpu" else torch.cuda.get_device_name().replace(" ", "_")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"trace_merged_{tag}.json").write_text(json.dumps(merged))
    info = merged["otherData"]
    png = trace_png(merged, out / f"timeline_merged_{tag}.png",
                    f"streamdag ops over PyTorch's ops{' and kernels' if info['kernels'] else ''}, "
                    f"one clock ({args.device})")
    print(f"{info['ops_in_torch_trace']} of {info['streamdag_ops']} streamdag ops found in PyTorch's "
          f"trace on their lane or stream; largest start offset {info['max_start_offset_us']} µs; "
          f"{info['kernels']} CUDA kernels")
    print(out / f"trace_merged_{tag}.json", png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
