"""Variants in processes of their own, timed in turns.

A variant that must run alone in its process (one under CUDA graph trees, whose pool and state are
the process's) is set up in a process of its own. Timed one process after another, the variants
would be compared across minutes of the host's and the GPU's drift, which moves a step's time by
several percent; so the processes are set up one after another (a compile, and streamdag's timing
of its candidates, find the GPU idle), kept, and then timed in turns: each, in an order that
rotates from turn to turn, runs :data:`STEPS_PER_TURN` timed steps after an untimed one (its
process's first launch after another process ran), until each has its rounds.

A child serves with :func:`children.serve`: it answers ``{"steps": n, "warm": w}`` with
``{"ms": [...]}``, the time of each of the ``n`` steps after ``w`` untimed ones.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from children import ServedChild

__all__ = ["STEPS_PER_TURN", "Turns", "time_in_turns"]

#: the timed steps a variant runs at each of its turns
STEPS_PER_TURN = 3


@dataclass
class Turns:
    """What :func:`time_in_turns` measured: each variant's median step time (ms), and why the others
    have none (a setup that failed, a process that stopped answering)."""

    ms: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def time_in_turns(commands: dict[str, list[str]], rounds: int, limit_s: float | None,
                  env: dict[str, str] | None, name: str) -> Turns:
    """Set each variant's command up as a :class:`~children.ServedChild`, one after another (each
    within ``limit_s`` seconds), then time them in turns until each has ``rounds`` steps; every
    process ends before this returns. ``name`` heads the progress lines."""
    turns = Turns()
    served: dict[str, ServedChild] = {}
    times: dict[str, list[float]] = {}
    try:
        for label, cmd in commands.items():
            t0 = time.perf_counter()
            served[label] = ServedChild(cmd, env=env)
            ready = served[label].receive(limit_s)
            if ready is not None and ready.get("ready"):
                times[label] = []
            else:
                turns.errors[label] = "its setup failed" if ready is not None else \
                    f"not set up within {limit_s} s, or its process ended"
            print(f"  {name} {label}: {'set up' if label in times else turns.errors[label]} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        turn = 0
        while any(len(ts) < rounds for ts in times.values()):
            order = [label for label, ts in times.items() if len(ts) < rounds]
            k = turn % len(order)
            for label in order[k:] + order[:k]:
                answer = served[label].request({"steps": STEPS_PER_TURN, "warm": 1}, limit_s)
                if answer is None or "ms" not in answer:
                    turns.errors[label] = f"its process stopped answering at turn {turn}"
                    del times[label]
                else:
                    times[label] += answer["ms"]
            turn += 1
    finally:
        for label, child in served.items():
            done = child.finish(60)
            if done.returncode != 0 and label not in turns.errors:
                turns.errors[label] = f"exit {done.returncode}: {done.output[-500:]}"
            elif label in turns.errors and done.returncode != 0:
                turns.errors[label] += f" (exit {done.returncode}: {done.output[-300:]})"
    for label, ts in times.items():
        turns.ms[label] = statistics.median(ts)
        print(f"  {name} {label}: {turns.ms[label]:.3f} ms over {len(ts)} steps", flush=True)
    return turns
