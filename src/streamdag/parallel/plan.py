"""Whether splitting a layer over several devices pays, how, and over how many: a cost model. Pure code.

A plan names one step per layer of ``y = act(x @ W)``:

- ``"single"``: the layer on the first device;
- ``"splitK"``: split by the columns of ``W`` over a group of ``K`` devices
  (K = 2, 4, 8 or every device): device ``g`` computes the column block
  ``y_g`` from the whole input, so after each such layer every device of the
  next needs the other devices' blocks;
- ``"rowsK"``: split by the rows of ``x`` over ``K`` devices, each holding the
  whole of ``W``: device ``g`` computes its rows of ``y``. A run of row-split
  layers over the same devices exchanges nothing between its layers; the
  cost is a copy of ``W`` on every device of the group.

A layer's input arrives as the previous layer left it: whole on the first
device, in column blocks, or in row blocks. Each device multiplies what it
holds first and adds the products with the other pieces as their peer copies
arrive, one after another on its incoming copy stream, so the copies overlap
those products.

Which ``K`` devices form a group follows the measured links
(:meth:`Links.group`): the first device, then, one at a time, the device
whose copies to and from the group so far are cheapest, so that an uneven
machine (NVLink between some pairs, PCIe between others) groups the devices
linked best.

Costs come from measurement (:func:`streamdag.parallel.measure_costs` on
GPUs): the time of the layer on one device, of its block products and of its
row parts, and the latency and time per megabyte of a peer copy for every
ordered pair of devices. A dynamic program over the layers picks each layer's
step, with the final output gathered on the first device. A plan that splits
is returned only when it is estimated at least ``margin`` faster than keeping
every layer on one device: the model's error must not turn a small win on
paper into a loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["LayerCost", "LinkCost", "Links", "choose_layout", "choose_stages", "estimate", "split_sizes",
           "step_kind", "step_size"]

#: Where a layer's output is: ("cols" | "rows", the devices holding its blocks, by index).
State = tuple[str, tuple[int, ...]]

#: Group sizes a layer may be split over: powers of two divide the usual widths (and the device count).
SPLIT_SIZES = (2, 4, 8)
#: A split plan must be estimated at least this much faster than one device to be chosen: a gain
#: smaller than the model's error is not worth the risk of a loss.
MARGIN = 0.05
#: Estimates closer than this (relative) count as equal; then the plan with fewer layout changes wins.
TIE = 1e-9


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
        self.matrix: list[list[LinkCost | None]] = [list(row) for row in matrix]
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
    ``block_ms`` by its share of the arithmetic. ``rows_ms[k]`` is the whole
    layer on ``1/k`` of the rows.
    """

    single_ms: float
    block_ms: float
    in_mb: float  # the layer's whole input
    out_mb: float  # the layer's whole output
    products: Mapping[tuple[int, int], float] = field(default_factory=dict)
    rows_ms: Mapping[int, float] = field(default_factory=dict)  # K -> the whole layer on 1/K of the rows

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

    def row_ms(self, k: int) -> float:
        """The whole layer on ``1/k`` of the rows (scaled from ``single_ms`` where not measured)."""
        got = self.rows_ms.get(k)
        return got if got is not None else self.single_ms / k


def step_kind(step: str) -> str:
    """``"rows"`` for a row split, else ``"cols"`` (``"single"`` is one column block)."""
    return "rows" if step.startswith("rows") else "cols"


def step_size(step: str, n: int) -> int:
    """The devices a plan step uses: ``"single"`` 1, ``"split"`` all ``n``, ``"splitK"``/``"rowsK"`` K."""
    if step == "single":
        return 1
    if step == "split":
        return n
    for prefix in ("split", "rows"):
        if step.startswith(prefix) and step[len(prefix):].isdigit() and int(step[len(prefix):]) >= 2:
            return int(step[len(prefix):])
    raise ValueError(f"plan step {step!r}: use 'single', 'split' (every device), 'splitK' (by columns "
                     f"over K >= 2 devices: split2, split4, split8) or 'rowsK' (by rows: rows2, rows4, "
                     f"rows8)")


def split_sizes(n: int) -> list[int]:
    """The group sizes a layer may be split over on ``n`` devices: 2, 4, 8 up to ``n``, and ``n``."""
    return sorted({k for k in SPLIT_SIZES if k <= n} | ({n} if n >= 2 else set()))


def _links(link: LinkCost | Links, n: int) -> Links:
    if isinstance(link, Links):
        if link.n != n:
            raise ValueError(f"the link matrix covers {link.n} devices, the plan {n}: give the links of "
                             f"exactly the devices the plan uses, in their order")
        return link
    return Links.uniform(n, link)


def _step_ms(layer: LayerCost, src: State, dst: State, links: Links, n: int) -> float:
    """Finish time of a layer computed in layout ``dst`` from its input in layout ``src``."""
    (skind, have), (dkind, group) = src, dst
    p, k = len(have), len(group)
    if dkind == "rows" and skind == "rows":
        # every device already has its rows; other row blocks would have to be cut anew
        return layer.row_ms(k) if have == group else float("inf")
    if dkind == "cols":  # a column block from column blocks, or from full-width row blocks
        piece_mb = layer.in_mb / p
        product = layer.product_ms(p, k, n) if skind == "cols" else layer.product_ms(1, k, n) / p
    else:  # its rows of every column block
        piece_mb = layer.in_mb / (p * k)
        product = layer.row_ms(k) / p
    finish = 0.0
    for g in group:
        t = product if g in have else 0.0  # the piece it holds, first
        latency, moved = 0.0, 0.0
        for s in have:  # the others arrive one after another on g's incoming copy stream
            if s == g:
                continue
            link = links(s, g)
            latency, moved = max(latency, link.latency_ms), moved + piece_mb * link.ms_per_mb
            t = max(t, latency + moved) + product
        finish = max(finish, t)
    return finish


