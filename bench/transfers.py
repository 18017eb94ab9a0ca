"""Host<->device transfers: streamdag's copies against PyTorch's, from pinned and pageable memory.

One tensor of SIZES_MIB each way, fp32, every variant ending with the data in place (the host
waits for the copy). PyTorch: ``copy_(non_blocking=True)`` from (or into) pageable memory, which
the CUDA driver stages itself; the same after ``pin_memory()`` (pinning a new buffer each time, as
``x.pin_memory().to("cuda", non_blocking=True)`` does); and from (into) memory pinned beforehand.
streamdag: ``rt.copy`` from (into) the same pageable and pinned tensors; pageable data goes through
the runtime's reused pinned staging buffers, in chunks. Beside each copy's GB/s, the host time of
the submit itself (``rt.copy`` returns a future; the time until it returns is what the submitting
thread cannot use for other work). The variants run in interleaved rounds, each reporting its
median. Then the copy/compute case of bench/overlap.py from and into pageable memory (8 chunks of 64 MiB),
PyTorch's pipelines against streamdag's submits and ``stream_map`` (its default pieces), each
checked to give exactly the results of the first.

Run on a GPU machine: PYTHONPATH=src python bench/transfers.py
(writes bench/results/transfers_<gpu>.json)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

import streamdag as sd
from copy_streams import chunked_pipelines
from streamdag.suite.cuda_timing import interleaved_rounds_ms
from streamdag.suite.report import format_table, write_json

SIZES_MIB = (2, 8, 16, 256)
ROUNDS = 20
PIPELINE_CHUNKS, PIPELINE_ROUNDS = 8, 10


def variants_for(rt: sd.Runtime, mib: int, submit_ms: dict[str, list[float]]) -> dict:
    floats = mib << 18
    pageable = torch.randn(floats)
    pinned = torch.randn(floats).pin_memory()
    dev = torch.randn(floats, device="cuda")
    back_pageable = torch.empty(floats)
    back_pinned = torch.empty(floats, pin_memory=True)

    def timed_submit(label, fn):
        def run():
            t0 = time.perf_counter()
            future = fn()
            submit_ms.setdefault(label, []).append((time.perf_counter() - t0) * 1e3)
            future.result()
        return run

    return {
        ("h2d", "PyTorch, pageable"): lambda: dev.copy_(pageable, non_blocking=True),
        ("h2d", "PyTorch, pin_memory() then copy"):
            lambda: dev.copy_(pageable.pin_memory(), non_blocking=True),
        ("h2d", "PyTorch, pinned"): lambda: dev.copy_(pinned, non_blocking=True),
        ("h2d", "streamdag rt.copy, pageable"): timed_submit(f"h2d pageable {mib}",
                                                             lambda: rt.copy(dev, pageable)),
        ("h2d", "streamdag rt.copy, pinned"): timed_submit(f"h2d pinned {mib}", lambda: rt.copy(dev, pinned)),
        ("d2h", "PyTorch, pageable"): lambda: back_pageable.copy_(dev, non_blocking=True),
        ("d2h", "PyTorch, pinned"): lambda: back_pinned.copy_(dev, non_blocking=True),
        ("d2h", "streamdag rt.copy, pageable"): timed_submit(f"d2h pageable {mib}",
                                                             lambda: rt.copy(back_pageable, dev)),
        ("d2h", "streamdag rt.copy, pinned"): timed_submit(f"d2h pinned {mib}",
                                                           lambda: rt.copy(back_pinned, dev)),
    }, (pageable, pinned, dev, back_pageable, back_pinned)


def check(rt: sd.Runtime, tensors) -> None:
    """Every streamdag copy moves the bytes exactly."""
    pageable, pinned, dev, back_pageable, back_pinned = tensors
    rt.copy(dev, pageable).result()
    assert torch.equal(dev.cpu(), pageable), "pageable h2d"
    rt.copy(dev, pinned).result()
    assert torch.equal(dev.cpu(), pinned), "pinned h2d"
    rt.copy(back_pageable, dev).result()
    assert torch.equal(back_pageable, pinned), "pageable d2h"
    back_pinned.zero_()
    rt.copy(back_pinned, dev).result()
    assert torch.equal(back_pinned, pinned), "pinned d2h"


def pipeline_variants(rt: sd.Runtime) -> tuple[dict, dict]:
    """The copy/compute case of bench/overlap.py (8 chunks of 64 MiB, 6 x (bf16 matmul + tanh) each) from
    and into pageable memory: PyTorch on one stream and with a stream per stage (its copies from
    pageable memory hold the host until staged), streamdag's submits and ``stream_map``."""
    chunks, floats = PIPELINE_CHUNKS, 16 << 20
    host_in = [torch.randn(floats) for _ in range(chunks)]
    host_out = [torch.empty(floats) for _ in range(chunks)]
    dev_in = [torch.empty(floats, device="cuda") for _ in range(chunks)]
    dev_out = [torch.empty(floats, device="cuda") for _ in range(chunks)]
    w = (torch.randn(1024, 1024, device="cuda") / 32).bfloat16()

    def rows_fn(x):
        x = x.view(-1, 1024, 1024).bfloat16()
        for _ in range(6):
            x = torch.tanh(x @ w)
        return x.float().view(-1)

    def compute(src, dst):
        dst.copy_(rows_fn(src))

    sequential, hand_pipeline = chunked_pipelines(host_in, dev_in, dev_out, host_out, compute)

    def submits():
        for i in range(chunks):
            rt.copy(dev_in[i], host_in[i])
            rt.submit(compute, dev_in[i], dev_out[i], reads=[dev_in[i]], writes=[dev_out[i]])
            rt.copy(host_out[i], dev_out[i])
        rt.synchronize()

    matrices_in = [h.view(16, 1024, 1024) for h in host_in]
    matrices_out = [h.view(16, 1024, 1024) for h in host_out]

    def stream_mapped():  # its default pieces from pageable memory: 64 MiB, one chunk each
        for f in rt.stream_map(lambda x: rows_fn(x).view(x.shape), matrices_in, matrices_out):
            f.result()

    sequential()
    torch.cuda.synchronize()
    expected = [h.clone() for h in host_out]  # stream_map's pieces are whole chunks: the same results
    variants = {"PyTorch, one stream": sequential, "PyTorch, a stream per stage, hand-made": hand_pipeline,
                "streamdag rt.copy / submit / rt.copy": submits,
                "streamdag stream_map (its default pieces, 64 MiB)": stream_mapped}
    return variants, {"host_out": host_out, "expected": expected}


