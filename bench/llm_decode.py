"""LLM token generation: streamdag's decoder against Hugging Face's generate, side by side in one run.

Llama-style decoders with random weights (no downloads), greedy, a prompt of
``--prompt`` tokens (512) and ``--new`` new tokens (256), for each config and
batch:

* ``hf_eager``: ``model.generate`` with its default dynamic cache, uncompiled;
* ``inductor_ro_static_cache``: ``model.generate`` with a ``StaticCache`` (one,
  reset before each call) and its decode steps under
  ``torch.compile(mode="reduce-overhead")`` (Hugging Face's own automatic compile
  for a static cache on a GPU; on the CPU it does not compile, and the row says so);
* ``streamdag``: ``streamdag.decoder(model, max_length=prompt + new)``: the same
  static cache, each decode step one whole-call CUDA graph replayed;
* with ``--regions``, ``streamdag_regions``: the same with ``regions="always"``:
  the step's regions on several streams inside its graph, whatever the cost
  model predicts.

Times are medians of ``--repeats`` generate calls of each variant after its
warm-up calls (compiles and captures), with the device synchronized around
each: ``prefill_ms`` is a call with one new token (the prompt's forward and the
first token), ``ms_per_token`` is the rest of a full call over the other new
tokens (one decode step: one token per sequence), and ``tokens_per_s`` counts
the tokens of the whole batch. ``bound`` is the memory-bandwidth bound of a
decode step: every weight read once per step, ``weight bytes / bandwidth``
(``--bandwidth-tbs``, by default an H200's 4.8 TB/s; the KV cache's bytes are
listed beside it). Token ids are compared across the three variants: with
bf16 and random weights, near-tied logits may pick another token where the
kernels round differently, so the rows record the first position that differs.

    PYTHONPATH=src python bench/llm_decode.py                  # on a GPU: 1b and wide, batch 1 and 8, bf16
    PYTHONPATH=src python bench/llm_decode.py --quick          # a tiny config on the CPU: a smoke check

``--profile TOKENS`` adds, per variant, where a decode step's time goes (torch.profiler over a
generate call of TOKENS new tokens, less one of a single token: the steps alone, without the
prefill): the GPU's busy time per step and the kernels that take most of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

from zoo import commit, host_load, utc_now

VARIANTS = ("hf_eager", "inductor_ro_static_cache", "streamdag")
#: with --regions: streamdag's decoder with the step cut into regions on streams whatever the cost model says
REGIONS = "streamdag_regions"
SHORT = {"hf_eager": "hf", "inductor_ro_static_cache": "ro", "streamdag": "sd", REGIONS: "sd_regions"}
H200_TBS = 4.8

# name: LlamaConfig fields; "1b" as Llama 3.2 1B, "wide" as Llama 3 8B (wider layers, fills the GPU better)
CONFIGS: dict[str, dict[str, Any]] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "wide": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False),
}


def build(name: str, device: str, dtype: Any, max_positions: int) -> Any:
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(max_position_embeddings=max_positions, **CONFIGS[name])
    torch.manual_seed(0)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights made in the dtype and on the device: no fp32 copy of 8B
    try:
        with torch.device(device):
            model = tf.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def weight_bytes(model: Any) -> int:
    """The bytes of every distinct parameter: what a decode step reads at least once."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def kv_bytes(model: Any, batch: int, positions: int, dtype_bytes: int) -> int:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * batch * c.num_key_value_heads * positions * head_dim * dtype_bytes


