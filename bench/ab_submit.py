"""Per-op host cost of two versions of streamdag, side by side in one run: the A/B of a change.

(It replaces ``chain_ab.py``, which ran a whole process per version in turns: two processes of the
same code differed by up to ±2 µs per op there, and its turns were seconds apart.)

Several worker processes per version (its source folder on ``PYTHONPATH``),
made in the order A B B A (A B B A ...), each with its runtime and the dependent chain of
``bench/overhead.py`` (tiny ``torch.add`` ops, each reading the tensor the
one before wrote; ``--workload inline``: the same chain in the inline form,
``sd.read(a)`` and ``sd.write(b)`` among the arguments;
``--workload independent``: ops that each write their own
tensor; ``--workload copy``: copies of 1 KiB, on a GPU ``rt.copy`` from pinned
memory against PyTorch's ``copy_``, on the CPU the copy op's bookkeeping on a
simulated device's copy stream; ``--workload numpy``: the chain over numpy
arrays, ``np.add`` against numpy's own call). The workers take turns, in short rounds whose order
rotates; in each round a worker times its chain and PyTorch's plain
launches of the same ops, so each round gives the µs a version adds over
PyTorch's launch (the mean of its workers), and the host's drift between
rounds cancels. Several workers per version, because one process can run
faster than another of the same code for reasons of its own (its memory
layout: on a 2-core machine an A/A run with one worker each put the second
0.1-0.4 µs behind; on the H100 host, with two each, 0.4). All get the same
hash seed. Reported: each version's median added cost, and the median over
rounds of B minus A with a bootstrap interval; run an A/A (the same folder
twice) beside it to see the harness's own spread.

On the CPU (``--device cpu``) the runtime has a backend that runs each op
at once (``InlineBackend``), as ``bench/hot_path.py``: the bookkeeping alone.

Run: python bench/ab_submit.py A_SRC B_SRC [--labels A B] [--device cuda] [--rounds 40]
(e.g. A_SRC a ``git archive`` of the base revision's ``src``, B_SRC this tree's ``src``)
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

OPS_PER_ROUND = 1000
BOOTSTRAP = 2000


def worker(device: str) -> None:
    """Serve ``chain N``, ``independent N``, ``copy N`` and their baselines ``torch N`` and
    ``torch_copy N`` on stdin: the µs per op, a line each."""
    import numpy as np
    import torch

    import streamdag as sd

    bufs = [torch.zeros(256, device=device) for _ in range(64)]
    if device == "cpu":
        from streamdag.backends.inline import InlineBackend

        rt = sd.Runtime(backend=InlineBackend("cpu", 8), max_inflight=1_000_000)
    else:
        rt = sd.Runtime(device, streams=8, max_inflight=1_000_000)

    def chain(n: int) -> None:
        for i in range(n):
            a, b = bufs[i % 64], bufs[(i + 1) % 64]
            rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])

    def inline(n: int) -> None:  # the chain in the inline form: its accesses marked in the arguments
        for i in range(n):
            rt.submit(torch.add, sd.read(bufs[i % 64]), 1, out=sd.write(bufs[(i + 1) % 64]))

    def independent(n: int) -> None:
        for i in range(n):
            b = bufs[i % 64]
            rt.submit(b.add_, 1, writes=[b])

    def plain(n: int) -> None:
        for i in range(n):
            torch.add(bufs[i % 64], 1, out=bufs[(i + 1) % 64])

    # copies of 1 KiB: on a GPU rt.copy from pinned memory against PyTorch's copy_; on the CPU a copy
    # op on a simulated device's copy stream (the transfers' bookkeeping, streamdag's private
    # _device_copy, the same in both versions) against the copy alone
    if device == "cpu":
        from streamdag.backends.sim import SimArray
        from streamdag.runtime import transfers

        copy_rt = sd.Runtime(devices=["sim:0"], streams=2, max_inflight=1_000_000)
        stream = copy_rt._copy_index[("p2p", "sim:0")]
        srcs = [SimArray(np.zeros(256, np.float32), "sim:0") for _ in range(64)]
        dsts = [SimArray(np.zeros(256, np.float32), "sim:0") for _ in range(64)]

        def sim_copy(dst, src):
            np.copyto(dst.data, src.data)
            return dst

        def copies(n: int) -> None:
            for i in range(n):
                transfers._device_copy(copy_rt, dsts[i % 64], srcs[i % 64], stream, "copy", copier=sim_copy)

        def plain_copies(n: int) -> None:
            for i in range(n):
                sim_copy(dsts[i % 64], srcs[i % 64])
    else:
        copy_rt = rt
        pinned = [torch.zeros(256).pin_memory() for _ in range(64)]

        def copies(n: int) -> None:
            for i in range(n):
                rt.copy(bufs[i % 64], pinned[i % 64])

        def plain_copies(n: int) -> None:
            for i in range(n):
                bufs[i % 64].copy_(pinned[i % 64], non_blocking=True)

    def settle() -> None:
        rt.synchronize()
        copy_rt.synchronize()
        if device != "cpu":
            torch.cuda.synchronize()

    # the chain over numpy arrays (the CPU runtime's common case), against numpy's own call
    arrays = [np.zeros(256) for _ in range(64)]

    def numpy_chain(n: int) -> None:
        for i in range(n):
            a, b = arrays[i % 64], arrays[(i + 1) % 64]
            rt.submit(np.add, a, 1, out=b, reads=[a], writes=[b])

    def numpy_plain(n: int) -> None:
        for i in range(n):
            np.add(arrays[i % 64], 1, out=arrays[(i + 1) % 64])

    runs = {"chain": chain, "independent": independent, "torch": plain, "copy": copies,
            "torch_copy": plain_copies, "numpy": numpy_chain, "numpy_plain": numpy_plain, "inline": inline}
    for run in runs.values():
        run(2000)
    settle()
    print(json.dumps({"ready": sd.__file__}), flush=True)
    for line in sys.stdin:
        what, n = line.split()
        t0 = time.perf_counter()
        runs[what](int(n))
        seconds = time.perf_counter() - t0
        settle()
        print(json.dumps({"us": seconds / int(n) * 1e6}), flush=True)
    rt.close()
    copy_rt.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("a_src")
    parser.add_argument("b_src")
    parser.add_argument("--labels", nargs=2, default=["A", "B"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2, help="worker processes per version")
    parser.add_argument("--workload", choices=["chain", "inline", "independent", "copy", "numpy"],
                        default="chain")
    parser.add_argument("--ops", type=int, default=OPS_PER_ROUND,
                        help="ops per round and kind: fewer make rounds shorter than a noisy host's swings")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent / "src"))
    from streamdag.suite.report import format_table, write_json

    version_of = [0, 1, 1, 0] * (args.workers // 2) + [0, 1] * (args.workers % 2)  # A B B A ...
    sources = [(args.a_src, args.b_src)[v] for v in version_of]
    workers = []
    for src in sources:
        env = dict(os.environ, PYTHONPATH=str(Path(src).resolve()), PYTHONHASHSEED="0")
        proc = subprocess.Popen([sys.executable, __file__, "--worker", args.device], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        workers.append(proc)
    for proc, src in zip(workers, sources):
        ready = json.loads(proc.stdout.readline())
        assert Path(ready["ready"]).resolve().is_relative_to(Path(src).resolve()), (ready, src)

    def timed(proc: subprocess.Popen, what: str) -> float:
        proc.stdin.write(f"{what} {args.ops}\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())["us"]

    # PyTorch's own launch or copy, or numpy's own call
    baseline = {"copy": "torch_copy", "numpy": "numpy_plain"}.get(args.workload, "torch")
    added: list[list[float]] = [[], []]
    torch_us: list[list[float]] = [[], []]
    n = len(workers)
    for r in range(args.rounds):
        # rotated, not reversed: a worker that ran last and then first would run twice in a row,
        # on caches still warm from itself (in an A/A run that put the ends 0.25 µs ahead)
        order = [(r + i) % n for i in range(n)]
        first, second = (args.workload, baseline) if r % 2 else (baseline, args.workload)
        this_round: list[list[tuple[float, float]]] = [[], []]
        for k in order:
            t = {first: timed(workers[k], first), second: timed(workers[k], second)}
            this_round[version_of[k]].append((t[args.workload] - t[baseline], t[baseline]))
        for v in (0, 1):
            added[v].append(statistics.fmean(a for a, _ in this_round[v]))
            torch_us[v].append(statistics.fmean(t for _, t in this_round[v]))
    for proc in workers:
        proc.stdin.close()
        proc.wait(timeout=60)
    diffs = [b - a for a, b in zip(*added)]
    rng = random.Random(0)  # a bootstrap of the median difference: how sure the sign is
    boots = sorted(statistics.median(rng.choices(diffs, k=len(diffs))) for _ in range(BOOTSTRAP))
    low, high = boots[int(0.025 * BOOTSTRAP)], boots[int(0.975 * BOOTSTRAP) - 1]
    rows = [[label, statistics.median(torch_us[k]), statistics.median(added[k])]
            for k, label in enumerate(args.labels)]
    print(format_table([{"torch_copy": "PyTorch's copy µs", "numpy_plain": "numpy's call µs"}.get(
                            baseline, "PyTorch's launch µs"), "added per op µs (median round)"], rows))
    print(f"{args.labels[1]} - {args.labels[0]}: {statistics.median(diffs):+.3f} µs per op (median over "
          f"{len(diffs)} rounds; quartiles {statistics.quantiles(diffs, n=4)[0]:+.3f} / "
          f"{statistics.quantiles(diffs, n=4)[2]:+.3f}; 95% bootstrap interval {low:+.3f} / {high:+.3f})")
    if args.device == "cpu":
        name = "cpu"
    else:
        import torch

        name = torch.cuda.get_device_name().replace(" ", "_")
    print(write_json(here / "results", f"ab_submit_{name}",
                     {"settings": {"device": args.device, "ops_per_round": args.ops, "workers": args.workers,
                                   "workload": args.workload,
                                   "rounds": args.rounds, "labels": args.labels},
                      "added_us": dict(zip(args.labels, map(statistics.median, added))),
                      "b_minus_a_us": statistics.median(diffs),
                      "b_minus_a_95_interval_us": [low, high],
                      "rounds_added_us": dict(zip(args.labels, added)),
                      "rounds_torch_us": dict(zip(args.labels, torch_us))}))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
