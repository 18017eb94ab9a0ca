"""How long waiting takes once a tiny op is done: streamdag's futures against torch.cuda.synchronize.

Each sample launches one tiny op (a 16-float add, a few µs on the GPU) and
times only the wait that follows: PyTorch's ``torch.cuda.synchronize()``, a
streamdag future's ``result()``, ``rt.synchronize()``, and the result of a
recorded graph's ``g.run()`` (a captured CUDA graph). The variants are timed
in turns, sample after sample, so that the lent host's drift hits them alike.

Run on a GPU machine: PYTHONPATH=src python bench/latency.py
"""

import statistics
import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag.suite.report import format_table, write_json

SAMPLES = 500


def main() -> None:
    x = torch.zeros(16, device="cuda")
    rt = sd.Runtime("cuda", streams=4)
    with rt.record() as g:
        rt.submit(torch.add, x, 1, out=x, reads=[x], writes=[x])

    def torch_sync():
        torch.add(x, 1, out=x)
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def future_result():
        f = rt.submit(torch.add, x, 1, out=x, reads=[x], writes=[x])
        t0 = time.perf_counter()
        f.result()
        return time.perf_counter() - t0

    def runtime_sync():
        rt.submit(torch.add, x, 1, out=x, reads=[x], writes=[x])
        t0 = time.perf_counter()
        rt.synchronize()
        return time.perf_counter() - t0

    def graph_result():
        run = g.run()
        t0 = time.perf_counter()
        run.result()
        return time.perf_counter() - t0

    variants = {
        "PyTorch: torch.cuda.synchronize()": torch_sync,
        "streamdag: future.result()": future_result,
        "streamdag: rt.synchronize()": runtime_sync,
        "streamdag: g.run().result(), captured graph": graph_result,
    }
    samples: dict[str, list[float]] = {label: [] for label in variants}
    for fn in variants.values():  # warm up, and let the graph be captured
        for _ in range(20):
            fn()
    for _ in range(SAMPLES):
        for label, fn in variants.items():
            samples[label].append(fn() * 1e6)
    rt.close()
    base = statistics.median(samples["PyTorch: torch.cuda.synchronize()"])
    rows = []
    for label, us in samples.items():
        us = sorted(us)
        median = statistics.median(us)
        rows.append([label, median, us[int(0.9 * len(us))], f"{median / base:.2f}x"])
    print(format_table(["wait after a tiny op", "µs median", "µs p90", "vs PyTorch"], rows))
    print(write_json(Path(__file__).parent / "results",
                     "latency_" + torch.cuda.get_device_name().replace(" ", "_"),
                     {"settings": {"samples": SAMPLES, "streams": 4, "op": "torch.add of 16 floats"},
                      "median_us": {r[0]: r[1] for r in rows},
                      "p90_us": {r[0]: r[2] for r in rows}}))


if __name__ == "__main__":
    main()
