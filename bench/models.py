"""Real models, batch 1: streamdag.compile against PyTorch's ways to run them.

torchvision googlenet, inception_v3 and resnet50 with random weights, eval(),
inference_mode; fp32 with TF32, then bf16. Side by side in one run: eager; a
one-stream CUDA graph made by hand; torch.compile mode="reduce-overhead"
(fp32 only, with --compile: it takes 10-20 s per model); streamdag.compile.
Times are medians of wall time between torch.cuda.synchronize().

Run on a GPU machine: PYTHONPATH=src python bench/models.py [--compile]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torchvision

import streamdag as sd
from streamdag.suite.cuda_timing import graph_of, wall_ms
from streamdag.suite.report import format_table, write_json

MODELS = {
    "googlenet": (lambda: torchvision.models.googlenet(weights=None, aux_logits=False,
                                                       init_weights=False), 224),
    "inception_v3": (lambda: torchvision.models.inception_v3(weights=None, aux_logits=False,
                                                             init_weights=False), 299),
    "resnet50": (lambda: torchvision.models.resnet50(weights=None), 224),
}


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def run_model(name: str, dtype: torch.dtype, use_compile: bool) -> dict:
    make, size = MODELS[name]
    model = make().eval().cuda().to(dtype)
    x = torch.randn(1, 3, size, size, device="cuda", dtype=dtype)
    res: dict[str, float] = {}
    errors: dict[str, float] = {}
    with torch.inference_mode():
        ref = model(x)
        res["eager"] = wall_ms(lambda: model(x))
        g, g_out = graph_of(lambda: model(x))
        res["CUDA graph 1 stream"] = wall_ms(g.replay)
        errors["CUDA graph 1 stream"] = rel_err(g_out, ref)
        t0 = time.perf_counter()
        fast = sd.compile(model, engine="aten")
        for _ in range(40):  # trace, run, capture (choosing the stream count), time the variants
            fast(x)
            if all(e is None or e.chosen is not None for e in fast._entries.values()):
                break
        torch.cuda.synchronize()
        t_sd = time.perf_counter() - t0
        errors["streamdag"] = rel_err(fast(x), ref)
        res["streamdag"] = wall_ms(lambda: fast(x))
        stats = fast.statistics()
        spec = next(e for e in fast._entries.values() if e is not None)
        entry = spec.entry
        cap = entry.graph.statistics()
        explain_head = fast.explain().splitlines()[:3]
        t_compile = None
        if use_compile:
            torch._dynamo.reset()
            t0 = time.perf_counter()
            tc = torch.compile(model, mode="reduce-overhead")
            for _ in range(3):
                tc(x)
            torch.cuda.synchronize()
            t_compile = time.perf_counter() - t0
            res["torch.compile reduce-overhead"] = wall_ms(lambda: tc(x))
            errors["torch.compile reduce-overhead"] = rel_err(tc(x), ref)
        fast.close()
    return {
        "model": name, "dtype": str(dtype), "ms": res, "rel_error_vs_eager": errors,
        "streamdag_compile_s": t_sd, "torch_compile_s": t_compile,
        "ops": len(entry.graph), "stats": vars(stats), "variant": entry.label,
        "variant_ms": spec.choice_ms, "batching": str(entry.batch_report or ""),
        "group_estimates": [str(e) for e in spec.group_estimates],
        "capture": {"chosen_streams": cap.chosen_streams if cap else None,
                    "choice_ms": cap.choice_ms if cap else None,
                    "estimate_ms": cap.estimate_ms if cap else None,
                    "fallbacks": cap.fallbacks if cap else None},
        "explain_head": explain_head,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for name in args.models.split(","):
            results.append(run_model(name, dtype, args.compile and dtype == torch.float32))
    labels = ["eager", "CUDA graph 1 stream", "torch.compile reduce-overhead", "streamdag"]
    rows = []
    for r in results:
        base = r["ms"]["CUDA graph 1 stream"]
        row = [f"{r['model']} {r['dtype'].replace('torch.', '')}"]
        for label in labels:
            ms = r["ms"].get(label)
            row.append("-" if ms is None else f"{ms:.3f} ({base / ms:.2f}x)")
        row += [f"{r['streamdag_compile_s']:.2f}", r["capture"]["chosen_streams"], r["ops"],
                f"{r['rel_error_vs_eager']['streamdag']:.1e}"]
        rows.append(row)
    print(format_table(["model", *[f"{x} ms" for x in labels], "sd compile s", "streams", "ops",
                        "sd rel err"], rows))
    print(write_json(Path(__file__).parent / "results",
                     "models_" + torch.cuda.get_device_name().replace(" ", "_"),
                     {"settings": {"batch": 1, "tf32": True, "cudnn_benchmark": True}, "models": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
