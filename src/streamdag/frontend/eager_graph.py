"""A plain CUDA graph of the eager call: the baseline each whole-call graph must beat.

A whole-call graph (:mod:`.whole_call`) replays the kernels each of the call's
graphs chose: Inductor's fused code on one stream or its regions on several.
Where the model's own eager kernels are faster (attention through a fused
kernel that the aten graph decomposes, say), a CUDA graph of ``model(*args)``
captured by hand beats that, and a user could write it in five lines. So, once
a whole call is captured, the eager call is captured too over the same static
inputs, both are replayed in rounds, timed by CUDA events, and the faster is
kept: it must win by more than ``TIE``, a margin that only keeps timing noise
from choosing (ties keep the fused graph, which reads and writes less memory).

Only a module whose submodules are all in eval mode, and whose call writes
into none of its inputs, parameters or buffers, is captured this way, so the
extra warm-up calls change nothing. The eager graph has a memory pool of
its own, which goes back whole when streamdag's graph is kept; the one not
kept is dropped at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["TIE", "WARMUP", "capture_eager", "eager_refusal", "keep_eager"]

#: how much faster the eager graph must be to be kept: a plain CUDA graph of the eager call is what a
#: user would write instead, so a fused graph kept while 1-2% slower loses to it outright
TIE = 0.005
#: eager calls before its capture: cuDNN's autotuner, cuBLAS workspaces, lazy modules
WARMUP = 2
#: replays of each graph timed (alternating), the median kept
ROUNDS = 10


def eager_refusal(fn: Any, write_back: Sequence[int], updates_state: bool = False) -> str:
    """Why the eager call is not tried as a graph ('' where it is); ``updates_state``: a graph of
    the call writes into a parameter or buffer."""
    if not isinstance(fn, torch.nn.Module):
        return "a function, not a module: its eager call may change state a warm-up would repeat"
    training = next((type(m).__name__ for m in fn.modules() if m.training), None)
    if training is not None:
        return f"{training} is in training mode: a warm-up call would update its state"
    if write_back:
        return "the call writes into its inputs: a warm-up call would repeat the writes"
    if updates_state:
        return "the call writes into a parameter or buffer: a warm-up call would repeat the writes"
    return ""


def capture_eager(fn: Callable[..., Any], dev: Any, args: Sequence[Any], kwargs: dict[str, Any],
                  inputs: Sequence[Any]) -> tuple[Any, Any, list[Any]] | str:
    """``fn(*args, **kwargs)`` warmed up on the capture stream and captured on inputs of its own in
    place of ``inputs`` (``CudaCalls.capture_own_inputs``): (graph, its outputs, its inputs), or why
    it could not be."""
    try:
        caller = dev.caller()
        with dev.on_capture_stream():
            for _ in range(WARMUP):
                fn(*args, **kwargs)
        dev.join(caller, [])
        return dev.capture_own_inputs(fn, args, kwargs, inputs, private=True)
    except Exception as exc:  # the eager call cannot be captured: the whole-call graph stays
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"the eager call cannot be captured ({type(exc).__name__}: {first[:160]})"


def keep_eager(dev: Any, ours: Any, eager: Any) -> tuple[bool, str]:
    """Whether the eager graph is kept over ours (``ours`` and ``eager`` are whole-call entries),
    and the line ``explain()`` shows."""
    ours_ms, eager_ms = dev.time_graphs([ours.graph, eager.graph], ROUNDS)
    kept = eager_ms < ours_ms * (1.0 - TIE)
    which = "the eager graph" if kept else "streamdag's graph"
    return kept, (f"whole call: streamdag's graph {ours_ms:.4f} ms, a plain CUDA graph of the eager call "
                  f"{eager_ms:.4f} ms: {which} kept")
