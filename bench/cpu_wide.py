"""cpu_wide: streamdag on 2 CPU lanes against the same numpy ops run serially.

Run: .venv/bin/python bench/cpu_wide.py  (writes bench/results/cpu_wide.json)
"""

from pathlib import Path

from streamdag.suite import cpu_wide
from streamdag.suite.report import write_json

if __name__ == "__main__":
    result = cpu_wide.run()
    print(cpu_wide.table(result))
    print("bit-identical to serial:", result["bit_identical"])
    print(write_json(Path(__file__).parent / "results", "cpu_wide", result))
