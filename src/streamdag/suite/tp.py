"""The tensor-parallel chain on 1, 2, 4 and 8 GPUs, side by side in one run, against one GPU.

L layers of ``relu(h @ W)`` in bf16, D = 8192. For every GPU count ``N`` up
to the GPUs visible, streamdag runs :class:`streamdag.parallel.LinearChain`
over the first ``N`` GPUs with ``plan="auto"``: the cost model decides per
layer, from measured times and the measured peer links of every ordered pair
of GPUs, whether to keep it on one GPU or split it over 2, 4 or 8 of them,
and a split plan is kept only if measured faster than one GPU. Its input
comes two ways: whole on GPU 0, or split by columns over the N GPUs (as a
previous tensor-parallel layer leaves it); its output is gathered on GPU 0.

Baselines, in the same run: PyTorch on one GPU; on two GPUs the hand-made
version with peer copies (split W by columns, each GPU gathers the other's
half after every layer, streams and events); on N GPUs a hand-made row split
(every GPU holds every W and runs its rows through all layers: scatter,
layers, gather) and a hand-made column split with NCCL collectives from one
process (``torch.cuda.nccl.all_gather`` after every layer, activations kept
transposed so each GPU's block is contiguous), where this torch build has
NCCL. Also measured: the peer link matrix and the
throughput of many peer copies in flight through ``rt.copy``.

Times: median wall time per chain call, each between synchronizations of
every GPU in use, all variants of a case timed in interleaved rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import Runtime
from ..parallel import LinearChain
from ..parallel.measure import measure_links
from .cuda_timing import interleaved_wall_ms
from .report import format_table

__all__ = ["CASES", "NS", "goal", "hand_made", "hand_made_nccl", "hand_made_rows", "nccl_problem", "run",
           "run_case", "table"]

D = 8192
CASES = [(8, 8), (512, 8), (4096, 8), (16384, 4)]  # rows, layers
NS = (1, 2, 4, 8)
ANCHOR_GBS = 353.0
#: speedup over one GPU that large inputs should reach on N GPUs; small ones must not lose (0.98x)
LARGE_GOALS = {1: 0.98, 2: 1.85, 4: 3.5, 8: 6.5}
SMALL_GOAL = 0.98
LARGE_ROWS = 4096


def goal(rows: int, n: int) -> float:
    return LARGE_GOALS[n] if rows >= LARGE_ROWS else SMALL_GOAL


def hand_made(weights: list[torch.Tensor], rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Columns of W split over two GPUs; every GPU gathers the other's half after each layer."""
    devs = [torch.device("cuda:0"), torch.device("cuda:1")]
    half = D // 2
    cols = [slice(0, half), slice(half, D)]
    shards = [[w[:, cols[g]].contiguous().to(devs[g]) for w in weights] for g in range(2)]
    h = [[torch.empty(rows, D, dtype=torch.bfloat16, device=d) for d in devs] for _ in range(2)]
    y = [torch.empty(rows, half, dtype=torch.bfloat16, device=d) for d in devs]
    streams = [torch.cuda.Stream(d) for d in devs]

    def run(x: torch.Tensor) -> torch.Tensor:
        for g in range(2):
            streams[g].wait_stream(torch.cuda.current_stream(devs[g]))
        with torch.cuda.stream(streams[1]), torch.cuda.stream(streams[0]):
            h[0][0].copy_(x)
            h[0][1].copy_(x, non_blocking=True)  # PyTorch fences both devices' current streams
        cur = 0
        for layer in range(len(weights)):
            for g in range(2):
                with torch.cuda.stream(streams[g]):
                    torch.mm(h[cur][g], shards[g][layer], out=y[g])
                    y[g].relu_()
            for g in range(2):
                o = 1 - g
                with torch.cuda.stream(streams[g]):
                    h[1 - cur][g][:, cols[g]].copy_(y[g])
                # the peer half: PyTorch runs it on the source's current stream, fenced both ways
                with torch.cuda.stream(streams[g]), torch.cuda.stream(streams[o]):
                    h[1 - cur][g][:, cols[o]].copy_(y[o], non_blocking=True)
            cur = 1 - cur
        for g in range(2):
            torch.cuda.current_stream(devs[g]).wait_stream(streams[g])
        return h[cur][0]

    return run


