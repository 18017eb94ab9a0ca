"""A graph Inductor could not compile: run on the make_fx path (:class:`~.compiled.Compiled`, one
aten op per node on streams) without gradients, and as Dynamo traced it with gradients (the
make_fx path compiles inference graphs only).

State: ``inference_calls`` and ``grad_calls`` count the calls of each kind; the backend's
statistics (``stats``) count them all in ``calls``, and the calls with gradients also in
``uncaptured_calls``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._diagnostics import warn
from .whole_call import ACTIVE, NotWholeCapturable

__all__ = ["MakeFxFallback", "fall_back"]


class MakeFxFallback:
    """The callable Dynamo gets for a graph Inductor could not compile."""

    def __init__(self, legacy: Any, eager: Callable[..., Any], reason: str, index: int, ran: Any,
                 stats: Any) -> None:
        self.legacy = legacy  # the make_fx path's compiled graph (streamdag.frontend.compiled.Compiled)
        self.eager = eager  # the graph as Dynamo traced it
        self.reason = reason
        self.index = index
        self.ran = ran  # the backend's per-thread count of graph calls (a model call that runs none is eager)
        self.stats = stats
        self.inference_calls: int = 0
        self.grad_calls: int = 0

    def __call__(self, *args: Any) -> Any:
        self.ran.count += 1
        self.stats.calls += 1
        if ACTIVE.mode is not None:  # its own runtime runs it: no part of a whole call's CUDA graph
            ACTIVE.refusal = ACTIVE.refusal or f"graph {self.index} runs on the make_fx path"
            if ACTIVE.mode == "capture":
                raise NotWholeCapturable(ACTIVE.refusal)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self.grad_calls += 1
            self.stats.uncaptured_calls += 1
            return self.eager(*args)
        self.inference_calls += 1
        return self.legacy(*args)

    def explain(self) -> str:
        lines = [f"graph {self.index}: {self.reason}"]
        if self.grad_calls:
            lines.append(f"  {self.grad_calls} call(s) with gradients ran it as Dynamo traced it, op by op "
                         "(the make_fx path compiles graphs without gradients only)")
        if self.inference_calls:
            lines.append(f"  {self.inference_calls} call(s) without gradients ran on the make_fx path:")
            lines.append(self.legacy.explain())
        return "\n".join(lines)


def fall_back(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], exc: BaseException, index: int,
              streams: int, ran: Any, stats: Any, warned: set[str]) -> MakeFxFallback:
    """The fallback for graph ``index`` (``gm``, Dynamo's graph) that Inductor failed on with ``exc``;
    warns once per reason, saying where the graph's calls run."""
    from .compiled import Compiled

    reason = f"Inductor failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    stats.fallbacks += 1
    trained = torch.is_grad_enabled() and any(getattr(e, "requires_grad", False) for e in example_inputs)
    if reason not in warned:
        warned.add(reason)
        where = ("runs as Dynamo traced it, op by op, where it needs gradients (on the make_fx path "
                 "without them)" if trained else "runs on the make_fx path")
        warn(f"streamdag: graph {index} {where}: {reason}")
    return MakeFxFallback(Compiled(gm, streams=streams), gm, reason, index, ran, stats)
