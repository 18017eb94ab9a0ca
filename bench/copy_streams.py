"""What the device alone gives a pieced copy/compute pipeline: the floor under ``rt.stream_map``.

``bench/overlap.py``'s work (512 MiB in, 6 x (bf16 matmul + tanh), 512 MiB
out), hand-made and captured whole into CUDA graphs, so no host cost is in the
timings: copies both ways at once in pieces of 64 to 4 MiB, and the pipeline
of pieces through a ring of 4 device buffers, each with one copy stream per
direction or two taken in turn (to see whether a second stream hides the gap
between consecutive copies). Timed in interleaved rounds, medians; the bound is
max(copies in, copies out, compute, both ways in 64 MiB copies), as in
overlap.py. ``pieced_pipeline`` is also overlap.py's hand-made baseline of pieces, and
``chunked_pipelines`` its (and transfers.py's) PyTorch baselines over chunks.

Run on a GPU machine: PYTHONPATH=src python bench/copy_streams.py
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from streamdag.suite.cuda_timing import graph_of
from streamdag.suite.report import format_table, write_json

MiB = 1 << 20
TOTAL = 512 * MiB
STEPS = 6
ROUNDS = 15


def cut(t: torch.Tensor, floats: int) -> list[torch.Tensor]:
    return [t.view(-1)[lo : lo + floats] for lo in range(0, t.numel(), floats)]


def chunked_pipelines(host_in: Sequence[torch.Tensor], dev_in: Sequence[torch.Tensor],
                      dev_out: Sequence[torch.Tensor], host_out: Sequence[torch.Tensor],
                      compute: Callable[[torch.Tensor, torch.Tensor], object]
                      ) -> tuple[Callable[[], None], Callable[[], None]]:
    """The two PyTorch baselines over chunks: each chunk copied in, computed, copied out,
    all on one stream; and the hand-made pipeline with a stream per stage, ordered by events."""
    def sequential() -> None:
        for i in range(len(host_in)):
            dev_in[i].copy_(host_in[i], non_blocking=True)
            compute(dev_in[i], dev_out[i])
            host_out[i].copy_(dev_out[i], non_blocking=True)

    s_in, s_c, s_out = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()

    def hand_pipeline() -> None:
        main = torch.cuda.current_stream()
        for s in (s_in, s_c, s_out):
            s.wait_stream(main)
        for i in range(len(host_in)):
            with torch.cuda.stream(s_in):
                dev_in[i].copy_(host_in[i], non_blocking=True)
                e_in = torch.cuda.Event()
                e_in.record()
            with torch.cuda.stream(s_c):
                s_c.wait_event(e_in)
                compute(dev_in[i], dev_out[i])
                e_c = torch.cuda.Event()
                e_c.record()
            with torch.cuda.stream(s_out):
                s_out.wait_event(e_c)
                host_out[i].copy_(dev_out[i], non_blocking=True)
        for s in (s_in, s_c, s_out):
            main.wait_stream(s)

    return sequential, hand_pipeline


def pieced_pipeline(pieces_in: Sequence[torch.Tensor], pieces_out: Sequence[torch.Tensor],
                    fn: Callable[[torch.Tensor], torch.Tensor], buffers: int = 4,
                    copy_streams: int = 1) -> Callable[[], None]:
    """Each host piece copied into a ring of device buffers, ``fn`` on it into an output ring,
    copied out; events order a buffer's reuse after its last reader. Pieces of one size."""
    floats = pieces_in[0].numel()
    ring_in = [torch.empty(floats, device="cuda") for _ in range(buffers)]
    ring_out = [torch.empty(pieces_out[0].numel(), device="cuda") for _ in range(buffers)]
    ins = [torch.cuda.Stream() for _ in range(copy_streams)]
    outs = [torch.cuda.Stream() for _ in range(copy_streams)]
    comp = torch.cuda.Stream()

    def run() -> None:
        main = torch.cuda.current_stream()
        for s in [*ins, *outs, comp]:
            s.wait_stream(main)
        done_compute: list[torch.cuda.Event | None] = [None] * buffers
        done_out: list[torch.cuda.Event | None] = [None] * buffers
        for k, (host_in, host_out) in enumerate(zip(pieces_in, pieces_out)):
            slot = k % buffers
            si, so = ins[k % copy_streams], outs[k % copy_streams]
            with torch.cuda.stream(si):
                if done_compute[slot] is not None:
                    si.wait_event(done_compute[slot])
                ring_in[slot].copy_(host_in, non_blocking=True)
                e_in = torch.cuda.Event()
                e_in.record()
            with torch.cuda.stream(comp):
                comp.wait_event(e_in)
                if done_out[slot] is not None:
                    comp.wait_event(done_out[slot])
                ring_out[slot].copy_(fn(ring_in[slot]).reshape(-1))
                e_c = torch.cuda.Event()
                e_c.record()
                done_compute[slot] = e_c
            with torch.cuda.stream(so):
                so.wait_event(e_c)
                host_out.copy_(ring_out[slot], non_blocking=True)
                e_o = torch.cuda.Event()
                e_o.record()
                done_out[slot] = e_o
        for s in [*ins, *outs, comp]:
            main.wait_stream(s)
    return run


