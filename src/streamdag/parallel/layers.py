"""Tensor-parallel linear layers over the devices of a runtime, built from ops and peer copies.

- :func:`column_linear`: ``act(x @ W)`` split by the columns of ``W``: device
  ``g`` computes column block ``g``. ``x`` may come whole or as column blocks
  spread over the devices (a previous column layer's output); then each device
  multiplies the block it holds first, and adds the products with the other
  blocks as their peer copies arrive, so that the gather of one layer overlaps
  the compute of the next.
- :func:`row_linear`: ``x @ W`` with ``x`` in column blocks and ``W`` split by
  rows: each device multiplies its own block, and the partial sums are reduced
  on one device.
- ``_rows_run`` and ``_cols_from_rows`` (for :class:`.LinearChain`): layers split
  by the rows of their input, each device holding the whole weights, and the
  way back to column blocks.

Every buffer is allocated when a layer is built; runs only write into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .kernels import kernels_for

if TYPE_CHECKING:
    from ..runtime.core import Runtime

__all__ = ["Block", "column_linear", "row_linear"]


@dataclass(frozen=True)
class Block:
    """Columns ``[start, stop)`` of a matrix, held on ``device``."""

    value: Any
    device: str
    start: int
    stop: int


def _bounds(n: int, k: int) -> list[tuple[int, int]]:
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def _row_chunks(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``rows`` cut into ``chunks`` ranges, none empty (fewer where there are fewer rows)."""
    return _bounds(rows, max(1, min(chunks, rows)))


def _as_blocks(x: Any) -> list[Block]:
    if isinstance(x, list | tuple):
        return list(x)
    kern = kernels_for(x)
    return [Block(x, kern.device_of(x), 0, x.shape[1])]


def _product(rt: Runtime, blocks: Sequence[Block], weight_blocks: Sequence[Any], out: Any, device: str,
             activation: str | None, name: str) -> None:
    """``out = act(sum_j blocks[j] @ weight_blocks[j])`` on ``device``, local blocks first."""
    kern = kernels_for(out)
    order = sorted(range(len(blocks)), key=lambda j: blocks[j].device != device)
    for i, j in enumerate(order):
        x, w = blocks[j].value, weight_blocks[j]
        fn = kern.mm_into if i == 0 else kern.addmm_into
        rt.submit(fn, out, x, w, reads=[x, w], writes=[out], run_on=device, name=f"{name}.mm{j}")
    if activation == "relu":
        rt.submit(kern.relu_, out, writes=[out], run_on=device, name=f"{name}.relu")
    elif activation is not None:
        raise ValueError(f"activation={activation!r}: use 'relu' or None")


def _weight_blocks(w: Any, in_bounds: Sequence[tuple[int, int]], cols: tuple[int, int],
                   device: str) -> list[Any]:
    kern = kernels_for(w)
    return [kern.block(w, slice(a, b), slice(*cols), device) for a, b in in_bounds]


def column_linear(rt: Runtime, x: Any, w: Any, devices: Sequence[str] | None = None,
                  activation: str | None = None, name: str = "column_linear", row_chunks: int = 1,
                  outputs: dict[str, Any] | None = None) -> list[Block]:
    """``act(x @ w)`` split by the columns of ``w`` over ``devices``; returns one column block per device.

    ``x`` is a matrix on one device, a list of :class:`Block`, or a dict giving
    each device the blocks it reads (a full copy of its own, say). Weight
    blocks are copied to their devices here, once; record the call in
    ``rt.record()`` to run it many times. ``row_chunks`` computes each block
    in that many row chunks, so that whatever consumes the first chunks (a
    gather, say) overlaps the computing of the last. ``outputs`` gives the
    buffer of a device's block (a column slice of a larger matrix, say).
    """
    devices = list(devices or rt.devices)
    per_device = {g: _as_blocks(x[g] if isinstance(x, dict) else x) for g in devices}
    kern = kernels_for(w)
    out_blocks = []
    for g, cols in zip(devices, _bounds(w.shape[1], len(devices))):
        blocks = per_device[g]
        rows = blocks[0].value.shape[0]
        in_bounds = [(b.start, b.stop) for b in blocks]
        given = (outputs or {}).get(g)
        out = given if given is not None else kern.empty(rows, cols[1] - cols[0], w, g)
        weights = _weight_blocks(w, in_bounds, cols, g)
        for r0, r1 in _row_chunks(rows, row_chunks):
            part = [Block(_view(b.value, r0, r1), b.device, b.start, b.stop) for b in blocks]
            label = f"{name}@{g}" if row_chunks == 1 else f"{name}@{g}[{r0}:{r1}]"
            _product(rt, part, weights, _view(out, r0, r1), g, activation, label)
        out_blocks.append(Block(out, g, *cols))
    return out_blocks


