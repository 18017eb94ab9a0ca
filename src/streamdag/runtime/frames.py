"""A failed op's error without the frames of its traceback: they would keep the op's data alive."""

from __future__ import annotations

import traceback
from typing import Any

__all__ = ["release_frames"]

_RAISED_AT = "raised at (the traceback's frames are not kept):\n"


def release_frames(exc: BaseException, caught_here: bool = False) -> BaseException:
    """``exc`` without the frames of its traceback, where it was raised kept as text in a note; so
    too the exceptions it chains that were raised inside the op (not one the submitting code was
    handling, say, which is the user's). A failed op's error lives as long as its future, or a
    dependent's, is referenced; a traceback's frames would keep alive the locals of every function
    it passed through and, through each frame's caller, of the whole stack that ran the op (the op
    itself, its arguments, the submitting code's variables), GPU tensors too. ``caught_here``: the
    traceback's first entry is the caller's own frame, which the note leaves out."""
    tb = exc.__traceback__
    if caught_here and tb is not None:
        tb = tb.tb_next
    inside = tb.tb_frame if tb is not None else None  # the outermost frame of the op's own code
    _drop_traceback(exc, tb)
    pending, seen = [exc.__cause__, exc.__context__, *getattr(exc, "exceptions", ())], {id(exc)}
    while pending and inside is not None:
        error = pending.pop()
        if error is None or id(error) in seen or not _raised_under(error.__traceback__, inside):
            continue
        seen.add(id(error))
        _drop_traceback(error, error.__traceback__)
        pending += [error.__cause__, error.__context__, *getattr(error, "exceptions", ())]
    return exc


def _raised_under(tb: Any, frame: Any) -> bool:
    """Whether the traceback ``tb`` begins in ``frame`` or in a function it called."""
    caller = tb.tb_frame if tb is not None else None
    while caller is not None and caller is not frame:
        caller = caller.f_back
    return caller is not None


def _drop_traceback(error: BaseException, tb: Any) -> None:
    if not hasattr(error, "add_note"):  # Python 3.10: no notes; at least the locals go
        traceback.clear_frames(tb)
        return
    lines = "".join(traceback.format_list(traceback.extract_tb(tb))).rstrip()
    if lines and not any(str(n).startswith(_RAISED_AT) for n in getattr(error, "__notes__", ())):
        error.add_note(_RAISED_AT + lines)  # (one: an error raised again keeps where it began)
    error.__traceback__ = None
