"""Exceptions raised by streamdag.

Every message says what went wrong and what to do about it: a user reads the
message, not this module.
"""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    from builtins import BaseExceptionGroup, ExceptionGroup
else:  # pragma: no cover - Python 3.10
    from exceptiongroup import BaseExceptionGroup, ExceptionGroup

__all__ = [
    "BaseExceptionGroup",
    "CycleError",
    "DependencyFailed",
    "DeviceLost",
    "ExceptionGroup",
    "InvalidBuffer",
    "RuntimeClosed",
    "StreamdagError",
    "StreamdagWarning",
    "SubmittedInCapture",
    "WorkerLost",
    "WouldBlock",
]


class StreamdagError(Exception):
    """Base class of every error streamdag raises itself."""


class StreamdagWarning(RuntimeWarning):
    """The category of every warning streamdag gives: something runs slower than it could, or
    otherwise than asked (the compiled hot path is not installed, a graph runs without a CUDA graph,
    a compiled model runs eagerly), and the warning says how to fix it. It names the user's line."""


class WouldBlock(StreamdagError):
    """A ``*_nowait`` call would have had to wait (the in-flight bound is reached)."""


class RuntimeClosed(StreamdagError):
    """The runtime was closed before this call."""


class CycleError(StreamdagError, ValueError):
    """The dependencies given form a cycle, so no order can satisfy them."""

    def __init__(self, cycle: list[object]) -> None:
        self.cycle = cycle
        path = " -> ".join(str(n) for n in [*cycle, cycle[0]]) if cycle else "?"
        super().__init__(
            f"the dependency graph has a cycle ({path}); every edge must point from an op "
            "to one that runs after it: remove one edge of the cycle"
        )


class InvalidBuffer(StreamdagError, TypeError):
    """A value in ``reads``/``writes`` is not memory streamdag can track, or is on the wrong device."""


class DependencyFailed(StreamdagError):
    """An op did not run because an op it depends on failed.

    ``root_name`` and ``root_error`` name the op that failed first; the root
    exception is also chained as ``__cause__``.
    """

    def __init__(self, op_name: str, root_name: str, root_error: BaseException) -> None:
        self.op_name = op_name
        self.root_name = root_name
        self.root_error = root_error
        super().__init__(
            f"op {op_name!r} did not run: it depends on op {root_name!r}, which failed with "
            f"{type(root_error).__name__}: {root_error}"
        )
        self.__cause__: BaseException | None = root_error


class SubmittedInCapture(StreamdagError, RuntimeError):
    """An op was submitted while the caller's CUDA stream was being captured into a CUDA graph.

    A runtime's stream that waited on the caller's stream there would join that capture: the op
    would be captured instead of run, and the capture could not end. So the op fails at once.
    """

    def __init__(self) -> None:
        super().__init__(
            "an op was submitted while the caller's CUDA stream is being captured into a CUDA graph "
            "(torch.cuda.graph, or torch.compile's CUDA graphs), and a runtime's streams cannot join "
            "a capture they did not begin: submit outside the capture. To have streamdag's ops in a "
            "CUDA graph, record them (with rt.record() as g: ...) and let streamdag capture and "
            "replay them (g.run(), outside your capture)"
        )


class DeviceLost(StreamdagError):
    """A sticky device error (illegal address, device-side assert) made the device unusable."""

    def __init__(self, device: str, cause: BaseException) -> None:
        self.device = device
        super().__init__(
            f"device {device} is lost after a sticky error ({type(cause).__name__}: {cause}); "
            "every pending and later op on it fails. Restart the process to use the GPU again; "
            "run with CUDA_LAUNCH_BLOCKING=1 to find the op that caused it"
        )
        self.__cause__: BaseException | None = cause


class WorkerLost(StreamdagError):
    """A Ray worker of a :class:`streamdag.ray.Runtime` died (its process or node was lost).

    The ops placed on it that had not finished fail with it; ops that read their results fail with
    :class:`DependencyFailed`. The buffers it held are gone with its memory: Ray restarts the
    worker, and the runtime stays usable once they are written again (``rt.put(..., out=buf)``).
    """

    def __init__(self, worker: str, detail: str) -> None:
        self.worker = worker
        self.detail = detail
        super().__init__(
            f"ray worker {worker} was lost ({detail}); the ops placed on it that had not finished "
            "fail, and its buffers are gone: write them again (rt.put(value, out=buf)) before reading "
            "them; the runtime's other workers are unaffected"
        )

    def __reduce__(self) -> tuple[type[WorkerLost], tuple[str, str]]:
        # raised inside workers too: pickled by its arguments
        return (type(self), (self.worker, self.detail))
