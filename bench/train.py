"""Training steps side by side: eager, torch.compile, torch.compile(mode="reduce-overhead"), streamdag.

A training step is one forward, ``loss.backward()`` and an optimizer step
(AdamW, fused on CUDA, foreach on the CPU). For each model, dtype (fp32 with
TF32, or bf16 under ``torch.autocast``) and batch, in one run:

* ``eager``: the module as written;
* ``inductor``: ``torch.compile(model)``;
* ``inductor_ro``: ``torch.compile(model, mode="reduce-overhead")`` (CUDA graph trees);
* ``streamdag``: ``streamdag.compile(model)`` (on CUDA Inductor's code under CUDA graph
  trees, as ``inductor_ro``, against the forward's and backward's regions on streams under
  the trees, timed at each graph's first call);
* ``inductor_step`` (CUDA only): ``torch.compile(model)``'s whole step captured by hand into
  one ``torch.cuda.CUDAGraph``, PyTorch's whole-network recipe (warm-up on a side stream,
  static inputs copied in, AdamW ``capturable=True``);
* ``streamdag_step`` (CUDA only): ``streamdag.capture_step`` of the step with
  ``streamdag.compile(model)`` inside (AdamW ``capturable=True``).

Both variants under the trees mark each step's start with
``torch.compiler.cudagraph_mark_step_begin()``, as a training loop over the trees does.

Each variant trains its own copy of the model from the same weights; on CUDA each runs in a
process of its own (variants under the trees in one process would share their memory pool and
state). The processes are set up one after another and then timed in turns, a few steps each in
an order that rotates (``bench/in_turns.py``), so that the variants share the host's and the
GPU's drift over the minutes a row takes; ``--one-after-another`` times each process once it is
set up instead. The first step's gradients of every variant, eager's included, are measured
against the same step in float64 on a copy of the same weights (``grad_max_rel_err``: the
largest relative norm error over the parameters; dropout is set to 0 so that the variants
compute the same function). Against eager alone a deep network with BatchNorm shows TF32's
rounding, amplified, as errors of 0.2 in every compiled variant alike, which says nothing;
against float64 each variant's rounding has a yardstick, eager's own: ``grad_check`` passes
where every parameter's error is within 3x eager's on that parameter plus 1e-2 (a gradient
computed wrong, from a stale activation or a lost accumulation, is off by its own size). Times
are medians of wall time per step between ``torch.cuda.synchronize()`` calls after three warm-up
steps (which compile, and capture or choose candidates). ``peak_mib`` is the memory a variant
holds between steps after the warm-up (the CUDA caching allocator's segments it added: the
optimizer state, the gradients, the memory pools of CUDA graphs, whose temporaries allocated
bytes would miss) plus what one step reserves on top; its copy of the weights is not counted.
For streamdag the row keeps what each training graph chose and ``explain()``. Models come from
``bench/zoo_models.py`` (random weights, no downloads); ``tiny`` is a small branchy conv net
that also runs on the CPU, where ``--quick`` trains it for a smoke check in a few minutes.

    PYTHONPATH=src python bench/train.py --quick              # the CPU, or a GPU: tiny only
    PYTHONPATH=src python bench/train.py --models resnet50,bert --dtypes bf16 --batches 8
    PYTHONPATH=src python bench/train.py                      # all models, fp32 and bf16, batch 8 and 32
    PYTHONPATH=src python bench/train.py --gpus 4 --budget-s 500   # 4 rows at once, one per GPU
    PYTHONPATH=src python bench/train.py --models googlenet --batches 8 --prewarm 6   # compiles first

Rows timed at once share the host's cores: a step bound by its host (small batches under the CUDA
graph trees) is slower while another row compiles beside it. Time such rows with ``--gpus 1``.

Writes ``bench/results/train_<device>.json``: ``{"environment": {...}, "models": [{"model",
"dtype", "batch", "ms": {variant: ms}, "grad_max_rel_err": {variant: err}, "grad_check":
{variant: "ok" or what failed}, "peak_mib": {variant: MiB}, "errors": {variant: text}}]}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from children import run_child, serve, serve_fds
from in_turns import time_in_turns
from streamdag.suite.report import source_digest
from zoo import added_bytes, commit, environment, gpu_env, host_load, kept_rows, segments, utc_now
from zoo_models import build, first_tensor

VARIANTS = ("eager", "inductor", "inductor_ro", "streamdag", "inductor_step", "streamdag_step")
#: variants whose whole step (forward, backward, optimizer) replays as one CUDA graph
WHOLE_STEP = ("inductor_step", "streamdag_step")
#: ``streamdag.compile``'s options for this run (``--streamdag-regions``)
STREAMDAG_OPTIONS: dict[str, Any] = {}
MODELS = ("googlenet", "inception_v3", "resnet50", "vit_b_16", "swin_t", "bert", "llama", "tiny")


class Tiny(torch.nn.Module):
    """Two convolution branches of one input, batch norm, a linear head: regions in both directions."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.b = torch.nn.Conv2d(3, 16, 1)
        self.bn = torch.nn.BatchNorm2d(32)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x))], 1)
        return self.fc(torch.relu(self.bn(y)).mean((2, 3)))


