"""A model zoo on one GPU: streamdag.compile against PyTorch's ways to run each model, side by side.

Models are built with random weights and no downloads: torchvision classifiers
across families, two segmentation models, and Hugging Face models from their
configs. For each model, dtype (fp32 with TF32, bf16) and batch, in one run:

* ``eager``: the module as written;
* ``cuda_graph``: one-stream CUDA graph of eager, captured by hand;
* ``inductor``: ``torch.compile(model)``;
* ``inductor_ro``: ``torch.compile(model, mode="reduce-overhead")``;
* ``streamdag``: ``streamdag.compile(model)``.

Times are medians of wall time between ``torch.cuda.synchronize()`` calls, the
variants interleaved round by round. Every row records each variant's relative
error against eager, its compile time (the first calls until its output is
ready; Inductor's FX-graph and kernel caches stay on unless ``--cold-compile``,
so a later variant may reuse an earlier one's kernels), its memory over what
the model and inputs hold (``peak_mib``: what it keeps reserved after its
first calls, CUDA graph pools included, plus what one more call adds, which
``call_mib`` gives alone: a call's fresh outputs, say; in the one process
that times them all, the first variant to use a stream pays that stream's
cuBLAS workspace and caches for those after it, so ``--memory-alone`` sets
each variant up again alone in a process of its own for these two, at the
cost of a setup more per variant; ``peak_mib_shared`` keeps the shared
process's figures either way, and ``memory`` says which these are;
``compile_peak_mib``: the most it reserved while compiling), the host time of
a call issued back to back (``host_us``, for the variants that replay graphs)
and of a call begun with the GPU idle (``idle_host_us``: the host path alone),
the streams streamdag kept and anything it ran uncaptured or on the make_fx
path. The
table's ``x best`` is the best baseline's time over streamdag's (above 1,
streamdag is faster) and ``mem/ro`` streamdag's peak over reduce-overhead's.

Robust by construction: each model runs in a worker process with a time
limit (a crash or a hang loses that model's remaining rows, not the run); a
variant that fails records its error and the others go on; the JSON file is
rewritten after every model. ``--quick`` runs 8 representative models at fp32,
batch 1 (minutes, mostly Inductor's compiles).

The whole zoo (31 models, two dtypes, two batches) compiles each model three
ways per row, which takes hours on one GPU, so a run can be cut three ways:
``--gpus N`` times N models at once, one per GPU (identical GPUs, each model
timed alone on its own); ``--prewarm J`` first compiles every row J processes
at a time, untimed, so that the timed rows hit Inductor's caches (their
``compile_s`` is then a warm-cache figure; use ``--cold-compile`` on a
separate run to measure cold compiles); and ``--merge`` keeps the rows of the
existing result file that this run does not redo, so a table fills over
several runs (each row names the commit and time it was measured at).

    PYTHONPATH=src python bench/zoo.py --quick
    PYTHONPATH=src python bench/zoo.py --models resnet50,bert --dtypes bf16 --batches 1,8
    PYTHONPATH=src python bench/zoo.py --gpus 8 --prewarm 16 --merge
    PYTHONPATH=src python bench/zoo.py --models googlenet,gpt2 --memory-alone --model-s 900 --merge
    PYTHONPATH=src python bench/zoo.py --gpus 4 --memory-alone streamdag,inductor_ro --merge
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from children import run_child
from zoo_models import MODELS, QUICK, SEQ, build, first_tensor, rel_err

VARIANTS = ("eager", "cuda_graph", "inductor", "inductor_ro", "streamdag")
BASELINES = ("eager", "cuda_graph", "inductor", "inductor_ro")


# -- one row: a model at one dtype and batch ----------------------------------------------------------------

class VariantTimeout(Exception):
    pass


def _alarm(seconds: float) -> None:
    def handler(signum: int, frame: Any) -> None:
        raise VariantTimeout(f"over {seconds:.0f} s")
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def _setup(label: str, model: Any, args: tuple, kwargs: dict) -> tuple[Callable[[], Any], Any, Any]:
    """Make the variant, run it until its output is ready; returns (call, first output, handle)."""
    import torch

    import streamdag as sd
    from streamdag.suite.cuda_timing import graph_of

    call: Callable[[], Any]
    handle = None
    if label == "eager":
        call = lambda: model(*args, **kwargs)  # noqa: E731
    elif label == "cuda_graph":
        graph, out = graph_of(lambda: model(*args, **kwargs))
        handle = (graph, out)
        call = graph.replay
        graph.replay()  # a capture records the kernels without running them: the output is computed here
        torch.cuda.synchronize()
        return call, out, handle
    elif label in ("inductor", "inductor_ro"):
        compiled = torch.compile(model, mode="reduce-overhead" if label == "inductor_ro" else None)
        handle = compiled
        call = lambda: compiled(*args, **kwargs)  # noqa: E731
    elif label == "streamdag":
        compiled = sd.compile(model)
        handle = compiled
        call = lambda: compiled(*args, **kwargs)  # noqa: E731
    else:
        raise ValueError(label)
    out = None
    for _ in range(3):  # compile, then the calls that capture, time candidates, warm up cudagraph trees
        out = call()
    torch.cuda.synchronize()
    return call, out, handle


def segments() -> dict[tuple[Any, ...], int]:
    """The CUDA caching allocator's segments once its unused cache is released: address -> bytes.
    They hold the tensors alive and the memory pools of CUDA graphs (a graph's temporaries are
    free blocks of its pool, so allocated bytes would miss them)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {(s["address"], s["total_size"], s.get("segment_pool_id"), s.get("stream")): s["total_size"]
            for s in torch.cuda.memory_snapshot()}


