"""The torch extension's host copies (``native/_host_copy.h``), built with the machine's C++ compiler
into a small driver and checked byte for byte: the staged transfers copy through them, and on a
machine without a GPU nothing else runs that code."""

import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parent.parent / "src" / "streamdag" / "native"
DRIVER = Path(__file__).resolve().parent / "host_copy_driver.cpp"


def test_host_copies_land_exactly_from_any_thread_count_caller_and_process(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler here")
    exe = tmp_path / "host_copy_driver"
    subprocess.run([compiler, "-O2", "-std=c++17", "-pthread", f"-I{NATIVE}", str(DRIVER), "-o", str(exe)],
                   check=True, capture_output=True, text=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
