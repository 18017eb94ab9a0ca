"""Host cost per op that streamdag adds on top of PyTorch's own launch (goal: at most 5 µs).

Eager submits (each op's dependencies inferred and launched at once), the
runtime's bookkeeping alone (a backend that runs the op and makes no CUDA call
of its own), the CUDA calls alone (what any runtime on PyTorch's streams
calls per op, with no bookkeeping: the floor of this design through
PyTorch's Python API), and for comparison the same chain recorded once and
replayed as a captured CUDA graph. The lent host's speed drifts by tens of percent within
a minute, so the variants are timed in turns, round after round, and each
reports its median round.

Run on a GPU machine: PYTHONPATH=src python bench/overhead.py
"""

import statistics
import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag.backends.inline import InlineBackend
from streamdag.suite.report import format_table, write_json

GRAPH_OPS = 1000
OPS_PER_ROUND = 4000
ROUNDS = 15


def main():
    bufs = [torch.zeros(256, device="cuda") for _ in range(64)]

    def torch_loop(n):
        for i in range(n):
            torch.add(bufs[i % 64], 1, out=bufs[(i + 1) % 64])

    streams = [torch.cuda.Stream() for _ in range(8)]
    events = [torch.cuda.Event() for _ in range(64)]
    caller_event = torch.cuda.Event()
    record, wait = torch._C._CudaEventBase.record, torch._C._CudaEventBase.wait
    get_stream, set_stream = torch._C._cuda_getCurrentStream, torch._C._cuda_setStream

    def cuda_calls_only(n):
        """The CUDA calls any runtime on PyTorch's streams makes per op, and no bookkeeping:
        order the op's stream after the caller's, switch to it and back, record a completion event."""
        caller = torch.cuda.current_stream()
        for i in range(n):
            s = streams[i & 7]
            prev = get_stream(s.device_index)
            record(caller_event, caller)
            wait(caller_event, s)
            set_stream(s.stream_id, s.device_index, s.device_type)
            torch.add(bufs[i % 64], 1, out=bufs[(i + 1) % 64])
            set_stream(*prev)
            record(events[i % 64], s)

    def chain_on(rt):
        def chain(n):
            for i in range(n):
                a, b = bufs[i % 64], bufs[(i + 1) % 64]
                rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])
        return chain

    def independent_on(rt):
        def independent(n):
            for i in range(n):
                b = bufs[i % 64]
                rt.submit(b.add_, 1, writes=[b])
        return independent

    rt = sd.Runtime("cuda", streams=8, max_inflight=100000)
    # the same, but every op finished by the completion thread (the submitting thread never passes)
    thread_only = sd.Runtime("cuda", streams=8, max_inflight=100000)
    thread_only._finish_ready = []
    bare = sd.Runtime(backend=InlineBackend(f"cuda:{torch.cuda.current_device()}", 8),
                      max_inflight=100000)
    # the same chain recorded once and run as a captured CUDA graph: host cost per op of g.run()
    with rt.record() as g:
        chain_on(rt)(GRAPH_OPS)
    g.run().result()

    def graph_runs(n):
        for _ in range(max(1, n // GRAPH_OPS)):
            g.run()

    variants = {
        "PyTorch launch, one stream": torch_loop,
        "the CUDA calls of a stream runtime, no bookkeeping": cuda_calls_only,
        "streamdag submit, dependent chain": chain_on(rt),
        "streamdag submit, dependent chain, completion thread finishes all": chain_on(thread_only),
        "streamdag submit, independent ops": independent_on(rt),
        "streamdag bookkeeping alone, dependent chain": chain_on(bare),
        f"streamdag recorded chain of {GRAPH_OPS}, g.run() per op": graph_runs,
    }
    rounds: dict[str, list[float]] = {label: [] for label in variants}
    for fn in variants.values():  # warm up: caches, event pool, the graph's capture
        fn(500)
    torch.cuda.synchronize()
    for _ in range(ROUNDS):
        for label, fn in variants.items():
            t0 = time.perf_counter()
            fn(OPS_PER_ROUND)
            rounds[label].append((time.perf_counter() - t0) / OPS_PER_ROUND * 1e6)
            rt.synchronize()
            thread_only.synchronize()
            torch.cuda.synchronize()
    rt.close()
    thread_only.close()
    bare.close()
    medians = {label: statistics.median(ts) for label, ts in rounds.items()}
    t_torch = medians["PyTorch launch, one stream"]
    rows = [[label, us, us - t_torch, f"{min(rounds[label]):.1f}-{max(rounds[label]):.1f}"]
            for label, us in medians.items()]
    print(format_table(["per op (host)", "µs (median round)", "added over PyTorch µs", "rounds µs"], rows))
    print(write_json(Path(__file__).parent / "results",
                     "overhead_" + torch.cuda.get_device_name().replace(" ", "_"),
                     {"settings": {"ops_per_round": OPS_PER_ROUND, "rounds": ROUNDS, "streams": 8},
                      "us": {"torch_us": t_torch, **{k: v for k, v in medians.items() if k != rows[0][0]}},
                      "rounds_us": rounds}))


if __name__ == "__main__":
    main()
