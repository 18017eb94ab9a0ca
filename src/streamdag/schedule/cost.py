"""A cost model: how long a schedule takes on a device that concurrent ops share.

Each op has a duration measured when it ran (``durations[v]``, ms) and uses a
fraction ``use[v]`` of its engine: short kernels leave most of a GPU idle,
long ones fill it. Running ops share their engine in proportion to what they
use (processor sharing): while their uses sum to at most 1 each runs at full
speed, beyond that all slow down alike. Kernels share the compute engine;
copies run on their own engines (one per direction), beside the kernels. On
top, every op costs a launch, and every cross-stream wait costs a wait, on
its stream.

The model is pure and deliberately simple; the runtime uses it to estimate,
``explain()`` shows the estimate, and the final choice between stream counts
is still made by timing the candidates.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .plan import Schedule

__all__ = ["CostModel", "simulate"]


@dataclass(frozen=True)
class CostModel:
    """Costs in milliseconds; ``saturating_ms``: an op this long alone fills the device."""

    launch_ms: float = 0.002
    wait_ms: float = 0.001
    saturating_ms: float = 0.02
    min_use: float = 0.05

    def use(self, duration: float) -> float:
        return min(1.0, max(self.min_use, duration / self.saturating_ms))


def simulate(sched: Schedule, durations: Sequence[float], model: CostModel | None = None,
             engines: Sequence[Hashable] | None = None) -> float:
    """Estimated makespan (ms) of ``sched`` with the measured op ``durations``.

    ``engines[v]`` names what op ``v`` runs on (default: all on one compute
    engine); only ops on the same engine share it.
    """
    model = model or CostModel()
    n = sched.num_ops
    if n == 0:
        return 0.0
    engine = list(engines) if engines is not None else [0] * n
    if len(engine) != n:
        raise ValueError(f"got {len(engine)} engines for {n} ops")
    use = [model.use(d) for d in durations]
    remaining = [max(d, 0.0) for d in durations]
    finish = [-1.0] * n
    next_index = [0] * sched.num_streams  # position of each stream's next op
    ready_at: dict[int, float] = {}  # op -> when its launch and waits are done
    running: set[int] = set()
    now = 0.0
    done = 0
    while done < n:
        for s, ops in enumerate(sched.order):  # launch each stream's next op once its inputs are done
            i = next_index[s]  # advances when an op finishes: the one before has finished
            if i >= len(ops) or ops[i] in running or ops[i] in ready_at:
                continue
            v = ops[i]
            if all(finish[u] >= 0 for u in sched.preds[v]):
                ready_at[v] = now + model.launch_ms + model.wait_ms * len(sched.waits[v])
        starting = [v for v, t in ready_at.items() if t <= now + 1e-12]
        for v in starting:
            del ready_at[v]
            running.add(v)
        if not running:  # nothing can progress until the next op is ready
            if not ready_at:
                raise RuntimeError("the schedule deadlocks: a stream waits on an op that never runs")
            now = min(ready_at.values())
            continue
        demand: dict[Hashable, float] = {}
        for v in running:
            demand[engine[v]] = demand.get(engine[v], 0.0) + use[v]
        rate = {v: min(1.0, 1.0 / demand[engine[v]]) for v in running}  # fraction of its solo speed
        step = min(remaining[v] / rate[v] for v in running)
        if ready_at:
            step = min(step, max(min(ready_at.values()) - now, 0.0))
        now += step
        for v in list(running):
            remaining[v] -= step * rate[v]
            if remaining[v] <= 1e-12:
                running.discard(v)
                finish[v] = now
                next_index[sched.stream[v]] += 1
                done += 1
    return max(finish)
