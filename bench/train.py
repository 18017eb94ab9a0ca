"""Training steps side by side: eager, torch.compile, torch.compile(mode="reduce-overhead"), streamdag.

A training step is one forward, ``loss.backward()`` and an optimizer step
(AdamW, fused on CUDA, foreach on the CPU). For each model, dtype (fp32 with
TF32, or bf16 under ``torch.autocast``) and batch, in one run:

* ``eager``: the module as written;
* ``inductor``: ``torch.compile(model)``;
* ``inductor_ro``: ``torch.compile(model, mode="reduce-overhead")`` (CUDA graph trees);
* ``streamdag``: ``streamdag.compile(model)`` (on CUDA Inductor's code under CUDA graph
  trees, as ``inductor_ro``, against the forward's regions on streams, timed at the first call).

Each variant trains its own copy of the model from the same weights. The first
step's gradients of each compiled variant are compared with eager's
(``grad_max_rel_err``: the largest relative norm error over the parameters; dropout
is set to 0 so that the variants compute the same function). Times are medians
of wall time per step between ``torch.cuda.synchronize()`` calls, variants
interleaved round by round after three warm-up steps each (which compile, and
capture or choose candidates). ``peak_mib`` is the peak memory of one step after
the warm-up over what was allocated before it (the weights, the optimizer state
and the variants set up before it are not counted; a variant under CUDA graph trees replays
into memory its pool reserved when it recorded, which allocated bytes need not show). Models
come from ``bench/zoo_models.py`` (random weights, no downloads); ``tiny`` is a small branchy conv
net that also runs on the CPU, where ``--quick`` trains it for a smoke check in a few minutes.

    PYTHONPATH=src python bench/train.py --quick              # the CPU, or a GPU: tiny only
    PYTHONPATH=src python bench/train.py --models resnet50,bert --dtypes bf16 --batches 8
    PYTHONPATH=src python bench/train.py                      # all models, fp32 and bf16, batch 8 and 32

Writes ``bench/results/train_<device>.json``: ``{"environment": {...}, "models": [{"model",
"dtype", "batch", "ms": {variant: ms}, "grad_max_rel_err": {variant: err}, "peak_mib":
{variant: MiB}, "errors": {variant: text}}]}``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from streamdag.suite.report import source_digest
from zoo import commit, environment, host_load, kept_rows, utc_now
from zoo_models import build, first_tensor

VARIANTS = ("eager", "inductor", "inductor_ro", "streamdag")
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
    t = first_tensor(out).float()
    key = (tuple(t.shape), t.device)
    weights = _LOSS_WEIGHTS.get(key)
    if weights is None:
        g = torch.Generator(device=t.device).manual_seed(0)
        weights = _LOSS_WEIGHTS[key] = torch.randn(t.shape, generator=g, device=t.device)
    return (t * weights).mean()


def make_step(label: str, model: torch.nn.Module, args: tuple, kwargs: dict, bf16: bool,
              device: str) -> Callable[[bool], dict[str, torch.Tensor] | None]:
    """The variant's training step; ``step(True)`` also returns the gradients before the update."""
    import streamdag as sd

    if label == "eager":
        fn: Callable[..., Any] = model
    elif label in ("inductor", "inductor_ro"):
        fn = torch.compile(model, mode="reduce-overhead" if label == "inductor_ro" else None)
    elif label == "streamdag":
        fn = sd.compile(model)
    else:
        raise ValueError(label)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                            **({"fused": True} if device == "cuda" else {"foreach": True}))

    def step(grads: bool = False) -> dict[str, torch.Tensor] | None:
        if label == "inductor_ro" and device == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            out = fn(*args, **kwargs)
        loss_of(out).backward()
        kept = {n: q.grad.detach().float().clone() for n, q in model.named_parameters()
                if q.grad is not None} if grads else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return kept
    return step


