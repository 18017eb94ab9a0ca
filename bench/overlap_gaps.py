"""Where ``rt.stream_map`` loses time against the copy/compute bound: traced, copy by copy.

The case of ``bench/overlap.py`` (8 chunks of 64 MiB in, 6 x (matmul + tanh), out), through
``stream_map`` in pieces of 8, 16 or 32 MiB, each setting run 3 times under ``torch.profiler``
with CUDA activity alone (CUPTI: copies, kernels and CUDA runtime calls; recording CPU ops would
slow the host, and the host is what is looked at). Per run: the *lead* (the call to the device's
first work), the device's span, the *lag* (its last work to the results in hand); per copy
direction, its busy time and rate, and its idle gaps between copies: *host-late* where the copy's
launch (its runtime call) ended after the previous copy of that direction had finished, else
waiting on the device (a dependency, or the link shared with the other direction); the head
(first copy in starts -> first copy out starts) and the tail (last copy in ends -> last copy out
ends). Medians over the 3 runs.

Run on a GPU machine: PYTHONPATH=src python bench/overlap_gaps.py (prints; writes
bench/results/overlap_gaps_<gpu>.json)
"""

from __future__ import annotations

import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag.suite.report import format_table, write_json

CHUNKS, CHUNK_FLOATS, STEPS = 8, 16 << 20, 6


def trace(run, runs: int = 3) -> tuple[list[list[dict]], list[float], list[tuple[float, float]]]:
    """``runs`` runs of ``run`` (after warm-up), traced with CUDA activity alone (CUPTI: the copies,
    kernels and runtime calls; no CPU-op recording, which slows the host): each run's events, its
    wall ms, and its window in the trace (the device synchronizations around it)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    syncs = sorted((e for e in events if e.get("name") == "cudaDeviceSynchronize"), key=lambda e: e["ts"])
    # a run spans from the end of the sync before it to the start of the one after (the host had its
    # results then): the windows between two syncs that hold device work (the profiler syncs too)
    busy = [e["ts"] for e in events if e.get("cat") in ("gpu_memcpy", "kernel")]
    windows = [(a["ts"] + a["dur"], b["ts"]) for a, b in itertools.pairwise(syncs)
               if any(a["ts"] + a["dur"] <= t < b["ts"] for t in busy)]
    if len(windows) != runs:
        raise RuntimeError(f"expected {runs} runs between device synchronizations, found {len(windows)}")
    per_run = [[e for e in events if e.get("ph") == "X" and lo <= e["ts"] < hi] for lo, hi in windows]
    return per_run, walls, windows


def analyse(events: list[dict], window: tuple[float, float]) -> dict:
    """One run: each copy direction's gaps (host-late or waiting on the device), head, tail, rates (ms)."""
    launches = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e["ts"] + e.get("dur", 0)
    copies: dict[str, list[dict]] = {"HtoD": [], "DtoH": []}
    kernels = []
    for e in events:
        if e.get("cat") == "gpu_memcpy":
            kind = "HtoD" if "HtoD" in e["name"] else "DtoH" if "DtoH" in e["name"] else None
            if kind:
                copies[kind].append(e)
        elif e.get("cat") == "kernel":
            kernels.append(e)
    everything = copies["HtoD"] + copies["DtoH"] + kernels
    first = min(e["ts"] for e in everything)
    last = max(e["ts"] + e["dur"] for e in everything)
    out: dict = {"span_ms": (last - first) / 1e3,
                 "lead_ms": (first - window[0]) / 1e3,  # from the call to the device's first work
                 "lag_ms": (window[1] - last) / 1e3}  # from the device's last work to the results in hand
    for kind, cs in copies.items():
        cs.sort(key=lambda e: e["ts"])
        busy = sum(e["dur"] for e in cs)
        host_late = device_wait = 0.0
        for prev, cur in itertools.pairwise(cs):
            gap = cur["ts"] - (prev["ts"] + prev["dur"])
            if gap <= 0:
                continue
            launched = launches.get(cur["args"].get("correlation"), cur["ts"])
            late = min(gap, max(0.0, launched - (prev["ts"] + prev["dur"])))
            host_late += late
            device_wait += gap - late
        nbytes = sum(e["args"].get("bytes", 0) for e in cs)
        out[kind] = {"copies": len(cs), "busy_ms": busy / 1e3, "gaps_host_late_ms": host_late / 1e3,
                     "gaps_device_wait_ms": device_wait / 1e3,
                     "gb_per_s_while_busy": nbytes / busy / 1e3 if busy else 0.0,
                     "starts_ms": (cs[0]["ts"] - first) / 1e3,
                     "ends_ms": (cs[-1]["ts"] + cs[-1]["dur"] - first) / 1e3}
    out["compute_busy_ms"] = sum(e["dur"] for e in kernels) / 1e3
    return out


