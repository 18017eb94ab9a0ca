"""The compiled hot path against its Python reference: host time per submit, side by side.

Runtimes on the CPU with a backend that runs each op at once (no device, no
threads), so what a submit costs is the runtime's bookkeeping: one all
compiled (the submit and finish, the tracker, clocks and tensor ranges:
``streamdag.native``), one with the submit and finish in Python and the rest
compiled, and one all in Python (what runs where no C compiler is). A chain
of ops over 64 tensors, each reading one and writing the next, the op a
Python function that does nothing. The variants run in turns, round after
round, in alternating order; each reports its median round.

Run: python bench/hot_path.py (CPU only; writes bench/results/hot_path_cpu.json)
"""

import platform
import statistics
import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag import native
from streamdag.backends.inline import InlineBackend
from streamdag.graph import buffers, hazards
from streamdag.runtime import accel, arguments, completion, core
from streamdag.schedule import waits
from streamdag.suite.report import format_table, write_json

OPS_PER_ROUND = 10000
ROUNDS = 15


def nothing(*args, **kwargs):
    return None


def chain_on(kind: str):
    core.COMPILED_SUBMIT = kind == "compiled"
    try:
        rt = sd.Runtime(backend=InlineBackend("cpu", 8), max_inflight=1 << 20)
    finally:
        core.COMPILED_SUBMIT = True
    if kind == "python":
        rt._tracker = hazards.PyDepsTracker(retired=completion.finished_ok)
        rt._clocks = waits.PyStreamClocks(len(rt._streams))
    accesses = buffers._py_accesses if kind == "python" else accel.accesses
    bufs = [torch.zeros(256) for _ in range(64)]

    def chain(n):
        arguments.accesses_of = accesses
        try:
            for i in range(n):
                a, b = bufs[i % 64], bufs[(i + 1) % 64]
                rt.submit(nothing, a, 1, out=b, reads=[a], writes=[b])
        finally:
            arguments.accesses_of = accel.accesses
    return chain


def main():
    if native.load() is None:
        raise SystemExit(f"the compiled hot path is not built here ({native.status()}): nothing to compare")
    variants = {"all compiled": chain_on("compiled"),
                "submit in Python, tracker, clocks, ranges compiled": chain_on("glue"),
                "Python reference": chain_on("python")}
    rounds: dict[str, list[float]] = {label: [] for label in variants}
    for run in variants.values():
        run(2000)
    order = list(variants.items())
    for _ in range(ROUNDS):
        order.reverse()
        for label, run in order:
            t0 = time.perf_counter()
            run(OPS_PER_ROUND)
            rounds[label].append((time.perf_counter() - t0) / OPS_PER_ROUND * 1e6)
    medians = {label: statistics.median(ts) for label, ts in rounds.items()}
    base = medians["Python reference"]
    print(format_table(["submit (host, per op)", "µs (median round)", "x the Python reference", "rounds µs"],
                       [[label, us, us / base, f"{min(rounds[label]):.1f}-{max(rounds[label]):.1f}"]
                        for label, us in medians.items()]))
    print(write_json(Path(__file__).parent / "results", "hot_path_cpu",
                     {"settings": {"ops_per_round": OPS_PER_ROUND, "rounds": ROUNDS, "lanes": 8,
                                   "machine": platform.processor() or platform.machine(),
                                   "hot_path": native.status(where=False)},
                      "us": medians, "rounds_us": rounds}))


if __name__ == "__main__":
    main()
