"""Progress bars for long work (Inductor compiles of a graph's regions, the benchmark suite).

A bar is drawn with tqdm, on stderr, only where stderr is a terminal: a log, a CI run or a
notebook's captured output stays clean. tqdm is optional (the ``torch`` and ``bench`` extras
bring it); without it the work runs the same, without a bar. ``TQDM_DISABLE=1`` turns bars off.
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
    if isatty is None or not isatty():
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    return _closing(tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False,
                         dynamic_ncols=True))


def _closing(bar: Iterable[T]) -> Iterator[T]:
    """Iterate ``bar`` and close it also where the loop stops early (a break, an exception)."""
    try:
        yield from bar
    finally:
        bar.close()  # type: ignore[attr-defined]
