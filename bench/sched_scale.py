"""Scheduling time of a random DAG of 10,000 ops and ~50,000 edges (goal: under 2 s).

Run: .venv/bin/python bench/sched_scale.py  (writes bench/results/sched_scale.json)
"""

from pathlib import Path

from streamdag.suite import sched_scale
from streamdag.suite.report import write_json

if __name__ == "__main__":
    result = sched_scale.run()
    print(sched_scale.table(result))
    print(write_json(Path(__file__).parent / "results", "sched_scale", result))