def nccl_problem(n: int) -> str | None:
    """Why single-process NCCL collectives cannot run over the first ``n`` GPUs here, or None."""
    import torch.cuda.nccl as nccl

    if not all(hasattr(torch._C, f"_nccl_{op}") for op in ("all_gather", "broadcast")):
        return "this torch build has no NCCL (torch._C._nccl_all_gather is missing)"
    probe = [torch.empty(1, device=f"cuda:{g}") for g in range(n)]
    if not nccl.is_available(probe):
        return "torch.cuda.nccl.is_available() is False for these tensors"
    return None


def hand_made_nccl(weights: list[torch.Tensor], rows: int, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Columns of W split over ``n`` GPUs, one process; after each layer an NCCL all-gather.

    Activations are kept transposed (D x rows): GPU ``g``'s output block
    ``(h @ W[:, cols_g])^T = W[:, cols_g]^T @ h^T`` is then a contiguous run
    of rows, and the all-gather, which concatenates the GPUs' buffers in
    device order, leaves the whole next activation on every GPU.
    """
    import torch.cuda.nccl as nccl

    devs = [torch.device(f"cuda:{g}") for g in range(n)]
    part = D // n
    shards = [[w[:, g * part:(g + 1) * part].t().contiguous().to(devs[g]) for w in weights] for g in range(n)]
    h = [torch.empty(D, rows, dtype=torch.bfloat16, device=d) for d in devs]
    y = [torch.empty(part, rows, dtype=torch.bfloat16, device=d) for d in devs]

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.cuda.device(devs[0]):
            h[0].copy_(x.t())
        nccl.broadcast(h, root=0)  # on each GPU's current stream
        for layer in range(len(weights)):
            for g in range(n):
                with torch.cuda.device(devs[g]):
                    torch.mm(shards[g][layer], h[g], out=y[g])
                    y[g].relu_()
            nccl.all_gather(y, h)
        return h[0].t()

    return run


def hand_made_rows(weights: list[torch.Tensor], rows: int, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The rows of the input split over ``n`` GPUs, each holding every W: scatter, layers, gather.

    Each GPU runs its rows through every layer with nothing exchanged in
    between; ``copy_`` between GPUs fences both devices' current streams.
    """
    devs = [torch.device(f"cuda:{g}") for g in range(n)]
    bounds = [(rows * g // n, rows * (g + 1) // n) for g in range(n)]
    local = [[w.to(d) for w in weights] for d in devs]
    hs = [[torch.empty(b - a, D, dtype=torch.bfloat16, device=d) for _ in range(2)]
          for d, (a, b) in zip(devs, bounds)]
    out = torch.empty(rows, D, dtype=torch.bfloat16, device=devs[0])

    def run(x: torch.Tensor) -> torch.Tensor:
        for g, (a, b) in enumerate(bounds):
            with torch.cuda.device(devs[g]):
                hs[g][0].copy_(x[a:b], non_blocking=True)
                cur = 0
                for w in local[g]:
                    torch.mm(hs[g][cur], w, out=hs[g][1 - cur]).relu_()
                    cur = 1 - cur
        for g, (a, b) in enumerate(bounds):
            out[a:b].copy_(hs[g][len(weights) % 2], non_blocking=True)
        return out

    return run


def peer_copy_throughput(rt: Runtime, quick: bool) -> dict[str, float]:
    n, size = (4, 64 << 20) if quick else (16, 64 << 20)
    srcs = [torch.empty(size, dtype=torch.uint8, device="cuda:1") for _ in range(n)]
    dsts = [torch.empty(size, dtype=torch.uint8, device="cuda:0") for _ in range(n)]
    total = n * size

    def raw():
        with torch.cuda.device(1):
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)

    def ours():
        for d, s in zip(dsts, srcs):
            rt.copy(d, s)

    ms = interleaved_wall_ms({"raw": raw, "ours": ours}, rounds=10, devices=[0, 1])
    return {"bytes": total, "raw_copy_ms": ms["raw"], "streamdag_copy_ms": ms["ours"],
            "raw_GBps": total / ms["raw"] / 1e6, "streamdag_GBps": total / ms["ours"] / 1e6,
            "anchor_GBps": ANCHOR_GBS}


def _check(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= 0.05 * scale + 1e-3, f"{label} differs from one GPU: {err} vs {scale}"


def run_case(rt: Runtime, rows: int, layers: int, iters: int, ns: Sequence[int],
             nccl_ok: dict[int, bool]) -> dict[str, Any]:
    """One case: one GPU, then streamdag and the baselines over every N in ``ns``, timed together."""
    torch.manual_seed(rows)
    weights = [(torch.randn(D, D, device="cuda:0") / D ** 0.5).bfloat16() for _ in range(layers)]
    x = torch.randn(rows, D, device="cuda:0").bfloat16()

    def one_gpu() -> torch.Tensor:
        h = x
        for w in weights:
            h = torch.relu(h @ w)
        return h

    want = one_gpu()
    fns: dict[str, Callable[[], Any]] = {"one GPU": one_gpu}
    chains: dict[int, LinearChain] = {}
    for n in ns:
        chain = chains[n] = LinearChain(rt, weights, plan="auto", devices=n)
        _check(f"N={n}, input whole", chain(x), want)
        fns[f"{n} whole"] = lambda chain=chain: chain(x, copy_out=False)
        if n > 1:
            blocks = chain.input_blocks(x)
            for b in blocks:
                b.value.copy_(x[:, b.start:b.stop])
            _check(f"N={n}, input split", chain(blocks), want)
            fns[f"{n} split"] = lambda chain=chain, blocks=blocks: chain(blocks, copy_out=False)
        if n == 2:
            hand = hand_made(weights, rows)
            _check("hand-made peer copies", hand(x), want)
            fns["2 hand-made"] = lambda hand=hand: hand(x)
        if n > 1:
            spread = hand_made_rows(weights, rows, n)
            _check(f"hand-made row split over {n}", spread(x), want)
            fns[f"{n} hand-made rows"] = lambda spread=spread: spread(x)
        if n > 1 and nccl_ok.get(n):
            coll = hand_made_nccl(weights, rows, n)
            _check(f"hand-made NCCL over {n}", coll(x), want)
            fns[f"{n} hand-made NCCL"] = lambda coll=coll: coll(x)
    ms = interleaved_wall_ms(fns, rounds=iters, devices=list(range(max(ns))))
    one = ms["one GPU"]
    by_n: dict[str, Any] = {}
    for n, chain in chains.items():
        entry: dict[str, Any] = {
            "streamdag_input_whole_ms": ms[f"{n} whole"],
            "speedup_input_whole": one / ms[f"{n} whole"],
            "plan_input_whole": "/".join(chain._chosen[(rows, "single")]),
            "goal_speedup": goal(rows, n),
            "explain": chain.explain(),
        }
        if n > 1:
            entry.update(streamdag_input_split_ms=ms[f"{n} split"],
                         speedup_input_split=one / ms[f"{n} split"],
                         plan_input_split="/".join(chain._chosen[(rows, "split")]))
        for label, key in ((f"{n} hand-made", "hand_made_ms"), (f"{n} hand-made NCCL", "hand_made_nccl_ms"),
                           (f"{n} hand-made rows", "hand_made_rows_ms")):
            if label in ms:
                entry[key] = ms[label]
        entry["graphs_captured"] = [g.captured for g, _, _ in chain._graphs.values()]
        by_n[str(n)] = entry
    return {"rows": rows, "layers": layers, "one_gpu_ms": one, "by_n": by_n}


def link_matrix(devices: Sequence[str]) -> dict[str, Any]:
    """The measured peer link of every ordered pair: latency in µs and bandwidth in GB/s (row: source)."""
    links = measure_links(devices)
    n = len(devices)
    cells = [[None if s == d else links(s, d) for d in range(n)] for s in range(n)]
    return {"devices": list(devices),
            "latency_us": [[None if c is None else c.latency_ms * 1e3 for c in row] for row in cells],
            "GBps": [[None if c is None else 1.0 / c.ms_per_mb for c in row] for row in cells]}


def visible_ns(gpus: int, wanted: Sequence[int] | None = None) -> list[int]:
    """The GPU counts to run: ``wanted`` (each at most ``gpus``), or every one of 1, 2, 4, 8 that fits."""
    if wanted is None:
        return [n for n in NS if n <= gpus]
    odd = [n for n in wanted if n not in NS]
    if odd:
        raise ValueError(f"GPU counts {odd}: the benchmark runs {', '.join(map(str, NS))} GPUs (its goals "
                         f"are set for those); ask for some of them")
    too_many = [n for n in wanted if n > gpus]
    if too_many:
        raise ValueError(f"GPU counts {too_many} do not fit the {gpus} GPU(s) visible: ask for at most "
                         f"{gpus}, or run on a machine with more GPUs")
    return sorted(set(wanted))


def run(quick: bool = False, ns: Sequence[int] | None = None,
        cases: Sequence[tuple[int, int]] | None = None,
        on_case: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every case (the two small ones when ``quick``) over every GPU count, and the peer links;
    ``on_case`` sees each case's result as it is measured (a long run shows its progress)."""
    torch.backends.cuda.matmul.allow_tf32 = True
    gpus = torch.cuda.device_count()
    counts = visible_ns(gpus, ns)
    todo = list(cases) if cases is not None else (CASES[:2] if quick else CASES)
    iters = 5 if quick else 20
    devices = [f"cuda:{g}" for g in range(max(counts))]
    nccl_ok = {n: nccl_problem(n) is None for n in counts if n > 1}
    with Runtime(devices=devices, streams=2, max_inflight=10_000) as rt:
        links = link_matrix(devices) if len(devices) > 1 else None
        results = []
        for rows, layers in todo:
            results.append(run_case(rt, rows, layers, iters, counts, nccl_ok))
            if on_case is not None:
                on_case(results[-1])
        peer = peer_copy_throughput(rt, quick) if len(devices) > 1 else None
    return {"benchmark": "tp", "dtype": "bfloat16", "D": D, "iters": iters, "gpus": gpus, "ns": counts,
            "device_names": [torch.cuda.get_device_name(g) for g in range(gpus)],
            "nccl": {"version": _nccl_version(), "problems": {str(n): nccl_problem(n) for n in nccl_ok}},
            "links": links, "cases": results, "peer_copy": peer}


def _nccl_version() -> str | None:
    try:
        import torch.cuda.nccl as nccl

        v = nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # no NCCL in this build: the problems entry says why
        return None


def _rows_of_case(r: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for n, e in r["by_n"].items():
        whole, split = e["speedup_input_whole"], e.get("speedup_input_split")
        both = [whole] if split is None else [whole, split]
        # small inputs must not lose either way; large ones count their better layout
        judged = min(both) if r["rows"] < LARGE_ROWS else max(both)
        hand = [e.get(k) for k in ("hand_made_rows_ms", "hand_made_nccl_ms")]
        rows.append([r["rows"], n, e["streamdag_input_whole_ms"], whole,
                     "-" if split is None else e["streamdag_input_split_ms"], "-" if split is None else split,
                     e["goal_speedup"], "met" if judged >= e["goal_speedup"] else "MISSED",
                     *("-" if h is None else r["one_gpu_ms"] / h for h in hand), e["plan_input_whole"]])
    return rows


HEADERS = ["rows", "N", "whole-in ms", "speedup", "split-in ms", "speedup", "goal", "", "hand rows",
           "hand NCCL", "plan (input whole)"]


def table_of_case(r: dict[str, Any]) -> str:
    return (f"{r['rows']} x {D}, {r['layers']} layers: one GPU {r['one_gpu_ms']:.3f} ms\n"
            + format_table(HEADERS, _rows_of_case(r)))


def table(result: dict[str, Any]) -> str:
    """One row per case and GPU count: ms, speedup over one GPU, the goal, the plan; then the links."""
    rows = [row for r in result["cases"] for row in _rows_of_case(r)]
    parts = [format_table(HEADERS, rows),
             "speedup: one GPU's time over streamdag's; the goal counts the worse input layout for small "
             "inputs, the better for large ones; hand rows / hand NCCL: speedups of the hand-made row "
             "split and NCCL column split (input whole)"]
    links = result.get("links")
    if links:
        gbs = [v for row in links["GBps"] for v in row if v is not None]
        parts.append(f"peer links ({len(gbs)} ordered pairs): {min(gbs):.0f}-{max(gbs):.0f} GB/s")
    peer = result.get("peer_copy")
    if peer:
        raw, ours = peer["raw_GBps"], peer["streamdag_GBps"]
        parts.append(format_table(["peer copies (GPU1->GPU0)", "GB/s", "of anchor 353"],
                                  [["raw copy_ back to back", raw, raw / ANCHOR_GBS],
                                   ["streamdag rt.copy, all in flight", ours, ours / ANCHOR_GBS]]))
    return "\n".join(parts)
