"""Whether splitting a layer over several devices pays, and over how many: a cost model. Pure code.

A layer ``y = act(x @ W)`` split over a group of ``k`` devices is split by
the columns of ``W``: the group's device ``g`` computes the column block
``y_g``. Its input arrives as the previous layer left it: whole on the first
device ("single"), or in ``p`` column blocks over the previous layer's group.
Device ``g`` computes the product with the block it holds first and adds the
products with the other blocks as their peer copies arrive, one after
another on its incoming copy stream, so the copies overlap those products.

A plan names one step per layer: ``"single"`` (on the first device) or
``"splitK"`` (over a group of ``K`` devices, K = 2, 4, 8 or every device).
Which ``K`` devices form the group follows the measured links
(:meth:`Links.group`): the first device, then, one at a time, the device
whose copies to and from the group so far are cheapest, so that an uneven
machine (NVLink between some pairs, PCIe between others) groups the devices
linked best.

Costs come from measurement (:func:`streamdag.parallel.measure_costs` on
GPUs): the time of the layer on one device, of its block products, and the
latency and time per megabyte of a peer copy for every ordered pair of
devices. A dynamic program over the layers picks each layer's step, with the
final output gathered on the first device. A plan that splits is returned
only when it is estimated at least ``margin`` faster than keeping every
layer on one device: the model's error must not turn a small win on paper
into a loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["LayerCost", "LinkCost", "Links", "choose_layout", "choose_stages", "estimate", "split_sizes",
           "step_size"]

#: Group sizes a layer may be split over: powers of two divide the usual widths (and the device count).
SPLIT_SIZES = (2, 4, 8)
#: A split plan must be estimated at least this much faster than one device to be chosen.
MARGIN = 0.02


@dataclass(frozen=True)
class LinkCost:
    """A peer copy takes ``latency_ms + megabytes * ms_per_mb`` (cross-device event waits included)."""

    latency_ms: float
    ms_per_mb: float

    def copy_ms(self, megabytes: float) -> float:
        return self.latency_ms + megabytes * self.ms_per_mb


class Links:
    """The peer-copy cost of every ordered pair of ``n`` devices, by index (0 is the first device)."""

    def __init__(self, matrix: Sequence[Sequence[LinkCost | None]]) -> None:
        n = len(matrix)
        for i, row in enumerate(matrix):
            if len(row) != n:
                raise ValueError(f"Links needs a square matrix: row {i} has {len(row)} entries, not {n}")
            for j, cost in enumerate(row):
                if i != j and not isinstance(cost, LinkCost):
                    raise ValueError(f"Links: the copy from device {i} to device {j} has no LinkCost "
                                     f"({cost!r}); measure it (measure_links) or give one")
        self.matrix = [list(row) for row in matrix]
        self.n = n

    @classmethod
    def uniform(cls, n: int, link: LinkCost) -> Links:
        """Every pair of ``n`` devices linked alike."""
        return cls([[None if i == j else link for j in range(n)] for i in range(n)])

    def __call__(self, src: int, dst: int) -> LinkCost:
        if src == dst:
            return LinkCost(0.0, 0.0)
        return self.matrix[src][dst]  # type: ignore[return-value]

    def group(self, k: int) -> tuple[int, ...]:
        """The ``k`` devices a split over ``k`` uses: device 0, then the best-linked to those chosen."""
        if not 1 <= k <= self.n:
            raise ValueError(f"a group of {k} devices out of {self.n}: use 1 to {self.n}")
        chosen = [0]
        while len(chosen) < k:
            def worst(d: int) -> float:  # the slowest 1 MB copy between d and the group, either way
                return max(max(self(m, d).copy_ms(1.0), self(d, m).copy_ms(1.0)) for m in chosen)
            chosen.append(min((d for d in range(self.n) if d not in chosen), key=lambda d: (worst(d), d)))
        return tuple(chosen)

    def __repr__(self) -> str:
        return f"Links(n={self.n})"


@dataclass(frozen=True)
class LayerCost:
    """Measured on one device: the whole layer, and its block products.

    ``block_ms`` is one of the ``n * n`` block products when split over all
    ``n`` devices; ``products[(p, k)]`` is one product of an input column
    block of ``p`` by an output column block of ``k`` (the layer's input in
    ``p`` blocks, its output in ``k``). A pair not measured is scaled from
    ``block_ms`` by its share of the arithmetic.
    """

    single_ms: float
    block_ms: float
    in_mb: float  # the layer's whole input
    out_mb: float  # the layer's whole output
    products: Mapping[tuple[int, int], float] = field(default_factory=dict)

    def product_ms(self, p: int, k: int, n: int) -> float:
        """One product of an input block of ``p`` by an output block of ``k`` (``n``: all devices)."""
        got = self.products.get((p, k))
        if got is not None:
            return got
        if p == k == 1:
            return self.single_ms
        if k == 1:  # the layer on one device, by parts of its input
            return self.single_ms / p
        return self.block_ms * n * n / (p * k)


def step_size(step: str, n: int) -> int:
    """The number of devices a plan step uses: ``"single"`` 1, ``"split"`` all ``n``, ``"splitK"`` K."""
    if step == "single":
        return 1
    if step == "split":
        return n
    if step.startswith("split") and step[5:].isdigit() and int(step[5:]) >= 2:
        return int(step[5:])
    raise ValueError(f"plan step {step!r}: use 'single', 'split' (every device) or 'splitK' with K >= 2 "
                     f"devices (split2, split4, split8)")


def split_sizes(n: int) -> list[int]:
    """The group sizes a layer may be split over on ``n`` devices: 2, 4, 8 up to ``n``, and ``n``."""
    return sorted({k for k in SPLIT_SIZES if k <= n} | ({n} if n >= 2 else set()))


def _links(link: LinkCost | Links, n: int) -> Links:
    if isinstance(link, Links):
        if link.n < n:
            raise ValueError(f"the link matrix covers {link.n} devices, the plan {n}: measure the links "
                             f"of every device the plan uses")
        return link
    return Links.uniform(n, link)


def _step_ms(layer: LayerCost, src: tuple[int, ...], dst: tuple[int, ...], links: Links, n: int) -> float:
    """Finish time of a layer computed over group ``dst`` from its input in blocks over ``src``."""
    p, k = len(src), len(dst)
    product = layer.product_ms(p, k, n)
    block_mb = layer.in_mb / p
    finish = 0.0
    for g in dst:
        t = product if g in src else 0.0  # the block it holds, first
        latency, moved = 0.0, 0.0
        for s in src:  # the others arrive one after another on g's incoming copy stream
            if s == g:
                continue
            link = links(s, g)
            latency, moved = max(latency, link.latency_ms), moved + block_mb * link.ms_per_mb
            t = max(t, latency + moved) + product
        finish = max(finish, t)
    return finish


def _gather_ms(layer: LayerCost, group: tuple[int, ...], links: Links, chunks: int) -> float:
    """Moving a split output's blocks to the first device; only the last row chunk of each is exposed."""
    if group == (0,):
        return 0.0
    block_mb = layer.out_mb / len(group) / chunks
    others = [links(s, 0) for s in group if s != 0]
    return max(c.latency_ms for c in others) + sum(block_mb * c.ms_per_mb for c in others)


