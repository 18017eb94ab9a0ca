"""Host cost per op that streamdag adds on top of PyTorch's own launch (goal: at most 5 µs).

Eager submits (each op's dependencies inferred and launched at once), and for
comparison the same chain recorded once and replayed as a captured CUDA graph.

Run on a GPU machine: PYTHONPATH=src python bench/overhead.py
"""

import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag.suite.report import format_table, write_json

GRAPH_OPS = 1000


def per_op_us(fn, n=5000):
    fn(200)
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn(n)
        best.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(best)[2]


def main():
    bufs = [torch.zeros(256, device="cuda") for _ in range(64)]

    def torch_loop(n):
        for i in range(n):
            torch.add(bufs[i % 64], 1, out=bufs[(i + 1) % 64])

    rows, result = [], {}
    t_torch = per_op_us(torch_loop)
    rows.append(["PyTorch launch, one stream", t_torch, 0.0])
    result["torch_us"] = t_torch
    with sd.Runtime("cuda", streams=8, max_inflight=100000) as rt:
        def chain(n):
            for i in range(n):
                a, b = bufs[i % 64], bufs[(i + 1) % 64]
                rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])

        def independent(n):
            for i in range(n):
                b = bufs[i % 64]
                rt.submit(b.add_, 1, writes=[b])

        for label, fn in (("streamdag submit, dependent chain", chain),
                          ("streamdag submit, independent ops", independent)):
            t = per_op_us(fn)
            rt.synchronize()
            rows.append([label, t, t - t_torch])
            result[label] = t
        # the same chain recorded once and run as a captured CUDA graph: host cost per op of g.run()
        with rt.record() as g:
            chain(GRAPH_OPS)
        g.run().result()

        def graph_runs(n):
            for _ in range(max(1, n // GRAPH_OPS)):
                g.run()

        label = f"streamdag recorded chain of {GRAPH_OPS}, g.run() per op"
        t = per_op_us(graph_runs)
        rt.synchronize()
        rows.append([label, t, t - t_torch])
        result[label] = t
    print(format_table(["per op (host)", "µs", "added over PyTorch µs"], rows))
    print(write_json(Path(__file__).parent / "results",
                     "overhead_" + torch.cuda.get_device_name().replace(" ", "_"), {"us": result}))


if __name__ == "__main__":
    main()
