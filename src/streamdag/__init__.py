"""streamdag: run graphs of GPU and CPU work asynchronously and concurrently.

Submit ops with the buffers they read and write; get futures back at once.
Dependencies are inferred from memory, independent ops run on several
streams, and recorded graphs are scheduled once and run many times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, overload

from . import parallel
from .errors import (
    CycleError,
    DependencyFailed,
    DeviceLost,
    ExceptionGroup,
    InvalidBuffer,
    RuntimeClosed,
    StreamdagError,
    StreamdagWarning,
    SubmittedInCapture,
    WorkerLost,
    WouldBlock,
)
from .graph.buffers import read, write
from .observe.merge import merge_traces
from .observe.timeline import Span, Summary, Timeline
from .runtime import Future, GraphResult, OpNode, RecordedGraph, Runtime, RuntimeStatistics
from .runtime.accel import build_schedule
from .schedule import Schedule

if TYPE_CHECKING:  # importing streamdag imports no torch
    import torch

    from .frontend.compiled import Compiled
    from .frontend.compiled_model import CompiledModel
    from .frontend.compiled_module import CompiledModule
    from .frontend.decode import Decoder
    from .frontend.step_graph import CapturedStep

__version__ = "0.1.0"


# The overloads follow the engine argument; STREAMDAG_COMPILE_ENGINE=aten, read at run time, swaps
# the default engine's CompiledModel for the aten engine's Compiled where engine is left out.
@overload
def compile(fn: torch.nn.Module, *, engine: Literal["inductor"] | None = None,
            **options: Any) -> CompiledModule: ...


@overload
def compile(fn: Callable[..., Any], *, engine: Literal["inductor"] | None = None,
            **options: Any) -> CompiledModel: ...


@overload
def compile(fn: Callable[..., Any], *, engine: Literal["aten"], **options: Any) -> Compiled: ...


@overload
def compile(fn: Callable[..., Any], *, engine: str | None = None,
            **options: Any) -> CompiledModel | Compiled: ...


def compile(fn: Callable[..., Any], *, engine: str | None = None, **options: Any) -> CompiledModel | Compiled:
    """Make a PyTorch function or ``nn.Module`` run fused and its independent branches concurrently.

    ``engine="inductor"`` (the default, or ``STREAMDAG_COMPILE_ENGINE``): Dynamo,
    AOTAutograd and Inductor, with Inductor's code run on streamdag's streams
    (:func:`streamdag.frontend.compiled_model.compile_v2`). ``engine="aten"``:
    the make_fx path, one op per aten node (:func:`streamdag.frontend.compile`).
    Importing either imports torch.
    """
    import inspect

    from .frontend import dynamo  # noqa: F401 - registers backend="streamdag"
    from .frontend.compiled_model import compile_v2
    from .frontend.inductor_backend import engine_from

    if engine_from(engine) == "aten":
        from .frontend import compile as _compile

        if "inductor" in options:
            raise TypeError("streamdag.compile: inductor= takes Inductor settings, and the aten engine "
                            "runs no Inductor: drop it, or compile with engine='inductor'")

        return _compile(fn, **options)
    aten_only = sorted(set(options) & {"device", "batch"})
    if aten_only:
        raise TypeError(f"streamdag.compile: {', '.join(aten_only)} belong to the make_fx path: "
                        "pass engine='aten' with them")
    known = [name for name in inspect.signature(compile_v2).parameters if name != "fn"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(f"streamdag.compile got unknown option(s) {', '.join(map(repr, unknown))}; "
                        f"it takes {', '.join(known)} (and engine='aten' with its own)")
    return compile_v2(fn, **options)


@overload
def capture_step(fn: Callable[..., Any], *, warmup: int = 3, max_signatures: int = 4) -> CapturedStep: ...


@overload
def capture_step(fn: None = None, *, warmup: int = 3,
                 max_signatures: int = 4) -> Callable[[Callable[..., Any]], CapturedStep]: ...


def capture_step(fn: Callable[..., Any] | None = None, *, warmup: int = 3,
                 max_signatures: int = 4) -> CapturedStep | Callable[[Callable[..., Any]], CapturedStep]:
    """A whole training step (forward, ``backward()``, the optimizer's step) replayed as one CUDA
    graph per signature of its arguments, after ``warmup`` calls run as written
    (:class:`streamdag.frontend.step_graph.CapturedStep`). The batch comes in as arguments, on
    the GPU; optimizers inside are made with ``capturable=True``; the model may be
    ``streamdag.compile``'d (its graphs then run inside the step's graph) or ``torch.compile``'d
    with the default mode. A decorator as ``@capture_step`` or ``@capture_step(warmup=5)``.
    Imports torch.
    """
    from .frontend.step_graph import CapturedStep, check_step_settings

    if fn is None:  # @capture_step(warmup=...): the settings checked now, the function to come
        check_step_settings(warmup, max_signatures)
        return lambda f: CapturedStep(f, warmup=warmup, max_signatures=max_signatures)
    return CapturedStep(fn, warmup=warmup, max_signatures=max_signatures)


def decoder(model: torch.nn.Module, *, max_length: int, compile: bool | None = None, lookahead: int = 2,
            **options: Any) -> Decoder:
    """A greedy decoder for a Hugging Face causal LM: a static KV cache of ``max_length`` positions
    and each decode step one captured graph, replayed for every token
    (:class:`streamdag.frontend.decode.Decoder`). ``compile`` (default: on CUDA) compiles the step
    with ``streamdag.compile``, which takes ``options`` (``streams``, ``regions``, ...). Needs
    ``transformers``; imports torch.
    """
    from .frontend.decode import Decoder

    return Decoder(model, max_length=max_length, compile=compile, lookahead=lookahead, **options)


def generate(model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
             **options: Any) -> torch.Tensor:
    """Greedy generation in one call: the prompt followed by the new tokens, as
    ``model.generate(input_ids, do_sample=False)`` returns them
    (:func:`streamdag.frontend.decode.generate`; keep a :func:`decoder` to decode several prompts).
    """
    from .frontend.decode import generate as _generate

    return _generate(model, input_ids, max_new_tokens, **options)


__all__ = [
    "CycleError",
    "DependencyFailed",
    "DeviceLost",
    "ExceptionGroup",
    "Future",
    "GraphResult",
    "InvalidBuffer",
    "OpNode",
    "RecordedGraph",
    "Runtime",
    "RuntimeClosed",
    "RuntimeStatistics",
    "Schedule",
    "Span",
    "StreamdagError",
    "StreamdagWarning",
    "SubmittedInCapture",
    "Summary",
    "Timeline",
    "WorkerLost",
    "WouldBlock",
    "__version__",
    "build_schedule",
    "capture_step",
    "compile",
    "decoder",
    "generate",
    "merge_traces",
    "parallel",
    "read",
    "write",
]