def max_rel_err(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The largest relative error of a parameter's gradient against the reference's, each error taken
    against at least 1e-3 of the largest reference norm: a gradient that is zero in exact arithmetic
    (a key projection's bias) has only rounding noise, which has no relative size. A parameter
    without a gradient counts as a zero gradient (AOTAutograd gives zeros where eager gives None:
    a BERT pooler outside the loss)."""
    floor = 1e-3 * max((float(r.norm()) for r in ref.values()), default=0.0)
    errs = [0.0]
    for n in grads.keys() | ref.keys():
        g, r = grads.get(n), ref.get(n)
        diff = float((g - r if g is not None and r is not None else g if r is None else r).norm())
        scale = max(float(r.norm()) if r is not None else 0.0, floor)
        errs.append(diff / scale if scale > 0 else diff)
    return max(errs)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_row(name: str, dtype: str, batch: int, device: str, rounds: int) -> dict[str, Any]:
    _LOSS_WEIGHTS.clear()  # a language model's logits' weights alone are hundreds of MiB
    row: dict[str, Any] = {"model": name, "dtype": dtype, "batch": batch, "ms": {}, "grad_max_rel_err": {},
                           "peak_mib": {}, "errors": {}}
    torch.manual_seed(0)
    model, make_inputs = build_for_training(name, device)
    args, kwargs = make_inputs(batch)
    bf16 = dtype == "bf16"
    steps: dict[str, Callable[[bool], Any]] = {}
    ref: dict[str, torch.Tensor] | None = None
    for label in VARIANTS:  # eager first: its first gradients are the reference
        try:
            step = make_step(label, copy.deepcopy(model), args, kwargs, bf16, device)
            grads = step(True)  # compiles (and for streamdag, times its candidates)
            for _ in range(2):  # captures, warms up
                step(False)
            if device == "cuda":  # one step's peak over what the variant holds between steps
                sync(device)
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step(False)
                sync(device)
                row["peak_mib"][label] = (torch.cuda.max_memory_allocated() - base) / 2**20
            if label == "eager":
                ref = grads
            elif ref is not None and grads is not None:
                row["grad_max_rel_err"][label] = max_rel_err(grads, ref)
            steps[label] = step
        except Exception as exc:  # one variant's failure is its row's note, not the run's end
            row["errors"][label] = f"{type(exc).__name__}: {str(exc)[:500]}"
    times: dict[str, list[float]] = {label: [] for label in steps}
    for r in range(rounds):
        order = list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]
        for label in order:
            sync(device)
            t0 = time.perf_counter()
            steps[label](False)
            sync(device)
            times[label].append((time.perf_counter() - t0) * 1e3)
    row["ms"] = {label: statistics.median(ts) for label, ts in times.items() if ts}
    return row


def table(rows: list[dict[str, Any]]) -> str:
    from streamdag.suite.report import format_table

    out = []
    for r in rows:
        ms, err = r["ms"], r["grad_max_rel_err"]
        out.append([r["model"], r["dtype"], r["batch"],
                    *[f"{ms[v]:.2f}" if v in ms else "-" for v in VARIANTS],
                    f"{err['streamdag']:.1e}" if "streamdag" in err else "-", ", ".join(r["errors"]) or "-"])
    return format_table(["model", "dtype", "batch", *[f"{v} ms" for v in VARIANTS], "sd grad err", "errors"],
                        out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=None, help=f"comma-separated; default all: {','.join(MODELS)}")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="tiny, fp32, batch 8, 3 rounds (a smoke check)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/train_<device>.json)")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of the existing result file that this run does not redo")
    args = p.parse_args()
    if args.quick:
        args.models, args.dtypes, args.batches, args.rounds = args.models or "tiny", "fp32", "8", 3
    models = (args.models or ",".join(MODELS)).split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}: choose from {', '.join(MODELS)}")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    name = torch.cuda.get_device_name().replace(" ", "_") if cuda else "cpu"
    # a smoke check's numbers are no result: --quick writes to the temporary directory
    folder = Path(tempfile.gettempdir()) if args.quick else Path(__file__).parent / "results"
    path = Path(args.out) if args.out else folder / f"train_{name}.json"
    env_args = argparse.Namespace(cold_compile=False, rounds=args.rounds)
    result: dict[str, Any] = {"environment": {**environment(env_args), "device": name, "tf32": cuda,
                                              "cudnn_benchmark": cuda, "optimizer": "AdamW",
                                              "loss": "mean of the first output times a fixed random weight "
                                                      "(seed 0)"},
                              "models": kept_rows(path, models, args) if args.merge else []}
    for model in models:
        for dtype in args.dtypes.split(","):
            for batch in map(int, args.batches.split(",")):
                row = run_row(model, dtype, batch, device, args.rounds)
                row["measured"] = {"commit": commit(), "source": source_digest(), "utc": utc_now(),
                                   "load_1min": host_load()}
                result["models"].append(row)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result, indent=1))
                print(table([row]), flush=True)
    print(table(result["models"]))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