def captured(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``'s work as one CUDA graph (``graph_of``); returns its replay, which keeps ``fn`` too."""
    graph, _ = graph_of(fn)

    def replay() -> None:
        graph.replay()

    replay.work = fn  # type: ignore[attr-defined]  # its closure holds the device buffers the graph uses
    return replay


def main() -> None:
    floats = TOTAL // 4
    host_in = torch.randn(floats).pin_memory()
    host_out = torch.empty(floats).pin_memory()
    dev_in = torch.empty(floats, device="cuda")
    dev_out = torch.empty(floats, device="cuda")
    w = (torch.randn(1024, 1024, device="cuda") / 32).bfloat16()

    def rows_fn(x):
        x = x.view(-1, 1024, 1024).bfloat16()
        for _ in range(STEPS):
            x = torch.tanh(x @ w)
        return x

    def copies(pairs_of_streams):
        def run():
            main = torch.cuda.current_stream()
            streams = [s for ss in pairs_of_streams for s, _ in ss]
            for s in streams:
                s.wait_stream(main)
            for ss in pairs_of_streams:
                for s, (dst, src) in ss:
                    with torch.cuda.stream(s):
                        dst.copy_(src, non_blocking=True)
            for s in streams:
                main.wait_stream(s)
        return run

    def one_way(mib, direction, nstreams):
        f = mib * MiB // 4
        pairs = (zip(cut(dev_in, f), cut(host_in, f)) if direction == "in"
                 else zip(cut(host_out, f), cut(dev_out, f)))
        ss = [torch.cuda.Stream() for _ in range(nstreams)]
        return copies([[(ss[k % nstreams], p) for k, p in enumerate(pairs)]])

    def both(mib, nstreams):
        f = mib * MiB // 4
        s_in = [torch.cuda.Stream() for _ in range(nstreams)]
        s_out = [torch.cuda.Stream() for _ in range(nstreams)]
        pairs_in = list(zip(cut(dev_in, f), cut(host_in, f)))
        pairs_out = list(zip(cut(host_out, f), cut(dev_out, f)))
        # interleaved, as a pipeline queues them: piece k in, piece k out
        return copies([[(s_in[k % nstreams], p) for k, p in enumerate(pairs_in)],
                       [(s_out[k % nstreams], p) for k, p in enumerate(pairs_out)]])

    def compute_all():
        for d, o in zip(cut(dev_in, 4 * MiB), cut(dev_out, 4 * MiB)):
            o.copy_(rows_fn(d).reshape(-1))

    variants = {"in 64": one_way(64, "in", 1), "out 64": one_way(64, "out", 1), "compute": compute_all}
    for mib in (64, 16, 8, 4):
        for ns in (1, 2):
            if mib == 64 and ns == 2:
                continue
            variants[f"both {mib} MiB x{ns}"] = both(mib, ns)
    for mib in (8, 16):
        variants[f"in {mib} x1"] = one_way(mib, "in", 1)
        variants[f"in {mib} x2"] = one_way(mib, "in", 2)
    for mib in (32, 16, 8, 4):
        f = mib * MiB // 4
        for ns in (1, 2):
            variants[f"pipeline {mib} MiB x{ns}"] = pieced_pipeline(
                cut(host_in, f), cut(host_out, f), rows_fn, copy_streams=ns)
    graphs = {k: captured(v) for k, v in variants.items()}
    # check: pipelines of other pieces and streams give the same bytes (the compute maps matrices alone)
    host_in.copy_(torch.randn(floats))
    graphs["pipeline 16 MiB x2"]()
    torch.cuda.synchronize()
    got = host_out.clone()
    graphs["pipeline 8 MiB x1"]()
    torch.cuda.synchronize()
    assert torch.equal(got, host_out), "pipelines differ"
    times: dict[str, list[float]] = {k: [] for k in graphs}
    order = list(graphs.items())
    for _ in range(ROUNDS):
        order.reverse()
        for k, replay in order:
            torch.cuda.synchronize()
            t = time.perf_counter()
            replay()
            torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    bound = max(med["in 64"], med["out 64"], med["compute"], med["both 64 MiB x1"])
    print(format_table(["captured whole", "ms", "vs bound"],
                       [[k, v, f"{v / bound:.3f}x" if k.startswith(("pipeline", "both")) else ""]
                        for k, v in med.items()]))
    print(write_json(Path(__file__).parent / "results",
                     "copy_streams_" + torch.cuda.get_device_name().replace(" ", "_"),
                     {"settings": {"total_mib": TOTAL >> 20, "steps": STEPS, "ring_buffers": 4,
                                   "rounds": ROUNDS, "timing": "CUDA graph replays, interleaved rounds"},
                      "ms": med, "bound_ms": bound, "rounds_ms": times}))


if __name__ == "__main__":
    main()
