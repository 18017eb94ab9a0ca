"""Run a script under PyTorch's CUDA stream sanitizer, optionally with streamdag's event waits dropped."""

import os
import subprocess
import sys


def reports_race(script: str, drop_waits: bool) -> tuple[bool, str]:
    """Whether the sanitizer reported a data race, and what the script printed."""
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1", PYTHONPATH=os.pathsep.join(sys.path))
    if drop_waits:
        env["STREAMDAG_TEST_DROP_WAITS"] = "1"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    text = proc.stdout + proc.stderr
    return "data race" in text.lower() or "CUDASanitizerErrors" in text, text
