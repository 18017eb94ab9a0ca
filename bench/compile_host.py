"""The host path of a compiled model's call: streamdag.compile against reduce-overhead, per call.

For each model (torchvision's GoogLeNet and ResNet-50, random weights, batch 1,
fp32 under inference mode) and each way to run it:

* ``streamdag``: ``streamdag.compile(model)``, whose calls replay one CUDA graph of
  the whole call past Dynamo (``whole_call``);
* ``streamdag_graphs``: ``streamdag.compile(model, whole_call=False)``: every call
  through Dynamo, each graph replaying its own CUDA graph;
* ``reduce_overhead``: ``torch.compile(model, mode="reduce-overhead")``.

three times are taken, medians over rounds:

* ``host_us``: the host time of a call without synchronizing (calls issued back to
  back; the GPU runs behind);
* ``latency_ms``: a call and a ``torch.cuda.synchronize()``;
* ``replay_ms``: the GPU time of the CUDA graphs alone, replayed back to back (for
  reduce-overhead, the graphs of its CUDA-graph tree, where they can be found).

``latency_ms - replay_ms`` is what the call adds to the GPU's work: the goal for
streamdag is 20 µs or less. Models whose package is missing are skipped.

Run on a GPU machine: PYTHONPATH=src python bench/compile_host.py
(writes bench/results/compile_host_<gpu>.json)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import streamdag as sd
from streamdag.suite.cuda_timing import host_us
from streamdag.suite.report import format_table, write_json

MODELS = ("googlenet", "resnet50")
VARIANTS = ("streamdag", "streamdag_graphs", "reduce_overhead")


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor] | None:
    try:
        import torchvision
    except ImportError:
        return None
    kwargs: dict[str, Any] = {"weights": None}
    if name == "googlenet":
        kwargs.update(aux_logits=False, init_weights=False)
    model = getattr(torchvision.models, name)(**kwargs).eval().cuda()
    return model, torch.randn(1, 3, 224, 224, device="cuda")


def make(variant: str, model: torch.nn.Module) -> Any:
    if variant == "streamdag":
        return sd.compile(model)
    if variant == "streamdag_graphs":
        return sd.compile(model, whole_call=False)
    return torch.compile(model, mode="reduce-overhead")


def latency_ms(call: Callable[[], Any], calls: int) -> float:
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gpu_ms(replay: Callable[[], None], calls: int, rounds: int) -> float:
    """GPU time per replay, the replays back to back (the host issues them faster than they run)."""
    per_call = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / calls)
    return statistics.median(per_call)


def streamdag_graphs(compiled: Any) -> list[torch.cuda.CUDAGraph]:
    """The CUDA graphs a call of ``compiled`` replays: its whole-call graph, else each graph's own."""
    whole = compiled.whole
    if whole is not None and whole.current is not None and whole.current.entries:
        return [next(iter(whole.current.entries.values())).graph]
    graphs = []
    for runner in compiled.backend.runners:
        graphs += [g.graph for g in getattr(runner, "captures", [])[:1]]
    return graphs


def reduce_overhead_graphs() -> list[torch.cuda.CUDAGraph]:
    """The graphs of reduce-overhead's CUDA-graph tree (PyTorch internals: empty where they moved)."""
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
        found, todo = [], [n for nodes in manager.roots.values() for n in nodes]
        while todo:
            node = todo.pop(0)
            if getattr(node, "graph", None) is not None:
                found.append(node.graph)
            todo += [c for children in node.children.values() for c in children]
        return found
    except Exception:
        return []


def measure(name: str, variant: str, calls: int, rounds: int) -> dict[str, Any] | None:
    built = build(name)
    if built is None:
        return None
    model, x = built
    torch._dynamo.reset()
    with torch.inference_mode():
        t0 = time.perf_counter()
        compiled = make(variant, model)
        for _ in range(5):  # compile, choose candidates, capture; the rest replays
            compiled(x)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        out = compiled(x)
        err = float((out.float() - model(x).float()).norm() / model(x).float().norm())

        def call() -> Any:
            return compiled(x)

        row: dict[str, Any] = {"model": name, "variant": variant, "compile_s": compile_s, "rel_err": err,
                               "host_us": host_us(call, calls, rounds),
                               "latency_ms": latency_ms(call, calls * rounds // 4)}
        graphs = streamdag_graphs(compiled) if variant != "reduce_overhead" else reduce_overhead_graphs()
        row["graphs"] = len(graphs)
        row["replay_ms"] = None
        if graphs:
            def replay() -> None:
                for g in graphs:
                    g.replay()
            row["replay_ms"] = gpu_ms(replay, calls, rounds)
            row["added_us"] = (row["latency_ms"] - row["replay_ms"]) * 1e3
        if variant != "reduce_overhead":
            stats = compiled.statistics()
            row["statistics"] = vars(stats)
            row["explain"] = compiled.explain()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--calls", type=int, default=100, help="calls per round")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("bench/compile_host.py needs a CUDA GPU")
    # as bench/zoo.py runs fp32: TF32 matmuls and cuDNN's autotuner
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    rows = []
    for name in args.models.split(","):
        for variant in args.variants.split(","):
            row = measure(name, variant, args.calls, args.rounds)
            if row is None:
                print(f"{name}: skipped (torchvision is not installed)")
                break
            rows.append(row)
            print(f"{name} {variant}: host {row['host_us']:.1f} µs, latency {row['latency_ms']:.3f} ms, "
                  f"replay {row['replay_ms']} ms", flush=True)
    table = [[r["model"], r["variant"], r["host_us"], r["latency_ms"],
              "-" if r["replay_ms"] is None else r["replay_ms"],
              "-" if r.get("added_us") is None else r["added_us"], r["compile_s"]] for r in rows]
    print(format_table(["model", "variant", "host µs/call", "latency ms", "replay ms", "added µs",
                        "compile s"], table))
    name = "compile_host_" + torch.cuda.get_device_name().replace(" ", "_")
    print(write_json(Path(__file__).parent / "results", name,
                     {"settings": {"batch": 1, "dtype": "fp32", "tf32": True, "calls": args.calls,
                                   "rounds": args.rounds},
                      "rows": rows}))


if __name__ == "__main__":
    main()
