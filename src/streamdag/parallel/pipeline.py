"""Pipeline parallelism: micro-batches through stages on several devices, a bounded number in flight."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..runtime.peers import empty_on
from .plan import Links, choose_stages

if TYPE_CHECKING:
    from ..runtime.core import Runtime

__all__ = ["pipeline", "place_stages"]


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


def place_stages(makers: Sequence[Callable[[str], Callable[[Any], Any]]], devices: Sequence[str],
                 example: Any = None, stage_ms: Sequence[float] | None = None,
                 out_mb: Sequence[float] | None = None, links: Links | None = None
                 ) -> tuple[list[tuple[Callable[[Any], Any], str]], int]:
    """Stages for :func:`pipeline`, placed on ``devices`` by the cost model (:func:`.plan.choose_stages`).

    ``makers[s](device)`` builds stage ``s``'s function for the device it is
    placed on (its weights there, say). The stages' times and output sizes
    are ``stage_ms`` and ``out_mb``, or measured on the first device from
    ``example``; the links are ``links``, or measured between GPUs. Returns
    the ``(fn, device)`` stages and the ``max_in_flight`` that keeps every
    device used busy: one micro-batch per device, and one more on its way.
    """
    devices = list(devices)
    if not devices:
        raise ValueError("place_stages needs at least one device")
    if stage_ms is None or out_mb is None:
        if example is None:
            raise ValueError("place_stages needs the stages' costs: pass stage_ms= and out_mb=, or an "
                             "example input to measure them on the first device")
        from .measure import measure_stages

        stage_ms, out_mb = measure_stages([m(devices[0]) for m in makers], example, devices[0])
    if len(stage_ms) != len(makers):
        raise ValueError(f"place_stages: {len(makers)} stages but {len(stage_ms)} stage times")
    if links is None:
        if len(devices) > 1 and not all(d.startswith("cuda") for d in devices):
            raise ValueError(f"place_stages over {', '.join(devices)}: links are measured between GPUs "
                             f"only; pass links= (a Links of these devices, in their order)")
        if len(devices) > 1:
            from .measure import measure_links

            links = measure_links(devices)
    if links is not None and links.n != len(devices):
        raise ValueError(f"links cover {links.n} devices, the stages {len(devices)}: give the link "
                         f"matrix of the devices, in their order")
    if len(devices) == 1 or links is None:
        placed = [0] * len(makers)
    else:
        placed, _ = choose_stages(stage_ms, out_mb, len(devices), links)
    stages = [(make(devices[d]), devices[d]) for make, d in zip(makers, placed)]
    return stages, len(set(placed)) + 1
