"""What tiny ops sharing a completion event saves the host per op: one runtime against another whose
every op records its own event (``CudaBackend.shared_event_bytes = 0``), in one process.

The lent host's speed drifts by tens of percent within seconds, and two processes of the same code
can differ by half a microsecond per op (``bench/ab_submit.py``'s A/A runs): here both runtimes live
in one process and take turns in short rounds whose order alternates, each round also timing
PyTorch's own launches, and the difference is paired by round. Workloads: the dependent chain of
``bench/overhead.py`` (tiny ``torch.add`` ops, each reading what the one before wrote), independent
tiny ops, and the tiny wide graph of anchors.md submitted op by op (host ms per graph, its 129 ops).
Reported: the median per-round difference (shared minus own) with a bootstrap interval.

Run on a GPU machine: PYTHONPATH=src python bench/shared_events.py
(writes bench/results/shared_events_<gpu>.json)
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag.backends.cuda import CudaBackend
from streamdag.suite.gpu_wide import submit_wide, wide_tensors
from streamdag.suite.report import format_table, write_json

OPS_PER_ROUND, ROUNDS, GRAPHS_PER_ROUND, BOOTSTRAP = 500, 150, 4, 2000


def runtime(shared: bool) -> sd.Runtime:
    """A runtime as ``bench/overhead.py`` makes it; ``shared=False``: every op records its own event."""
    saved = CudaBackend.shared_event_bytes
    CudaBackend.shared_event_bytes = saved if shared else 0
    try:
        return sd.Runtime("cuda", streams=8, max_inflight=100000)
    finally:
        CudaBackend.shared_event_bytes = saved


def main() -> None:
    bufs = [torch.zeros(256, device="cuda") for _ in range(64)]
    x, W, hs, y = wide_tensors("tiny")

    def torch_chain(n):
        for i in range(n):
            torch.add(bufs[i % 64], 1, out=bufs[(i + 1) % 64])

    def chain(rt, n):
        for i in range(n):
            a, b = bufs[i % 64], bufs[(i + 1) % 64]
            rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])

    def independent(rt, n):
        for i in range(n):
            b = bufs[i % 64]
            rt.submit(b.add_, 1, writes=[b])

    def wide(rt, n):
        for _ in range(n):
            submit_wide(rt, x, W, hs, y)

    runtimes = {"shared": runtime(True), "own": runtime(False)}
    workloads = {"chain": (chain, OPS_PER_ROUND), "independent": (independent, OPS_PER_ROUND),
                 "wide tiny graph": (wide, GRAPHS_PER_ROUND)}
    rounds: dict[str, list[float]] = {"PyTorch launch": []}
    for w in workloads:
        for label in runtimes:
            rounds[f"{w}, {label}"] = []
    for rt in runtimes.values():  # warm up: caches, event pools
        for fn, n in workloads.values():
            fn(rt, n)
        rt.synchronize()
    order = [("PyTorch launch", None, None, OPS_PER_ROUND)] + [
        (f"{w}, {label}", fn, rt, n) for w, (fn, n) in workloads.items() for label, rt in runtimes.items()]
    for _ in range(ROUNDS):
        order.reverse()  # no variant always follows the same one
        for label, fn, rt, n in order:
            t0 = time.perf_counter()
            if rt is None:
                torch_chain(n)
            else:
                fn(rt, n)
            rounds[label].append((time.perf_counter() - t0) / n * 1e6)
            if rt is not None:
                rt.synchronize()
            torch.cuda.synchronize()
    for rt in runtimes.values():
        rt.close()

    rng = random.Random(0)
    rows, summary = [], {}
    for w in workloads:
        own, shared = rounds[f"{w}, own"], rounds[f"{w}, shared"]
        diffs = [s - o for s, o in zip(shared, own)]
        boot = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(BOOTSTRAP))
        lo, hi = boot[int(0.025 * BOOTSTRAP)], boot[int(0.975 * BOOTSTRAP) - 1]
        unit = "µs per graph" if w.startswith("wide") else "µs per op"
        summary[w] = {"own_us": statistics.median(own), "shared_us": statistics.median(shared),
                      "shared_minus_own_us": statistics.median(diffs), "interval_95_us": [lo, hi],
                      "unit": unit}
        rows.append([w, unit, f"{statistics.median(own):.2f}", f"{statistics.median(shared):.2f}",
                     f"{statistics.median(diffs):+.2f}", f"{lo:+.2f} / {hi:+.2f}"])
    print(f"PyTorch launch: {statistics.median(rounds['PyTorch launch']):.2f} µs per op (median round)")
    print(format_table(["workload", "unit", "each op its own event", "tiny ops share", "shared - own, paired",
                        "95% interval"], rows))
    print(write_json(Path(__file__).parent / "results",
                     "shared_events_" + torch.cuda.get_device_name().replace(" ", "_"),
                     {"settings": {"ops_per_round": OPS_PER_ROUND, "graphs_per_round": GRAPHS_PER_ROUND,
                                   "rounds": ROUNDS, "streams": 8,
                                   "shared_event_bytes": CudaBackend.shared_event_bytes},
                      "torch_launch_us": statistics.median(rounds["PyTorch launch"]),
                      "summary": summary, "rounds_us": rounds}))


if __name__ == "__main__":
    main()
