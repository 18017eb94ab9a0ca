"""Host work feeding the GPU: a host-lane op prepares each step's input, device ops consume it.

A loop of STEPS steps, each: a host function normalizes the rows of a
pageable host tensor into a pinned buffer (PyTorch on the CPU), the buffer is
copied to the GPU, and ``tanh(x_i @ W)`` runs there. Variants, timed in turns:

- PyTorch eager: prepare, copy (non-blocking), compute, step after step (the
  GPU work of a step runs while the host prepares the next);
- streamdag, the preparation on a host lane, the submitter waiting for it
  before it submits the step's copy (what a submit did before device ops
  after a host-lane op were held);
- streamdag, the same with the copy and the compute held behind the
  preparation: every step is submitted at once, and the preparations run on
  the host lanes side by side.

Also measured alone: the GPU's time for all copies and compute, and the
host's for all preparations one after another.

``--torch-threads N`` sets PyTorch's CPU threads per op (default: PyTorch's
own, one per core): with one, each preparation runs on one core, as in a data
loader's worker, and the host lanes' preparations side by side can use two.

Run on a GPU machine: PYTHONPATH=src python bench/host_feed.py [--torch-threads N]
(writes bench/results/host_feed_<gpu>_threads<N>.json)
"""

import argparse
import statistics
from pathlib import Path

import torch

import streamdag as sd
from streamdag.suite.cuda_timing import interleaved_rounds_ms, loops_table
from streamdag.suite.report import format_table, write_json

STEPS = 16
ROWS, DIM = 2048, 4096  # each step's input: 32 MiB of float32
ROUNDS = 9
HOST_LANES = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-threads", type=int, default=None)
    args = parser.parse_args()
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    raw = [torch.randn(ROWS, DIM) for _ in range(STEPS)]
    pinned = [torch.empty(ROWS, DIM).pin_memory() for _ in range(STEPS)]
    xs = [torch.empty(ROWS, DIM, device="cuda") for _ in range(STEPS)]
    ys = [torch.empty(ROWS, DIM, device="cuda") for _ in range(STEPS)]
    w = torch.randn(DIM, DIM, device="cuda") / DIM**0.5

    def prepare(i: int) -> None:
        src = raw[i]
        torch.sub(src, src.mean(dim=1, keepdim=True), out=pinned[i])
        pinned[i].div_(src.std(dim=1, keepdim=True))

    def step(i: int) -> None:
        torch.tanh(torch.matmul(xs[i], w), out=ys[i])

    def torch_eager() -> None:
        for i in range(STEPS):
            prepare(i)
            xs[i].copy_(pinned[i], non_blocking=True)
            step(i)

    def on_runtime(rt: sd.Runtime, wait: bool):
        def run() -> None:
            for i in range(STEPS):
                prepared = rt.submit(prepare, i, reads=[raw[i]], writes=[pinned[i]], run_on="host")
                if wait:
                    prepared.result()
                rt.copy(xs[i], pinned[i])
                rt.submit(step, i, reads=[xs[i], w], writes=[ys[i]])
            rt.synchronize()
        return run

    def gpu_alone() -> None:
        for i in range(STEPS):
            xs[i].copy_(pinned[i], non_blocking=True)
            step(i)

    def host_alone() -> None:
        for i in range(STEPS):
            prepare(i)

    rt = sd.Runtime("cuda", streams=2, host_lanes=HOST_LANES)
    variants = {
        "PyTorch eager, one stream": torch_eager,
        "streamdag, prepared on a host lane, the submitter waits for it": on_runtime(rt, True),
        "streamdag, prepared on a host lane, copy and compute held": on_runtime(rt, False),
    }
    parts = {"GPU alone: all copies and compute": gpu_alone,
             "host alone: all preparations, one after another": host_alone}
    torch_eager()
    torch.cuda.synchronize()
    expected = ys[-1].clone()
    for label, fn in variants.items():  # warm up, and check every variant's last result
        ys[-1].zero_()
        fn()
        torch.cuda.synchronize()
        assert torch.equal(ys[-1], expected), label
    rounds = interleaved_rounds_ms({**variants, **parts}, ROUNDS, warmup=0)
    rt.close()
    ms = {label: statistics.median(ts) for label, ts in rounds.items()}
    headers, rows = loops_table(ms, list(variants), list(parts), "PyTorch eager, one stream")
    print(format_table(headers, rows))
    gpu = torch.cuda.get_device_name()
    name = f"host_feed_{gpu.replace(' ', '_')}_threads{torch.get_num_threads()}"
    print(write_json(Path(__file__).parent / "results", name,
                     {"settings": {"steps": STEPS, "rows": ROWS, "dim": DIM, "rounds": ROUNDS,
                                   "host_lanes": HOST_LANES, "torch_threads": torch.get_num_threads()},
                      "ms": ms, "rounds_ms": rounds}))


if __name__ == "__main__":
    main()
