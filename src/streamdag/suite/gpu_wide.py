"""The wide graph (B branches of matmul+relu) on one GPU: streamdag against PyTorch's baselines.

B branches of L layers ``h = relu(h @ W[b][l])`` from one shared input, joined
by ``torch.stack(outs).sum(0)``; fp32 with TF32. Every variant is timed in
the same run as the median wall time of one iteration between
``torch.cuda.synchronize()`` calls, and checked against eager. The eager
variants and the hand-made graphs are timed in interleaved rounds
(``interleaved_wall_ms``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

import streamdag as sd

from .cuda_timing import graph_of, interleaved_wall_ms, wall_ms
from .report import format_table

__all__ = ["CASES", "profile_case", "run_case", "table"]

CASES = {
    "tiny": (32, 4, 64, 256),
    "small": (32, 4, 64, 1024),
    "medium": (16, 4, 512, 2048),
    "large": (8, 4, 4096, 4096),
}


def layer(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    torch.matmul(h, w, out=out)
    return torch.relu_(out)


def join(outs: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return torch.sum(torch.stack(outs), 0, out=y)


Tensors = tuple[torch.Tensor, list[list[torch.Tensor]], list[list[torch.Tensor]], torch.Tensor]


def wide_tensors(name: str, generator: torch.Generator | None = None) -> Tensors:
    """The case's input ``x``, weights ``W[b][l]``, layer outputs ``hs[b][l]`` and result ``y`` (GPU)."""
    B, L, rows, D = CASES[name]
    dev = torch.device("cuda")
    x = torch.randn(rows, D, device=dev, generator=generator)
    W = [[torch.randn(D, D, device=dev, generator=generator) / D**0.5 for _ in range(L)] for _ in range(B)]
    hs = [[torch.empty(rows, D, device=dev) for _ in range(L)] for _ in range(B)]
    y = torch.empty(rows, D, device=dev)
    return x, W, hs, y


def submit_wide(rt: sd.Runtime, x: torch.Tensor, W: list[list[torch.Tensor]], hs: list[list[torch.Tensor]],
                y: torch.Tensor) -> sd.Future[torch.Tensor]:
    """The wide graph's ops, each with the buffers it reads and writes."""
    for b, (ws, hb) in enumerate(zip(W, hs)):
        src = x
        for i, (w, h) in enumerate(zip(ws, hb)):
            rt.submit(layer, src, w, h, reads=[src, w], writes=[h], name=f"b{b}l{i}")
            src = h
    outs = [h[-1] for h in hs]
    return rt.submit(join, outs, y, reads=outs, writes=[y], name="join")


def _eager_baselines(x, W, B: int):
    """The case's eager forms: one branch, the whole graph on one stream, the whole graph on 8 side
    streams by hand; and the eager result that every variant is checked against."""

    def eager_branch(b):
        h = x
        for layer_w in W[b]:
            h = torch.relu(h @ layer_w)
        return h

    def eager():
        return torch.stack([eager_branch(b) for b in range(B)]).sum(0)

    ref = eager()
    side = [torch.cuda.Stream() for _ in range(8)]

    def eager_streams():
        main = torch.cuda.current_stream()
        outs = [None] * B
        for s in side:
            s.wait_stream(main)
        for b in range(B):
            with torch.cuda.stream(side[b % 8]):
                outs[b] = eager_branch(b)
        for s in side:
            main.wait_stream(s)
        return torch.stack(outs).sum(0)

    return eager_branch, eager, eager_streams, ref


def _time_runtime(tensors, streams: int, iters: int, baselines: dict, graphs_out: dict,
                  results: dict, check) -> dict:
    """Time the runtime (ops submitted with what they read and write, into ``hs`` and ``y``; then
    recorded, captured and replayed) against ``baselines``, timed in the same interleaved rounds,
    so that the host's drift falls on all. ``graphs_out``: the baselines' CUDA graph outputs, checked.
    Returns the recorded graph's timings and capture statistics."""
    x, W, hs, y = tensors
    with sd.Runtime("cuda", streams=streams, max_inflight=1024) as rt:
        def submit_all():
            return submit_wide(rt, x, W, hs, y)

        def sd_eager():
            submit_all()

        results.update(interleaved_wall_ms({**baselines, "streamdag eager, multi-stream": sd_eager}, iters))
        for label, out in graphs_out.items():
            check(label, out)
        rt.synchronize()
        check("streamdag eager, multi-stream", y)

        t0 = time.perf_counter()
        with rt.record() as graph:
            submit_all()
        graph.run().result()  # first run: eager, warms up
        t_rec = time.perf_counter() - t0
        t0 = time.perf_counter()
        graph.run().result()  # second run: capture (choosing the stream count), then replay
        t_cap = time.perf_counter() - t0
        y.zero_()
        graph.run().result()
        check("streamdag captured", y)
        results["streamdag captured"] = wall_ms(lambda: graph.run(), iters)
        results["streamdag captured, result() latency"] = wall_ms(lambda: graph.run().result(), iters)
        explain = graph.explain()
        cap_stats = graph.statistics()
    return {
        "record_and_first_run_s": t_rec, "capture_and_choice_s": t_cap,
        "capture": {"chosen_streams": cap_stats.chosen_streams, "choice_ms": cap_stats.choice_ms,
                    "estimate_ms": cap_stats.estimate_ms,
                    "captures": cap_stats.captures, "replays": cap_stats.replays},
        "explain_head": explain.splitlines()[:3],
    }


