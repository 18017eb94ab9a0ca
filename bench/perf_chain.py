"""Where a chain's host time goes: the workload for ``bench/perf_chain.sh`` (Linux ``perf``).

``chain``: streamdag submits of a dependent chain of tiny ``torch.add`` ops; ``torch``: the same
launches straight through PyTorch. After a warm-up, the timed loop is bracketed by ``enable`` and
``disable`` written to perf's control fifo (``PERF_CTL``, acknowledged on ``PERF_ACK``), so the
profile holds that loop alone, not the imports and the builds.

Run: bash bench/perf_chain.sh (on a GPU machine; see there)
"""

import os
import sys
import time
from contextlib import nullcontext

import torch

import streamdag as sd


def perf(command: str) -> None:
    """Tell perf to start or stop sampling, and wait until it has."""
    if os.environ.get("PERF_CTL"):
        with open(os.environ["PERF_CTL"], "w") as ctl:
            ctl.write(command + "\n")
        with open(os.environ["PERF_ACK"]) as ack:
            ack.readline()


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    bufs = [torch.zeros(256, device="cuda") for _ in range(64)]
    # the plain launches run with no runtime in the process
    runtime = sd.Runtime("cuda", streams=8, max_inflight=1_000_000) if mode == "chain" else nullcontext()
    with runtime as rt:
        def chain(count: int) -> None:
            for i in range(count):
                a, b = bufs[i % 64], bufs[(i + 1) % 64]
                rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])
            rt.synchronize()

        def plain(count: int) -> None:
            for i in range(count):
                torch.add(bufs[i % 64], 1, out=bufs[(i + 1) % 64])
            torch.cuda.synchronize()

        run = chain if mode == "chain" else plain
        run(3000)
        perf("enable")
        t0 = time.perf_counter()
        run(n)
        seconds = time.perf_counter() - t0
        perf("disable")
    print(f"{mode}: {seconds / n * 1e6:.2f} µs per op (wall)")


if __name__ == "__main__":
    main()
