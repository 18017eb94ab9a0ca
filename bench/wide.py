"""The wide graph (B branches of matmul+relu) on one GPU: streamdag against PyTorch's baselines.

Run on a GPU machine: PYTHONPATH=src python bench/wide.py [--compile] [--cases tiny,small]
(writes bench/results/wide_<gpu>.json, and a trace and PNG of the tiny case).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from streamdag.suite.gpu_wide import profile_case, run_case, table
from streamdag.suite.report import write_json


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="tiny,small,medium,large")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile (slow)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/wide.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    cases = [run_case(c, args.compile, args.streams) for c in args.cases.split(",")]
    print(table(cases))
    for c in cases:
        print(c["case"], "errors", {k: f"{v:.1e}" for k, v in c["rel_error_vs_eager"].items()},
              "capture", c["capture"], f"capture+choice {c['capture_and_choice_s']:.2f}s")
    path = write_json(args.out, "wide_" + torch.cuda.get_device_name().replace(" ", "_"),
                      {"settings": {"tf32": True, "streams": args.streams,
                                   "timing": "median wall ms; eager and hand-made graphs interleaved"},
                       "cases": cases})
    print(path)
    gpu = torch.cuda.get_device_name().replace(" ", "_")
    timeline = profile_case("tiny", args.streams)
    print(timeline.summary())
    print(timeline.save_trace(Path(args.out) / f"trace_wide_tiny_{gpu}.json"))
    print(timeline.save_png(Path(args.out) / f"timeline_wide_tiny_{gpu}.png",
                            f"wide tiny, op by op on {gpu}: {timeline.summary().makespan_ms:.2f} ms"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
