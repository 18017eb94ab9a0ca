"""The tensor-parallel chain on two GPUs: one GPU, the hand-made two-GPU version, streamdag.

L layers of ``relu(h @ W)`` in bf16, D = 8192. The hand-made version splits W
by columns over the two GPUs, and after every layer each GPU gathers the
other's half with a peer copy (streams and events, no host synchronization).
streamdag runs :class:`streamdag.parallel.LinearChain` with ``plan="auto"``:
the cost model decides per layer from measured times, and a split plan is kept
only if measured faster than one GPU. Its input comes two ways: whole on GPU 0,
or split by columns over the GPUs (as a previous tensor-parallel layer leaves
it); its output is gathered whole on GPU 0. Also measured: peer copy
throughput, many copies in flight through ``rt.copy`` against raw ``copy_``.

Times: median wall time per chain call, each between synchronizations of both
GPUs (latency); then ten calls back to back per synchronization (throughput).
streamdag is called as ``chain(x)``: once captured, one CUDA graph over both
GPUs replayed on the caller's stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import Runtime
from ..parallel import LinearChain
from .cuda_timing import wall_ms
from .report import format_table

__all__ = ["CASES", "hand_made", "run", "run_case", "table"]

D = 8192
CASES = [(8, 8), (512, 8), (4096, 8), (16384, 4)]  # rows, layers
ANCHOR_GBS = 353.0
GOALS = {8: 0.98, 512: 0.98, 4096: 1.85, 16384: 1.85}


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

    t_raw = wall_ms(raw, iters=10, devices=[0, 1])
    t_ours = wall_ms(ours, iters=10, devices=[0, 1])
    return {"bytes": total, "raw_copy_ms": t_raw, "streamdag_copy_ms": t_ours,
            "raw_GBps": total / t_raw / 1e6, "streamdag_GBps": total / t_ours / 1e6,
            "anchor_GBps": ANCHOR_GBS}


def back_to_back(fn: Callable[[], Any], iters: int, n: int = 10) -> float:
    """Throughput: ``n`` calls per synchronization, ms per call."""
    return wall_ms(lambda: [fn() for _ in range(n)], iters=max(iters // 4, 3), devices=[0, 1]) / n


def run_case(rt: Runtime, rows: int, layers: int, iters: int) -> dict[str, Any]:
    torch.manual_seed(rows)
    weights = [(torch.randn(D, D, device="cuda:0") / D ** 0.5).bfloat16() for _ in range(layers)]
    x = torch.randn(rows, D, device="cuda:0").bfloat16()

    def one_gpu():
        h = x
        for w in weights:
            h = torch.relu(h @ w)
        return h

    hand = hand_made(weights, rows)
    chain = LinearChain(rt, weights, plan="auto")
    blocks = chain.input_blocks(x)
    for b in blocks:
        b.value.copy_(x[:, b.start:b.stop])
    want = one_gpu()
    for label, got in (("input whole", chain(x)), ("input split", chain(blocks)), ("hand-made", hand(x))):
        err = (got.float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        assert err <= 0.05 * scale + 1e-3, f"{label} differs from one GPU: {err} vs {scale}"
    result = {
        "rows": rows, "layers": layers,
        "one_gpu_ms": wall_ms(one_gpu, iters=iters, devices=[0, 1]),
        "hand_made_ms": wall_ms(lambda: hand(x), iters=iters, devices=[0, 1]),
        "streamdag_input_whole_ms": wall_ms(lambda: chain(x, copy_out=False), iters=iters, devices=[0, 1]),
        "streamdag_input_split_ms": wall_ms(lambda: chain(blocks, copy_out=False), iters=iters,
                                            devices=[0, 1]),
        "back_to_back": {
            "one_gpu_ms": back_to_back(one_gpu, iters),
            "hand_made_ms": back_to_back(lambda: hand(x), iters),
            "streamdag_input_split_ms": back_to_back(lambda: chain(blocks, copy_out=False), iters),
        },
        "plan_input_whole": "/".join(chain._chosen[(rows, "single")]),
        "plan_input_split": "/".join(chain._chosen[(rows, "split")]),
        "graphs_captured": [g.captured for g, _, _ in chain._graphs.values()],
        "goal_speedup": GOALS[rows],
        "explain": chain.explain(),
    }
    return result


def run(quick: bool = False) -> dict[str, Any]:
    """Every case (the two small ones when ``quick``) and the peer-copy throughput."""
    torch.backends.cuda.matmul.allow_tf32 = True
    cases = CASES[:2] if quick else CASES
    iters = 5 if quick else 20
    with Runtime(devices=["cuda:0", "cuda:1"], streams=2, max_inflight=10_000) as rt:
        results = [run_case(rt, rows, layers, iters) for rows, layers in cases]
        link = peer_copy_throughput(rt, quick)
    return {"benchmark": "tp", "dtype": "bfloat16", "D": D, "iters": iters, "cases": results,
            "peer_copy": link}


def table(result: dict[str, Any]) -> str:
    """Latency and throughput tables, and the peer-copy throughput."""
    rows, thr_rows = [], []
    for r in result["cases"]:
        one = r["one_gpu_ms"]
        label = f"{r['rows']} x {D}, {r['layers']}"
        rows.append([label, one, r["hand_made_ms"], one / r["hand_made_ms"], r["streamdag_input_whole_ms"],
                     one / r["streamdag_input_whole_ms"], r["streamdag_input_split_ms"],
                     one / r["streamdag_input_split_ms"], r["goal_speedup"], r["plan_input_split"]])
        b = r["back_to_back"]
        thr_rows.append([label, b["one_gpu_ms"], b["hand_made_ms"], b["streamdag_input_split_ms"],
                         b["one_gpu_ms"] / b["streamdag_input_split_ms"]])
    link = result["peer_copy"]
    return "\n".join([
        format_table(["rows x D, L", "one GPU ms", "hand 2-GPU ms", "hand speedup", "sd whole-in ms",
                      "sd speedup", "sd split-in ms", "sd speedup", "goal", "plan"], rows),
        "back to back (10 calls, one synchronization), ms per call:",
        format_table(["rows x D, L", "one GPU", "hand 2-GPU", "sd split-in", "sd speedup"], thr_rows),
        format_table(["peer copies (GPU1->GPU0)", "GB/s", "of anchor 353"],
                     [["raw copy_ back to back", link["raw_GBps"], link["raw_GBps"] / ANCHOR_GBS],
                      ["streamdag rt.copy, all in flight", link["streamdag_GBps"],
                       link["streamdag_GBps"] / ANCHOR_GBS]]),
    ])
