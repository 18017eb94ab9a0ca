"""PNGs of what ran: a timeline (one row per stream, ops as bars, cross-stream waits as arrows), and
a Chrome trace such as a merged one (one row per thread or stream, every profiler's events)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .timeline import Timeline

__all__ = ["timeline_png", "trace_png"]

_KIND_COLORS = {"compute": "#4e79a7", "h2d": "#59a14f", "d2h": "#e15759"}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is in the dev and plot extras
        raise ImportError("timeline PNGs need matplotlib: pip install 'streamdag[plot]'") from exc
    return plt


def timeline_png(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    plt = _pyplot()
    tracks = sorted(timeline.tracks())
    row = {key: i for i, key in enumerate(tracks)}
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.45 * max(len(tracks), 1)), dpi=110)
    by_seq = {s.seq: s for s in timeline.spans}
    makespan = max((s.end for s in timeline.spans), default=1.0) - min(
        (s.start for s in timeline.spans), default=0.0)
    for s in timeline.spans:
        y = row[(s.device, s.stream)]
        color = "#bab0ac" if s.failed else _KIND_COLORS.get(s.kind, "#4e79a7")
        ax.broken_barh([(s.start, max(s.duration, 1e-6))], (y - 0.38, 0.76), facecolors=color,
                       edgecolors="white", linewidth=0.3)
        if s.duration > 0.04 * makespan:  # label the bars wide enough to hold a name
            ax.text(s.start + s.duration / 2, y, s.name, ha="center", va="center", fontsize=7,
                    color="white", clip_on=True)
    for s in timeline.spans:
        for d in s.deps:
            src = by_seq.get(d)
            if src is not None and (src.device, src.stream) != (s.device, s.stream):
                ax.annotate("", xy=(s.start, row[(s.device, s.stream)]),
                            xytext=(src.end, row[(src.device, src.stream)]),
                            arrowprops={"arrowstyle": "->", "color": "#f28e2b", "lw": 0.6, "alpha": 0.7})
    summary = timeline.summary()
    return _finish(plt, fig, ax, [f"{d} s{st}" for d, st in tracks], path,
                   title or f"makespan {summary.makespan_ms:.3f} ms, concurrency {summary.concurrency:.2f}")


def _finish(plt: Any, fig: Any, ax: Any, labels: list[str], path: str | Path, title: str,
            fontsize: int | None = None) -> Path:
    """Label the rows (top to bottom) and the axes, and write the figure to ``path``."""
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=fontsize)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _trace_color(event: Mapping[str, Any]) -> str:
    cat = str(event.get("cat", ""))
    if cat.startswith("streamdag"):
        return _KIND_COLORS.get(cat.split()[-1], "#4e79a7")
    return "#59a14f" if cat in ("kernel", "gpu_memcpy", "gpu_memset") else "#f28e2b"


def trace_png(trace: Mapping[str, Any], path: str | Path, title: str = "") -> Path:
    """A PNG of a Chrome trace: a row per (process, thread); streamdag's ops as tall bars, the
    other profilers' events (PyTorch's ops orange, CUDA kernels green) as short bars below them."""
    from .merge import complete_events, track_names

    plt = _pyplot()
    events = complete_events(trace)
    names = track_names(trace)
    tracks = sorted({(e.get("pid"), e.get("tid")) for e in events}, key=lambda t: (str(t[0]), str(t[1])))
    row = {key: i for i, key in enumerate(tracks)}
    start = min((float(e["ts"]) for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.5 * max(len(tracks), 1)), dpi=110)
    for e in events:
        y = row[(e.get("pid"), e.get("tid"))]
        ours = str(e.get("cat", "")).startswith("streamdag")
        x0, width = (float(e["ts"]) - start) / 1e3, max(float(e.get("dur", 0.0)) / 1e3, 1e-6)
        bottom, height = (y - 0.4, 0.5) if ours else (y + 0.12, 0.28)
        ax.broken_barh([(x0, width)], (bottom, height), facecolors=_trace_color(e), edgecolors="white",
                       linewidth=0.2)
        if ours:
            ax.text(x0 + width / 2, y - 0.15, str(e.get("name", "")), ha="center", va="center", fontsize=6,
                    color="white", clip_on=True)
    return _finish(plt, fig, ax, [names.get(t, f"pid {t[0]} tid {t[1]}")[:48] for t in tracks], path,
                   title or "merged trace: streamdag ops (tall) over PyTorch ops and kernels (short)",
                   fontsize=7)
