"""The public API type-checks: futures are generic in their op's result, and misspelt attributes fail.

Each checker runs on two snippets at once: one that uses the API correctly (no error), one with a
mistake on every marked line (an error on each of those lines, and on no other).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

GOOD = """
import numpy as np
import streamdag as sd

def total(a: np.ndarray, b: np.ndarray) -> float:
    return float((a + b).sum())

x, y = np.ones(4), np.empty(4)
with sd.Runtime(device="cpu", streams=2) as rt:
    f: sd.Future[float] = rt.submit(total, sd.read(x), x, name="total")
    value: float = f.result(timeout=5.0)
    f.add_done_callback(lambda done: print(done.result() + 1.0))
    rt.submit(np.multiply, x, 2.0, out=sd.write(y)).result()
    rt.submit(np.matmul, x, x, reads=[x], run_on=None).result()
    with rt.record() as g:
        rt.submit(total, x, x)
    values: sd.GraphResult = g.run().result()
    first = values[0]
    with rt.profile() as prof:
        rt.submit(total, x, x)
    makespan: float = prof.timeline.summary().makespan_ms
    print(value, first, makespan, g.explain(), rt.statistics().completed)

async def waits(rt: sd.Runtime) -> float:
    return await rt.submit(total, x, x)

@sd.capture_step(warmup=5)
def step(a: np.ndarray) -> float:
    return float(a.sum())

@sd.capture_step
def plain_step(a: np.ndarray) -> float:
    return float(a.sum())

said: str = step.explain() + plain_step.explain()  # (both are captured steps, not decorators)

import torch

fast = sd.compile(torch.nn.Linear(4, 4))  # a module compiles to a module
layer: torch.nn.Module = fast.eval()
plan: str = fast.explain()
"""

BAD = """
import numpy as np
import streamdag as sd

def total(a: np.ndarray, b: np.ndarray) -> float:
    return float((a + b).sum())

x = np.ones(4)
with sd.Runtime(device="cpu") as rt:
    f = rt.submit(total, x, x)
    f.reslt()  # BAD
    text: str = f.result()  # BAD
    with rt.record() as g:
        rt.submit(total, x, x)
    g.rn()  # BAD
    with rt.profile() as prof:
        rt.submit(total, x, x)
    prof.timline  # BAD
    rt.sumbit(total, x, x)  # BAD

import torch

# (nn.Module's __getattr__ lets any attribute name of a module type-check: a wrong type is caught)
count: int = sd.compile(torch.nn.Linear(4, 4)).explain()  # BAD
"""


def _bad_lines() -> set[int]:
    return {i for i, line in enumerate(textwrap.dedent(BAD).splitlines(), 1) if line.endswith("# BAD")}


def _command(checker: str, files: list[Path]) -> list[str]:
    if checker == "mypy":
        return [sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent",
                "--python-executable", sys.executable, "--show-column-numbers", *map(str, files)]
    return [sys.executable, "-m", "pyright", "--pythonpath", sys.executable, *map(str, files)]


@pytest.mark.parametrize("checker", ["mypy", "pyright"])
def test_a_type_checker_accepts_correct_uses_and_flags_each_misspelt_or_mistyped_use(checker, tmp_path):
    if importlib.util.find_spec(checker) is None:
        pytest.skip(f"{checker} is not installed (it comes with the dev extra: pip install -e '.[dev]')")
    good, bad = tmp_path / "good_use.py", tmp_path / "bad_use.py"
    good.write_text(textwrap.dedent(GOOD))
    bad.write_text(textwrap.dedent(BAD))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(_command(checker, [good, bad]), capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    output = done.stdout + done.stderr
    if checker == "pyright" and "error" not in output and done.returncode != 0:
        pytest.skip(f"pyright could not run here: {output.strip()[-300:]}")
    errors = re.findall(r"(good_use|bad_use)\.py:(\d+):\d+:? - error|(good_use|bad_use)\.py:(\d+):\d+: error",
                        output)
    found: dict[str, set[int]] = {"good_use": set(), "bad_use": set()}
    for py_file, py_line, my_file, my_line in errors:
        found[py_file or my_file].add(int(py_line or my_line))
    assert done.returncode != 0, output
    assert found["good_use"] == set(), output
    assert found["bad_use"] == _bad_lines(), output


def test_pyright_finds_at_least_95_percent_of_the_exported_symbols_fully_typed():
    """The goal of ``pyright --verifytypes``: each unannotated public attribute, parameter or return
    costs a user's type checker its inference. Symbols whose type PyTorch or the compiled extension
    leaves unknown to pyright (subclasses of its CUDA stream and event) are the known remainder."""
    if importlib.util.find_spec("pyright") is None:
        pytest.skip("pyright is not installed (it comes with the dev extra: pip install -e '.[dev]')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pyright", "--pythonpath", sys.executable, "--verifytypes",
                           "streamdag", "--ignoreexternal", "--outputjson"],
                          capture_output=True, text=True, cwd=SRC, env=env, timeout=300)
    try:
        completeness = json.loads(done.stdout)["typeCompleteness"]
    except (ValueError, KeyError):
        pytest.skip(f"pyright could not run here: {(done.stdout + done.stderr).strip()[-300:]}")
    incomplete = [s["name"] for s in completeness["symbols"]
                  if s["isExported"] and (not s["isTypeKnown"] or s["isTypeAmbiguous"])]
    assert completeness["completenessScore"] >= 0.95, incomplete
