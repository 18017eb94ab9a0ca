"""Timing helpers, environment capture, result tables and JSON files for benchmarks."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["environment", "format_table", "median_ms", "source_digest", "write_json"]


def median_ms(fn: Callable[[], Any], repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in milliseconds (``fn`` must finish its work before returning)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def environment() -> dict[str, Any]:
    import numpy

    import streamdag

    env: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "numpy": numpy.__version__,
        "streamdag": streamdag.__version__,
        "streamdag_source": source_digest(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
            env["cuda"] = torch.version.cuda
            env["gpus"] = torch.cuda.device_count()
    except ImportError:
        env["torch"] = None
    return env


def source_digest() -> str:
    """A digest of the installed package's own source files (Python, C, C++): which code a result
    came from, where a copy of the tree carries no git history or a stale one."""
    import hashlib

    import streamdag

    root = Path(streamdag.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in {".py", ".c", ".cpp", ".h"}):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [
        [f"{c:.3f}" if isinstance(c, float) else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(directory: str | Path, name: str, payload: dict[str, Any]) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2) + "\n")
    return path
