"""How long the pure scheduler takes on a large random DAG."""

from __future__ import annotations

import random
import time
from typing import Any

from ..runtime.accel import build_schedule
from .report import format_table

__all__ = ["random_dag", "run"]


def random_dag(n: int, edges: int, seed: int = 0, window: int = 0) -> list[list[int]]:
    """``n`` ops, about ``edges`` edges, each from an earlier op (within ``window`` ops if set)."""
    rng = random.Random(seed)
    per = edges / max(n - 1, 1)
    preds: list[list[int]] = [[]]
    for v in range(1, n):
        k = min(v, int(per) + (rng.random() < per - int(per)))
        lo = max(0, v - window) if window else 0
        preds.append(sorted(set(rng.randrange(lo, v) for _ in range(k))))
    return preds


def run(n: int = 10_000, edges: int = 50_000, streams: int = 8, repeats: int = 3) -> dict[str, Any]:
    cases = {}
    for label, window in (("uniform", 0), ("local (window 200)", 200)):
        preds = random_dag(n, edges, seed=1, window=window)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sched = build_schedule(preds, max_streams=streams)
            times.append(time.perf_counter() - t0)
        cases[label] = {
            "ops": n,
            "edges": sum(len(p) for p in preds),
            "seconds": sorted(times)[len(times) // 2],
            "reduced_edges": sum(len(p) for p in sched.preds),
            "levels": len(sched.levels),
            "width": sched.width,
            "streams": sched.num_streams,
            "waits": sched.num_waits,
        }
    return {"settings": {"streams": streams, "repeats": repeats}, "cases": cases}


def table(result: dict[str, Any]) -> str:
    rows = [[label, c["ops"], c["edges"], c["reduced_edges"], c["width"], c["waits"], c["seconds"]]
            for label, c in result["cases"].items()]
    return format_table(["random DAG", "ops", "edges", "after reduction", "width",
                         "waits (8 streams)", "schedule s"], rows)
