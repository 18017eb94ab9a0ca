"""Host functions on GPU results: a host function inside its submit against one on the host lanes.

A loop of STEPS steps, each: ``tanh(x_i @ W)`` on the GPU, a copy of the
result into pinned host memory, then a host function that summarizes it (its
mean and standard deviation, by PyTorch on the CPU). Variants, timed in turns:

- PyTorch eager, one stream: compute, copy, synchronize, summarize, step
  after step (what plain code does);
- streamdag, the summary submitted as a plain op: on a GPU runtime its
  function runs inside its submit, so that submit waits for the step's copy
  and the submitter queues the next step only after the summary;
- streamdag, the summary with ``run_on="host"``: it waits for its copy on a
  host lane, and the submitter queues every step at once.

Also measured alone: the GPU's time for all steps (compute and copies, no
summaries) and the host's for all summaries (one after another): a loop that
overlaps both at best takes the longer of the two (the summaries on two
lanes may take less than their sum, if the CPU has the cores).

Run on a GPU machine: PYTHONPATH=src python bench/host_lanes.py
(writes bench/results/host_lanes_<gpu>.json)
"""

import statistics
from pathlib import Path

import torch

import streamdag as sd
from streamdag.suite.cuda_timing import interleaved_rounds_ms, loops_table
from streamdag.suite.report import format_table, write_json

STEPS = 16
ROWS, DIM = 2048, 4096  # each step's result: 32 MiB of float32
ROUNDS = 9


def summarize(t: torch.Tensor) -> tuple[float, float]:
    return float(t.mean()), float(t.std())


def main() -> None:
    xs = [torch.randn(ROWS, DIM, device="cuda") for _ in range(STEPS)]
    w = torch.randn(DIM, DIM, device="cuda") / DIM**0.5
    ys = [torch.empty(ROWS, DIM, device="cuda") for _ in range(STEPS)]
    hosts = [torch.empty(ROWS, DIM).pin_memory() for _ in range(STEPS)]

    def step(i: int) -> None:
        torch.tanh(torch.matmul(xs[i], w), out=ys[i])

    def torch_eager() -> list[tuple[float, float]]:
        out = []
        for i in range(STEPS):
            step(i)
            hosts[i].copy_(ys[i], non_blocking=True)
            torch.cuda.current_stream().synchronize()
            out.append(summarize(hosts[i]))
        return out

    def on_runtime(rt: sd.Runtime, run_on: str | None):
        def run() -> list[tuple[float, float]]:
            futures = []
            for i in range(STEPS):
                rt.submit(step, i, reads=[xs[i], w], writes=[ys[i]])
                rt.copy(hosts[i], ys[i])
                futures.append(rt.submit(summarize, hosts[i], reads=[hosts[i]], run_on=run_on))
            return [f.result() for f in futures]
        return run

    def gpu_alone() -> None:
        for i in range(STEPS):
            step(i)
            hosts[i].copy_(ys[i], non_blocking=True)
        torch.cuda.synchronize()

    def host_alone() -> None:
        for i in range(STEPS):
            summarize(hosts[i])

    rt = sd.Runtime("cuda", streams=2)
    variants = {
        "PyTorch eager, one stream, summary after each step": torch_eager,
        "streamdag, summary inside its submit": on_runtime(rt, None),
        'streamdag, summary on a host lane (run_on="host")': on_runtime(rt, "host"),
    }
    parts = {"GPU alone: all steps' compute and copies": gpu_alone,
             "host alone: all summaries, one after another": host_alone}
    expected = torch_eager()
    for label, fn in variants.items():  # warm up, and check every variant's summaries
        got = fn()
        assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for g, e in zip(got, expected)
                   for a, b in zip(g, e)), label
    rounds = interleaved_rounds_ms({**variants, **parts}, ROUNDS, warmup=0)
    rt.close()
    ms = {label: statistics.median(ts) for label, ts in rounds.items()}
    base = "PyTorch eager, one stream, summary after each step"
    headers, rows = loops_table(ms, list(variants), list(parts), base)
    print(format_table(headers, rows))
    gpu = torch.cuda.get_device_name()
    print(write_json(Path(__file__).parent / "results", "host_lanes_" + gpu.replace(" ", "_"),
                     {"settings": {"steps": STEPS, "rows": ROWS, "dim": DIM, "rounds": ROUNDS,
                                   "host_lanes": 2, "tf32": False, "torch_threads": torch.get_num_threads()},
                      "ms": ms, "rounds_ms": rounds}))


if __name__ == "__main__":
    main()