def _group(step: str, n: int, links: Links) -> tuple[int, ...]:
    k = step_size(step, n)
    if k > n:
        raise ValueError(f"plan step {step!r} needs {k} devices, the plan has {n}: use a step of at most "
                         f"{n} devices, or plan over more devices")
    return links.group(k)


def estimate(plan: Sequence[str], layers: Sequence[LayerCost], n: int, link: LinkCost | Links,
             start: str = "single", gather: bool = True, gather_chunks: int = 1) -> float:
    """Estimated time of a whole chain run under ``plan`` over ``n`` devices.

    ``start`` is the input's layout: ``"single"`` (whole on the first device)
    or ``"split"`` (column blocks over all ``n``); ``gather`` adds moving a
    split output to the first device, of which only the last of
    ``gather_chunks`` row chunks is exposed. ``link`` is one cost for every
    pair, or the measured :class:`Links`.
    """
    links = _links(link, n)
    group = (0,) if start == "single" else tuple(range(n))
    total = 0.0
    for step, layer in zip(plan, layers, strict=True):
        nxt = _group(step, n, links)
        total += _step_ms(layer, group, nxt, links, n)
        group = nxt
    if gather and layers:
        total += _gather_ms(layers[-1], group, links, gather_chunks)
    return total


def choose_layout(layers: Sequence[LayerCost], n: int, link: LinkCost | Links, start: str = "single",
                  gather: bool = True, gather_chunks: int = 1, sizes: Sequence[int] | None = None,
                  margin: float = MARGIN) -> tuple[list[str], float]:
    """The plan of least estimated time over ``n`` devices, and that time.

    Each layer is kept on the first device or split over a group of ``k``
    devices, ``k`` from ``sizes`` (default: 2, 4, 8 up to ``n``, and ``n``).
    A split plan must be estimated at least ``margin`` (a fraction) faster
    than every layer on one device, else the plan is every layer on one device.
    """
    links = _links(link, n)
    single = ["single"] * len(layers)
    single_ms = estimate(single, layers, n, links, start, gather, gather_chunks)
    steps = ["single"] + [f"split{k}" for k in (split_sizes(n) if sizes is None else sizes) if 2 <= k <= n]
    if n < 2 or not layers or len(steps) == 1:
        return single, single_ms
    groups = {s: _group(s, n, links) for s in steps}
    # best[group] = (time so far, plan) with the last layer's output in blocks over that group
    best: dict[tuple[int, ...], tuple[float, list[str]]] = {
        (0,) if start == "single" else tuple(range(n)): (0.0, [])}
    for layer in layers:
        nxt: dict[tuple[int, ...], tuple[float, list[str]]] = {}
        for src, (t, plan) in best.items():
            for step in steps:
                dst = groups[step]
                total = t + _step_ms(layer, src, dst, links, n)
                if dst not in nxt or total < nxt[dst][0]:
                    nxt[dst] = (total, [*plan, step])
        best = nxt
    if gather:
        best = {g: (t + _gather_ms(layers[-1], g, links, gather_chunks), plan)
                for g, (t, plan) in best.items()}
    t, plan = min(best.values(), key=lambda tp: tp[0])
    if plan != single and t > single_ms * (1 - margin):
        return single, single_ms
    return plan, t



