"""How long waiting takes once a tiny op is done: streamdag's futures against torch.cuda.synchronize.

Each sample launches one tiny op (a 16-float add, a few µs on the GPU) and
times only the wait that follows: PyTorch's ``torch.cuda.synchronize()``, a
streamdag future's ``result()``, ``rt.synchronize()``, and the result of a
recorded graph's ``g.run()`` (a captured CUDA graph). A second group waits
after a burst of 64 submits (each compared with PyTorch's synchronize after
64 adds): ``result()`` of the last, ``concurrent.futures.wait`` for the last
and for all 64, and ``await``, which wait in other ways than ``result()``.
The variants are timed in turns, sample after sample and in a shuffled
order, so that the machine's drift (and each variant's after-effects) hit
them alike.

Run on a GPU machine: PYTHONPATH=src python bench/latency.py
"""

import asyncio
import concurrent.futures
import random
import statistics
import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag.suite.report import format_table, write_json

SAMPLES = 500
BURST = 64  # ops submitted before the wait, in the second group (the last one's wait is timed)


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

    def burst(n=BURST):
        for _ in range(n - 1):
            rt.submit(torch.add, x, 1, out=x, reads=[x], writes=[x])
        return rt.submit(torch.add, x, 1, out=x, reads=[x], writes=[x])

    def torch_sync_burst():
        for _ in range(BURST):
            torch.add(x, 1, out=x)
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def result_burst():
        f = burst()
        t0 = time.perf_counter()
        f.result()
        return time.perf_counter() - t0

    def wait_burst():
        f = burst()
        t0 = time.perf_counter()
        concurrent.futures.wait([f])
        return time.perf_counter() - t0

    def wait_all_burst():
        futures = [rt.submit(torch.add, x, 1, out=x, reads=[x], writes=[x]) for _ in range(BURST)]
        t0 = time.perf_counter()
        concurrent.futures.wait(futures)
        return time.perf_counter() - t0

    def await_burst():
        f = burst()

        async def waiting():
            t0 = time.perf_counter()
            await f
            return time.perf_counter() - t0

        return asyncio.run(waiting())

    variants = {
        "PyTorch: torch.cuda.synchronize()": torch_sync,
        "streamdag: future.result()": future_result,
        "streamdag: rt.synchronize()": runtime_sync,
        "streamdag: g.run().result(), captured graph": graph_result,
        f"PyTorch: {BURST} ops, torch.cuda.synchronize()": torch_sync_burst,
        f"streamdag: {BURST} ops, result() of the last": result_burst,
        f"streamdag: {BURST} ops, concurrent.futures.wait([last])": wait_burst,
        f"streamdag: {BURST} ops, concurrent.futures.wait(all)": wait_all_burst,
        f"streamdag: {BURST} ops, await last (asyncio)": await_burst,
    }
    samples: dict[str, list[float]] = {label: [] for label in variants}
    for fn in variants.values():  # warm up, and let the graph be captured
        for _ in range(20):
            fn()
    order = list(variants.items())
    shuffle = random.Random(0).shuffle
    for _ in range(SAMPLES):
        shuffle(order)  # a fixed order let one variant's after-effects fall on the same next one
        for label, fn in order:
            samples[label].append(fn() * 1e6)
    rt.close()
    base = statistics.median(samples["PyTorch: torch.cuda.synchronize()"])
    base_burst = statistics.median(samples[f"PyTorch: {BURST} ops, torch.cuda.synchronize()"])
    rows = []
    for label, us in samples.items():
        us = sorted(us)
        median = statistics.median(us)
        vs = base_burst if f"{BURST} ops" in label else base
        rows.append([label, median, us[int(0.9 * len(us))], f"{median / vs:.2f}x"])
    print(format_table(["wait after a tiny op", "µs median", "µs p90", "vs PyTorch"], rows))
    print(write_json(Path(__file__).parent / "results",
                     "latency_" + torch.cuda.get_device_name().replace(" ", "_"),
                     {"settings": {"samples": SAMPLES, "streams": 4, "op": "torch.add of 16 floats",
                                   "burst": BURST},
                      "median_us": {r[0]: r[1] for r in rows},
                      "p90_us": {r[0]: r[2] for r in rows}}))


if __name__ == "__main__":
    main()
