"""Which ops synchronize with the host, watched thread by thread.

A recorded graph's first, eager run wraps each op with :func:`probe_host_syncs`:
an op that synchronizes (``.item()``, ``float(t)``) cannot be captured, so such
a graph is never captured at all. PyTorch reports a sync only through its
sync debug mode and Python's warnings, and both are the process's: a plain
``warnings.catch_warnings(record=True)`` around the op also caught the syncs
of every other thread, so a sync elsewhere marked the op and its graph was
never captured. The watch here counts a sync warning for an op only when the
thread that runs the op raised it; other threads' sync warnings are shown
only if the sync debug mode was on before the probe, and every other warning
is shown as usual. The hook on ``warnings.showwarning`` stays once set: a sync
that another thread began while the mode was on warns only after its call
returns, maybe after the probe, and is dropped then unless the mode is on.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

__all__ = ["probe_host_syncs"]

#: the start of PyTorch's warning for a synchronizing CUDA call
_SYNC_WARNING = "called a synchronizing CUDA operation"


class _SyncWatch:
    """The process's one sync watch, on while any thread probes an op."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._probes = 0
        self._mode_before = 0
        self._show_before: Any = None
        self._filter: tuple[Any, ...] | None = None
        self._local = threading.local()
        self._hook = self._show  # one bound method, so that it can be recognised by identity

    def start(self) -> tuple[list[str], list[str] | None]:
        """Watch this thread's syncs; returns its list of them and the one it replaces."""
        found: list[str] = []
        outer = getattr(self._local, "found", None)  # a probed op may run a probed graph
        self._local.found = found
        with self._lock:
            if self._probes == 0:
                self._mode_before = torch.cuda.get_sync_debug_mode()
                if self._mode_before == 0:
                    torch.cuda.set_sync_debug_mode(1)
                if warnings.showwarning is not self._hook:
                    self._show_before = warnings.showwarning
                    warnings.showwarning = self._hook
                # every sync is seen, not once per line as the default filter would
                warnings.filterwarnings("always", message=_SYNC_WARNING, category=UserWarning)
                self._filter = warnings.filters[0]
            self._probes += 1
        return found, outer

    def stop(self, outer: list[str] | None) -> None:
        self._local.found = outer
        with self._lock:
            self._probes -= 1
            if self._probes:
                return
            if self._mode_before == 0:
                torch.cuda.set_sync_debug_mode(0)
            if self._filter in warnings.filters:  # unless someone reset the filters meanwhile
                warnings.filters.remove(self._filter)
            self._filter = None

    def _show(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if str(message).startswith(_SYNC_WARNING):
            found = getattr(self._local, "found", None)
            if found is not None:
                found.append(str(message))
            asked = self._mode_before if self._probes else torch.cuda.get_sync_debug_mode()
            if asked == 0:
                return  # nobody asked to see it
        show = self._show_before or warnings._showwarning_orig  # type: ignore[attr-defined]
        show(message, category, filename, lineno, *rest)


_WATCH = _SyncWatch()


def probe_host_syncs(fn: Any, name: str, found: list[str]) -> Any:
    """Wrap ``fn`` to note (in ``found``) if it synchronizes with the host, as ``.item()`` does.

    Only syncs made by the thread that calls the wrapped function count.
    """

    def probed(*args: Any, **kwargs: Any) -> Any:
        syncs, outer = _WATCH.start()
        try:
            return fn(*args, **kwargs)
        finally:
            _WATCH.stop(outer)
            if syncs:
                found.append(name)

    return probed
