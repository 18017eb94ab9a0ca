"""The argument check before each replay of a captured graph, and g.run()'s host time, by check.

A recorded graph's CUDA graph baked in its tensor arguments' addresses, sizes and strides; before
every replay ``CudaGraphRunner._still_valid`` checks that none changed. Two ways, swapped in turn
on one runner of the tiny wide graph (129 ops, 258 tensors): the torch extension's loop over a
snapshot of them (``_torch.cpp``: ``same_layouts``), and PyTorch's own C++ checks, the library
way it stands in for (``torch._C._tensors_data_ptrs_at_indices_equal``, then Dynamo's
``TensorGuards``). Alternating
rounds: the check alone, and g.run()'s host time after a synchronize (its result() after the
timing). Medians.

Run on a GPU machine: PYTHONPATH=src python bench/replay_check.py
(writes bench/results/replay_check_<gpu>.json)
"""

import functools
import statistics
import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag.runtime import capture
from streamdag.suite.gpu_wide import submit_wide, wide_tensors
from streamdag.suite.report import format_table, write_json

ROUNDS, CHECKS, RUNS = 20, 200, 20


def main() -> None:
    x, W, hs, y = wide_tensors("tiny")
    with sd.Runtime("cuda", streams=8, max_inflight=1024) as rt:
        with rt.record() as g:
            submit_wide(rt, x, W, hs, y)
        for _ in range(3):  # an eager run, the capture, a replay
            g.run().result()
        runner = g._runner
        t = runner._tensors
        if not isinstance(runner._layouts_unchanged, functools.partial):
            raise SystemExit("the torch extension is not loaded: nothing to compare")
        checks = {"the torch extension's loop": capture._layout_check(t),
                  "PyTorch's checks (before)": capture._checked_by_pytorch(t)}
        check_us = {k: [] for k in checks}
        run_us = {k: [] for k in checks}
        for r in range(ROUNDS):
            for label, check in (list(checks.items())[:: 1 if r % 2 else -1]):
                runner._layouts_unchanged = check
                assert runner._still_valid()
                t0 = time.perf_counter()
                for _ in range(CHECKS):
                    runner._still_valid()
                check_us[label].append((time.perf_counter() - t0) / CHECKS * 1e6)
                for _ in range(RUNS):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    f = g.run()
                    run_us[label].append((time.perf_counter() - t0) * 1e6)
                    f.result()
        recaptures = g.statistics().recaptures
    rows_out = [[label, statistics.median(check_us[label]), statistics.median(run_us[label])]
                for label in checks]
    print(f"{len(t)} tensor arguments; recaptures while timing: {recaptures}")
    print(format_table(["check", "check alone µs", "g.run() host µs"], rows_out))
    name = "replay_check_" + torch.cuda.get_device_name().replace(" ", "_")
    print(write_json(Path(__file__).parent / "results", name,
                     {"settings": {"case": "tiny", "tensors": len(t), "rounds": ROUNDS,
                                   "checks_per_round": CHECKS, "runs_per_round": RUNS},
                      "check_us": {k: statistics.median(v) for k, v in check_us.items()},
                      "run_host_us": {k: statistics.median(v) for k, v in run_us.items()},
                      "recaptures": recaptures}))


if __name__ == "__main__":
    main()
