"""The install scripts take PyTorch's build from the index that fits the machine, and the command
line writes where its help says."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from streamdag import cli

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _torch_index(tmp_path: Path, nvidia_smi: str | None, **env: str) -> str:
    """``torch_index`` of scripts/_venv.sh on a PATH with a stand-in ``nvidia-smi`` (or none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi is not None:
        fake = bin_dir / "nvidia-smi"
        fake.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        fake.chmod(0o755)
    done = subprocess.run(["/bin/bash", "-c", "source scripts/_venv.sh && torch_index"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_without_nvidia_smi_torch_comes_from_the_cpu_index(tmp_path):
    if any((Path(p) / "nvidia-smi").exists() for p in ("/usr/bin", "/bin")):
        pytest.skip("this machine has nvidia-smi in /usr/bin")
    assert _torch_index(tmp_path, None) == CPU_INDEX


def test_with_a_gpu_torch_comes_from_the_default_index_whose_build_carries_cuda(tmp_path):
    assert _torch_index(tmp_path, "echo 'GPU 0: NVIDIA H100 (UUID: GPU-0)'") == ""


def test_an_nvidia_smi_that_finds_no_driver_counts_as_no_gpu(tmp_path):
    assert _torch_index(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9") == CPU_INDEX


@pytest.mark.parametrize("index", ["https://example.invalid/simple", ""])
def test_streamdag_torch_index_overrides_the_choice(tmp_path, index):
    assert _torch_index(tmp_path, None, STREAMDAG_TORCH_INDEX=index) == index
    assert _torch_index(tmp_path, "true", STREAMDAG_TORCH_INDEX=index) == index


def test_bench_writes_into_streamdag_results_in_the_current_directory_and_says_so(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert "streamdag-results" in " ".join(capsys.readouterr().out.split())
    assert cli.DEFAULT_OUT == "streamdag-results" and not os.path.isabs(cli.DEFAULT_OUT)
    readme = (ROOT / "README.md").read_text()
    assert "`streamdag-results/` in the current directory" in readme
