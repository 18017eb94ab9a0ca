"""Write docs/benchmarks.md from the result files in bench/results/ (one table per file).

Run from the repository root after a benchmark has written a new result:

    python scripts/benchmarks_page.py            # writes docs/benchmarks.md
    python scripts/benchmarks_page.py --check    # exits 1 if docs/benchmarks.md is out of date

Each benchmark script writes ``bench/results/<benchmark>_<device>.json`` with the environment it
ran in; this page shows the numbers of every such file, so that what the docs quote can be traced
to a file. It reads JSON only: no GPU, no torch needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"


def fmt(value: Any) -> str:
    """A cell: floats with three decimals (one from 100 up), None as a dash, the rest as text."""
    if isinstance(value, bool) or value is None:
        return "—" if value is None else str(value).lower()
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ratio(base: float | None, value: float | None) -> str:
    """``value`` with how many times faster than ``base`` it is, e.g. ``0.214 (4.40x)``."""
    if value is None:
        return "—"
    if not base:
        return fmt(value)
    return f"{fmt(value)} ({base / value:.2f}x)"


# ------------------------------------------------------------------ one renderer per benchmark

def render_wide(data: dict) -> str:
    cases = data["cases"]
    labels = list(dict.fromkeys(label for c in cases for label in c["ms"]))
    rows = [[label, *(ratio(c["ms"].get("eager 1 stream"), c["ms"].get(label)) for c in cases)]
            for label in labels]
    shape = ", ".join(f"{c['case']}: B={c['B']} L={c['L']} rows={c['rows']} D={c['D']}" for c in cases)
    chosen = ", ".join(f"{c['case']} {c['streamdag_compile']['variant']}" for c in cases
                       if c.get("streamdag_compile"))
    captured = ", ".join(f"{c['case']} {c['capture']['chosen_streams']}" for c in cases)
    return "\n\n".join([
        table(["ms per iteration (speedup over eager, 1 stream)", *(c["case"] for c in cases)], rows),
        f"Cases: {shape}. Streams chosen for the captured graph: {captured}. "
        f"streamdag.compile variant kept: {chosen or 'not run'}.",
    ])


def render_models(data: dict) -> str:
    headers = ["model", "dtype", "eager", "CUDA graph 1 stream", "torch.compile reduce-overhead",
               "**streamdag.compile** (variant)", "streamdag compile s", "torch.compile s"]
    rows = []
    for m in data["models"]:
        ms = m["ms"]
        rows.append([m["model"], m["dtype"].removeprefix("torch."), ms.get("eager"),
                     ms.get("CUDA graph 1 stream"), ms.get("torch.compile reduce-overhead"),
                     f"**{fmt(ms.get('streamdag'))}** ({m.get('variant', '?')})",
                     m.get("streamdag_compile_s"), m.get("torch_compile_s")])
    return "Median wall ms per call, batch 1.\n\n" + table(headers, rows)


def render_overhead(data: dict) -> str:
    us, added = data["us"], data["added_paired_us"]
    rows = [["PyTorch launch, one stream", us["torch_us"], 0.0]]
    rows += [[label, value, added.get(label)] for label, value in us.items() if label != "torch_us"]
    return table(["variant", "µs per op", "µs added over its PyTorch baseline (paired rounds)"], rows)


def render_overlap(data: dict) -> str:
    ms = data["ms"]
    bound, sequential = ms["bound"], ms["sequential, one stream"]
    bounds = ["copies_in", "copies_out", "compute", "both_ways", "bound", "pipeline_bound"]
    variants = [k for k in ms if k not in bounds and not k.startswith(("both_ways", "link_model"))]
    rows = [[k, ms[k], f"{ms[k] / bound:.2f}x", f"{sequential / ms[k]:.2f}x"] for k in variants]
    return "\n\n".join([
        f"Bound {fmt(bound)} ms (copies in {fmt(ms['copies_in'])}, out {fmt(ms['copies_out'])}, "
        f"compute {fmt(ms['compute'])}, all copy bytes both ways at "
        f"{data['bidirectional_gbs']:.1f} GB/s); results equal the sequential version's: "
        f"{fmt(data['results_equal'])}.",
        table(["variant", "ms", "of the bound", "speedup over sequential"], rows),
    ])


def render_transfers(data: dict) -> str:
    results = data["results"]
    sizes = list(dict.fromkeys(k.split(" streamdag")[0].split(" PyTorch")[0] for k in results))
    kinds = list(dict.fromkeys(k[len(s) + 1:] for k in results for s in sizes if k.startswith(s + " ")))
    rows = []
    for size in sizes:
        row: list[Any] = [size]
        for kind in kinds:
            r = results.get(f"{size} {kind}")
            row.append("—" if r is None else f"{fmt(r['ms'])} ({r['vs_pytorch_pageable']:.2f}x)")
        rows.append(row)
    parts = ["ms per copy (speedup over PyTorch's pageable copy), the host waiting for the data:",
             table(["size, direction", *kinds], rows)]
    submit = [[k, r["submit_host_ms"]] for k, r in results.items() if r.get("submit_host_ms") is not None]
    parts += ["Host time of streamdag's submit (ms; the copy itself continues after it returns):",
              table(["copy", "submit ms"], submit)]
    pipeline = data.get("pageable_pipeline_ms")
    if pipeline:
        base = pipeline.get("PyTorch, one stream")
        parts += ["8 chunks of 64 MiB from and into pageable memory, 6 x (bf16 matmul + tanh) each:",
                  table(["variant", "ms (speedup over one stream)"],
                        [[k, ratio(base, v)] for k, v in pipeline.items()])]
    return "\n\n".join(parts)


def render_latency(data: dict) -> str:
    rows = [[k, v, data["p90_us"].get(k)] for k, v in data["median_us"].items()]
    return table(["wait", "median µs", "p90 µs"], rows)


def render_wait_latency(data: dict) -> str:
    ms = data["ms"]
    kinds = list(dict.fromkeys(kind for v in ms.values() for kind in v))
    rows = [[case, *(v.get(kind) for kind in kinds)] for case, v in ms.items()]
    return ("ms from submit to `result()` returning; `torch`: the same work and "
            "`torch.cuda.synchronize()`.\n\n" + table(["work", *kinds], rows))


def render_tp(data: dict) -> str:
    """The chain over 1, 2, 4, 8 GPUs side by side (``by_n``), or the two-GPU layout of older files."""
    if not data["cases"] or "by_n" not in data["cases"][0]:
        return render_tp_two(data)
    headers = ["rows × D, layers", "GPUs", "one GPU", "**streamdag**, input whole",
               "**streamdag**, input split", "goal", "hand-made row split", "hand-made NCCL",
               "hand-made peer copies", "plan (input whole)"]
    rows = []
    for c in data["cases"]:
        one = c["one_gpu_ms"]
        for n, e in c["by_n"].items():
            rows.append([f"{c['rows']} × {data['D']}, {c['layers']}", n, one,
                         ratio(one, e["streamdag_input_whole_ms"]),
                         ratio(one, e.get("streamdag_input_split_ms")),
                         f"{e['goal_speedup']:.2f}x", ratio(one, e.get("hand_made_rows_ms")),
                         ratio(one, e.get("hand_made_nccl_ms")),
                         ratio(one, e.get("hand_made_ms")), e["plan_input_whole"]])
    parts = [f"`relu(h @ W)` in {data['dtype']} on the first N of {data['gpus']} GPUs, ms per call "
             f"(speedup over one GPU); goals: large inputs 1.85x (2), 3.5x (4), 6.5x (8), small ones "
             f"never below 0.98x.", table(headers, rows)]
    links = data.get("links")
    if links:
        names = [d.split(":")[-1] for d in links["devices"]]
        matrix = [[f"from {a}", *(fmt(v) if v is None else f"{v:.0f}" for v in row)]
                  for a, row in zip(names, links["GBps"])]
        parts += ["Peer links measured per ordered pair, GB/s:",
                  table(["", *(f"to {b}" for b in names)], matrix)]
    problems = {n: p for n, p in data.get("nccl", {}).get("problems", {}).items() if p}
    if problems:
        parts.append("NCCL baseline not run: "
                     + "; ".join(f"{n} GPUs: {p}" for n, p in problems.items()) + ".")
    peer = data.get("peer_copy")
    if peer:
        parts.append(f"Peer copies, many in flight: `rt.copy` {peer['streamdag_GBps']:.0f} GB/s, "
                     f"back-to-back `copy_` {peer['raw_GBps']:.0f} GB/s.")
    return "\n\n".join(parts)


def render_tp_two(data: dict) -> str:
    headers = ["rows × D, layers", "one GPU", "hand-made 2 GPUs", "**streamdag**, input whole",
               "**streamdag**, input split", "plan (input whole)"]
    rows = []
    for c in data["cases"]:
        one = c["one_gpu_ms"]
        rows.append([f"{c['rows']} × {data['D']}, {c['layers']}", one, ratio(one, c["hand_made_ms"]),
                     ratio(one, c["streamdag_input_whole_ms"]), ratio(one, c["streamdag_input_split_ms"]),
                     c["plan_input_whole"]])
    peer = data["peer_copy"]
    return "\n\n".join([
        f"`relu(h @ W)` in {data['dtype']}, ms per call (speedup over one GPU).",
        table(headers, rows),
        f"Peer copies, many in flight: `rt.copy` {peer['streamdag_GBps']:.0f} GB/s, "
        f"back-to-back `copy_` {peer['raw_GBps']:.0f} GB/s.",
    ])


def render_cpu_wide(data: dict) -> str:
    s = data["settings"]
    rows = [[k, v] for k, v in data["ms"].items()]
    return "\n\n".join([
        f"{s['branches']} branches x {s['layers']} layers of numpy matmul+relu ({s['rows']} x {s['dim']}), "
        f"{s['streams']} lanes. Speedup over serial: eager {data['speedup']['eager']:.2f}x, recorded "
        f"graph {data['speedup']['graph']:.2f}x; results bit-identical: {fmt(data['bit_identical'])}.",
        table(["variant", "ms"], rows),
    ])


def render_sched_scale(data: dict) -> str:
    keys = ["ops", "edges", "seconds", "reduced_edges", "levels", "width", "streams", "waits"]
    rows = [[name, *(c.get(k) for k in keys)] for name, c in data["cases"].items()]
    return table(["random DAG", *keys], rows)


def render_hot_path(data: dict) -> str:
    return table(["hot path", "µs per submit (a do-nothing op)"], list(data["us"].items()))


def render_native_pieces(data: dict) -> str:
    """One row per configuration: µs per op of each workload, and x the first row, paired by round."""
    works = list(next(iter(data["us"].values())))
    rows = [[label, *(f"{us[w]:.2f} ({data['x_first'][label][w]:.2f}x)" for w in works)]
            for label, us in data["us"].items()]
    s = data["settings"]
    return "\n\n".join([f"{s['rounds']} rounds of {s['ops_per_round']} ops; µs per op (x the first row in "
                         "the same round, median).", table(["configuration", *works], rows)])








def render_compile_host(data: dict) -> str:
    rows = [[r["model"], r["variant"], r["host_us"], r["latency_ms"], r.get("replay_ms"), r.get("added_us"),
             r.get("compile_s")] for r in data["rows"]]
    return table(["model", "variant", "host µs per call (no sync)", "latency ms (sync)",
                  "graph replay ms (GPU)", "latency over replay µs", "compile s"], rows)


def _memory_vs_ro(peak: dict, how: str | None = None) -> str:
    """streamdag's peak memory over reduce-overhead's, e.g. ``52 MiB (1.04x)``; ``alone`` where each
    variant was set up alone in a process (``how``, a zoo row's ``memory``), not after the others."""
    ours, ro = peak.get("streamdag"), peak.get("inductor_ro")
    if ours is None:
        return "—"
    alone = ", alone" if how and (how.startswith("each variant alone") or (
        how.startswith("alone in a process each:") and "streamdag" in how and "inductor_ro" in how)) else ""
    return f"{ours:.0f} MiB" + (f" ({ours / ro:.2f}x{alone})" if ro else "")


def _compile_vs_inductor(seconds: dict) -> str:
    """streamdag's compile time and its ratio to torch.compile's, e.g. ``13.7 s (0.70x)``."""
    ours, inductor = seconds.get("streamdag"), seconds.get("inductor")
    if ours is None:
        return "—"
    return f"{ours:.1f} s" + (f" ({ours / inductor:.2f}x)" if inductor else "")


def _host_over_replay(host: dict) -> str:
    """streamdag's host time per call over a bare CUDA graph replay's, each call begun with the GPU
    idle, in µs, e.g. ``17.8`` (— for a row without ``idle_host_us``)."""
    ours, replay = host.get("streamdag"), host.get("cuda_graph")
    return "—" if ours is None or replay is None else f"{ours - replay:.1f}"


def render_zoo(data: dict) -> str:
    """One row per model, dtype and batch: each way's ms and streamdag against the best baseline."""
    rows = []
    for m in data["models"]:
        if "dtype" not in m:  # a model the run skipped (over its time budget)
            continue
        ms = m.get("ms") or {}  # none where the model's worker was lost (its errors say why)
        best = min((v for k, v in ms.items() if k != "streamdag" and v is not None), default=None)
        rows.append([m["model"], m["dtype"], m["batch"], *(ms.get(k) for k in
                     ("eager", "cuda_graph", "inductor", "inductor_ro", "streamdag")),
                     ratio(best, ms.get("streamdag")), m.get("streams"),
                     _memory_vs_ro(m.get("peak_mib") or {}, m.get("memory")),
                     _compile_vs_inductor(m.get("compile_s") or {}),
                     _host_over_replay(m.get("idle_host_us") or {})])
    return table(["model", "dtype", "batch", "eager ms", "CUDA graph ms", "torch.compile ms",
                  "reduce-overhead ms", "streamdag ms", "streamdag vs best", "streams",
                  "memory vs reduce-overhead", "compile vs torch.compile",
                  "host µs over a replay, GPU idle"], rows)


def render_llm_decode(data: dict) -> str:
    """One row per config and batch: ms per decode step of each way (and its tokens/s), the
    bandwidth bound, the prefill, and whether the token ids equal Hugging Face eager's."""
    ways = ("hf_eager", "inductor_ro_static_cache", "streamdag")
    regions = any("streamdag_regions" in r["ms_per_token"] for r in data["rows"])
    if regions:  # (a run with --regions or --only: the decode step's regions on streams too)
        ways += ("streamdag_regions",)
    rows = []
    for r in data["rows"]:
        c, ms, tps, bound = r["config"], r["ms_per_token"], r["tokens_per_s"], r["bound"]
        same = ", ".join(f"{k}: same" if e.get("equal")
                         else f"{k}: differs from token {e.get('first_difference')}"
                         for k, e in r.get("tokens_equal", {}).items())
        rows.append([c["name"], f"{c['params'] / 1e9:.2f}B", c["dtype"], c["batch"],
                     *(f"{fmt(ms.get(k))} ({fmt(tps.get(k))})" for k in ways),
                     f"{fmt(bound['ms_per_token'])} ({fmt(bound['tokens_per_s'])})",
                     *(r["prefill_ms"].get(k) for k in ways), same or "—"])
    return ("ms per decode step (tokens/s of the batch); the bound: weight bytes over "
            f"{data['rows'][0]['bound']['bandwidth_tbs'] if data['rows'] else '?'} TB/s.\n\n"
            + table(["config", "params", "dtype", "batch", "HF eager", "HF static + reduce-overhead",
                     "**streamdag**", *(["streamdag, regions on streams"] if regions else []),
                     "bandwidth bound", "HF eager prefill ms", "reduce-overhead prefill ms",
                     "streamdag prefill ms", *(["regions prefill ms"] if regions else []),
                     "token ids vs HF eager"], rows))


def render_soak(data: dict) -> str:
    rows = [[name, c["programs"], c["ops"], c["failures_injected"], c["mismatches"], c["hangs"],
             c["skipped"]] for name, c in sorted(data["by_category"].items())]
    rows.append(["total", data["programs"], data["ops"], data["failures_injected"], data["mismatches"],
                 data["hangs"], data["skipped"]])
    return table(["category", "programs", "ops", "failures injected", "mismatches", "hangs", "skipped"],
                 rows)


def render_ray_pipeline(data: dict) -> str:
    """Per way: tiny and real work per run, per op and per micro-batch; the driver's time per call;
    the goals' ratios."""
    tiny, work = data["ms"]["tiny"], data["ms"]["work"]
    rows = [[k, tiny[k], data["per_op_us_tiny"][k], work[k], data["micro_batches_per_s"][k]] for k in tiny]
    parts = [table(["way", "tiny: ms per run", "tiny: µs per op", "work: ms per run",
                    "work: micro-batches/s"], rows),
             _submit_table(data),
             table(["streamdag.ray against Ray", "ratio"], list(data["goals"].items()))]
    return "\n\n".join(parts)


def _submit_table(data: dict) -> str:
    """The driver's time per call, sent and (where measured) up to the call's completion."""
    done = data.get("submit_to_done_us")
    if done is None:
        return table(["driver host time per call", "µs"], list(data["submit_us"].items()))
    return table(["driver host time per call", "µs, sent", "µs, up to its completion"],
                 [[k, v, done[k]] for k, v in data["submit_us"].items()])


def same_run_ratio(row: dict, base: float | None, key: str) -> str:
    """``ratio(base, row["ms"][key])``, except for a variant measured in another run than the row's
    (``--merge`` stamps it under ``measured_apart``): a ratio across runs says nothing."""
    value = (row.get("ms") or {}).get(key)
    if value is not None and key in (row.get("measured_apart") or {}):
        return f"{fmt(value)} (timed apart)"
    return ratio(base, value)


def render_train(data: dict) -> str:
    """One row per model, dtype and batch: each way's ms per training step, streamdag's per-graph
    path and its whole captured step against the faster torch.compile mode, the whole step captured
    by hand, streamdag's gradient error and its check (against a float64 step, within 3x eager's
    error; rows without a check were measured against eager's gradients, which TF32's rounding
    alone moves by up to 0.2 on deep BatchNorm networks) and each way's peak memory."""
    rows = []
    for m in data["models"]:
        ms, err, peak = m.get("ms") or {}, m.get("grad_max_rel_err") or {}, m.get("peak_mib") or {}
        check = m.get("grad_check") or {}
        failed = [k for k, v in check.items() if v != "ok"]
        verdict = ("failed: " + ", ".join(failed)) if failed else "ok" if check else "-"
        # the faster mode where reduce-overhead ran (the default alone is far slower on small steps)
        best = min((ms[k] for k in ("inductor", "inductor_ro") if ms.get(k)), default=None) \
            if ms.get("inductor_ro") else None
        rows.append([m["model"], m["dtype"], m["batch"], *(ms.get(k) for k in
                     ("eager", "inductor", "inductor_ro", "streamdag")), same_run_ratio(m, best, "streamdag"),
                     ms.get("inductor_step"), same_run_ratio(m, best, "streamdag_step"),
                     err.get("streamdag"), verdict,
                     ", ".join(f"{k} {v:.0f}" for k, v in peak.items())])
    return table(["model", "dtype", "batch", "eager ms", "torch.compile ms", "reduce-overhead ms",
                  "streamdag ms", "streamdag vs faster compile", "whole step by hand ms",
                  "streamdag.capture_step ms", "streamdag grad err", "grad check", "peak MiB"], rows)


def render_flat(data: dict) -> str:
    """A benchmark whose result is one dict of numbers (``ms``, ``us_per_op``...): one row each."""
    for key, unit in (("ms", "ms"), ("us_per_op", "µs per op"), ("us", "µs")):
        values = data.get(key)
        if isinstance(values, dict) and all(isinstance(v, (int, float)) for v in values.values()):
            return table(["variant", unit], list(values.items()))
    return "(no table for this result's layout: read the JSON file)"


#: benchmark name -> (the script that writes it, what it measures, its renderer), in page order
BENCHMARKS: dict[str, tuple[str, str, Callable[[dict], str]]] = {
    "wide": ("bench/wide.py", "The wide graph: B branches of L layers of matmul+relu from one input, "
             "joined by a sum; PyTorch eager, hand-made CUDA graphs, streamdag op by op, recorded and "
             "captured, and streamdag.compile.", render_wide),
    "models": ("bench/models.py", "torchvision models at batch 1 (random weights, inference): "
               "streamdag.compile against PyTorch's ways to run them.", render_models),
    "overhead": ("bench/overhead.py", "Host time per op that streamdag adds to PyTorch's own launch: "
                 "a dependent chain of tiny kernels, and 1 KiB pinned copies.", render_overhead),
    "overlap": ("bench/overlap.py", "Copy/compute overlap: 8 chunks of 64 MiB from pinned memory in, "
                "6 x (bf16 matmul + tanh), out; against the bound measured in the same run.",
                render_overlap),
    "transfers": ("bench/transfers.py", "Host<->device copies from pinned and pageable memory: "
                  "`rt.copy` against PyTorch's `copy_`.", render_transfers),
    "latency": ("bench/latency.py", "Waiting for a tiny op: futures against "
                "`torch.cuda.synchronize()`.", render_latency),
    "wait_latency": ("bench/wait_latency.py", "Waiting for longer work: `result()` against "
                     "`torch.cuda.synchronize()`.", render_wait_latency),
    "tp": ("bench/tp.py", "Tensor-parallel chain on 1, 2, 4 and 8 GPUs (`LinearChain`); the file "
           "name says how many GPUs the machine had.", render_tp),
    "host_lanes": ("bench/host_lanes.py", "Host functions on GPU results: inside their submit "
                   "against `run_on=\"host\"`.", render_flat),
    "host_feed": ("bench/host_feed.py", "Host-lane ops preparing each step's input while the GPU "
                  "works.", render_flat),
    "recorded_host_op": ("bench/recorded_host_op.py", "A recorded graph with a host step between "
                         "two chains of tiny kernels.", render_flat),
    "held_ops": ("bench/held_ops.py", "What an op held behind a host-lane op costs the host.",
                 render_flat),
    "copy_streams": ("bench/copy_streams.py", "The device alone: hand-made, captured copy/compute "
                     "pipelines in pieces (the floor under `stream_map`).", render_flat),
    "compile_host": ("bench/compile_host.py", "The host path of a compiled model's call at batch 1: "
                     "streamdag.compile (one CUDA graph for the whole call, and per graph) against "
                     "reduce-overhead.", render_compile_host),
    "zoo": ("bench/zoo.py", "Public models with random weights (torchvision, Hugging Face configs): "
            "streamdag.compile against eager, a CUDA graph of eager, torch.compile and its "
            "reduce-overhead mode; the ratio is the best baseline's time over streamdag's. Compile time is "
            "streamdag's first calls against torch.compile's, in one process after it (Inductor's caches "
            "hold what torch.compile built); host time is a call's, begun with the GPU idle, over a "
            "bare replay of a CUDA graph's. Peak memory is each way's after the others in one process, "
            "which moves with their order (the caching allocator keeps what an earlier way freed), "
            "except where it says \"alone\": each way set up alone in a process of its own "
            "(`--memory-alone`).", render_zoo),
    "llm_decode": ("bench/llm_decode.py", "Greedy token generation with Llama-style configs (random "
                   "weights), a 512-token prompt and 256 new tokens: Hugging Face's generate eager, with a "
                   "static cache under torch.compile reduce-overhead, and `streamdag.decoder`.",
                   render_llm_decode),
    "train": ("bench/train.py", "Training steps (forward, backward, AdamW) of public models: eager, "
              "torch.compile, its reduce-overhead mode, streamdag.compile, and the whole step as one "
              "CUDA graph (by hand, and streamdag.capture_step). The gradient check measures the first "
              "step's gradients against the same step in float64, each within 3x eager's own error; "
              "rows without one were measured against eager's gradients, which TF32's rounding moves "
              "on deep networks by as much as any compiled variant's error there (0.2 to 1.0 on some "
              "parameters, for torch.compile as for streamdag). On CUDA each variant runs in a "
              "process of its own; a row's `measured.timed` says whether the processes were timed in "
              "turns (`bench/in_turns.py`: they share the drift over the row's minutes) or one after "
              "another, and rows without it were timed one after another.", render_train),
    "soak": ("bench/soak.py", "Random programs of every kind (eager, recorded graphs, failures, "
             "nested submits and waits, callbacks, close() racing submitters) checked against their "
             "serial run; files with `_plant_` ran with a planted defect that the soak must find.",
             render_soak),
    "ray_pipeline": ("bench/ray_pipeline.py", "A 4-stage numpy pipeline of 8 micro-batches over two "
                     "local Ray nodes: `streamdag.ray` recorded and eager against the same pipeline "
                     "written with Ray actors and with a Ray Compiled Graph.", render_ray_pipeline),
    "cpu_wide": ("bench/cpu_wide.py", "The CPU suite's wide graph on worker lanes against a serial "
                 "loop.", render_cpu_wide),
    "sched_scale": ("bench/sched_scale.py", "Scheduling a random DAG of 10,000 ops (pure Python "
                    "scheduler).", render_sched_scale),
    "hot_path": ("bench/hot_path.py", "Host time per submit, compiled hot path against its Python "
                 "reference, with a backend that runs each op at once.", render_hot_path),
    "native_pieces": ("bench/native_pieces.py", "Host time per op with each compiled piece alone in "
                      "Python (the rest compiled), and a second checkout's build beside this one.",
                      render_native_pieces),
}


#: what sets a result file apart from its benchmark's usual run, where its name alone does not say
NOTES = {
    "models_NVIDIA_H100_80GB_HBM3_cudnn_bn_grouped.json":
        "A variant, not the default: the batching pass also grouping `cudnn_batch_norm`, which it "
        "leaves alone because this run measured it slower on GoogLeNet fp32.",
}


def benchmark_of(stem: str) -> str | None:
    """The benchmark a result file belongs to: the longest name that its stem starts with."""
    names = [n for n in BENCHMARKS if stem == n or stem.startswith(n + "_")]
    return max(names, key=len, default=None)


def device_line(env: dict) -> str:
    if env.get("gpu"):
        gpus = env.get("gpus") or 1
        device = f"{env['gpu']}" + (f" (of {gpus} on the host)" if gpus > 1 else "")
        software = f"PyTorch {env.get('torch')}, CUDA {env.get('cuda')}"
    else:
        device = f"CPU, {env.get('cpu_count')} cores"
        software = f"PyTorch {env.get('torch')}" if env.get("torch") else "no PyTorch"
    return f"{device}; Python {env.get('python')}, {software}, streamdag {env.get('streamdag')}"


def section(path: Path) -> tuple[str, str]:
    """(benchmark name, the markdown section) of one result file."""
    data = json.loads(path.read_text())
    name = benchmark_of(path.stem)
    if name is None:
        raise SystemExit(f"{path}: no benchmark is named like this file; add it to BENCHMARKS in "
                         f"{Path(__file__).name} (its script, what it measures, a renderer)")
    render = BENCHMARKS[name][2]
    env = data.pop("environment", {})
    note = [NOTES[path.name]] if path.name in NOTES else []
    return name, "\n\n".join([f"### `{path.name}`", f"{device_line(env)}.", *note, render(data)])


HEADER = """\
# Benchmarks

Generated by `python scripts/benchmarks_page.py` from the files in
[`bench/results/`](../bench/results/): do not edit by hand. Each file holds the
environment it ran in and every number below; the latest result per benchmark
and device is kept, earlier ones are in git history. Times are medians. Host
speed varies between machines by tens of percent, so compare variants within
one table rather than across tables.

To add or refresh a result, run the benchmark's script on the device (each
writes its JSON into `bench/results/`), then regenerate this page.
`streamdag bench` runs the built-in suite and writes into
`streamdag-results/` (or `--out DIR`), which this page does not read.
"""


def page(results: Path = RESULTS) -> str:
    sections: dict[str, list[str]] = {}
    for path in sorted(results.glob("*.json")):
        if path.stem.startswith("trace_"):  # Chrome traces, not results
            continue
        name, text = section(path)
        sections.setdefault(name, []).append(text)
    parts = [HEADER.strip()]
    for name, (script, what, _) in BENCHMARKS.items():
        if name in sections:
            parts.append(f"## {name}\n\n{what} Script: `{script}`.")
            parts.extend(sections[name])
    images = sorted(results.glob("timeline_*.png"))
    if images:
        parts.append("## Timelines\n\n" + "\n\n".join(
            f"`{p.name}`:\n\n![{p.stem}](../bench/results/{p.name})" for p in images))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python scripts/benchmarks_page.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
