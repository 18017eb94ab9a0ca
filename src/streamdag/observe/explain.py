"""``explain()``: a schedule as text a person reads."""

from __future__ import annotations

from collections.abc import Sequence

from ..schedule.plan import Schedule

__all__ = ["explain_schedule"]

_MAX_ROWS = 40


def _clip(items: list[str], limit: int = 12) -> str:
    shown = items[:limit]
    more = f" ... (+{len(items) - limit})" if len(items) > limit else ""
    return "  ".join(shown) + more


def explain_schedule(names: Sequence[str], sched: Schedule, extra: Sequence[str] = ()) -> str:
    n = sched.num_ops
    width = f"width {sched.width}" if sched.width is not None else "width not computed"
    lines = [
        f"{n} ops, {len(sched.levels)} levels, {sched.chains} chains ({width}), "
        f"{sched.num_streams} streams, {sched.num_waits} waits for "
        f"{sched.cross_stream_edges} cross-stream edges, {sched.removed_edges} implied edges removed",
    ]
    lines += list(extra)
    path = [names[v] for v in sched.critical_path]
    lines.append(f"critical path ({len(path)} ops, cost {sched.critical_cost:g}): " + " -> ".join(path[:20])
                 + (" -> ..." if len(path) > 20 else ""))
    lines.append("levels (ops between two barriers):")
    for i, level in enumerate(sched.levels[:_MAX_ROWS]):
        lines.append(f"  L{i:<3} " + _clip([f"{names[v]}[s{sched.stream[v]}]" for v in level]))
    if len(sched.levels) > _MAX_ROWS:
        lines.append(f"  ... {len(sched.levels) - _MAX_ROWS} more levels")
    lines.append("streams (in run order):")
    for s, ops in enumerate(sched.order[:_MAX_ROWS]):
        lines.append(f"  s{s:<3} " + _clip([names[v] for v in ops]))
    lines.append("waits (op <- event of an op on another stream):")
    rows = [
        f"  {names[v]}[s{sched.stream[v]}] <- {names[u]}[s{sched.stream[u]}]"
        for v in range(n)
        for u in sched.waits[v]
    ]
    lines += rows[:_MAX_ROWS] or ["  none"]
    if len(rows) > _MAX_ROWS:
        lines.append(f"  ... {len(rows) - _MAX_ROWS} more waits")
    return "\n".join(lines)
