"""Progress bars for long work (Inductor compiles of a graph's regions, the benchmark suite).

A bar is drawn with tqdm where someone watches: on stderr where it is a terminal, and in a
Jupyter notebook (tqdm's widget where ipywidgets is installed, else its text bar). A log or a CI
run stays clean. tqdm is optional (the ``torch`` and ``bench`` extras bring it); without it the
work runs the same, without a bar. ``TQDM_DISABLE=1`` turns bars off.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress"]

T = TypeVar("T")


def progress(items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it") -> Iterable[T]:
    """``items`` as they are, or wrapped in a tqdm bar described by ``desc`` (see the module)."""
    isatty = getattr(sys.stderr, "isatty", None)
    terminal = isatty is not None and isatty()
    if not terminal and not _in_a_notebook():
        return items
    try:
        if terminal:
            from tqdm import tqdm
        else:
            from tqdm.auto import tqdm
    except ImportError:
        return items
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    return _closing(tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False,
                         dynamic_ncols=True))


def _in_a_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (IPython's ZMQ shell), where stderr is no terminal."""
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    shell = get_ipython() if callable(get_ipython) else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def _closing(bar: Iterable[T]) -> Iterator[T]:
    """Iterate ``bar`` and close it also where the loop stops early (a break, an exception)."""
    try:
        yield from bar
    finally:
        bar.close()  # type: ignore[attr-defined]