def main() -> None:
    dev = torch.device("cuda")
    host_in = [torch.randn(CHUNK_FLOATS).pin_memory() for _ in range(CHUNKS)]
    host_out = [torch.empty(CHUNK_FLOATS).pin_memory() for _ in range(CHUNKS)]
    w = (torch.randn(1024, 1024, device=dev) / 32).bfloat16()

    def rows_fn(x):
        x = x.bfloat16()
        for _ in range(STEPS):
            x = torch.tanh(x @ w)
        return x

    rt = sd.Runtime("cuda", streams=1)
    matrices_in = [h.view(16, 1024, 1024) for h in host_in]
    matrices_out = [h.view(16, 1024, 1024) for h in host_out]

    def stream_map_of(mib, capture, buffers=4):
        def run():
            futures = rt.stream_map(rows_fn, matrices_in, matrices_out, piece_bytes=mib << 20,
                                    capture=capture, buffers=buffers)
            for f in futures:
                f.result()
        return run

    variants = {}
    for mib, capture, buffers in ((16, True, 4), (8, True, 4), (16, True, 8), (32, False, 4)):
        label = f"stream_map {mib} MiB{' captured' if capture else ''}, {buffers} buffers"
        variants[label] = stream_map_of(mib, capture, buffers)
    results = {}
    rows = []
    for label, run in variants.items():
        per_run, walls, windows = trace(run)
        runs = [analyse(events, window) for events, window in zip(per_run, windows)]
        results[label] = {"walls_ms": walls, "runs": runs}

        def med(get, runs=runs):
            return statistics.median(get(r) for r in runs)

        rows.append([label, statistics.median(walls), med(lambda r: r["lead_ms"]),
                     med(lambda r: r["span_ms"]), med(lambda r: r["lag_ms"]),
                     med(lambda r: r["HtoD"]["busy_ms"]),
                     med(lambda r: r["HtoD"]["gaps_host_late_ms"]),
                     med(lambda r: r["HtoD"]["gaps_device_wait_ms"]),
                     med(lambda r: r["DtoH"]["busy_ms"]), med(lambda r: r["DtoH"]["gaps_host_late_ms"]),
                     med(lambda r: r["DtoH"]["gaps_device_wait_ms"]), med(lambda r: r["DtoH"]["starts_ms"]),
                     med(lambda r: r["DtoH"]["ends_ms"] - r["HtoD"]["ends_ms"])])
    print(format_table(["variant (median of 3 traced runs)", "wall ms", "lead", "GPU span", "lag", "in busy",
                        "in gaps host-late", "in gaps device", "out busy", "out gaps host-late",
                        "out gaps device", "head", "tail"], rows))
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    print(write_json(Path(__file__).parent / "results", f"overlap_gaps_{gpu}",
                     {"settings": {"chunks": CHUNKS, "chunk_mib": CHUNK_FLOATS * 4 >> 20, "steps": STEPS,
                                   "traced_runs": 3, "activities": "CUDA"},
                      "variants": results}))
    rt.close()


if __name__ == "__main__":
    main()
