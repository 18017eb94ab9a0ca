"""Tensor-parallel chain on two GPUs: see :mod:`streamdag.suite.tp` for what is measured.

Run on a two-GPU machine: PYTHONPATH=src python bench/tp.py [--quick]
(writes bench/results/tp_<gpu>x2.json).
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
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit(f"bench/tp.py needs two GPUs; this machine has {torch.cuda.device_count()}")
    result = tp.run(args.quick)
    for case in result["cases"]:
        print(case["explain"], flush=True)
    print(tp.table(result))
    tag = torch.cuda.get_device_name(0).split()[1]
    print(f"wrote {write_json(Path(args.out), f'tp_{tag}x2' + ('_quick' if args.quick else ''), result)}")


if __name__ == "__main__":
    main()
