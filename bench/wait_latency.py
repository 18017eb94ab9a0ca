"""How long ``future.result()`` takes past the op's end, against PyTorch's ``synchronize()``.

Each variant submits one piece of work and waits for it; PyTorch's baseline launches the same
work and calls ``torch.cuda.synchronize()`` (for the recorded stream_map: the same pipeline by
hand, captured whole). streamdag's waiter either spins on its op's event with the GIL released
(the torch extension's ``spin_wait``, the default) or polls as where the extension does not build
(``poll``: the completion queue's ``_spin_wait`` set to None). The two are timed in alternating
blocks of rounds in one process; each block starts with one untimed run.

Run on a GPU machine: PYTHONPATH=src python bench/wait_latency.py
(writes bench/results/wait_latency_<gpu>.json)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

import streamdag as sd
from copy_streams import captured, pieced_pipeline
from streamdag.suite.report import format_table, write_json

BLOCKS, ROUNDS = 16, 5
COPY_MIB = (2, 16, 256)
SLEEP_CYCLES = 8_000_000  # torch.cuda._sleep: a few ms of GPU time


def main() -> None:
    floats = 16 << 20
    host_in = [torch.randn(floats).pin_memory() for _ in range(8)]
    host_out = [torch.empty(floats).pin_memory() for _ in range(8)]
    w = (torch.randn(1024, 1024, device="cuda") / 32).bfloat16()

    def rows_fn(x):
        x = x.bfloat16()
        for _ in range(6):
            x = torch.tanh(x @ w)
        return x

    matrices_in = [h.view(16, 1024, 1024) for h in host_in]
    matrices_out = [h.view(16, 1024, 1024) for h in host_out]
    rt = sd.Runtime("cuda", streams=4)
    completions = rt.backend._completions
    spin = completions._spin_wait
    if spin is None:
        raise SystemExit("the torch extension did not load: nothing to compare")
    graphs = {}
    for mib in (16, 8):
        with rt.record() as graphs[mib]:
            rt.stream_map(rows_fn, matrices_in, matrices_out, piece_bytes=mib << 20)
        graphs[mib].run().result()

    def pieces(hosts, mib):
        return [p for h in hosts for p in h.view(-1).split(mib << 18)]

    by_hand = {mib: captured(pieced_pipeline(pieces(host_in, mib), pieces(host_out, mib),
                                             lambda p: rows_fn(p.view(-1, 1024, 1024))))
               for mib in (16, 8)}
    copies = {mib: (torch.randn(mib << 18).pin_memory(), torch.empty(mib << 18, device="cuda"))
              for mib in COPY_MIB}
    x = torch.zeros(256, device="cuda")

    def synced(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return run

    variants = {}
    for mib in (16, 8):
        variants[f"recorded stream_map, {mib} MiB pieces: g.run()"] = (
            lambda g=graphs[mib]: g.run().result(), by_hand[mib])
    for mib, (src, dev) in copies.items():
        variants[f"rt.copy, {mib} MiB pinned to device"] = (
            lambda s=src, d=dev: rt.copy(d, s).result(), lambda s=src, d=dev: d.copy_(s, non_blocking=True))
    variants["tiny op (x.add_(1))"] = (lambda: rt.submit(x.add_, 1, writes=[x]).result(), lambda: x.add_(1))
    variants["a few ms of GPU sleep"] = (lambda: rt.submit(torch.cuda._sleep, SLEEP_CYCLES).result(),
                                         lambda: torch.cuda._sleep(SLEEP_CYCLES))
    times = {label: {"spin": [], "poll": [], "torch": []} for label in variants}
    for block in range(BLOCKS):
        mode = "spin" if block % 2 == 0 else "poll"
        completions._spin_wait = spin if mode == "spin" else None
        for label, (ours, theirs) in variants.items():
            ours()
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                ours()
                times[label][mode].append((time.perf_counter() - t0) * 1e3)
                if mode == "spin":  # PyTorch's in the same rounds as the default
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    synced(theirs)()
                    times[label]["torch"].append((time.perf_counter() - t0) * 1e3)
    completions._spin_wait = spin
    rt.close()
    ms = {label: {mode: statistics.median(ts) for mode, ts in modes.items()}
          for label, modes in times.items()}
    rows = [[label, f"{m['torch']:.3f}", f"{m['spin']:.3f}", f"{m['poll']:.3f}",
             f"{m['spin'] / m['torch']:.3f}", f"{m['spin'] / m['poll']:.3f}"] for label, m in ms.items()]
    headers = ["submit one thing, wait for it", "PyTorch + synchronize() ms", "streamdag result() ms",
               "polling waiter ms", "x PyTorch", "x polling"]
    print(format_table(headers, rows))
    gpu = torch.cuda.get_device_name()
    print(write_json(Path(__file__).parent / "results", "wait_latency_" + gpu.replace(" ", "_"),
                     {"settings": {"blocks": BLOCKS, "rounds": ROUNDS, "copy_mib": COPY_MIB,
                                   "sleep_cycles": SLEEP_CYCLES, "timing": "alternating blocks"},
                      "ms": ms, "rounds_ms": times}))


if __name__ == "__main__":
    main()
