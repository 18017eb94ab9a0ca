"""Where the host time of ``submit`` goes on a GPU runtime: cProfile of a chain of small ops.

Run on a GPU machine: PYTHONPATH=src python bench/profile_submit.py
"""

import cProfile
import pstats
import time

import torch

import streamdag as sd

bufs = [torch.zeros(256, device="cuda") for _ in range(64)]


def chain(rt, n):
    for i in range(n):
        a, b = bufs[i % 64], bufs[(i + 1) % 64]
        rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])


with sd.Runtime("cuda", streams=8, max_inflight=100000) as rt:
    chain(rt, 2000)
    rt.synchronize()
    t0 = time.perf_counter()
    chain(rt, 5000)
    print(f"submit: {(time.perf_counter() - t0) / 5000 * 1e6:.1f} us/op")
    rt.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    chain(rt, 5000)
    rt.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