def _part_ms(a: int, b: int, j: int, group: Sequence[int], stage_ms: Sequence[float],
             out_mb: Sequence[float], links: Links) -> float:
    """How busy the ``j``-th device of ``group`` is per micro-batch with stages ``[a, b)``: computing
    them, or receiving their input on its copy stream (beside the compute of other micro-batches)."""
    busy = float(sum(stage_ms[a:b]))
    if j:
        busy = max(busy, links(group[j - 1], group[j]).copy_ms(out_mb[a - 1]))
    return busy


def choose_stages(stage_ms: Sequence[float], out_mb: Sequence[float], n: int, link: LinkCost | Links,
                  margin: float = MARGIN) -> tuple[list[int], float]:
    """The device index of each pipeline stage, and the estimated time per micro-batch in steady state.

    Stages keep their order and are cut into runs of consecutive stages, one
    run per device of a group (:meth:`Links.group`), so that the busiest
    device, computing its stages or receiving its input (``out_mb`` of the
    stage before), is as little busy as possible. More than one device is used
    only when that is estimated at least ``margin`` faster than every stage on
    the first device.
    """
    if len(out_mb) != len(stage_ms):
        raise ValueError(f"choose_stages: {len(stage_ms)} stage times but {len(out_mb)} output sizes; "
                         f"give one of each per stage")
    links = _links(link, n)
    stages = len(stage_ms)
    one = float(sum(stage_ms))
    best_ms, best = one, [0] * stages
    for parts in range(2, min(n, stages) + 1):
        group = links.group(parts)
        # cut[(j, b)]: (busiest, cuts) with the first b stages on the first j devices of the group
        cut: dict[tuple[int, int], tuple[float, list[int]]] = {(0, 0): (0.0, [0])}
        for j in range(1, parts + 1):
            for b in range(j, stages - (parts - j) + 1):
                options = [(max(cut[(j - 1, a)][0], _part_ms(a, b, j - 1, group, stage_ms, out_mb, links)),
                            [*cut[(j - 1, a)][1], b]) for a in range(j - 1, b) if (j - 1, a) in cut]
                cut[(j, b)] = min(options, key=lambda o: o[0])
        t, cuts = cut[(parts, stages)]
        if t < best_ms and t < one * (1 - margin):
            best_ms, best = t, [group[j] for j in range(parts) for _ in range(cuts[j + 1] - cuts[j])]
    return best, best_ms