def _gather_ms(layer: LayerCost, state: State, links: Links, chunks: int) -> float:
    """Moving a split output's blocks to the first device; only the last row chunk of each is exposed."""
    group = state[1]
    if group == (0,):
        return 0.0
    block_mb = layer.out_mb / len(group) / chunks
    others = [links(s, 0) for s in group if s != 0]
    return max(c.latency_ms for c in others) + sum(block_mb * c.ms_per_mb for c in others)


def _state(step: str, n: int, links: Links) -> State:
    k = step_size(step, n)
    if k > n:
        raise ValueError(f"plan step {step!r} needs {k} devices, the plan has {n}: use a step of at most "
                         f"{n} devices, or plan over more devices")
    return step_kind(step), links.group(k)


def _start(start: str, n: int) -> State:
    if start not in ("single", "split"):
        raise ValueError(f"start={start!r}: use 'single' (whole on the first device) or 'split' (column "
                         f"blocks over every device)")
    return ("cols", (0,)) if start == "single" else ("cols", tuple(range(n)))


def estimate(plan: Sequence[str], layers: Sequence[LayerCost], n: int, link: LinkCost | Links,
             start: str = "single", gather: bool = True, gather_chunks: int = 1) -> float:
    """Estimated time of a whole chain run under ``plan`` over ``n`` devices.

    ``start`` is the input's layout: ``"single"`` (whole on the first device)
    or ``"split"`` (column blocks over all ``n``); ``gather`` adds moving a
    split output to the first device, of which only the last of
    ``gather_chunks`` row chunks is exposed. ``link`` is one cost for every
    pair, or the measured :class:`Links`. A plan the chain cannot run (a row
    split after a row split over other devices) is estimated ``inf``.
    """
    links = _links(link, n)
    state = _start(start, n)
    total = 0.0
    for step, layer in zip(plan, layers, strict=True):
        nxt = _state(step, n, links)
        total += _step_ms(layer, state, nxt, links, n)
        state = nxt
    if gather and layers:
        total += _gather_ms(layers[-1], state, links, gather_chunks)
    elif state[0] == "rows" and state[1] != (0,):
        return float("inf")  # output wanted in column blocks
    return total


def _better(a: tuple[float, int, list[str]], b: tuple[float, int, list[str]]) -> bool:
    """Faster, or as fast with fewer layout changes."""
    if a[0] < b[0] * (1 - TIE):
        return True
    return a[0] <= b[0] * (1 + TIE) and a[1] < b[1]


def choose_layout(layers: Sequence[LayerCost], n: int, link: LinkCost | Links, start: str = "single",
                  gather: bool = True, gather_chunks: int = 1, sizes: Sequence[int] | None = None,
                  margin: float = MARGIN, row_sizes: Sequence[int] | None = None) -> tuple[list[str], float]:
    """The plan of least estimated time over ``n`` devices, and that time.

    Each layer is kept on the first device, split by columns over a group of
    ``k`` devices, ``k`` from ``sizes`` (default: 2, 4, 8 up to ``n``, and
    ``n``), or split by rows over ``k`` from ``row_sizes`` (default: as
    ``sizes``; ``()`` for none). A split plan must be estimated at least
    ``margin`` (a fraction) faster than every layer on one device, else the
    plan is every layer on one device.
    """
    links = _links(link, n)
    single = ["single"] * len(layers)
    single_ms = estimate(single, layers, n, links, start, gather, gather_chunks)
    col_sizes = split_sizes(n) if sizes is None else sizes
    steps = ["single"] + [f"split{k}" for k in col_sizes if 2 <= k <= n] + \
        [f"rows{k}" for k in (col_sizes if row_sizes is None else row_sizes) if 2 <= k <= n]
    if n < 2 or not layers or len(steps) == 1:
        return single, single_ms
    states = {s: _state(s, n, links) for s in steps}
    # best[state] = (time so far, layout changes, plan) with the last layer's output in that layout
    best: dict[State, tuple[float, int, list[str]]] = {_start(start, n): (0.0, 0, [])}
    for layer in layers:
        nxt: dict[State, tuple[float, int, list[str]]] = {}
        for src, (t, changes, plan) in best.items():
            for step in steps:
                dst = states[step]
                option = (t + _step_ms(layer, src, dst, links, n), changes + (dst != src), [*plan, step])
                if dst not in nxt or _better(option, nxt[dst]):
                    nxt[dst] = option
        best = nxt
    if gather:
        best = {g: (t + _gather_ms(layers[-1], g, links, gather_chunks), c, plan)
                for g, (t, c, plan) in best.items()}
    else:  # the output is wanted in column blocks
        best = {g: option for g, option in best.items() if g[0] == "cols" or g[1] == (0,)}
    t, _, plan = min(best.values(), key=lambda option: (option[0], option[1]))
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
