"""The soak (``bench/soak.py``) in small: random programs checked against their serial run.

A short soak of each category must find no mismatch and no hang; and with a defect planted in
the runtime on purpose it must find mismatches (or count hangs), or it could not fail at all.
Each run is a subprocess of its own, whose workers dump and replace a hung process.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"

#: the categories that run clean
WORKING = ["eager", "eager_fail", "graph", "graph_eager", "threads", "zero_size", "base_exc"]


def soak(tmp_path: Path, *options: str, timeout: float = 240) -> dict:
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(SOAK), "--json", str(out), "--seed", "7", *options],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def findings(result: dict) -> str:
    """What to show when a soak found something: the first mismatch or hang of each category."""
    shown = {cat: ex[0] for cat, ex in {**result["mismatch_examples"], **result["hang_examples"]}.items()}
    return json.dumps(shown, indent=1)[:6000]


def test_a_short_soak_of_the_working_categories_finds_no_mismatch_and_no_hang(tmp_path):
    result = soak(tmp_path, "--programs", "3000", "--categories", ",".join(WORKING))
    assert result["programs"] == 3000
    assert set(result["by_category"]) == set(WORKING)
    assert result["failures_injected"] > 0
    assert result["mismatches"] == 0 and result["hangs"] == 0, findings(result)


@pytest.mark.parametrize("category", [
    "graph_fail", "mixed", "base_exc_graph",
    "nested",
    "nested_graph", "close_race", "sync_in_op", "markers_nested", "callbacks",
])
def test_a_short_soak_of_each_other_category_finds_no_mismatch_and_no_hang(tmp_path, category):
    result = soak(tmp_path, "--programs", "200", "--categories", category, "--hang-seconds", "3",
                  "--max-hangs", "1")
    assert result["programs"] > 0
    assert result["mismatches"] == 0 and result["hangs"] == 0, findings(result)


@pytest.mark.parametrize("defect", ["drop_waits", "skip_indirect"])
def test_the_soak_finds_the_mismatches_of_a_planted_defect(tmp_path, defect):
    """The negative control: a runtime that lets a dependent run before its producer on another
    lane, or passes a failure to direct dependents only, must be caught."""
    result = soak(tmp_path, "--programs", "400", "--categories", "eager,eager_fail", "--plant", defect)
    assert result["mismatches"] > 0, findings(result)
    assert result["settings"]["plant"] == defect


def test_the_soak_counts_a_hang_and_goes_on_with_a_fresh_worker(tmp_path):
    """A runtime that never finishes one op in 300: each such program is a hang, with the stacks of
    its threads, and the soak goes on past it."""
    result = soak(tmp_path, "--programs", "100", "--categories", "eager", "--plant", "lose_finish",
                  "--hang-seconds", "2", "--max-hangs", "100", "--workers", "1")
    assert result["hangs"] > 0
    assert result["programs"] == 100
    example = result["hang_examples"]["eager"][0]
    assert "pending" in example["hang"] or "did not return" in example["hang"]
    assert "Thread" in example["stacks"]
