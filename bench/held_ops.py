"""What an op held behind a host-lane op costs the host, against a plain submit and PyTorch's launch.

A device op that follows an unfinished host-lane op is held: its submit links
it and returns, and the launcher thread launches it once the host op has
finished. Per op, in alternating rounds of OPS ops (each op a lambda of two
tiny kernels on one tensor, a dependent chain):

- PyTorch launch: the lambda called directly;
- streamdag submit: a plain submit (launched inside it);
- held submit: the same submits while a gated host-lane op that they follow is
  pending (the submits alone, the gate still closed);
- held release: from opening the gate to the last held op finished, per op
  (the launcher's launch of each, and the finish).

Then the timeline of one iteration of the eager variant of
``bench/recorded_host_op.py`` (64 ops, a copy out, a host step, a copy in, 64
ops), the median over iterations of each moment, in ms since its first submit.

Run on a GPU machine: PYTHONPATH=src python bench/held_ops.py
(writes bench/results/held_ops_<gpu>.json)
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag.suite.report import format_table, write_json

OPS, ROUNDS, N = 130, 30, 4096
ITERATIONS, WARMUP = 40, 5


def per_op_costs(a: torch.Tensor) -> dict[str, list[float]]:
    """µs per op of each variant, one value per round."""
    rt = sd.Runtime("cuda", streams=2)

    def torch_launches() -> None:
        for _ in range(OPS):
            (lambda: a.mul_(1.0001).add_(0.001))()

    def submits() -> None:
        for _ in range(OPS):
            rt.submit(lambda: a.mul_(1.0001).add_(0.001), writes=[a])

    costs: dict[str, list[float]] = {k: [] for k in ("PyTorch launch", "streamdag submit", "held submit",
                                                     "held release")}
    pair = [("PyTorch launch", torch_launches), ("streamdag submit", submits)]
    for r in range(ROUNDS):
        for label, fn in pair if r % 2 == 0 else pair[::-1]:
            torch.cuda.synchronize()
            rt.synchronize()
            start = time.perf_counter()
            fn()
            costs[label].append((time.perf_counter() - start) / OPS * 1e6)
        torch.cuda.synchronize()
        rt.synchronize()
        gate = threading.Event()
        rt.submit(gate.wait, writes=[a], run_on="host")
        start = time.perf_counter()
        submits()
        submitted = time.perf_counter()
        last = rt.submit(lambda: a.add_(0), writes=[a])
        gate.set()
        last.result()
        costs["held submit"].append((submitted - start) / OPS * 1e6)
        costs["held release"].append((time.perf_counter() - submitted) / OPS * 1e6)
    rt.close()
    return costs


def eager_timeline() -> dict[str, float]:
    """The moments of one eager iteration of recorded_host_op.py, median ms since its first submit."""
    half = 64
    a, b = torch.zeros(N, device="cuda"), torch.zeros(N, device="cuda")
    out_host, in_host = torch.zeros(N, pin_memory=True), torch.zeros(N, pin_memory=True)
    result = torch.zeros(1, pin_memory=True)
    moments: dict[str, float] = {}
    clock = time.perf_counter

    def host_step() -> None:
        moments["host step starts"] = clock()
        in_host.copy_(out_host * 0.5 + 1)
        moments["host step ends"] = clock()

    def second_half_op(i: int):
        def op() -> None:
            if i == 0:
                moments["first held op launched"] = clock()
            elif i == half - 1:
                moments["last held op launched"] = clock()
            b.mul_(1.0001).add_(0.001)
        return op

    rt = sd.Runtime("cuda", streams=2)
    rows = []
    for it in range(ITERATIONS):
        moments.clear()
        start = clock()
        rt.submit(a.fill_, 1, writes=[a])
        for _ in range(half):
            rt.submit(lambda: a.mul_(1.0001).add_(0.001), writes=[a])
        rt.copy(out_host, a)
        moments["first half submitted"] = clock()
        rt.submit(host_step, reads=[out_host], writes=[in_host], run_on="host")
        rt.copy(b, in_host)
        for i in range(half):
            rt.submit(second_half_op(i), writes=[b])
        last = rt.submit(lambda: result.copy_(b.sum(0, keepdim=True), non_blocking=True), reads=[b],
                         writes=[result])
        moments["all submitted"] = clock()
        last.result()
        moments["result returned"] = clock()
        if it >= WARMUP:
            rows.append({k: (v - start) * 1e3 for k, v in moments.items()})
    rt.close()
    order = ["first half submitted", "all submitted", "host step starts", "host step ends",
             "first held op launched", "last held op launched", "result returned"]
    return {k: statistics.median(r[k] for r in rows) for k in order}


def main() -> None:
    a = torch.zeros(N, device="cuda")
    costs = per_op_costs(a)
    us = {k: statistics.median(v) for k, v in costs.items()}
    launch = us["PyTorch launch"]
    print(format_table(["per op (a lambda of two tiny kernels)", "µs (median round)",
                        "added to PyTorch's launch"],
                       [[k, f"{v:.2f}", f"{v - launch:+.2f}"] for k, v in us.items()]))
    timeline = eager_timeline()
    print(format_table(["one eager iteration of recorded_host_op.py", "ms since its first submit (median)"],
                       [[k, f"{v:.3f}"] for k, v in timeline.items()]))
    gpu = torch.cuda.get_device_name()
    print(write_json(Path(__file__).parent / "results", "held_ops_" + gpu.replace(" ", "_"),
                     {"settings": {"ops_per_round": OPS, "rounds": ROUNDS, "elements": N,
                                   "timeline_iterations": ITERATIONS, "warmup": WARMUP},
                      "us_per_op": us, "rounds_us": costs, "eager_timeline_ms": timeline}))


if __name__ == "__main__":
    main()
