"""CPU time per op by shared object and by symbol in ``perf_chain.sh``'s two profiles, and what
streamdag's chain adds to PyTorch's own launches.

Run: python bench/perf_diff.py <folder of perf_chain.sh's reports> <ops per profile>
"""

import re
import sys
from pathlib import Path

from streamdag.suite.report import format_table


def per_op(path: Path, ops: int) -> dict[str, float]:
    """µs of CPU per op (all threads) of each row of a ``perf report --stdio`` file."""
    total_us, rows = None, {}
    for line in path.read_text().splitlines():
        count = re.search(r"Event count \(approx\.\): (\d+)", line)  # cpu-clock counts nanoseconds
        if count:
            total_us = int(count.group(1)) / 1e3 / ops
        row = re.match(r"\s+([\d.]+)%\s+(\S.*?)\s*$", line)
        if row and not line.startswith("#"):
            rows[" ".join(row.group(2).split())] = float(row.group(1))
    if total_us is None:
        raise SystemExit(f"{path}: no event count in the report")
    return {"(all)": total_us} | {key: pct * total_us / 100 for key, pct in rows.items()}


def table(kind: str, folder: Path, ops: int, top: int) -> str:
    chain, torch = per_op(folder / f"chain.{kind}.txt", ops), per_op(folder / f"torch.{kind}.txt", ops)
    keys = sorted(set(chain) | set(torch), key=lambda k: -(chain.get(k, 0) - torch.get(k, 0)))
    rows = [[key[:90], chain.get(key, 0), torch.get(key, 0), chain.get(key, 0) - torch.get(key, 0)]
            for key in keys[:top]]
    return format_table([kind, "chain µs/op", "PyTorch µs/op", "added µs/op"], rows)


def main() -> None:
    folder, ops = Path(sys.argv[1]), int(sys.argv[2])
    print(table("dso", folder, ops, 15))
    print()
    print(table("dso_sym", folder, ops, 40))


if __name__ == "__main__":
    main()