def _time_streamdag_compile(eager, iters: int, results: dict, check) -> dict:
    """Time ``streamdag.compile`` of the eager function: traced, batched or not as timing decides.
    Returns the variant it chose and why."""
    with torch.no_grad():
        t0 = time.perf_counter()
        fast = sd.compile(eager, engine="aten")
        spec = None
        for _ in range(40):  # trace, run, capture and time the variants, choose
            fast()
            spec = next(iter(fast._entries.values()))
            if spec.chosen is not None:
                break
        torch.cuda.synchronize()
        t_sd_compile = time.perf_counter() - t0
        check("streamdag.compile", fast())
        results["streamdag.compile (batching chosen by timing)"] = wall_ms(fast, iters)
        compiled_info = {"variant": spec.entry.label, "variant_ms": spec.choice_ms,
                         "batching": {v.label: str(v.batch_report) for v in spec.variants[1:]},
                         "group_estimates": [str(e) for e in spec.group_estimates],
                         "seconds": t_sd_compile}
        fast.close()
    return compiled_info


def _time_torch_compile(eager, iters: int, results: dict) -> float:
    """Time ``torch.compile(mode="reduce-overhead")`` of the eager function; returns its compile time."""
    torch._dynamo.reset()
    t0 = time.perf_counter()
    compiled = torch.compile(eager, mode="reduce-overhead")
    for _ in range(3):
        compiled()
    t_compile = time.perf_counter() - t0
    results["torch.compile reduce-overhead"] = wall_ms(compiled, iters)
    return t_compile


def run_case(name: str, use_compile: bool, streams: int) -> dict[str, Any]:
    B, L, rows, D = CASES[name]
    dev = torch.device("cuda")
    tensors = wide_tensors(name, torch.Generator(device=dev).manual_seed(0))
    x, W, _, _ = tensors
    iters = 20 if name == "large" else 100
    eager_branch, eager, eager_streams, ref = _eager_baselines(x, W, B)
    g1, g1_out = graph_of(eager)
    g8, g8_out = graph_of(eager_streams)

    results: dict[str, float] = {}
    checks: dict[str, float] = {}

    def check(label, got):
        checks[label] = float((got - ref).norm() / ref.norm())

    recorded = _time_runtime(tensors, streams, iters, {
        "eager 1 stream": eager,
        "eager 8 streams, hand-made": eager_streams,
        "CUDA graph 1 stream": g1.replay,
        "CUDA graph 8 streams, hand-made": g8.replay,
    }, {"CUDA graph 1 stream": g1_out, "CUDA graph 8 streams, hand-made": g8_out}, results, check)
    compiled_info = _time_streamdag_compile(eager, iters, results, check)
    t_compile = _time_torch_compile(eager, iters, results) if use_compile else None

    def branch_alone():
        return eager_branch(0)

    gb, _ = graph_of(branch_alone)
    results["one branch alone, CUDA graph (critical path)"] = wall_ms(gb.replay, iters)
    return {
        "case": name, "B": B, "L": L, "rows": rows, "D": D, "iters": iters,
        "ms": results, "rel_error_vs_eager": checks,
        "record_and_first_run_s": recorded["record_and_first_run_s"],
        "capture_and_choice_s": recorded["capture_and_choice_s"],
        "torch_compile_s": t_compile,
        "capture": recorded["capture"],
        "explain_head": recorded["explain_head"],
        "streamdag_compile": compiled_info,
    }


def table(cases: list[dict[str, Any]]) -> str:
    labels = list(cases[0]["ms"])
    rows = []
    for label in labels:
        row = [label]
        for c in cases:
            ms = c["ms"].get(label)
            base = c["ms"]["CUDA graph 1 stream"]
            row.append("-" if ms is None else f"{ms:.3f} ({base / ms:.2f}x)")
        rows.append(row)
    return format_table(["ms (speedup vs CUDA graph 1 stream)", *[c["case"] for c in cases]], rows)


def profile_case(name: str, streams: int = 8) -> sd.Timeline:
    """A timeline of one op-by-op run of the case's graph (for the trace and the PNG)."""
    x, W, hs, y = wide_tensors(name)
    with sd.Runtime("cuda", streams=streams) as rt:
        with rt.record() as graph:
            submit_wide(rt, x, W, hs, y)
        graph.run().result()  # warm up
        with rt.profile(per_op=True) as prof:
            graph.run().result()
    return prof.timeline
