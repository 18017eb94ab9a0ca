"""Whether splitting a layer over several devices pays: a cost model over measured times. Pure code.

A layer ``y = act(x @ W)`` over ``k`` devices is split by the columns of
``W``: device ``g`` computes the column block ``y_g``. Its input arrives as
either one block on the first device ("single" layout) or ``k`` column blocks,
one per device ("split" layout). Device ``g`` computes ``x_g @ W[g-th rows,
g-th cols]`` first, with what it holds, and adds the products with the other
blocks as their peer copies arrive: the copies overlap that first product.

Costs come from measurement (:func:`streamdag.parallel.measure_costs` on
GPUs): the time of the layer on one device, of one block product, and the
latency and time per megabyte of a peer copy. A dynamic program over the
layers picks, for each, "split" or "single" (on the first device), with the
final output gathered on the first device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LayerCost", "LinkCost", "choose_layout", "estimate"]


@dataclass(frozen=True)
class LinkCost:
    """A peer copy takes ``latency_ms + megabytes * ms_per_mb`` (cross-device event waits included)."""

    latency_ms: float
    ms_per_mb: float

    def copy_ms(self, megabytes: float) -> float:
        return self.latency_ms + megabytes * self.ms_per_mb


@dataclass(frozen=True)
class LayerCost:
    """Measured on one device: the whole layer, and one of its ``k * k`` block products."""

    single_ms: float
    block_ms: float
    in_mb: float  # the layer's whole input
    out_mb: float  # the layer's whole output


def _split_ms(layer: LayerCost, layout: str, k: int, link: LinkCost) -> float:
    """Finish time of a split layer, from the moment its input is complete."""
    c = layer.block_ms
    if layout == "split":  # device g holds block g; the k-1 others arrive one after another
        t = c
        for j in range(1, k):
            arrival = link.latency_ms + j * (layer.in_mb / k) * link.ms_per_mb
            t = max(t, arrival) + c
        return t
    # the whole input is on the first device: the others wait for all of it
    return link.copy_ms(layer.in_mb) + k * c


def _single_ms(layer: LayerCost, layout: str, k: int, link: LinkCost) -> float:
    if layout == "single":
        return layer.single_ms
    part = layer.single_ms / k  # the product with the local block first
    t = part
    for j in range(1, k):
        arrival = link.latency_ms + j * (layer.in_mb / k) * link.ms_per_mb
        t = max(t, arrival) + part
    return t


def estimate(plan: Sequence[str], layers: Sequence[LayerCost], k: int, link: LinkCost,
             start: str = "single", gather: bool = True, gather_chunks: int = 1) -> float:
    """Estimated time of a whole chain run under ``plan``.

    ``start`` is the input's layout; ``gather`` adds moving a split output to the
    first device, of which only the last of ``gather_chunks`` row chunks is exposed.
    """
    layout, total = start, 0.0
    for choice, layer in zip(plan, layers, strict=True):
        step = _split_ms if choice == "split" else _single_ms
        total += step(layer, layout, k, link)
        layout = choice
    if gather and layout == "split" and layers:
        total += link.copy_ms(layers[-1].out_mb * (k - 1) / k / gather_chunks)
    return total


def choose_layout(layers: Sequence[LayerCost], k: int, link: LinkCost, start: str = "single",
                  gather: bool = True, gather_chunks: int = 1) -> tuple[list[str], float]:
    """The plan ("split" / "single" per layer) of least estimated time, and that time."""
    if k < 2 or not layers:
        single = ["single"] * len(layers)
        return single, estimate(single, layers, max(k, 1), link, start, gather, gather_chunks)
    # best[layout] = (time so far, plan) with the last layer's output in that layout
    best: dict[str, tuple[float, list[str]]] = {start: (0.0, [])}
    for layer in layers:
        nxt: dict[str, tuple[float, list[str]]] = {}
        for layout, (t, plan) in best.items():
            for choice in ("single", "split"):
                step = _split_ms(layer, layout, k, link) if choice == "split" else \
                    _single_ms(layer, layout, k, link)
                if choice not in nxt or t + step < nxt[choice][0]:
                    nxt[choice] = (t + step, [*plan, choice])
        best = nxt
    if gather and "split" in best:
        t, plan = best["split"]
        best["split"] = (t + link.copy_ms(layers[-1].out_mb * (k - 1) / k / gather_chunks), plan)
    t, plan = min(best.values(), key=lambda tp: tp[0])
    return plan, t
