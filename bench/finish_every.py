"""How often the submitting thread should finish completed ops (``FINISH_EVERY``), on a GPU.

Finishing more often keeps fewer ops pending between passes, so fewer of
their objects live through a young collection of Python's cycle collector
and get promoted: in the tiny wide graph (129 ops between synchronizations)
those promotions bring full collections, each a stall of tens of ms with
torch loaded. Finishing less often batches the bookkeeping. The settings are
timed in turns, round after round (a machine's speed drifts): the tiny wide graph
submitted op by op (median ms per graph, with the cycle collector's passes
and time) and a chain of tiny ops (median µs per op). The last setting
repeats 32 with ``gc.freeze()`` around its rounds: what a user can add, since
a full collection then skips every object made before (torch's among them).

Run on a GPU machine: PYTHONPATH=src python bench/finish_every.py
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag.suite.gpu_wide import submit_wide, wide_tensors
from streamdag.suite.report import format_table, write_json

#: (FINISH_EVERY, whether gc.freeze() is on), each a label of the table
SETTINGS = ((64, False), (32, False), (16, False), (32, True))
ROUNDS = 7
GRAPHS_PER_ROUND = 60
CHAIN_OPS = 4000


class CollectorClock:
    """Collections of each generation and the time they took, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._t0


def main() -> None:
    x, W, hs, y = wide_tensors("tiny")
    bufs = [torch.zeros(256, device="cuda") for _ in range(64)]
    runtimes = {}
    for setting in SETTINGS:
        rt = sd.Runtime("cuda", streams=8, max_inflight=1024)
        rt._finish_every = setting[0]
        runtimes[setting] = rt
    clock = CollectorClock()
    graph_ms: dict[tuple, list[float]] = {e: [] for e in SETTINGS}
    chain_us: dict[tuple, list[float]] = {e: [] for e in SETTINGS}
    collections: dict[tuple, list[int]] = {e: [0, 0, 0] for e in SETTINGS}
    collector_s: dict[tuple, float] = {e: 0.0 for e in SETTINGS}

    def wide(rt):
        for _ in range(GRAPHS_PER_ROUND):
            t0 = time.perf_counter()
            submit_wide(rt, x, W, hs, y)
            torch.cuda.synchronize()
            yield (time.perf_counter() - t0) * 1e3

    def chain(rt, n):
        for i in range(n):
            a, b = bufs[i % 64], bufs[(i + 1) % 64]
            rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])

    for rt in runtimes.values():  # warm up
        list(wide(rt))
        chain(rt, 1000)
        rt.synchronize()
    for _ in range(ROUNDS):
        for every, rt in runtimes.items():
            if every[1]:
                gc.freeze()
            before, before_s = list(clock.count), clock.seconds
            graph_ms[every] += list(wide(rt))
            t0 = time.perf_counter()
            chain(rt, CHAIN_OPS)
            chain_us[every].append((time.perf_counter() - t0) / CHAIN_OPS * 1e6)
            rt.synchronize()
            collections[every] = [c + (a - b) for c, a, b in zip(collections[every], clock.count, before)]
            collector_s[every] += clock.seconds - before_s
            if every[1]:
                gc.unfreeze()
    for rt in runtimes.values():
        rt.close()
    rows_out = []
    for every in SETTINGS:
        rows_out.append([label(every), statistics.median(graph_ms[every]), statistics.mean(graph_ms[every]),
                         max(graph_ms[every]),
                         statistics.median(chain_us[every]),
                         "/".join(str(c) for c in collections[every]), collector_s[every] * 1e3])
    print(format_table(["FINISH_EVERY, gc.freeze()", "wide tiny ms (median)", "(mean)", "(max)",
                        "chain µs/op (median round)", "collections gen 0/1/2", "collector ms"], rows_out))
    print(write_json(Path(__file__).parent / "results",
                     "finish_every_" + torch.cuda.get_device_name().replace(" ", "_"),
                     {"settings": {"rounds": ROUNDS, "graphs_per_round": GRAPHS_PER_ROUND,
                                   "chain_ops": CHAIN_OPS, "streams": 8},
                      "graph_ms": {label(k): v for k, v in graph_ms.items()},
                      "chain_us": {label(k): v for k, v in chain_us.items()},
                      "collections": {label(k): v for k, v in collections.items()},
                      "collector_ms": {label(k): v * 1e3 for k, v in collector_s.items()}}))


def label(setting: tuple) -> str:
    return f"{setting[0]}{', gc.freeze()' if setting[1] else ''}"


if __name__ == "__main__":
    main()
