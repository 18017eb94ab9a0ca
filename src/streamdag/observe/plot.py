"""A PNG of a timeline: one row per stream, ops as bars, cross-stream waits as arrows."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .timeline import Timeline

__all__ = ["timeline_png"]

_KIND_COLORS = {"compute": "#4e79a7", "h2d": "#59a14f", "d2h": "#e15759"}


def timeline_png(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is in the dev and plot extras
        raise ImportError("timeline PNGs need matplotlib: pip install 'streamdag[plot]'") from exc
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
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([f"{d} s{st}" for d, st in tracks])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    summary = timeline.summary()
    ax.set_title(title or f"makespan {summary.makespan_ms:.3f} ms, concurrency {summary.concurrency:.2f}",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