def added_bytes(before: dict[tuple[Any, ...], int], after: dict[tuple[Any, ...], int]) -> int:
    """The bytes of the segments in ``after`` that ``before`` did not hold, a segment known by its
    address, size, pool and stream. (Not a difference of totals: a variant set up after another
    may release what the other held, as a recompile of the same module frees the earlier
    variant's graph.)"""
    return sum(size for segment, size in after.items() if segment not in before)


def run_row(name: str, dtype_name: str, batch: int, variant_s: float, rounds: int) -> dict[str, Any]:
    import torch

    from streamdag.suite.cuda_timing import host_us, idle_host_us, interleaved_wall_ms

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    row: dict[str, Any] = {"model": name, "dtype": dtype_name, "batch": batch, "ms": {}, "rel_err": {},
                           "compile_s": {}, "peak_mib": {}, "call_mib": {}, "compile_peak_mib": {},
                           "streams": None, "fallback": [], "errors": {}}
    model, make_inputs = build(name)
    model = model.cuda().to(dtype)
    args, kwargs = make_inputs(batch, dtype)
    calls: dict[str, Callable[[], Any]] = {}
    outputs: dict[str, Any] = {}
    handles: dict[str, Any] = {}
    held: dict[str, int] = {}
    with torch.inference_mode():
        for label in VARIANTS:
            before = segments()
            base = sum(before.values())
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                _alarm(variant_s)
                calls[label], out, handles[label] = _setup(label, model, args, kwargs)
                # kept on the host: a copy on the GPU, or the result itself, would count as held
                outputs[label] = first_tensor(out).cpu()
                del out
            except Exception as exc:
                row["errors"][label] = f"{type(exc).__name__}: {str(exc)[:500]}"
                continue
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            row["compile_s"][label] = time.perf_counter() - t0
            row["compile_peak_mib"][label] = (torch.cuda.max_memory_reserved() - base) / 2**20
            held[label] = added_bytes(before, segments())
        if "eager" in outputs:
            row["rel_err"] = {k: rel_err(v, outputs["eager"]) for k, v in outputs.items() if k != "eager"}
        try:
            _alarm(variant_s)
            row["ms"] = interleaved_wall_ms(calls, rounds=rounds, warmup=3)
            replaying = [k for k in ("cuda_graph", "inductor_ro", "streamdag") if k in calls]
            row["host_us"] = {k: host_us(calls[k]) for k in replaying}
            row["idle_host_us"] = {k: idle_host_us(calls[k]) for k in replaying}
        except Exception as exc:
            row["errors"]["timing"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for label, call in calls.items():  # what it holds, plus what one call adds on top
            reserved = sum(segments().values())
            torch.cuda.reset_peak_memory_stats()
            call()
            torch.cuda.synchronize()
            row["call_mib"][label] = (torch.cuda.max_memory_reserved() - reserved) / 2**20
            row["peak_mib"][label] = held[label] / 2**20 + row["call_mib"][label]
    row["peak_mib_shared"], row["call_mib_shared"] = dict(row["peak_mib"]), dict(row["call_mib"])
    row["memory"] = "all variants in one process"
    fast = handles.get("streamdag")
    if fast is not None:
        _describe_streamdag(fast, row)
    return row


def _memory_of_each_alone(row: dict[str, Any], name: str, dtype_name: str, batch: int,
                          labels: list[str], variant_s: float) -> None:
    """``row``'s ``peak_mib`` and ``call_mib`` of each variant set up alone in a process of its own
    (:func:`memory_alone`); a variant whose process fails keeps its shared figure, and the row
    says so in ``memory_errors``."""
    errors = {}
    every = set(labels) == set(row["peak_mib"])
    for label in labels:
        with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as tmp:
            out_path = tmp.name
        cmd = [sys.executable, __file__, "--worker", name, "--memory-of", label, "--dtypes", dtype_name,
               "--batches", str(batch), "--variant-s", str(variant_s), "--worker-out", out_path]
        done = run_child(cmd, variant_s + 60)
        text = Path(out_path).read_text()
        os.unlink(out_path)
        if done.timed_out:
            errors[label] = f"over the {variant_s + 60:.0f} s limit"
        elif done.returncode != 0 or not text.strip():
            errors[label] = f"exit {done.returncode}: {done.output[-500:]}"
        else:
            row["peak_mib"][label], row["call_mib"][label] = json.loads(text)
    row["memory"] = (("each variant alone in a process" if every
                      else f"alone in a process each: {', '.join(labels)}; the others in one")
                     + (" (but those in memory_errors)" if errors else ""))
    if errors:
        row["memory_errors"] = errors


def alone_labels(chosen: str, labels: list[str]) -> list[str]:
    """The variants of ``labels`` whose memory ``--memory-alone chosen`` takes alone ('all': each)."""
    if chosen == "all":
        return labels
    wanted = [v.strip() for v in chosen.split(",") if v.strip()]
    unknown = sorted(set(wanted) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--memory-alone: unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    return [label for label in labels if label in wanted]


def memory_alone(name: str, dtype_name: str, batch: int, label: str, variant_s: float) -> tuple[float, float]:
    """One variant of a row set up alone in this process, as :func:`run_row` sets it up: (MiB it
    keeps after its first calls plus what one more call adds, MiB that call adds)."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model, make_inputs = build(name)
    model = model.cuda().to(dtype)
    args, kwargs = make_inputs(batch, dtype)
    with torch.inference_mode():
        before = segments()
        _alarm(variant_s)
        try:
            call, out, _ = _setup(label, model, args, kwargs)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        del out
        held = added_bytes(before, segments())
        for _ in range(10):  # (the shared process measures after its timed calls)
            call()
        reserved = sum(segments().values())
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        call_mib = (torch.cuda.max_memory_reserved() - reserved) / 2**20
    return held / 2**20 + call_mib, call_mib


def _describe_streamdag(fast: Any, row: dict[str, Any]) -> None:
    stats = fast.statistics()
    runners = fast.backend.runners
    chosen = [getattr(r, "chosen", None) for r in runners]
    row["streams"] = max((c.streams for c in chosen if c is not None), default=None)
    row["streamdag"] = {"graphs": stats.graphs, "captures": stats.captures, "replays": stats.replays,
                        "uncaptured_calls": stats.uncaptured_calls, "fallbacks": stats.fallbacks,
                        "inner_compile_s": stats.compile_s,
                        "whole_captures": getattr(stats, "whole_captures", None),
                        "whole_replays": getattr(stats, "whole_replays", None),
                        "chosen": [None if c is None else c.label for c in chosen],
                        "candidates": [[{"label": c.label, "streams": c.streams, "ms": c.ms,
                                         "peak_mib": c.peak_mib, "error": c.error}
                                        for c in getattr(r, "candidates", [])] for r in runners],
                        "explain": fast.explain().splitlines()[:60]}
    if stats.fallbacks:
        row["fallback"].append(f"{stats.fallbacks} graph(s) on the make_fx path")
    if stats.uncaptured_calls:
        row["fallback"].append(f"{stats.uncaptured_calls} uncaptured call(s)")
    if stats.graphs > 1:
        row["fallback"].append(f"{stats.graphs} graphs (graph breaks or recompiles)")


# -- worker and orchestration ----------------------------------------------------------------------

def warm(name: str, dtypes: str, batches: str, variant_s: float) -> None:
    """Compile each compiled variant of each row once, untimed: fills Inductor's caches."""
    import torch

    model, make_inputs = build(name)
    for dtype_name in dtypes.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
        typed = model.cuda().to(dtype)
        for batch in (int(b) for b in batches.split(",")):
            args, kwargs = make_inputs(batch, dtype)
            with torch.inference_mode():
                for label in ("inductor", "inductor_ro", "streamdag"):
                    try:
                        _alarm(variant_s)
                        _setup(label, typed, args, kwargs)
                    except Exception as exc:  # the timed run records it
                        print(f"warm {name} {dtype_name} b{batch} {label}: {type(exc).__name__}", flush=True)
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                    torch._dynamo.reset()
            torch.cuda.empty_cache()


def worker(args: argparse.Namespace) -> int:
    import torch

    from streamdag.suite.report import source_digest

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    if args.cold_compile:
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    if args.warm_only:
        warm(args.worker, args.dtypes, args.batches, args.variant_s)
        return 0
    if args.memory_of:
        figures = memory_alone(args.worker, args.dtypes, int(args.batches), args.memory_of, args.variant_s)
        Path(args.worker_out).write_text(json.dumps(figures))
        return 0
    with open(args.worker_out, "a") as out:
        for dtype in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                try:
                    row = run_row(args.worker, dtype, batch, args.variant_s, args.rounds)
                except Exception as exc:  # the model itself failed (build, inputs): the row says so
                    row = {"model": args.worker, "dtype": dtype, "batch": batch,
                           "errors": {"row": f"{type(exc).__name__}: {exc}"},
                           "traceback": traceback.format_exc()[-3000:]}
                row["measured"] = {"commit": commit(), "source": source_digest(), "utc": utc_now(),
                                   "rounds": args.rounds, "load_1min": host_load()}
                out.write(json.dumps(row) + "\n")
                out.flush()
                if args.memory_alone and "peak_mib" in row:  # (written again: a time limit keeps the first)
                    alone = alone_labels(args.memory_alone, list(row["peak_mib"]))
                    _memory_of_each_alone(row, args.worker, dtype, batch, alone, args.variant_s)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                torch._dynamo.reset()
                torch.cuda.empty_cache()
    return 0


def environment(args: argparse.Namespace) -> dict[str, Any]:
    env: dict[str, Any] = {"argv": sys.argv[1:], "tf32": True, "cudnn_benchmark": True,
                           "cold_compile": args.cold_compile, "rounds": args.rounds, "seq_len": SEQ}
    try:
        from streamdag.suite.report import environment as base

        env.update(base())
    except Exception as exc:  # never lose a run to the environment record
        env["environment_error"] = repr(exc)
    for mod in ("torchvision", "transformers", "triton"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    env["streamdag_commit"] = commit()
    return env


def host_load() -> float | None:
    """The host's load average over the last minute, as the row ends: other work on the host (a
    test run beside the zoo) slows the host side of every variant, streamdag's host time most."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # no load average on this platform
        return None


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())


def commit() -> str | None:
    """The checkout's commit, ``-dirty`` where its files differ from it (a copy of the tree whose git
    history is stale shows so); the environment's ``streamdag_source`` names the code itself."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        return None


def speedup(row: dict[str, Any]) -> float | None:
    """The best baseline's time over streamdag's: above 1, streamdag is faster."""
    ms = row.get("ms") or {}
    best = [ms[b] for b in BASELINES if ms.get(b)]
    if not ms.get("streamdag") or not best:
        return None
    return min(best) / ms["streamdag"]


def memory_vs_ro(row: dict[str, Any]) -> float | None:
    """streamdag's steady peak memory over reduce-overhead's."""
    peak = row.get("peak_mib") or {}
    if not peak.get("streamdag") or not peak.get("inductor_ro"):
        return None
    return peak["streamdag"] / peak["inductor_ro"]


def table(rows: list[dict[str, Any]]) -> str:
    from streamdag.suite.report import format_table

    out = []
    for r in rows:
        ms = r.get("ms") or {}
        q, m = speedup(r), memory_vs_ro(r)
        out.append([r["model"], r["dtype"], r["batch"], *[ms.get(v, "-") for v in VARIANTS],
                    "-" if q is None else f"{q:.2f}", r.get("streams") or "-",
                    "-" if m is None else f"{m:.2f}",
                    f"{(r.get('compile_s') or {}).get('inductor', float('nan')):.1f}",
                    f"{(r.get('compile_s') or {}).get('streamdag', float('nan')):.1f}",
                    f"{(r.get('rel_err') or {}).get('streamdag', float('nan')):.1e}",
                    "; ".join(r.get("fallback") or []) + ("; errors: " + ", ".join(r["errors"])
                                                          if r.get("errors") else "")])
    return format_table(["model", "dtype", "batch", *[f"{v} ms" for v in VARIANTS], "x best", "streams",
                         "mem/ro", "inductor s", "sd s", "sd rel err", "notes"], out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help=f"comma-separated; default all: {','.join(MODELS)}")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--quick", action="store_true", help="8 representative models, fp32, batch 1")
    p.add_argument("--model-s", type=float, default=600.0, help="time limit per model (its worker)")
    p.add_argument("--variant-s", type=float, default=240.0, help="time limit per variant's setup")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting models after this")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--cold-compile", action="store_true", help="no FX-graph or AOTAutograd cache hits")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/zoo_<device>.json)")
    p.add_argument("--gpus", type=int, default=1, help="time this many models at once, one per GPU")
    p.add_argument("--prewarm", type=int, default=0, metavar="J",
                   help="first compile every row untimed, J processes at a time (fills Inductor's caches)")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of the existing result file that this run does not redo")
    p.add_argument("--memory-alone", nargs="?", const="all", default=None, metavar="VARIANTS",
                   help="take each variant's memory with it set up alone in a process of its own (in the "
                        "process that times them all, the first variant on a stream pays its workspaces "
                        "for the others); a setup more per variant: raise --model-s. A comma list "
                        "(e.g. streamdag,inductor_ro) takes those variants' alone, the others' shared"),
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)
    p.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.models = args.models or ",".join(QUICK)
        args.dtypes, args.batches = "fp32", "1"
        args.model_s = min(args.model_s, 150.0)
        args.variant_s = min(args.variant_s, 100.0)
        args.budget_s = args.budget_s or 480.0
        args.rounds = min(args.rounds, 20)
    models = (args.models or ",".join(MODELS)).split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}: choose from {', '.join(MODELS)}")
    if args.memory_alone:
        alone_labels(args.memory_alone, list(VARIANTS))  # (a misspelt variant stops the run here)
    import torch

    if not torch.cuda.is_available():
        p.error("bench/zoo.py needs a CUDA GPU")
    device = torch.cuda.get_device_name().replace(" ", "_")
    path = Path(args.out) if args.out else Path(__file__).parent / "results" / f"zoo_{device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.gpus > torch.cuda.device_count():
        p.error(f"--gpus {args.gpus}: only {torch.cuda.device_count()} GPU(s) visible")
    kept = kept_rows(path, models, args) if args.merge else []
    result = {"environment": environment(args), "models": list(kept)}
    if kept:  # the environment is this run's; each row names the commit and rounds it was timed at
        result["environment"]["argv"] = ["(merged) rows from several runs: each row names its commit in "
                                         "measured.commit; the last run's arguments:", *sys.argv[1:]]
    if args.prewarm:
        _prewarm(models, args)
    t_start = time.perf_counter()
    free_gpus: queue.SimpleQueue[int] = queue.SimpleQueue()
    for gpu in range(args.gpus):
        free_gpus.put(gpu)
    with concurrent.futures.ThreadPoolExecutor(args.gpus) as pool:
        slots = [pool.submit(_timed_model, name, free_gpus, t_start, args) for name in models]
        for done_model in concurrent.futures.as_completed(slots):
            rows = done_model.result()
            result["models"] += rows
            path.write_text(json.dumps(result, indent=1))
            print(table([r for r in rows if "dtype" in r]), flush=True)
    order = {m: i for i, m in enumerate(MODELS)}
    result["models"].sort(key=lambda r: (order.get(r["model"], len(order)), r.get("dtype", ""),
                                         r.get("batch", 0)))
    path.write_text(json.dumps(result, indent=1))
    done = [r for r in result["models"] if "dtype" in r]
    print(table(done))
    speedups = [q for q in map(speedup, done) if q]
    if speedups:
        geo = float(torch.tensor(speedups).log().mean().exp())
        print(f"streamdag against the best baseline: geomean {geo:.3f}x over {len(speedups)} rows; "
              f"under 0.98x in {sum(q < 0.98 for q in speedups)}")
    print(path)
    return 0


