"""Variants in processes of their own, timed in turns.

A variant that must run alone in its process (one under CUDA graph trees, whose pool and state are
the process's) is set up in a process of its own. Timed one process after another, the variants
would be compared across minutes of the host's and the GPU's drift, which moves a step's time by
several percent; so the processes are set up one after another (a compile, and streamdag's timing
of its candidates, find the GPU idle), kept, and then timed in turns: each, in an order that
rotates from turn to turn and runs backwards every other turn, runs :data:`STEPS_PER_TURN` timed
steps after an untimed one (its process's first launch after another process ran), until each
has its rounds.

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
    within ``limit_s`` seconds, and each request too; None: an hour), then time them in turns until
    each has ``rounds`` steps. A child that fails or stops answering is ended at once (the GPU stays
    the others'); every child has ended before this returns or raises. ``name`` heads the progress
    lines."""
    limit = 3600.0 if limit_s is None else limit_s
    turns = Turns()
    served: dict[str, ServedChild] = {}
    times: dict[str, list[float]] = {}

    def drop(label: str, why: str, gently: bool = False) -> None:
        """``label``'s child ends now: told it is done where it said its setup failed (it then writes
        why), else killed."""
        if gently:
            served[label].finish(60)
        else:
            served[label].kill()
        turns.errors[label] = why
        times.pop(label, None)

    try:
        for label, cmd in commands.items():
            t0 = time.perf_counter()
            served[label] = ServedChild(cmd, env=env)
            ready = served[label].receive(limit)
            if ready is not None and ready.get("ready"):
                times[label] = []
            elif ready is not None:
                drop(label, "its setup failed", gently=True)
            else:
                drop(label, f"not set up within {limit:.0f} s, or its process ended")
            print(f"  {name} {label}: {'set up' if label in times else turns.errors[label]} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        turn = 0
        while any(len(ts) < rounds for ts in times.values()):
            order = [label for label, ts in times.items() if len(ts) < rounds]
            k = (turn // 2) % len(order)
            order = order[k:] + order[:k]
            # turn by turn the order rotates, and every other turn it runs backwards: each variant
            # begins turns as often as the others, after each of the others in turn
            for label in order if turn % 2 == 0 else order[::-1]:
                steps = min(STEPS_PER_TURN, rounds - len(times[label]))
                answer = served[label].request({"steps": steps, "warm": 1}, limit)
                if answer is None or "ms" not in answer:
                    drop(label, f"its process stopped answering at turn {turn}")
                else:
                    times[label] += answer["ms"]
            turn += 1
    except BaseException:
        for child in served.values():  # (first all of them: a wait for one must not leave the others)
            child.kill()
        raise
    finally:
        for label, child in served.items():
            done = child.finish(60)
            if label in turns.errors and done.returncode not in (0, None):
                turns.errors[label] += f" (exit {done.returncode}: {done.output[-300:]})"
    for label, ts in times.items():
        turns.ms[label] = statistics.median(ts)
        print(f"  {name} {label}: {turns.ms[label]:.3f} ms over {len(ts)} steps", flush=True)
    return turns
