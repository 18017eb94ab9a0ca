"""A recorded graph with a host function in it: tiny kernels, a host step, tiny kernels.

Each iteration: a chain of OPS tiny kernels on the GPU, a copy of its result into pinned memory,
a host function that reads it and writes a pinned input for the second half, copied in, and a
second chain of OPS tiny kernels. Variants, timed in turns (wall time per iteration, the host
waiting for the result at its end):

- PyTorch eager, one stream: the chain, the copy out, a synchronize, the host step, the rest;
- streamdag, eager submits: the host step with ``run_on="host"`` (its submit returns at once);
- streamdag, the same ops recorded once and run: the graph runs in parts, the device ops before and
  after the host step replayed as CUDA graphs, the host step on a host lane between them.

Run on a GPU machine: PYTHONPATH=src python bench/recorded_host_op.py
(writes bench/results/recorded_host_op_<gpu>.json)
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

import streamdag as sd
from streamdag.suite.cuda_timing import interleaved_rounds_ms
from streamdag.suite.report import format_table, write_json

OPS, N, ROUNDS = 64, 4096, 30


def main() -> None:
    a, b = torch.zeros(N, device="cuda"), torch.zeros(N, device="cuda")
    out_host, in_host = torch.zeros(N, pin_memory=True), torch.zeros(N, pin_memory=True)
    result = torch.zeros(1, pin_memory=True)

    def host_step() -> None:
        in_host.copy_(out_host * 0.5 + 1)

    def torch_eager() -> float:
        a.fill_(1)
        for _ in range(OPS):
            a.mul_(1.0001).add_(0.001)
        out_host.copy_(a, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        host_step()
        b.copy_(in_host, non_blocking=True)
        for _ in range(OPS):
            b.mul_(1.0001).add_(0.001)
        result.copy_(b.sum(0, keepdim=True), non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return float(result[0])

    def submit_all(rt: sd.Runtime) -> sd.Future:
        rt.submit(a.fill_, 1, writes=[a])
        for _ in range(OPS):
            rt.submit(lambda: a.mul_(1.0001).add_(0.001), writes=[a])
        rt.copy(out_host, a)
        rt.submit(host_step, reads=[out_host], writes=[in_host], run_on="host")
        rt.copy(b, in_host)
        for _ in range(OPS):
            rt.submit(lambda: b.mul_(1.0001).add_(0.001), writes=[b])
        return rt.submit(lambda: result.copy_(b.sum(0, keepdim=True), non_blocking=True), reads=[b],
                         writes=[result])

    rt = sd.Runtime("cuda", streams=2)

    def eager_submits() -> float:
        submit_all(rt).result()
        return float(result[0])

    with rt.record() as graph:
        submit_all(rt)

    def recorded() -> float:
        graph.run().result()
        return float(result[0])

    variants = {"PyTorch eager, one stream": torch_eager, "streamdag, eager submits": eager_submits,
                "streamdag, recorded graph (device parts replayed)": recorded}
    expected = torch_eager()
    for label, fn in variants.items():  # warm up (the graph captures its parts on its second run)
        for _ in range(3):
            got = fn()
            assert abs(got - expected) <= 1e-4 * abs(expected), (label, got, expected)
    rounds = interleaved_rounds_ms(variants, ROUNDS, warmup=0)
    captured = graph.last_run_captured
    rt.close()
    ms = {label: statistics.median(ts) for label, ts in rounds.items()}
    base = ms["PyTorch eager, one stream"]
    print(format_table(["variant", "ms per iteration (median)", "speedup vs PyTorch eager"],
                       [[label, f"{v:.3f}", f"{base / v:.2f}x"] for label, v in ms.items()]))
    print(f"device parts replayed as CUDA graphs in the last run: {captured}")
    gpu = torch.cuda.get_device_name()
    print(write_json(Path(__file__).parent / "results", "recorded_host_op_" + gpu.replace(" ", "_"),
                     {"settings": {"ops_per_chain": OPS, "elements": N, "rounds": ROUNDS},
                      "ms": ms, "rounds_ms": rounds, "parts_captured": captured}))


if __name__ == "__main__":
    main()