def row_linear(rt: Runtime, x: Sequence[Block], w: Any, out_device: str | None = None,
               name: str = "row_linear") -> Any:
    """``x @ w`` with ``x`` in column blocks: each device multiplies its block by its rows of ``w``.

    The partial products are summed on ``out_device`` (default: the runtime's
    first device) as their peer copies arrive.
    """
    out_device = out_device or rt.device
    kern = kernels_for(w)
    rows, cols = x[0].value.shape[0], w.shape[1]
    partials = []
    for b in x:
        part = kern.empty(rows, cols, w, b.device)
        wb = kern.block(w, slice(b.start, b.stop), slice(0, cols), b.device)
        rt.submit(kern.mm_into, part, b.value, wb, reads=[b.value, wb], writes=[part], run_on=b.device,
                  name=f"{name}.partial@{b.device}")
        partials.append(part)
    local = sorted(partials, key=lambda p: kern.device_of(p) != out_device)
    out = local[0] if kern.device_of(local[0]) == out_device else None
    if out is None:
        out = kern.empty(rows, cols, w, out_device)
        rt.copy(out, local[0], name=f"{name}.first")
    for p in local[1:]:
        rt.submit(kern.add_into, out, p, reads=[p], writes=[out], run_on=out_device, name=f"{name}.reduce")
    return out


@dataclass(frozen=True)
class _RowBlock:
    """Rows ``[start, stop)`` of a matrix, every column, held on ``device``."""

    value: Any
    device: str
    start: int
    stop: int


def _rows_run(rt: Runtime, x: Sequence[Block], weights: Sequence[Any], devices: Sequence[str],
              activation: str | None, name: str, row_chunks: int = 1, gather_into: Any = None,
              gather_device: str | None = None) -> list[_RowBlock]:
    """``h = act(h @ W)`` for each of ``weights``, split by the rows of ``h`` over ``devices``.

    Every device holds each weight whole and computes its own rows; the first
    layer reads its rows of the column blocks ``x`` (its own first, the
    others as their peer copies arrive), the later ones read only what the
    device computed, so nothing crosses devices between the layers. Each
    device runs its rows in ``row_chunks`` chunks, every chunk through all the
    layers before the next, so that a gather of the output (``gather_into``,
    a matrix on ``gather_device`` receiving every device's rows) overlaps the
    computing of the later chunks.
    """
    kern = kernels_for(weights[0])
    rows = x[0].value.shape[0]
    in_bounds = [(b.start, b.stop) for b in x]
    out = []
    k = len(devices)  # fewer rows than devices: one row each on the first devices
    bounds = _bounds(rows, k) if rows >= k else [(min(i, rows), min(i + 1, rows)) for i in range(k)]
    for g, (r0, r1) in zip(devices, bounds):
        if r1 == r0:
            continue
        ws = [_weight_blocks(weights[0], in_bounds, (0, weights[0].shape[1]), g)]
        ws += [[kern.block(w, slice(0, w.shape[0]), slice(0, w.shape[1]), g)] for w in weights[1:]]
        ys = [kern.empty(r1 - r0, w.shape[1], w, g) for w in weights[:-1]]
        ys.append(_view(gather_into, r0, r1) if gather_into is not None and g == gather_device
                  else kern.empty(r1 - r0, weights[-1].shape[1], weights[-1], g))
        for c0, c1 in _row_chunks(r1 - r0, row_chunks):
            src = [Block(_view(b.value, r0 + c0, r0 + c1), b.device, b.start, b.stop) for b in x]
            for i, w in enumerate(weights):
                if i:
                    src = [Block(_view(ys[i - 1], c0, c1), g, 0, w.shape[0])]
                _product(rt, src, ws[i], _view(ys[i], c0, c1), g, activation,
                         f"{name}+{i}@{g}[{r0 + c0}:{r0 + c1}]")
            if gather_into is not None and g != gather_device:
                rt.copy(_view(gather_into, r0 + c0, r0 + c1), _view(ys[-1], c0, c1),
                        name=f"gather@{g}->{gather_device}[{r0 + c0}:{r0 + c1}]")
        out.append(_RowBlock(ys[-1], g, r0, r1))
    return out


def _cols_from_rows(rt: Runtime, x: Sequence[_RowBlock], w: Any, devices: Sequence[str],
                    activation: str | None, name: str, outputs: dict[str, Any] | None = None) -> list[Block]:
    """``act(x @ w)`` split by the columns of ``w``, from ``x`` in row blocks: one column block per device.

    Each device multiplies every row block (its own first, the others as their
    peer copies arrive) into those rows of its column block.
    """
    kern = kernels_for(w)
    rows = max(p.stop for p in x)
    out_blocks = []
    for g, cols in zip(devices, _bounds(w.shape[1], len(devices))):
        given = (outputs or {}).get(g)
        out = given if given is not None else kern.empty(rows, cols[1] - cols[0], w, g)
        wb = [kern.block(w, slice(0, w.shape[0]), slice(*cols), g)]
        for p in sorted(x, key=lambda p: p.device != g):
            _product(rt, [Block(p.value, p.device, 0, w.shape[0])], wb, _view(out, p.start, p.stop), g,
                     activation, f"{name}@{g}[{p.start}:{p.stop}]")
        out_blocks.append(Block(out, g, *cols))
    return out_blocks


def _view(m: Any, r0: int, r1: int, c0: int = 0, c1: int | None = None) -> Any:
    """Rows ``[r0, r1)`` and columns ``[c0, c1)`` of a matrix, as a view."""
    if r0 == 0 and r1 == m.shape[0] and c0 == 0 and c1 in (None, m.shape[1]):
        return m
    return kernels_for(m).view(m, r0, r1, c0, c1)


def _clone(value: Any) -> Any:
    return kernels_for(value).clone(value)
