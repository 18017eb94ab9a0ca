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
    WouldBlock,
)
from .graph.buffers import read, write
from .observe.timeline import Span, Summary, Timeline
from .runtime import Future, GraphResult, OpNode, RecordedGraph, Runtime, RuntimeStatistics
from .schedule import Schedule, build_schedule

__version__ = "0.1.0"


def compile(fn, **options):
    """Make a PyTorch function or ``nn.Module`` run its independent operators concurrently.

    See :func:`streamdag.frontend.compile` (importing it imports torch).
    """
    from .frontend import compile as _compile
    from .frontend import dynamo  # noqa: F401 - registers backend="streamdag"

    return _compile(fn, **options)


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
    "WouldBlock",
    "__version__",
    "build_schedule",
    "compile",
    "parallel",
    "read",
    "write",
]