def build_for_training(name: str, device: str) -> tuple[torch.nn.Module, Callable[[int], tuple[tuple, dict]]]:
    """The model in training mode with dropout at 0, and a function batch -> its inputs on ``device``."""
    if name == "tiny":
        model: torch.nn.Module = Tiny()

        def inputs(batch: int) -> tuple[tuple, dict]:
            return (torch.randn(batch, 3, 32, 32, device=device),), {}
    else:
        if device != "cuda":
            raise RuntimeError(f"{name} runs on CUDA only here (its inputs come as CUDA tensors)")
        model, zoo_inputs = build(name)

        def inputs(batch: int) -> tuple[tuple, dict]:
            return zoo_inputs(batch, torch.float32)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("dropout_prob", "attention_dropout", "dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    return model.to(device).train(), inputs


_LOSS_WEIGHTS: dict[tuple[Any, ...], torch.Tensor] = {}


def loss_of(out: Any) -> torch.Tensor:
    """``mean(out * W)`` for a fixed random ``W`` of the output's shape: every output element counts
    with a weight of its own. (The mean of squares is nearly constant under a final LayerNorm,
    BERT's last hidden state, which leaves every gradient before it near zero and its relative
    error meaningless.)"""
    t = first_tensor(out)
    t = t if t.dtype == torch.float64 else t.float()  # the float64 reference stays in float64
    key = (tuple(t.shape), t.device)
    weights = _LOSS_WEIGHTS.get(key)
    if weights is None:
        g = torch.Generator(device=t.device).manual_seed(0)
        weights = _LOSS_WEIGHTS[key] = torch.randn(t.shape, generator=g, device=t.device)
    return (t * weights.to(t.dtype)).mean()


def make_step(label: str, model: torch.nn.Module, args: tuple, kwargs: dict, bf16: bool,
              device: str) -> Callable[[bool], dict[str, torch.Tensor] | None]:
    """The variant's training step; ``step(True)`` also returns the gradients before the update
    (a whole-step variant's first call, which runs as written). ``step.compiled`` is what runs
    the model (``streamdag.compile``'s model, for its explanation)."""
    import streamdag as sd

    if label == "eager":
        fn: Callable[..., Any] = model
    elif label in ("inductor", "inductor_ro", "inductor_step"):
        fn = torch.compile(model, mode="reduce-overhead" if label == "inductor_ro" else None)
    elif label in ("streamdag", "streamdag_step"):
        fn = sd.compile(model, **STREAMDAG_OPTIONS)
    else:
        raise ValueError(label)
    whole = label in WHOLE_STEP
    if whole and device != "cuda":
        raise ValueError(f"{label} needs CUDA graphs")
    settings = {"fused": True, "capturable": whole} if device == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **settings)
    kept: list[dict[str, torch.Tensor]] = []

    def body(*a: Any, want_grads: bool = False, **k: Any) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            out = fn(*a, **k)
        loss = loss_of(out)
        loss.backward()
        if want_grads:
            kept.append({n: q.grad.detach().float().clone() for n, q in model.named_parameters()
                         if q.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if label == "streamdag_step":
        run = sd.capture_step(body)
    elif label == "inductor_step":
        run = _graphed_by_hand(body)
    else:
        run = body

    def step(grads: bool = False) -> dict[str, torch.Tensor] | None:
        if label in ("inductor_ro", "streamdag") and device == "cuda":
            # the start of a step, as a training loop over CUDA graph trees tells them
            torch.compiler.cudagraph_mark_step_begin()
        kept.clear()
        run(*args, **kwargs, **({"want_grads": True} if grads else {}))
        return kept[0] if grads else None
    step.compiled = fn  # type: ignore[attr-defined]
    step.runs = run  # type: ignore[attr-defined]
    return step


def _graphed_by_hand(body: Callable[..., torch.Tensor], warmup: int = 3) -> Callable[..., torch.Tensor]:
    """PyTorch's whole-network capture (the CUDA graphs section of its CUDA semantics notes): warm-up
    calls on a side stream, then ``body`` captured over static copies of the batch, replayed after
    the batch is copied in. One signature, as the recipe has it."""
    state: dict[str, Any] = {"calls": 0}

    def run(*a: Any, want_grads: bool = False, **k: Any) -> torch.Tensor:
        state["calls"] += 1
        if state["calls"] <= warmup or want_grads:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = body(*a, want_grads=want_grads, **k)
            torch.cuda.current_stream().wait_stream(side)
            return out
        leaves = [x for x in (*a, *k.values()) if isinstance(x, torch.Tensor)]
        if "graph" not in state:
            state["static"] = [x.clone() for x in leaves]
            it = iter(state["static"])
            s_a = [next(it) if isinstance(x, torch.Tensor) else x for x in a]
            s_k = {n: next(it) if isinstance(x, torch.Tensor) else x for n, x in k.items()}
            state["graph"] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(state["graph"]):
                state["out"] = body(*s_a, **s_k)
        torch._foreach_copy_(state["static"], leaves)
        state["graph"].replay()
        return state["out"].clone()
    return run


def max_rel_err(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest relative error of a parameter's gradient against the reference's, each error taken
    against at least 1e-3 of the largest reference norm: a gradient that is zero in exact arithmetic
    (a key projection's bias) has only rounding noise, which has no relative size. A parameter
    without a gradient counts as a zero gradient (AOTAutograd gives zeros where eager gives None:
    a BERT pooler outside the loss)."""
    return max(rel_errs(grads, ref).values(), default=0.0)


def reference_grads(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """The first step's gradients in float64 (eager, no autocast) on a copy of ``model``: the
    yardstick each variant's rounding, and eager's, is measured against."""
    ref = copy.deepcopy(model).double()
    as64 = lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x  # noqa: E731
    loss_of(ref(*[as64(a) for a in args], **{k: as64(v) for k, v in kwargs.items()})).backward()
    grads = {n: q.grad.detach().clone() for n, q in ref.named_parameters() if q.grad is not None}
    del ref
    return grads


def rel_errs(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each parameter's relative error against ``ref`` (:func:`max_rel_err` says how)."""
    floor = 1e-3 * max((float(r.norm()) for r in ref.values()), default=0.0)
    errs = {}
    for n in grads.keys() | ref.keys():
        g, r = grads.get(n), ref.get(n)
        g, r = (None if g is None else g.double()), (None if r is None else r.double())
        diff = float((g - r if g is not None and r is not None else g if r is None else r).norm())
        scale = max(float(r.norm()) if r is not None else 0.0, floor)
        errs[n] = diff / scale if scale > 0 else diff
    return errs


def grad_check(grads: dict[str, torch.Tensor], eager: dict[str, torch.Tensor],
               ref: dict[str, torch.Tensor], factor: float = 3.0, slack: float = 1e-2) -> str:
    """"ok" where every parameter's gradient is within ``factor`` times eager's error on it plus
    ``slack`` (errors against the float64 ``ref``); else the parameter furthest over, in words."""
    mine, theirs = rel_errs(grads, ref), rel_errs(eager, ref)
    over = {n: e - (factor * theirs.get(n, 0.0) + slack) for n, e in mine.items()}
    worst = max(over, key=over.__getitem__, default=None)
    if worst is None or over[worst] <= 0:
        return "ok"
    return f"{worst}: error {mine[worst]:.2e} against eager's {theirs.get(worst, 0.0):.2e}"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_row(name: str, dtype: str, batch: int, device: str, rounds: int,
            variant_s: float | None = None, variants: tuple[str, ...] = VARIANTS,
            gpu: int = 0, in_turns: bool = True) -> dict[str, Any]:
    """Every variant of one row. On CUDA each runs in a process of its own on GPU ``gpu``
    (``variant_s``: its time limit): variants under CUDA graph trees in one thread would share the
    trees' memory pool and their state (one variant's step would start where the other's left the
    trees), and the pool's memory would count for the first of them alone. ``in_turns``: the
    processes are set up one after another and then timed in turns (:func:`_row_in_turns`);
    else each is timed once set up, and ends before the next starts."""
    row: dict[str, Any] = {"model": name, "dtype": dtype, "batch": batch, "ms": {}, "grad_max_rel_err": {},
                           "grad_check": {}, "peak_mib": {}, "errors": {}}
    if device == "cuda" and in_turns:
        return _row_in_turns(row, variants, rounds, variant_s, gpu)
    for label in variants:
        t0 = time.perf_counter()
        part = _in_child(label, name, dtype, batch, rounds, variant_s, gpu) if device == "cuda" \
            else measure_variant(label, name, dtype, batch, device, rounds)
        outcome = part.get("errors", {}).get(label) or f"{part.get('ms', {}).get(label, float('nan')):.3f} ms"
        print(f"  {name} {dtype} b{batch} {label}: {outcome} ({time.perf_counter() - t0:.0f} s)", flush=True)
        _merge(row, part)
    return row


def _row_in_turns(row: dict[str, Any], variants: tuple[str, ...], rounds: int, variant_s: float | None,
                  gpu: int) -> dict[str, Any]:
    """``row``'s variants timed in turns (:func:`in_turns.time_in_turns`), each in a process of its own."""
    name, dtype, batch = row["model"], row["dtype"], row["batch"]
    with tempfile.TemporaryDirectory() as tmp:
        outs = {label: Path(tmp) / f"{label}.json" for label in variants}
        commands = {label: _child_command(label, name, dtype, batch, rounds, outs[label])
                    for label in variants}
        turns = time_in_turns(commands, rounds, variant_s, gpu_env(gpu), f"{name} {dtype} b{batch}")
        for label in variants:
            _merge(row, json.loads(outs[label].read_text()) if outs[label].exists() else
                   {"errors": {label: turns.errors.get(label, "no result")}})
    for label, message in turns.errors.items():
        row["errors"].setdefault(label, message)
    row["ms"].update(turns.ms)
    return row


def _merge(row: dict[str, Any], part: dict[str, Any]) -> None:
    for key, value in part.items():
        if isinstance(row.get(key), dict):
            row[key].update(value)
        else:
            row[key] = value


#: the keys of a row that hold one entry per variant
PER_VARIANT = ("ms", "grad_max_rel_err", "grad_check", "peak_mib", "errors")


def carry_variants(row: dict[str, Any], earlier: dict[str, Any] | None) -> None:
    """Into a row measured again with some variants (``--merge``), the other variants' entries from
    the ``earlier`` row, each stamped under ``measured_apart`` with the run that measured it: a
    ratio between variants holds only within one run."""
    if earlier is None:
        return
    redone = set(row["ms"]) | set(row["errors"])
    kept = {v for v in earlier.get("ms", {}) if v not in redone}
    for key in PER_VARIANT:
        for variant, value in earlier.get(key, {}).items():
            if variant in kept:
                row.setdefault(key, {})[variant] = value
    for variant in sorted(kept):
        if variant in earlier:  # (a variant's own details: streamdag_step's explanation)
            row[variant] = earlier[variant]
        row.setdefault("measured_apart", {})[variant] = \
            earlier.get("measured_apart", {}).get(variant, earlier.get("measured"))


def _child_command(label: str, name: str, dtype: str, batch: int, rounds: int, out: Path,
                   warm_only: bool = False) -> list[str]:
    return [sys.executable, __file__, "--variant", label, "--models", name, "--dtypes", dtype,
            "--batches", str(batch), "--rounds", str(rounds), "--out", str(out),
            "--streamdag-regions", STREAMDAG_OPTIONS.get("regions", "auto"),
            *(["--warm-only"] if warm_only else [])]


def _in_child(label: str, name: str, dtype: str, batch: int, rounds: int,
              variant_s: float | None, gpu: int, warm_only: bool = False,
              compile_threads: int | None = None) -> dict[str, Any]:
    env = gpu_env(gpu)
    if compile_threads is not None:  # (processes compiling side by side share the host's cores)
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "variant.json"
        cmd = _child_command(label, name, dtype, batch, rounds, out, warm_only)
        done = run_child(cmd, variant_s, env=env)
        if done.timed_out:
            return {"errors": {label: f"over the variant's time limit of {variant_s:.0f} s"}}
        if done.returncode != 0 or not out.exists():
            return {"errors": {label: f"exit {done.returncode}: {done.output[-500:]}"}}
        return json.loads(out.read_text())


def prewarm(keys: list[tuple[str, str, int]], variants: tuple[str, ...], jobs: int, gpus: int,
            variant_s: float | None) -> None:
    """Compile every variant of every row untimed, ``jobs`` processes at a time over the GPUs, so that
    the timed processes find Inductor's and AOTAutograd's caches filled (a variant's compile is then
    a cache hit, not minutes). A failure here is met again, and recorded, by the timed run."""
    t0 = time.perf_counter()
    work = [(v, *key) for key in keys for v in variants if v != "eager"]
    threads = max(1, (os.cpu_count() or 1) // jobs)

    def one(i: int, job: tuple[str, str, str, int]) -> None:
        label, name, dtype, batch = job
        _in_child(label, name, dtype, batch, 1, variant_s, i % gpus, warm_only=True, compile_threads=threads)

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, range(len(work)), work))
    print(f"prewarmed {len(work)} variant(s) in {time.perf_counter() - t0:.0f} s", flush=True)


def measure_variant(label: str, name: str, dtype: str, batch: int, device: str,
                    rounds: int, warm_only: bool = False, serve_fds: str | None = None) -> dict[str, Any]:
    """One variant of a row: its first step's gradients against eager's (computed first, on a copy
    of the same weights), its memory, and the median of ``rounds`` timed steps after the warm-up.
    With ``serve_fds`` (a child of :func:`_row_in_turns`) the parent asks for the timed steps, a
    few at a time, and takes their median itself."""
    _LOSS_WEIGHTS.clear()  # a language model's logits' weights alone are hundreds of MiB
    part: dict[str, Any] = {"ms": {}, "grad_max_rel_err": {}, "grad_check": {}, "peak_mib": {}, "errors": {}}
    torch.manual_seed(0)
    model, make_inputs = build_for_training(name, device)
    args, kwargs = make_inputs(batch)
    bf16 = dtype == "bf16"
    serving = False
    try:
        ref64 = reference_grads(model, args, kwargs)
        eager = None if label == "eager" else \
            make_step("eager", copy.deepcopy(model), args, kwargs, bf16, device)(True)
        variant_model = copy.deepcopy(model)
        before = segments() if device == "cuda" else {}
        step = make_step(label, variant_model, args, kwargs, bf16, device)
        grads = step(True)  # compiles (and for streamdag, times its candidates)
        for _ in range(4 if label in WHOLE_STEP else 2):  # captures, warms up
            step(False)
        if device == "cuda" and not warm_only:
            part["peak_mib"][label] = _step_peak(step, before) / 2**20
        if grads is not None:
            part["grad_max_rel_err"][label] = max_rel_err(grads, ref64)
            if eager is not None:
                part["grad_max_rel_err"]["eager"] = max_rel_err(eager, ref64)
                part["grad_check"][label] = grad_check(grads, eager, ref64)
        if warm_only:  # (--prewarm: the compiles, to fill the caches; no memory, no timing)
            return part
        if label.startswith("streamdag"):
            _describe_streamdag(step.compiled, part, label)  # type: ignore[attr-defined]
        if label == "streamdag_step":
            part[label]["step"] = step.runs.explain().splitlines()  # type: ignore[attr-defined]
        del ref64, eager, grads, model  # (the timing holds only what the step needs)
        if serve_fds is not None:
            serving = True  # (a step that raises ends the serving: the parent reads why from the part)
            serve(serve_fds, {"ready": True}, lambda asked: {"ms": timed_steps(step, device, **asked)})
            return part
        part["ms"][label] = statistics.median(timed_steps(step, device, rounds))
    except Exception as exc:  # one variant's failure is its row's note, not the run's end
        part["errors"][label] = f"{type(exc).__name__}: {str(exc)[:500]}"
    if serve_fds is not None and not serving:  # a failed setup
        serve(serve_fds, {"ready": False}, lambda asked: {})
    return part


def timed_steps(step: Callable[[bool], Any], device: str, steps: int, warm: int = 0) -> list[float]:
    """The wall time of each of ``steps`` steps in ms, each between synchronizations, after ``warm``
    untimed ones."""
    times = []
    for i in range(warm + steps):
        sync(device)
        t0 = time.perf_counter()
        step(False)
        sync(device)
        if i >= warm:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _step_peak(step: Callable[[bool], Any], before: dict[tuple[Any, ...], int]) -> int:
    """The bytes a variant holds between steps (the segments it added since ``before``: optimizer
    state, gradients, the pools of its CUDA graphs, whose temporaries allocated bytes miss) plus
    what one step reserves on top."""
    now = segments()
    held, reserved = added_bytes(before, now), sum(now.values())
    torch.cuda.reset_peak_memory_stats()
    step(False)
    torch.cuda.synchronize()
    return held + torch.cuda.max_memory_reserved() - reserved


def _describe_streamdag(compiled: Any, row: dict[str, Any], label: str) -> None:
    """What streamdag chose for each training graph, and its explanation, under ``row[label]``."""
    graphs = [t for r in compiled.backend.runners for t in getattr(r, "training", ())]
    if label == "streamdag":
        row["streams"] = max((t.chosen.streams for t in graphs if t.chosen is not None), default=None)
    row[label] = {
        "chosen": [f"{t.kind}: {t.chosen.label if t.chosen is not None else '-'}" for t in graphs],
        "candidates": [[{"label": c.label, "streams": c.streams, "ms": c.ms, "peak_mib": c.peak_mib,
                         "error": c.error} for c in t.candidates] for t in graphs],
        "statistics": vars(compiled.statistics()),
        "explain": compiled.explain().splitlines()[:80]}


def table(rows: list[dict[str, Any]]) -> str:
    from streamdag.suite.report import format_table

    out = []
    for r in rows:
        ms, err, check = r["ms"], r["grad_max_rel_err"], r.get("grad_check") or {}
        failed = [v for v, c in check.items() if c != "ok"]
        out.append([r["model"], r["dtype"], r["batch"],
                    *[f"{ms[v]:.2f}" if v in ms else "-" for v in VARIANTS],
                    *[f"{err[v]:.1e}" if v in err else "-" for v in ("eager", "streamdag")],
                    ("failed: " + ", ".join(failed)) if failed else "ok" if check else "-",
                    ", ".join(r["errors"]) or "-"])
    return format_table(["model", "dtype", "batch", *[f"{v} ms" for v in VARIANTS], "eager grad err",
                         "sd grad err", "grads", "errors"], out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help=f"comma-separated; default all: {','.join(MODELS)}")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="tiny, fp32, batch 8, 3 rounds (a smoke check)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/train_<device>.json)")
    p.add_argument("--gpus", type=int, default=1,
                   help="on CUDA, time this many rows at once, one per GPU (identical GPUs)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no row after this many seconds (on a lent machine of limited time)")
    p.add_argument("--variant-s", type=float, default=1200,
                   help="on CUDA, the time limit of each variant's process (compiles included)")
    p.add_argument("--streamdag-regions", choices=("auto", "always", "never"), default="auto",
                   help="streamdag.compile's regions= (auto: where its cost model expects a gain)")
    p.add_argument("--variants", default=None,
                   help="comma-separated; default all (on the CPU those without CUDA graphs)")
    p.add_argument("--variant", choices=VARIANTS, default=None,
                   help="measure this variant of the one row given and write its part of the row to --out "
                        "(what a row's processes run)")
    p.add_argument("--prewarm", type=int, default=0, metavar="J",
                   help="on CUDA, first compile every variant of every row untimed, J processes at a time")
    p.add_argument("--warm-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-fds", default=None, help=argparse.SUPPRESS)
    p.add_argument("--one-after-another", action="store_true",
                   help="on CUDA, time each variant's process once it is set up, not all of them in turns")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of the existing result file that this run does not redo, and in a "
                        "row it redoes, the variants it does not (stamped apart)")
    args = p.parse_args()
    if args.quick:
        args.models, args.dtypes, args.batches, args.rounds = args.models or "tiny", "fp32", "8", 3
    models = (args.models or ",".join(MODELS)).split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}: choose from {', '.join(MODELS)}")
    STREAMDAG_OPTIONS["regions"] = args.streamdag_regions
    cuda = torch.cuda.is_available()
    variants = tuple(args.variants.split(",")) if args.variants else \
        tuple(v for v in VARIANTS if cuda or v not in WHOLE_STEP)
    if not set(variants) <= set(VARIANTS):
        p.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}: "
                f"choose from {', '.join(VARIANTS)}")
    device = "cuda" if cuda else "cpu"
    if args.gpus < 1 or args.gpus > max(torch.cuda.device_count(), 1) or (args.gpus > 1 and not cuda):
        p.error(f"--gpus {args.gpus}: {torch.cuda.device_count()} GPU(s) visible")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    if args.variant is not None:
        if args.out is None:
            p.error("--variant writes its part of the row to --out")
        if args.serve_fds is not None:
            serve_fds(args.serve_fds)  # (first: kept from the compile workers this process starts)
        part = measure_variant(args.variant, models[0], args.dtypes.split(",")[0],
                               int(args.batches.split(",")[0]), device, args.rounds, args.warm_only,
                               args.serve_fds)
        partial = Path(f"{args.out}.partial")  # (whole or absent: a parent may kill this process)
        partial.write_text(json.dumps(part))
        os.replace(partial, args.out)
        return 0
    name = torch.cuda.get_device_name().replace(" ", "_") if cuda else "cpu"
    # a smoke check's numbers are no result: --quick writes to the temporary directory
    folder = Path(tempfile.gettempdir()) if args.quick else Path(__file__).parent / "results"
    path = Path(args.out) if args.out else folder / f"train_{name}.json"
    env_args = argparse.Namespace(cold_compile=False, rounds=args.rounds)
    result: dict[str, Any] = {"environment": {**environment(env_args), "device": name, "tf32": cuda,
                                              "streamdag_options": STREAMDAG_OPTIONS,
                                              "cudnn_benchmark": cuda, "optimizer": "AdamW",
                                              "loss": "mean of the first output times a fixed random weight "
                                                      "(seed 0)",
                                              "grad_reference": "the first step in float64, eager"},
                              "models": kept_rows(path, models, args) if args.merge else []}
    earlier_rows = {(r["model"], r["dtype"], r["batch"]): r
                    for r in (json.loads(path.read_text()).get("models", [])
                              if args.merge and path.exists() else []) if "dtype" in r}
    path.parent.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    keys = [(m, d, b) for m in models for d in args.dtypes.split(",") for b in batches]
    if args.prewarm < 0:
        p.error(f"--prewarm {args.prewarm}: a number of processes, 0 for none")
    if args.prewarm and cuda:
        prewarm(keys, variants, args.prewarm, args.gpus, args.variant_s)
    free_gpus: queue.SimpleQueue[int] = queue.SimpleQueue()
    for gpu in range(args.gpus):
        free_gpus.put(gpu)
    t_start = time.perf_counter()

    def one(key: tuple[str, str, int]) -> dict[str, Any] | None:
        gpu = free_gpus.get()
        try:
            if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
                print(f"{key}: not run, over the {args.budget_s:.0f} s budget", flush=True)
                return None
            row = run_row(*key, device, args.rounds, args.variant_s, variants, gpu,
                          in_turns=not args.one_after_another)
            row["measured"] = {"commit": commit(), "source": source_digest(), "utc": utc_now(),
                               "load_1min": host_load(), "variants_in_own_process": cuda, "gpu": gpu,
                               "timed": ("in turns" if cuda and not args.one_after_another
                                         else "one variant after another")}
            carry_variants(row, earlier_rows.get(key))
            return row
        finally:
            free_gpus.put(gpu)

    with concurrent.futures.ThreadPoolExecutor(args.gpus) as pool:
        for done in concurrent.futures.as_completed([pool.submit(one, k) for k in keys]):
            row = done.result()
            if row is None:
                continue
            result["models"].append(row)
            path.write_text(json.dumps(result, indent=1))
            print(table([row]), flush=True)
    print(table(result["models"]))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