def _timed_model(name: str, free_gpus: queue.SimpleQueue[int], t_start: float,
                 args: argparse.Namespace) -> list[dict[str, Any]]:
    """One model's rows, timed alone on a free GPU (models on the other GPUs run meanwhile)."""
    gpu = free_gpus.get()
    try:
        if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            return [{"model": name, "skipped": f"over the {args.budget_s:.0f} s budget"}]
        return _run_worker(name, args, gpu)
    finally:
        free_gpus.put(gpu)


def _prewarm(models: list[str], args: argparse.Namespace) -> None:
    """Compile every row untimed, ``args.prewarm`` processes at a time spread over the GPUs."""
    t0 = time.perf_counter()
    gpus = itertools.cycle(range(args.gpus))

    def one(name: str, gpu: int) -> None:
        cmd = [sys.executable, __file__, "--worker", name, "--warm-only", "--dtypes", args.dtypes,
               "--batches", args.batches, "--variant-s", str(args.variant_s), "--worker-out", os.devnull]
        run_child(cmd, args.model_s, env=gpu_env(gpu))  # (a failure: the timed run meets it and records it)

    with concurrent.futures.ThreadPoolExecutor(args.prewarm) as pool:
        list(pool.map(one, models, [next(gpus) for _ in models]))
    print(f"prewarmed {len(models)} models in {time.perf_counter() - t0:.0f} s", flush=True)


