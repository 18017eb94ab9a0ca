"""Graphviz source of a schedule."""

from __future__ import annotations

from collections.abc import Sequence

from ..schedule.plan import Schedule

__all__ = ["schedule_to_dot"]

_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac"]


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def schedule_to_dot(names: Sequence[str], sched: Schedule) -> str:
    lines = ["digraph streamdag {", "  rankdir=TB;", "  node [shape=box, style=filled, fontcolor=white];"]
    for v, name in enumerate(names):
        s = sched.stream[v]
        label = _quote(name)[:-1] + '\\n' + f's{s}' + '"'
        color = _quote(_COLORS[s % len(_COLORS)])
        lines.append(f"  n{v} [label={label}, fillcolor={color}];")
    waits = {(u, v) for v in range(len(names)) for u in sched.waits[v]}
    for v, ps in enumerate(sched.preds):
        for u in ps:
            if sched.stream[u] == sched.stream[v]:
                attrs = "style=solid"
            elif (u, v) in waits:
                attrs = "style=dashed, color=red"
            else:
                attrs = "style=dotted"
            lines.append(f"  n{u} -> n{v} [{attrs}];")
    lines.append("}")
    return "\n".join(lines)
