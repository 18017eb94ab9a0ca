"""A wide graph of GIL-releasing numpy work: streamdag on CPU lanes against a serial loop.

B branches of L layers ``h = relu(h @ W[b][l])`` from one shared input, joined
by a sum, like the GPU wide graph. BLAS runs single-threaded in both, so the
serial loop is an honest baseline for the lanes.
"""

from __future__ import annotations

import statistics
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

import streamdag as sd

from .._progress import progress
from .report import format_table, median_ms

__all__ = ["profile", "run"]


def _one_blas_thread() -> AbstractContextManager[Any]:
    """BLAS on one thread for the block (``threadpoolctl``, in the ``bench`` extra): without it the
    serial loop would use every core and the comparison would say nothing."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError as exc:
        raise ImportError("the CPU benchmark suite limits BLAS to one thread with threadpoolctl: "
                          "pip install 'streamdag[bench]'") from exc
    return threadpool_limits(limits=1)


def _layer(h: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    np.matmul(h, w, out=out)
    np.maximum(out, 0, out=out)


def _join(outs: list[np.ndarray], total: np.ndarray) -> None:
    total[...] = 0
    for o in outs:
        total += o


class _Workload:
    """The buffers of the wide graph, and its ops submitted to a runtime."""

    def __init__(self, branches: int, layers: int, rows: int, dim: int) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((rows, dim), dtype=np.float32)
        self.ws = [[rng.standard_normal((dim, dim), dtype=np.float32) / dim**0.5 for _ in range(layers)]
                   for _ in range(branches)]
        self.hs = [[np.empty((rows, dim), np.float32) for _ in range(layers)] for _ in range(branches)]
        self.total = np.empty((rows, dim), np.float32)
        self.outs = [h[-1] for h in self.hs]

    def submit_all(self, rt: sd.Runtime) -> None:
        for b, (ws, hs) in enumerate(zip(self.ws, self.hs)):
            src = self.x
            for layer, (w, h) in enumerate(zip(ws, hs)):
                rt.submit(_layer, src, w, h, reads=[src, w], writes=[h], name=f"b{b}l{layer}")
                src = h
        rt.submit(_join, self.outs, self.total, reads=self.outs, writes=[self.total], name="join")


def run(branches: int = 8, layers: int = 4, rows: int = 256, dim: int = 384, streams: int = 2,
        repeats: int = 15) -> dict[str, Any]:
    work = _Workload(branches, layers, rows, dim)
    x, ws, hs, total, outs = work.x, work.ws, work.hs, work.total, work.outs

    def serial() -> None:
        for b in range(branches):
            src = x
            for layer in range(layers):
                _layer(src, ws[b][layer], hs[b][layer])
                src = hs[b][layer]
        _join(outs, total)

    with _one_blas_thread(), sd.Runtime("cpu", streams=streams) as rt:
        def submit_all() -> None:
            work.submit_all(rt)

        def eager() -> None:
            submit_all()
            rt.synchronize()

        with rt.record() as graph:
            submit_all()

        def replay() -> None:
            graph.run().result()

        serial()
        expect = total.copy()
        eager()
        ok_eager = bool(np.array_equal(total, expect))
        replay()
        ok_graph = bool(np.array_equal(total, expect))
        # interleaved, so that the machine's drift hits every variant alike
        samples: dict[str, list[float]] = {"serial": [], "eager": [], "graph": []}
        for _ in progress(range(repeats), desc="cpu_wide", unit="round"):
            for key, fn in (("serial", serial), ("eager", eager), ("graph", replay)):
                samples[key].append(median_ms(fn, repeats=1, warmup=0))
        t_serial, t_eager, t_graph = (statistics.median(samples[k]) for k in ("serial", "eager", "graph"))
        t_serial2 = statistics.median(sorted(samples["serial"])[: repeats // 2 + 1])
    flops = 2.0 * branches * layers * rows * dim * dim
    return {
        "settings": {"branches": branches, "layers": layers, "rows": rows, "dim": dim,
                     "streams": streams, "repeats": repeats, "blas_threads": 1, "dtype": "float32"},
        "ms": {"serial": t_serial, "serial_fastest_half": t_serial2, "streamdag_eager": t_eager,
               "streamdag_graph": t_graph},
        "speedup": {"eager": t_serial / t_eager, "graph": t_serial / t_graph},
        "gflops_serial": flops / t_serial / 1e6,
        "bit_identical": ok_eager and ok_graph,
    }


def table(result: dict[str, Any]) -> str:
    ms = result["ms"]
    rows = [
        ["serial loop, 1 thread", ms["serial"], 1.0],
        ["serial loop, median of the faster half", ms["serial_fastest_half"],
         ms["serial"] / ms["serial_fastest_half"]],
        [f"streamdag eager, {result['settings']['streams']} lanes", ms["streamdag_eager"],
         result["speedup"]["eager"]],
        [f"streamdag recorded graph, {result['settings']['streams']} lanes", ms["streamdag_graph"],
         result["speedup"]["graph"]],
    ]
    return format_table(["cpu_wide", "ms", "x serial"], rows)


def profile(branches: int = 8, layers: int = 4, rows: int = 256, dim: int = 384,
            streams: int = 2) -> sd.Timeline:
    """A timeline of one run of the recorded graph (for the trace and the PNG)."""
    work = _Workload(branches, layers, rows, dim)
    with _one_blas_thread(), sd.Runtime("cpu", streams=streams) as rt:
        with rt.record() as graph:
            work.submit_all(rt)
        graph.run().result()
        with rt.profile() as prof:
            graph.run().result()
    return prof.timeline