def main() -> None:
    rt = sd.Runtime("cuda")
    rows, results = [], {}
    submit_ms: dict[str, list[float]] = {}
    for mib in SIZES_MIB:
        variants, tensors = variants_for(rt, mib, submit_ms)
        check(rt, tensors)
        rounds = interleaved_rounds_ms({f"{k[0]}|{k[1]}": fn for k, fn in variants.items()}, ROUNDS)
        ms = {label: statistics.median(ts) for label, ts in rounds.items()}
        for direction in ("h2d", "d2h"):
            base = ms[f"{direction}|PyTorch, pageable"]
            for label, t in ms.items():
                kind, name = label.split("|")
                if kind != direction:
                    continue
                gbs = (mib << 20) / t / 1e6
                key = f"{direction} pageable {mib}" if "pageable" in name else f"{direction} pinned {mib}"
                host = statistics.median(submit_ms[key]) if name.startswith("streamdag") else None
                rows.append([f"{mib} MiB", direction, name, f"{t:.3f}", f"{gbs:.1f}", f"{base / t:.2f}x",
                             f"{host:.3f}" if host is not None else ""])
                results[f"{mib} MiB {direction} {name}"] = {
                    "ms": t, "gb_per_s": gbs, "vs_pytorch_pageable": base / t, "submit_host_ms": host,
                    "rounds_ms": rounds[label]}
        del variants, tensors
    print(format_table(["size", "direction", "variant", "ms (median)", "GB/s", "x PyTorch pageable",
                        "submit returns after (ms)"], rows))
    variants, data = pipeline_variants(rt)
    for label, fn in variants.items():  # each ends with every chunk's result in host_out, exactly
        for h in data["host_out"]:
            h.zero_()
        fn()
        torch.cuda.synchronize()
        assert all(torch.equal(h, e) for h, e in zip(data["host_out"], data["expected"])), label
    rounds = interleaved_rounds_ms(variants, PIPELINE_ROUNDS)
    pipeline_ms = {label: statistics.median(ts) for label, ts in rounds.items()}
    base = pipeline_ms["PyTorch, one stream"]
    headers = ["8 x 64 MiB pageable in, compute, pageable out", "ms (median)", "x PyTorch one stream"]
    print(format_table(headers, [[k, f"{t:.2f}", f"{base / t:.2f}x"] for k, t in pipeline_ms.items()]))
    rt.close()
    gpu = torch.cuda.get_device_name()
    print(write_json(Path(__file__).parent / "results", "transfers_" + gpu.replace(" ", "_"),
                     {"settings": {"sizes_mib": SIZES_MIB, "rounds": ROUNDS,
                                   "torch_threads": torch.get_num_threads()},
                      "results": results, "pageable_pipeline_ms": pipeline_ms,
                      "pageable_pipeline_rounds_ms": rounds}))


if __name__ == "__main__":
    main()
