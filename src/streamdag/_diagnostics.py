"""How streamdag tells its user things: warnings that point at the user's line, and a log.

Every warning the library gives is a :class:`~streamdag.StreamdagWarning` (a ``RuntimeWarning``),
attributed to the first frame outside streamdag (and outside PyTorch and ``contextlib``, which a
call may pass through on its way in), so that ``-W error::streamdag.StreamdagWarning`` and
``warnings.filterwarnings(..., module=...)`` see the user's code. The decisions streamdag takes on
its own (streams, CUDA-graph capture, batching, compile candidates, fall-backs) go to
``logging.getLogger("streamdag")`` and its children, at DEBUG and INFO: silent unless the
application configures logging.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from types import FrameType

from .errors import StreamdagWarning

__all__ = ["get_logger", "user_stacklevel", "warn"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CONTEXTLIB = os.path.abspath(contextlib.__file__)


def get_logger(module: str) -> logging.Logger:
    """The logger of a streamdag module (``streamdag.runtime.recorded``...), a child of ``streamdag``."""
    return logging.getLogger(module)


def _passed_through(filename: str) -> bool:
    """Whether a frame of this file is one a call passes through on its way to streamdag."""
    if filename.startswith(_PACKAGE) or filename == _CONTEXTLIB:
        return True
    if "importlib" in filename and "_bootstrap" in filename:
        return True
    torch = sys.modules.get("torch")
    torch_file = getattr(torch, "__file__", None)
    return torch_file is not None and filename.startswith(os.path.dirname(torch_file) + os.sep)


def _levels_to_user(frame: FrameType) -> int:
    """How many frames above ``frame`` (1: its caller) the first frame outside streamdag is (and
    outside the files :func:`_passed_through` lists); frames of the import machinery, which
    :mod:`warnings` itself skips in counting, do not count. In a thread of streamdag's own, with no
    user frame, the outermost frame is named."""
    level = 0
    while frame.f_back is not None:
        frame = frame.f_back
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            continue
        level += 1
        if not _passed_through(os.path.abspath(name)):
            break
    return level


def user_stacklevel() -> int:
    """The ``stacklevel`` that names the user's line, for a ``warnings.warn`` made by the function
    that calls this one."""
    return 1 + _levels_to_user(sys._getframe(1))


def warn(message: str, category: type[Warning] = StreamdagWarning) -> None:
    """Warn with ``message`` at the user's line; also logged at INFO by the logger of the module
    that warns, so that a log shows it among the decisions."""
    caller = sys._getframe(1)
    module = caller.f_globals.get("__name__", "")
    get_logger(module if module.startswith("streamdag.") else "streamdag").info("warning: %s", message)
    warnings.warn(message, category, stacklevel=2 + _levels_to_user(caller))
