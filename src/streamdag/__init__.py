"""streamdag: run graphs of GPU and CPU work asynchronously and concurrently.

Submit ops with the buffers they read and write; get futures back at once.
Dependencies are inferred from memory, independent ops run on several
streams, and recorded graphs are scheduled once and run many times.
"""

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
from .observe.timeline import Span, Summary, Timeline
from .runtime import Future, GraphResult, OpNode, RecordedGraph, Runtime, RuntimeStatistics
from .runtime.accel import build_schedule
from .schedule import Schedule

__version__ = "0.1.0"


def compile(fn, *, engine=None, **options):
    """Make a PyTorch function or ``nn.Module`` run fused and its independent branches concurrently.

    ``engine="inductor"`` (the default, or ``STREAMDAG_COMPILE_ENGINE``): Dynamo,
    AOTAutograd and Inductor, with Inductor's code run on streamdag's streams
    (:func:`streamdag.frontend.inductor_backend.compile_v2`). ``engine="aten"``:
    the make_fx path, one op per aten node (:func:`streamdag.frontend.compile`).
    Importing either imports torch.
    """
    from .frontend import dynamo  # noqa: F401 - registers backend="streamdag"
    from .frontend.inductor_backend import compile_v2, engine_from

    if engine_from(engine) == "aten":
        from .frontend import compile as _compile

        return _compile(fn, **options)
    aten_only = sorted(set(options) & {"device", "batch"})
    if aten_only:
        raise TypeError(f"streamdag.compile: {', '.join(aten_only)} belong to the make_fx path: "
                        "pass engine='aten' with them")
    return compile_v2(fn, **options)


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
    "compile",
    "parallel",
    "read",
    "write",
]