class Variant:
    """One way to generate: ``run(ids, new)`` returns the prompt and the new tokens."""

    def __init__(self, name: str, model: Any, prompt: int, new: int) -> None:
        import torch
        from transformers import StaticCache

        self.name, self.model, self.compiled = name, model, True
        self.notes: dict[str, Any] = {}
        if name.startswith("streamdag"):
            import streamdag as sd

            options = {"regions": "always"} if name == REGIONS else {}
            self.decoder = sd.decoder(model, max_length=prompt + new, **options)
        elif name == "inductor_ro_static_cache":
            self.cache = StaticCache(config=model.config, max_cache_len=prompt + new)
            self.compiled = next(model.parameters()).device.type == "cuda"  # Hugging Face compiles on GPUs
        else:
            self.compiled = False
        self.torch = torch

    def run(self, ids: Any, new: int) -> Any:
        torch = self.torch
        with torch.inference_mode():
            if self.name.startswith("streamdag"):  # every token asked for, as below: no end of sequence
                return self.decoder.generate(ids, new, eos_token_id=None)
            kwargs: dict[str, Any] = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
            if self.name == "inductor_ro_static_cache":
                self.cache.reset()
                kwargs["past_key_values"] = self.cache
            return self.model.generate(ids, **kwargs)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def time_variant(v: Variant, ids: Any, new: int, repeats: int, warmup: int, device: str) -> dict[str, Any]:
    out = None
    t0 = time.perf_counter()
    for _ in range(warmup):  # compiles and captures: both lengths, so no timed call compiles
        v.run(ids, 1)
        out = v.run(ids, new)
    _sync(device)
    setup_s = time.perf_counter() - t0
    prefill, full = [], []
    for _ in range(repeats):
        for n, times in ((1, prefill), (new, full)):
            _sync(device)
            t = time.perf_counter()
            out = v.run(ids, n)
            _sync(device)
            times.append((time.perf_counter() - t) * 1e3)
    p_ms, f_ms = statistics.median(prefill), statistics.median(full)
    step_ms = (f_ms - p_ms) / max(new - 1, 1)
    return {"tokens": out.cpu(), "prefill_ms": p_ms, "ms_per_token": step_ms,
            "tokens_per_s": ids.shape[0] * 1e3 / step_ms if step_ms > 0 else None, "setup_s": setup_s}


