"""Pipeline parallelism: micro-batches through stages on several devices, a bounded number in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..runtime.peers import empty_on

if TYPE_CHECKING:
    from ..runtime.core import Runtime

__all__ = ["pipeline"]


def pipeline(rt: Runtime, stages: Sequence[tuple[Callable[[Any], Any], str]], batches: Sequence[Any],
             max_in_flight: int = 2) -> list[Any]:
    """Run every micro-batch through ``stages`` (``(fn, device)`` pairs); returns the outputs in order.

    Stage ``s`` of micro-batch ``i`` runs on its device as soon as stage
    ``s - 1`` of that micro-batch is done, so different micro-batches occupy
    different devices at once; inputs cross devices as peer copies. At most
    ``max_in_flight`` micro-batches are unfinished at a time: the next waits
    for the oldest. The first micro-batch runs alone, to learn each stage's
    output shape; later stages write into buffers allocated up front.
    """
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
    if not stages:
        raise ValueError("pipeline needs at least one (fn, device) stage")
    outputs: list[Any] = []
    examples: list[Any] = []
    in_flight: deque[Any] = deque()
    for i, x in enumerate(batches):
        if i == 0:  # learn the shapes
            h = x
            for s, (fn, device) in enumerate(stages):
                h = rt.submit(fn, h, reads=[h], run_on=device, name=f"stage{s}[0]").result()
                examples.append(h)
            outputs.append(h)
            continue
        while len(in_flight) >= max_in_flight:
            in_flight.popleft().result()
        h = x
        last = None
        for s, (fn, device) in enumerate(stages):
            out = empty_on(examples[s], device)
            last = rt.submit(_into, fn, h, out, reads=[h], writes=[out], run_on=device, name=f"stage{s}[{i}]")
            h = out
        in_flight.append(last)
        outputs.append(h)
    for f in in_flight:
        f.result()
    return outputs


def _into(fn: Callable[[Any], Any], x: Any, out: Any) -> Any:
    return out.copy_(fn(x))
