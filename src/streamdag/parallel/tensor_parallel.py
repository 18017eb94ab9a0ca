"""A chain of linear layers over several devices, each layer planned by the cost model.

:class:`LinearChain`: layers ``act(h @ W_l)`` one after another; each layer
kept on the first device or split over a group of 2, 4, 8... devices as the
cost model of :mod:`.plan` decides from measured times and links, checked
against the whole chain on one device by timing both. Runs are recorded
graphs: a CUDA graph when everything stays on one GPU, a host replay of the
recorded schedule when it spans several. The layers are built from
:mod:`.layers`.

Every buffer is allocated when the chain records a plan; runs only write into them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..runtime.ops import then
from .kernels import kernels_for
from .layers import (
    Block,
    _bounds,
    _clone,
    _cols_from_rows,
    _row_chunks,
    _RowBlock,
    _rows_run,
    _view,
    column_linear,
)
from .plan import LayerCost, Links, choose_layout, estimate, split_sizes, step_kind, step_size

if TYPE_CHECKING:
    from ..runtime.core import Runtime

__all__ = ["LinearChain"]

#: Row chunks of a chain's last layer when its output is gathered: the gather of each overlaps the next.
GATHER_CHUNKS = 2
#: Row chunks of each device's rows in a run of row-split layers, for the same overlap.
ROW_CHUNKS = 4


@dataclass
class ChainInfo:
    """What :meth:`LinearChain.explain` reports."""

    plan: list[str]
    estimate_ms: dict[str, float] = field(default_factory=dict)
    measured_ms: dict[str, float] = field(default_factory=dict)
    layer_costs: list[LayerCost] = field(default_factory=list)
    links: Links | None = None
    chosen: str = ""
    groups: dict[str, list[str]] = field(default_factory=dict)


class LinearChain:
    """``h = act(h @ W_l)`` for each weight in turn, over ``devices`` of ``rt``.

    ``devices`` is a count (the runtime's first ``N`` devices), a list of the
    runtime's devices, or ``None`` (all of them). ``plan`` is ``"auto"``
    (measure, then let the cost model decide per layer, and keep a split plan
    only if it is measured faster than the chain on one device), ``"single"``,
    ``"split"`` (over every device), ``"splitK"`` (over a group of ``K``
    devices), or a list with one of those per layer. A split's ``K`` must
    divide the layer's output columns. The group of ``K`` devices follows the
    links (``links``, measured under ``"auto"``; else the first ``K`` devices).
    ``row_chunks`` cuts split layers into row chunks, so that the next layer
    starts on the first chunk while the last is computed (``None``: measured,
    1 or 2, under ``"auto"``; else 1). ``exchange`` is how split layers pass
    their output on: ``"ksplit"`` (column blocks; the next layer sums products
    over them, the local one first) or ``"gathered"`` (every device gathers a
    full copy by row chunks); ``None``: measured under ``"auto"``, else ksplit.

    The input comes whole on the first device, or as column blocks over the
    devices (a list of :class:`Block`, as a previous tensor-parallel layer
    leaves it; :meth:`input_blocks` gives the chain's own, which need no copy).
    The output is whole on the first device when ``gather`` (the default),
    else column blocks.

    Two ways to run it, not to be mixed on one chain: :meth:`run` is an op of
    the runtime and returns a Future of the output; calling the chain returns
    the output ordered on the caller's current streams, as PyTorch does, and
    once the chain is captured (``capture``, from its third call) it replays
    the CUDA graph there directly. Outputs are the chain's own buffers,
    rewritten by the next run, unless ``copy_out``.
    """

    def __init__(self, rt: Runtime, weights: Sequence[Any], activation: str | None = "relu",
                 plan: str | Sequence[str] = "auto", gather: bool = True, capture: bool = True,
                 row_chunks: int | None = None, exchange: str | None = None,
                 devices: int | Sequence[str] | None = None, links: Links | None = None) -> None:
        if not weights:
            raise ValueError("LinearChain needs at least one weight")
        for a, b in itertools.pairwise(weights):
            if a.shape[1] != b.shape[0]:
                raise ValueError(f"weights do not chain: {tuple(a.shape)} then {tuple(b.shape)}")
        if activation not in (None, "relu"):
            raise ValueError(f"activation={activation!r}: LinearChain supports 'relu' or None")
        self.rt = rt
        self.weights: list[Any] = list(weights)
        self.activation = activation
        self.gather = gather
        self.capture = capture
        if row_chunks is not None and row_chunks < 1:
            raise ValueError(f"row_chunks must be at least 1, got {row_chunks}")
        self.row_chunks = row_chunks
        if exchange not in (None, "ksplit", "gathered"):
            raise ValueError(f"exchange={exchange!r}: use 'ksplit', 'gathered' or None (measured)")
        self.exchange = exchange
        self.devices: list[str] = _chain_devices(rt, devices)
        if links is not None and links.n != len(self.devices):
            raise ValueError(f"links cover {links.n} devices, the chain {len(self.devices)}: give the "
                             f"link matrix of the chain's devices, in their order")
        self.links = links
        self._fast: dict[tuple[int, bool], _FastReplay] = {}  # captured graphs, by input shape
        self._plan_option = plan
        if plan != "auto":  # a given plan is checked now, against the weights and the devices
            self._normalized(plan)
        self._graphs: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}
        self._inputs: dict[tuple[Any, ...], Any] = {}
        self._chosen: dict[tuple[Any, ...], tuple[str, ...]] = {}
        #: per input shape: row chunks of split layers, and the mode (see ``_record``)
        self._variant: dict[tuple[Any, ...], tuple[int, str]] = {}
        #: what was decided for each input shape and layout: (rows, "single" | "split") -> ChainInfo
        self.infos: dict[tuple[int, str], ChainInfo] = {}

    # ------------------------------------------------------------------ API
    def input_blocks(self, example: Any) -> list[Block]:
        """The chain's own input column blocks for inputs shaped like ``example``: fill them, pass them."""
        return self._input(example, "split")

    def run(self, x: Any) -> Any:
        """Launch one run on ``x``; a Future of the output (valid until the next run)."""
        graph, inp, out, layout = self._prepare(x)
        if layout == "single":
            if x is not inp:
                self.rt.copy(inp, x, name="chain_input")
        else:
            for given, own in zip(x, inp, strict=True):
                if given.value is not own.value:
                    self.rt.copy(own.value, given.value, name="chain_input")
        return then(graph.run(), lambda _r: out, "chain")

    def __call__(self, x: Any, copy_out: bool = True) -> Any:
        split = isinstance(x, list | tuple)
        fast = self._fast.get(((x[0].value if split else x).shape[0], split))
        if fast is not None:  # captured: replay here, with what was worked out once
            out = fast.out
            fast.replay(x)
        else:
            graph, inp, out, layout = self._prepare(x)
            if graph.captured:
                fast = self._fast[(inp.shape[0] if layout == "single" else inp[0].value.shape[0],
                                   layout == "split")] = _FastReplay(self, graph, inp, out, layout)
                fast.replay(x)
            else:
                out = self.run(x).result()
        if not copy_out:
            return out
        return [Block(_clone(b.value), b.device, b.start, b.stop) for b in out] \
            if isinstance(out, list) else _clone(out)

    def _prepare(self, x: Any) -> tuple[Any, Any, Any, str]:
        layout = "split" if isinstance(x, list | tuple) else "single"
        example = x[0].value if layout == "split" else x
        key = (example.shape[0], layout)
        plan = self._chosen.get(key)
        if plan is None:
            plan = self._chosen[key] = self._decide(example, layout)
        chunks, mode = self._variant.get(key, (self.row_chunks or 1, self.exchange or "ksplit"))
        graph, inp, out = self._graph(example, layout, plan, chunks, mode)
        return graph, inp, out, layout

    def explain(self) -> str:
        """Per input shape: the plan per layer, the cost model's estimates and the measured times."""
        if not self.infos:
            return "not run yet: the plan is made on the first run"
        lines = [f"LinearChain over {', '.join(self.devices)}: {len(self.weights)} layers"]
        for (rows, layout), info in self.infos.items():
            lines += self._explain_one(rows, layout, info)
        return "\n".join(lines)

    @staticmethod
    def _explain_one(rows: int, layout: str, info: ChainInfo) -> list[str]:
        lines = [f"- {rows} rows, input {'whole' if layout == 'single' else 'split'}: "
                 f"plan {'/'.join(info.plan)} ({info.chosen})"]
        if info.links is not None:
            lines += _explain_links(info.links)
        for step, group in info.groups.items():
            lines.append(f"  {step}: {', '.join(group)}")
        for i, c in enumerate(info.layer_costs):
            lines.append(f"  layer {i}: one device {c.single_ms:.3f} ms, block product {c.block_ms:.3f} ms "
                         f"-> {info.plan[i]}")
        for key, ms in info.estimate_ms.items():
            lines.append(f"  estimate {key}: {ms:.3f} ms")
        for key, ms in info.measured_ms.items():
            lines.append(f"  measured {key}: {ms:.3f} ms")
        return lines

    # ------------------------------------------------------------- internals
    def _normalized(self, plan: str | Sequence[str]) -> tuple[str, ...]:
        """The plan with one ``"single"`` or ``"splitK"`` per layer; bad steps get an error with the fix."""
        n, devices = len(self.weights), len(self.devices)
        steps = [plan] * n if isinstance(plan, str) else list(plan)
        if len(steps) != n or not all(isinstance(s, str) for s in steps):
            raise ValueError(f"plan={plan!r}: use 'auto', 'single', 'split', 'splitK', 'rowsK' or a list "
                             f"of those with one entry per layer ({n})")
        if devices < 2:
            return ("single",) * n
        out: list[str] = []
        for i, (step, w) in enumerate(zip(steps, self.weights)):
            k = step_size(step, devices)
            if k > devices:
                raise ValueError(f"plan step {step!r} of layer {i} needs {k} devices, the chain has "
                                 f"{devices} ({', '.join(self.devices)}): use split{devices} or less, or a "
                                 f"runtime over {k} devices")
            if step_kind(step) == "rows":
                if out and out[-1].startswith("rows") and out[-1] != f"rows{k}":
                    raise ValueError(f"plan step {step!r} of layer {i} follows {out[-1]!r}: row splits in "
                                     f"a row share their devices; use one K for them, or put a 'splitK' "
                                     f"or 'single' between")
                if i == n - 1 and not self.gather:
                    raise ValueError(f"plan step {step!r} of the last layer leaves the output in row blocks, "
                                     f"but gather=False wants column blocks: end with 'single' or a "
                                     f"'splitK', or gather=True")
                out.append(f"rows{k}")
                continue
            if k > 1 and w.shape[1] % k:
                fits = [d for d in range(2, devices + 1) if w.shape[1] % d == 0]
                raise ValueError(f"plan step {step!r} of layer {i}: {k} devices do not divide its "
                                 f"{w.shape[1]} output columns; use a split the columns divide "
                                 f"({', '.join(f'split{d}' for d in fits) or 'none fits'}) or 'single', or "
                                 f"pad the weight to a multiple of {k} columns")
            out.append("single" if k == 1 else f"split{k}")
        return tuple(out)

    def _group(self, step: str) -> list[str]:
        """The devices of a plan step: the first one, or a group by the links (else the first ``K``)."""
        k = step_size(step, len(self.devices))
        if self.links is None:
            return self.devices[:k]
        return [self.devices[i] for i in self.links.group(k)]

    def _decide(self, x: Any, layout: str) -> tuple[str, ...]:
        single = ("single",) * len(self.weights)
        if self._plan_option != "auto":
            plan = self._normalized(self._plan_option)
            self.infos[(x.shape[0], layout)] = ChainInfo(list(plan), chosen="given")
            return plan
        if len(self.devices) < 2 or not _is_cuda(x):
            self.infos[(x.shape[0], layout)] = ChainInfo(
                list(single), chosen="nothing to measure or split over: one device")
            return single
        from .measure import measure_costs

        n = len(self.devices)
        sizes = [k for k in split_sizes(n) if all(w.shape[1] % k == 0 for w in self.weights)]
        row_sizes = [k for k in split_sizes(n) if k <= x.shape[0]]
        layers, links = measure_costs(self.weights, x.shape[0], x.dtype, self.devices, sizes, row_sizes)
        self.links = self.links or links
        plan, est = choose_layout(layers, n, self.links, layout, self.gather, GATHER_CHUNKS, sizes,
                                  row_sizes=row_sizes)
        info = ChainInfo(plan, layer_costs=layers, links=self.links)
        info.groups = {s: self._group(s) for s in dict.fromkeys(plan) if s != "single"}
        info.estimate_ms = {"/".join(plan): est, "single": estimate(single, layers, n, self.links, layout,
                                                                    self.gather, GATHER_CHUNKS)}
        self.infos[(x.shape[0], layout)] = info
        if tuple(plan) == single:
            info.chosen = "the cost model keeps every layer on one device"
            return single
        # never slower: the split plan must beat one device when measured, not only on paper; split
        # layers in two row chunks are measured too (the next layer starts on the first chunk)
        chunk_options = [self.row_chunks] if self.row_chunks else [1, 2]
        candidates = []
        if not any(s.startswith("split") for s in plan):  # chunks and exchange change column splits only
            candidates.append((tuple(plan), chunk_options[0], self.exchange or "ksplit"))
        else:
            if self.exchange in (None, "ksplit"):
                candidates += [(tuple(plan), n, "ksplit") for n in chunk_options]
            if self.exchange in (None, "gathered"):
                candidates.append((tuple(plan), max(chunk_options), "gathered"))
        candidates.append((single, 1, "ksplit"))
        measured = {c: self._time(x, layout, *c) for c in candidates}
        info.measured_ms = {
            ("single" if p == single else "/".join(p) + f", {n} row chunk(s), {mode}"): ms
            for (p, n, mode), ms in measured.items()}
        best, chunks, mode = min(measured, key=measured.get)  # type: ignore[arg-type]
        self._variant[(x.shape[0], layout)] = (chunks, mode)
        for p, n, m in candidates:  # the losers' buffers and CUDA graphs are not needed again
            if (p, n, m) != (best, chunks, mode):
                self._graphs.pop((x.shape[0], layout, p, n, m), None)
        info.chosen = (f"measured faster, {chunks} row chunk(s), {mode}" if best != single
                       else "split measured slower: one device")
        info.plan = list(best)
        return best

    def _time(self, x: Any, layout: str, plan: tuple[str, ...], chunks: int = 1, mode: str = "ksplit",
              runs: int = 5) -> float:
        graph, _, _ = self._graph(x, layout, plan, chunks, mode)
        for _ in range(3):  # eager first run, then the capture (one device) or host replays
            graph.run().result()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            for _ in range(3):
                graph.run()
            graph.run().result()
            self.rt.synchronize()
            times.append((time.perf_counter() - t0) * 1e3 / 4)
        return sorted(times)[len(times) // 2]

    def _copy_blocks(self, blocks: list[Block], into: dict[str, Any], rows: int, chunks: int,
                     name: str) -> None:
        """Copy every block into the matrices of ``into`` on the other devices, row chunk by chunk."""
        for b in blocks:
            for device, matrix in into.items():
                if device == b.device:
                    continue
                for r0, r1 in _row_chunks(rows, chunks):
                    self.rt.copy(_view(matrix, r0, r1, b.start, b.stop), _view(b.value, r0, r1),
                                 name=f"{name}@{b.device}->{device}[{r0}:{r1}]")

    def _input(self, x: Any, layout: str) -> Any:
        key = (x.shape[0], layout)
        got = self._inputs.get(key)
        if got is None:
            kern = kernels_for(self.weights[0])
            rows, cols = x.shape[0], self.weights[0].shape[0]
            if layout == "single":
                got = kern.empty(rows, cols, self.weights[0], self.devices[0])
            else:
                got = [Block(kern.empty(rows, b - a, self.weights[0], d), d, a, b)
                       for d, (a, b) in zip(self.devices, _bounds(cols, len(self.devices)))]
            self._inputs[key] = got
        return got

    def _graph(self, x: Any, layout: str, plan: tuple[str, ...], chunks: int = 1,
               mode: str = "ksplit") -> tuple[Any, Any, Any]:
        key = (x.shape[0], layout, plan, chunks, mode)
        got = self._graphs.get(key)
        if got is None:
            got = self._graphs[key] = self._record(x, layout, plan, chunks, mode)
        return got

    def _record(self, x: Any, layout: str, plan: tuple[str, ...], chunks: int,
                mode: str = "ksplit") -> tuple[Any, Any, Any]:
        """Record one run. ``mode`` is how a column-split layer's output reaches the next one:

        - ``"ksplit"``: left in column blocks; the next layer multiplies each block by
          its rows of the weight and sums (the local block first, while the others arrive);
        - ``"gathered"``: every device gathers a full copy, by row chunks, and the next
          layer multiplies it in one product over the whole width (where the next layer
          is split by columns over the same devices or fewer of them; else as ``"ksplit"``).

        A run of row-split layers goes through :func:`.layers._rows_run` at once.
        """
        rt, kern, first = self.rt, kernels_for(self.weights[0]), self.devices[0]
        rows, last = x.shape[0], len(self.weights) - 1
        inp = self._input(x, layout)
        gathering = self.gather and plan[-1] != "single"
        groups = [self._group(step) for step in plan]
        out = kern.empty(rows, self.weights[-1].shape[1], self.weights[-1], first) if gathering else None
        with rt.record() as graph:
            cur: Any = [Block(inp, first, 0, inp.shape[1])] if layout == "single" else list(inp)
            full: dict[str, Any] | None = None  # each device's gathered copy, in "gathered" mode
            i = 0
            while i <= last:
                w, step, devices = self.weights[i], plan[i], groups[i]
                if step_kind(step) == "rows":
                    j = i
                    while j < last and plan[j + 1] == step:
                        j += 1
                    cur = _rows_run(rt, cur, self.weights[i:j + 1], devices, self.activation, f"layer{i}",
                                    max(chunks, ROW_CHUNKS), out if j == last else None, first)
                    i, full = j + 1, None
                    continue
                bounds = _bounds(w.shape[1], len(devices))
                gather_now = i == last and gathering
                n = max(chunks, GATHER_CHUNKS) if gather_now else chunks if step != "single" else 1
                outputs = {first: _view(out, 0, rows, *bounds[0])} if gather_now else None
                keep_full = (mode == "gathered" and i < last and step != "single" and plan[i + 1] != "single"
                             and step_kind(plan[i + 1]) == "cols" and set(groups[i + 1]) <= set(devices))
                if keep_full:
                    full_next = {g: kern.empty(rows, w.shape[1], w, g) for g in groups[i + 1]}  # the readers
                    outputs = {g: _view(full_next[g], 0, rows, *bounds[j]) for j, g in enumerate(devices)
                               if g in full_next}
                if cur and isinstance(cur[0], _RowBlock):
                    cur = _cols_from_rows(rt, cur, w, devices, self.activation, f"layer{i}", outputs)
                else:
                    src = cur if full is None else {g: [Block(full[g], g, 0, w.shape[0])] for g in devices}
                    cur = column_linear(rt, src, w, devices, self.activation, name=f"layer{i}", row_chunks=n,
                                        outputs=outputs)
                full = None
                if gather_now:  # the others' blocks copied in by row chunks, the first while the last compute
                    self._copy_blocks(cur[1:], {first: out}, rows, n, "gather")
                elif keep_full:
                    self._copy_blocks(cur, full_next, rows, chunks, f"layer{i}.gather")
                    full = full_next
                i += 1
            if not gathering:
                out = cur[0].value if len(cur) == 1 and cur[0].device == first else cur
        graph.capture = graph.capture and self.capture
        return graph, inp, out


class _FastReplay:
    """A captured chain, replayed on the caller's stream of the first GPU, fenced with the others'."""

    def __init__(self, chain: LinearChain, graph: Any, inp: Any, out: Any, layout: str) -> None:
        import torch

        self.graph, self.inp, self.out, self.split = graph, inp, out, layout == "split"
        self.index = torch.device(chain.devices[0]).index
        self.others = [torch.device(d).index for d in graph.touched_devices if d != chain.devices[0]]
        self.fences = [(torch.cuda.Event(), torch.cuda.Event()) for _ in self.others]

    def replay(self, x: Any) -> None:
        import torch

        caller_device = torch.cuda.current_device()
        if caller_device != self.index:
            torch.cuda.set_device(self.index)
        try:
            if not self.split:
                if x is not self.inp:
                    self.inp.copy_(x)
            else:
                for given, own in zip(x, self.inp, strict=True):
                    if given.value is not own.value:
                        own.value.copy_(given.value)
            if not self.others:
                self.graph.replay_on_current_stream()
                return
            main = torch.cuda.current_stream()
            for d, (before, _) in zip(self.others, self.fences):  # the caller's work there comes first
                before.record(torch.cuda.current_stream(d))
                main.wait_event(before)
            self.graph.replay_on_current_stream()
            for d, (_, after) in zip(self.others, self.fences):  # and its next work there after
                after.record(main)
                torch.cuda.current_stream(d).wait_event(after)
        finally:
            if caller_device != self.index:
                torch.cuda.set_device(caller_device)


def _chain_devices(rt: Runtime, devices: int | Sequence[str] | None) -> list[str]:
    """The chain's devices: the runtime's first ``devices`` of them, the ones named, or all."""
    have = list(rt.devices)
    if devices is None:
        return have
    if isinstance(devices, int):
        if not 1 <= devices <= len(have):
            raise ValueError(f"LinearChain(devices={devices}): the runtime has {len(have)} device(s) "
                             f"({', '.join(have)}); use 1 to {len(have)}, or make the runtime over more "
                             f"devices (sd.Runtime(devices=[...]))")
        return have[:devices]
    named = [str(d) for d in devices]
    missing = [d for d in named if d not in have]
    if missing or not named or len(set(named)) != len(named):
        raise ValueError(f"LinearChain(devices={named}): name each device once, from the runtime's "
                         f"({', '.join(have)}); not of the runtime: {', '.join(missing) or 'none'}")
    return named


def _explain_links(links: Links) -> list[str]:
    """The measured peer copies: the range over all pairs, and the slowest pair."""
    pairs = [(links(s, d), s, d) for s in range(links.n) for d in range(links.n) if s != d]
    if not pairs:
        return []
    lat = [c.latency_ms * 1e3 for c, _, _ in pairs]
    per_mb = [c.ms_per_mb * 1e3 for c, _, _ in pairs]
    worst, s, d = max(pairs, key=lambda p: p[0].ms_per_mb)
    return [f"  peer copies ({len(pairs)} pairs): {min(lat):.1f}-{max(lat):.1f} us + "
            f"{min(per_mb):.2f}-{max(per_mb):.2f} us/MB; slowest {s}->{d}: {worst.ms_per_mb * 1e3:.2f} us/MB"]


def _is_cuda(x: Any) -> bool:
    return getattr(getattr(x, "device", None), "type", None) == "cuda"
