"""The ``streamdag`` command: ``streamdag bench`` runs the built-in suite on the best device present."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


def _bench(args: argparse.Namespace) -> int:
    from .suite import cpu_wide, sched_scale
    from .suite.report import environment, write_json

    env = environment()
    device = env.get("gpu") or "CPU only (no CUDA device found)"
    print(f"streamdag {env['streamdag']} on {env['platform']}, {env['cpu_count']} cores; {device}")
    out = Path(args.out)
    print("\n[1/2] scheduler: random DAG of 10,000 ops and ~50,000 edges", flush=True)
    sched = sched_scale.run(repeats=1 if args.quick else 3)
    print(sched_scale.table(sched))
    write_json(out, "sched_scale", sched)
    print("\n[2/2] cpu_wide: 8 branches x 4 layers of numpy matmul+relu, 2 lanes vs serial", flush=True)
    wide = cpu_wide.run(repeats=5 if args.quick else 15)
    print(cpu_wide.table(wide))
    if not wide["bit_identical"]:
        print("ERROR: concurrent results differ from the serial run", file=sys.stderr)
        return 1
    write_json(out, "cpu_wide", wide)
    print(f"\nJSON written to {out}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamdag", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run the built-in benchmark suite and print the table")
    bench.add_argument("--out", default="bench/results/latest", help="folder for the JSON results")
    bench.add_argument("--quick", action="store_true", help="fewer repeats")
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