def _kernel_times(v: Variant, ids: Any, new: int, device: str) -> dict[str, list[float]]:
    """Per kernel name (on the CPU, per operator), how many ran and their time in µs, over a
    generate call of ``new`` tokens under torch.profiler."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        v.run(ids, new)
        _sync(device)
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if device == "cuda" and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time if device == "cuda" else e.self_cpu_time_total
        by_name[e.name[:100]][0] += 1
        by_name[e.name[:100]][1] += us
    return by_name


def profile_variant(v: Variant, ids: Any, new: int, device: str, top: int = 12) -> dict[str, Any]:
    """Where a decode step's time goes, by torch.profiler (after the timed calls): per decode step,
    the GPU's busy time (the sum of its kernels' and copies' times; on the CPU, of the operators'
    own times), the kernels it ran (those inside a CUDA graph's replay each count) and, for the
    ``top`` kernels by time, their time, their count and their time each. The steps' share is a
    generate call of ``new`` tokens less one of a single token (the prefill and the first token),
    kernel by kernel, over its ``new - 1`` steps."""
    steps = max(new - 1, 1)
    whole = _kernel_times(v, ids, new, device)
    prefill = _kernel_times(v, ids, 1, device) if new > 1 else {}
    per_step: dict[str, list[float]] = {}
    for name, (n, t) in whole.items():
        n0, t0 = prefill.get(name, (0, 0.0))
        if n - n0 > 0 and t - t0 > 0:
            per_step[name] = [n - n0, t - t0]
    ranked = sorted(per_step.items(), key=lambda kv: -kv[1][1])
    return {"tokens": new, "steps": steps,
            "busy_ms_per_token": sum(t for _, t in per_step.values()) / steps / 1e3,
            "kernels_per_token": sum(n for n, _ in per_step.values()) / steps,
            "top": [{"name": k, "us_per_token": t / steps, "per_token": n / steps, "us_each": t / max(n, 1)}
                    for k, (n, t) in ranked[:top]]}


def profile_table(row: dict[str, Any]) -> str:
    from streamdag.suite.report import format_table

    out = []
    for variant, prof in row.get("profile", {}).items():
        busy, kernels = prof["busy_ms_per_token"] * 1e3, prof["kernels_per_token"]
        out.append([variant, "all", f"{busy:.1f}", f"{kernels:.0f}", ""])
        out += [["", k["name"][:70], f"{k['us_per_token']:.1f}", f"{k['per_token']:.1f}",
                 f"{k['us_each']:.2f}"] for k in prof["top"]]
    return format_table(["variant", "kernel", "us/token", "kernels/token", "us each"], out)


def compare(a: Any, b: Any, prompt: int) -> dict[str, Any]:
    if a.shape != b.shape:
        return {"equal": False, "note": f"shapes {tuple(a.shape)} and {tuple(b.shape)}"}
    diff = (a[:, prompt:] != b[:, prompt:]).any(0).nonzero()
    return {"equal": bool(diff.numel() == 0), "first_difference": int(diff[0]) if diff.numel() else None}


def run_row(name: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model = build(name, args.device, dtype, args.prompt + args.new)
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt), generator=g).to(args.device)
    wbytes = weight_bytes(model)
    bound_ms = wbytes / (args.bandwidth_tbs * 1e12) * 1e3
    row: dict[str, Any] = {
        "config": {"name": name, "params": sum(p.numel() for p in model.parameters()),
                   "dtype": args.dtype, "batch": batch, "prompt": args.prompt, "new_tokens": args.new,
                   **CONFIGS[name]},
        "tokens_per_s": {}, "ms_per_token": {}, "prefill_ms": {}, "setup_s": {}, "errors": {},
        "bound": {"weight_bytes": wbytes, "bandwidth_tbs": args.bandwidth_tbs, "ms_per_token": bound_ms,
                  "tokens_per_s": batch * 1e3 / bound_ms,
                  "kv_bytes_at_end": kv_bytes(model, batch, args.prompt + args.new, dtype.itemsize)},
    }
    tokens: dict[str, Any] = {}
    for vname in args.variants:
        try:
            v = Variant(vname, model, args.prompt, args.new)
            r = time_variant(v, ids, args.new, args.repeats, args.warmup, args.device)
            tokens[vname] = r.pop("tokens")
            for key in ("tokens_per_s", "ms_per_token", "prefill_ms", "setup_s"):
                row[key][vname] = r[key]
            if vname == "inductor_ro_static_cache":
                row["inductor_ro_compiled"] = v.compiled
            if args.profile:
                row.setdefault("profile", {})[vname] = profile_variant(v, ids, args.profile, args.device)
            if vname.startswith("streamdag"):
                stats = v.decoder.statistics().get(batch)
                row[f"{vname}_statistics"] = vars(stats) if stats is not None else None
                row[f"{vname}_explain"] = v.decoder.explain()
            del v
        except Exception as exc:  # one variant's failure keeps the others' numbers
            row["errors"][vname] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    base = tokens.get("hf_eager")
    row["tokens_equal"] = {k: compare(base, t, args.prompt) for k, t in tokens.items()
                           if k != "hf_eager" and base is not None}
    del model
    if args.device == "cuda":
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return row


def environment(args: argparse.Namespace) -> dict[str, Any]:
    env: dict[str, Any] = {"argv": vars(args)}
    try:
        from streamdag.suite.report import environment as base

        env.update(base())
    except Exception as exc:  # never lose a run to the environment record
        env["environment_error"] = repr(exc)
    for mod in ("transformers", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    env["bandwidth_note"] = (f"the bound takes {args.bandwidth_tbs} TB/s of memory bandwidth "
                             f"(--bandwidth-tbs; {H200_TBS} is an H200's HBM3e)")
    return env


def table(rows: list[dict[str, Any]], variants: tuple[str, ...] = VARIANTS) -> str:
    from streamdag.suite.report import format_table

    out = []
    for r in rows:
        c, ms, tps = r["config"], r["ms_per_token"], r["tokens_per_s"]
        same = [f"{SHORT[k]}:{'same' if e.get('equal') else 'differs@' + str(e.get('first_difference'))}"
                for k, e in r["tokens_equal"].items()]
        out.append([c["name"], c["batch"], *[f"{ms.get(v, float('nan')):.3f}" for v in variants],
                    f"{r['bound']['ms_per_token']:.4f}",
                    *[f"{tps.get(v) or float('nan'):.0f}" for v in variants],
                    *[f"{r['prefill_ms'].get(v, float('nan')):.1f}" for v in variants],
                    " ".join(same), "; ".join(r["errors"]) or "-"])
    legend = ", ".join(f"{SHORT[v]}: {v}" for v in variants)
    return format_table(["config", "batch", *[f"{SHORT[v]} ms/tok" for v in variants], "bound ms/tok",
                         *[f"{SHORT[v]} tok/s" for v in variants],
                         *[f"{SHORT[v]} prefill ms" for v in variants], "tokens vs hf", "errors"], out) + (
        f"\n({legend}; tok/s: the batch's tokens)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="1b,wide", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"),
                   help="default bf16 on a GPU, fp32 on the CPU")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--bandwidth-tbs", type=float, default=H200_TBS,
                   help=f"memory bandwidth for the bound, TB/s (default {H200_TBS}: an H200)")
    p.add_argument("--device", default=None, choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true",
                   help="the tiny config, a short prompt, on the CPU: a smoke check")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/llm_decode_<device>.json)")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of the existing result file that this run does not redo")
    p.add_argument("--regions", action="store_true",
                   help=f"also {REGIONS}: the decode step's regions on streams (regions='always')")
    p.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                   help="also profile a generate call of TOKENS new tokens per variant (torch.profiler): "
                        "the kernels a decode step spends its time in, into the row's 'profile'")
    p.add_argument("--only", default=None,
                   help=f"comma-separated variants to run, of {', '.join((*VARIANTS, REGIONS))} "
                        "(default: all, with --regions)")
    args = p.parse_args()
    args.variants = (*VARIANTS, REGIONS) if args.regions else VARIANTS
    if args.only:
        unknown = sorted(set(args.only.split(",")) - {*VARIANTS, REGIONS})
        if unknown:
            p.error(f"unknown variants {unknown}: choose from {', '.join((*VARIANTS, REGIONS))}")
        args.variants = tuple(args.only.split(","))
        if args.merge:
            p.error("--only with --merge would drop the other variants' numbers from the rows it redoes: "
                    "write the run to its own file (--out)")
    import torch

    from streamdag.suite.report import source_digest

    if args.quick:
        args.configs, args.prompt, args.new = "tiny", 32, 16
        args.repeats, args.warmup = min(args.repeats, 2), 1
        args.device = args.device or "cpu"
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}: choose from {', '.join(CONFIGS)}")
    label = torch.cuda.get_device_name().replace(" ", "_") if args.device == "cuda" else "cpu"
    path = Path(args.out) if args.out else Path(__file__).parent / "results" / f"llm_decode_{label}.json"
    if args.quick and not args.out:  # a smoke check's numbers are not results
        path = Path(__file__).parent / "results" / "latest" / f"llm_decode_{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    redo = {(name, batch) for name in args.configs.split(",") for batch in map(int, args.batches.split(","))}
    earlier = json.loads(path.read_text()).get("rows", []) if args.merge and path.exists() else []
    kept = [r for r in earlier if (r["config"]["name"], r["config"]["batch"]) not in redo]
    result: dict[str, Any] = {"environment": environment(args), "rows": kept}
    if kept:  # the environment is this run's; each row names the code it ran
        result["environment"]["merged"] = "rows from several runs: each row's measured names its commit"
    for name in args.configs.split(","):
        for batch in map(int, args.batches.split(",")):
            row = run_row(name, batch, args)
            row["measured"] = {"commit": commit(), "source": source_digest(), "utc": utc_now(),
                               "load_1min": host_load()}
            result["rows"].append(row)
            path.write_text(json.dumps(result, indent=1))
            print(table(result["rows"][-1:], args.variants), flush=True)
            if args.profile:
                print(profile_table(result["rows"][-1]), flush=True)
    print(table(result["rows"], args.variants))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
