"""Tensor-parallel chain on 1, 2, 4 and 8 GPUs: see :mod:`streamdag.suite.tp` for what is measured.

One run per machine measures every GPU count up to the GPUs visible, side by
side: PYTHONPATH=src python bench/tp.py [--quick] [--n 1 2 4] [--rows 8 16384]
(writes bench/results/tp_<gpu>x<visible GPUs>.json, e.g. tp_H200x4.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from streamdag.suite import tp
from streamdag.suite.report import write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small cases only, few iterations")
    parser.add_argument("--n", type=int, nargs="+", help="GPU counts to run (default: 1, 2, 4, 8 that fit)")
    parser.add_argument("--rows", type=int, nargs="+", help=f"only the cases of these rows ({tp.CASES})")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 1:
        sys.exit("bench/tp.py needs at least one NVIDIA GPU (and measures several when it has them)")
    try:
        counts = tp.visible_ns(gpus, args.n)
    except ValueError as exc:
        sys.exit(f"bench/tp.py: {exc}")
    cases = [c for c in tp.CASES if args.rows is None or c[0] in args.rows]
    if args.quick and args.rows is None:
        cases = tp.CASES[:2]
    if not cases:
        sys.exit(f"bench/tp.py: no case has rows {args.rows}; the cases are {tp.CASES}")
    print(f"{gpus} GPU(s): {torch.cuda.get_device_name(0)}; GPU counts {counts}", flush=True)
    result = tp.run(args.quick, counts, cases,
                    on_case=lambda case: print(tp.table_of_case(case), flush=True))
    for case in result["cases"]:
        for entry in case["by_n"].values():
            print(entry["explain"], flush=True)
    print(tp.table(result))
    tag = torch.cuda.get_device_name(0).split()[1]
    partial = args.quick or args.n is not None or args.rows is not None
    suffix = "_quick" if args.quick else "_partial" if partial else ""
    name = f"tp_{tag}x{gpus}{suffix}"
    print(f"wrote {write_json(Path(args.out), name, result)}")


if __name__ == "__main__":
    main()