def gpu_env(gpu: int) -> dict[str, str]:
    """The environment of a process that sees only GPU ``gpu`` of those this one sees."""
    env = dict(os.environ)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
    return env


def kept_rows(path: Path, models: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of an earlier result file that this run does not redo."""
    if not path.exists():
        return []
    redo = {(m, d, int(b)) for m in models for d in args.dtypes.split(",") for b in args.batches.split(",")}
    rows = json.loads(path.read_text()).get("models", [])
    return [r for r in rows if "dtype" in r and (r["model"], r["dtype"], r["batch"]) not in redo]


def _run_worker(name: str, args: argparse.Namespace, gpu: int = 0) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as tmp:
        out_path = tmp.name
    cmd = [sys.executable, __file__, "--worker", name, "--worker-out", out_path, "--dtypes", args.dtypes,
           "--batches", args.batches, "--variant-s", str(args.variant_s), "--rounds", str(args.rounds)]
    if args.cold_compile:
        cmd.append("--cold-compile")
    if args.memory_alone:
        cmd += ["--memory-alone", args.memory_alone]
    t0 = time.perf_counter()
    done = run_child(cmd, args.model_s, env=gpu_env(gpu))
    note = (f"worker over the {args.model_s:.0f} s limit" if done.timed_out
            else f"worker exited {done.returncode}: {done.output[-2000:]}" if done.returncode else None)
    last: dict[tuple[str, int], dict[str, Any]] = {}  # a row written again (its memory alone) counts last
    for line in Path(out_path).read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # (a line cut off by the time limit)
            row = json.loads(line)
            last[(row["dtype"], row["batch"])] = row
    os.unlink(out_path)
    rows = list(last.values())
    wanted = [(d, int(b)) for d in args.dtypes.split(",") for b in args.batches.split(",")]
    for d, b in wanted:
        if (d, b) not in last:
            rows.append({"model": name, "dtype": d, "batch": b, "errors": {"row": note or "no row written"}})
    for r in rows:
        r.setdefault("worker_s", time.perf_counter() - t0)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
