"""The ``streamdag`` command.

- ``streamdag bench``: the built-in suite on the best device present (CUDA,
  else the CPU): prints the comparison tables, writes JSON, a Chrome/Perfetto
  trace and a PNG timeline; with two GPUs or more, the tensor-parallel chain too.
- ``streamdag doctor``: devices, peer access, copy bandwidth, versions, and
  what is missing; it exits 1 where a part asked for (``--native``, ``--cuda``)
  is missing.
- ``streamdag --version``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

from . import __version__
from ._progress import progress

__all__ = ["DEFAULT_OUT", "main"]

#: where ``streamdag bench`` writes its results unless ``--out`` says otherwise: a folder of its own
#: in the current directory (in a clone, ``bench/results/`` holds the committed results instead)
DEFAULT_OUT = "streamdag-results"


def _step(i: int, n: int, text: str) -> None:
    print(f"\n[{i}/{n}] {text}", flush=True)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _bench(args: argparse.Namespace) -> int:
    from .suite import sched_scale
    from .suite.report import environment, write_json

    env = environment()
    out = Path(args.out)
    cuda = _has_cuda() and not args.cpu
    print(f"streamdag {env['streamdag']} on {env['platform']}, {env['cpu_count']} cores; "
          f"{env.get('gpu') or 'no CUDA device: the CPU suite'}")
    if not cuda and importlib.util.find_spec("threadpoolctl") is None:
        print("streamdag bench: the CPU suite runs BLAS on one thread with threadpoolctl, which is not "
              "installed: pip install 'streamdag[bench]'", file=sys.stderr)
        return 1
    several = cuda and _gpu_count() >= 2
    steps = 4 if several else 3
    _step(1, steps, "scheduler: random DAG of 10,000 ops and ~50,000 edges")
    sched = sched_scale.run(repeats=1 if args.quick else 3)
    print(sched_scale.table(sched))
    write_json(out, "sched_scale", sched)
    if cuda:
        from .suite import gpu_wide

        cases = ["tiny", "small"] if args.quick else list(gpu_wide.CASES)
        _step(2, steps, f"wide graph on the GPU: {', '.join(cases)}")
        results = []
        for c in progress(cases, desc="wide graph", unit="case"):
            results.append(gpu_wide.run_case(c, False, 8))
        print(gpu_wide.table(results))
        write_json(out, "wide", {"cases": results})
        _step(3, steps, "timeline of the tiny wide graph, op by op")
        timeline = gpu_wide.profile_case("tiny")
        title = "wide graph (tiny), op by op on the GPU"
    else:
        from .suite import cpu_wide

        _step(2, steps, "cpu_wide: 8 branches x 4 layers of numpy matmul+relu, 2 lanes vs serial")
        wide = cpu_wide.run(repeats=5 if args.quick else 15)
        print(cpu_wide.table(wide))
        if not wide["bit_identical"]:
            print("ERROR: concurrent results differ from the serial run", file=sys.stderr)
            return 1
        write_json(out, "cpu_wide", wide)
        _step(3, steps, "timeline of one cpu_wide run")
        timeline = cpu_wide.profile()
        title = "cpu_wide, 2 lanes"
    print(timeline.summary())
    if several:
        from .suite import tp

        _step(4, steps, "tensor-parallel chain over 1, 2, 4, 8 GPUs (those visible) against one GPU")
        chain = tp.run(quick=args.quick, on_case=lambda case: print(tp.table_of_case(case), flush=True))
        print(tp.table(chain))
        write_json(out, "tp", chain)
    try:
        png = timeline.save_png(out / "timeline.png", title).name
    except ImportError as exc:  # the plot extra is not installed: the results stand, say how to get it
        png = f"no timeline.png ({exc})"
    print(f"\nwrote {out}/: JSON, {timeline.save_trace(out / 'trace.json').name} "
          f"(open in ui.perfetto.dev), {png}")
    return 0


def _version(name: str) -> str:
    try:
        return getattr(importlib.import_module(name), "__version__", "installed")
    except ImportError:
        return "missing"


def _doctor(args: argparse.Namespace) -> int:
    """Prints what is here; 1 where a part that was asked for (``--native`` or ``STREAMDAG_NATIVE=1``,
    ``--cuda``) is missing, so that an image build or a CI step can check for it."""
    import platform

    import streamdag

    print(f"streamdag {streamdag.__version__}, Python {platform.python_version()} on {platform.platform()}")
    for name in ("numpy", "torch", "matplotlib", "threadpoolctl"):
        print(f"  {name:<11} {_version(name)}")
    from . import native

    print(f"hot path: {native.status()}")
    chosen = native.choices()
    if chosen:
        print("  compiled: " + (", ".join(n for n, c in chosen.items() if c) or "none")
              + ("; Python: " + ", ".join(n for n, c in chosen.items() if not c)
                 if not all(chosen.values()) else ""))
    missing = []  # what streamdag runs without, slower or with less
    required = []  # what was asked for and is not here
    choice = os.environ.get("STREAMDAG_NATIVE")
    if native.load() is None and (args.native or choice != "0"):
        fix = ("the compiled hot path: unset STREAMDAG_NATIVE=0" if choice == "0"
               else f"the compiled hot path: {native._HOW_TO_BUILD}")
        (required if args.native or choice == "1" else missing).append(fix)
    if _version("torch") == "missing":
        missing.append("torch (pip install 'streamdag[torch]') for CUDA and streamdag.compile")
    if _version("matplotlib") == "missing":
        missing.append("matplotlib (pip install 'streamdag[plot]') for PNG timelines")
    if _version("threadpoolctl") == "missing":
        missing.append("threadpoolctl (pip install 'streamdag[bench]') for streamdag bench on the CPU")
    if not _has_cuda():
        (required if args.cuda else missing).append("a CUDA GPU (and a CUDA build of torch): streamdag runs "
                                                    "on CPU lanes only")
    else:
        _print_cuda()
        if native.load_torch() is None:
            (required if args.cuda else missing).append(
                f"the torch extension ({native.torch_status()}): {native._HOW_TO_BUILD_TORCH}")
    print("missing: " + ("; ".join(required + missing) if required or missing else "nothing"))
    if required:
        print("streamdag doctor: missing what was asked for: " + "; ".join(required), file=sys.stderr)
        return 1
    return 0


def _print_cuda() -> None:
    """The CUDA devices, their peer access and host-to-device copy bandwidth."""
    import torch

    from . import native

    n = torch.cuda.device_count()
    print(f"CUDA calls: {native.torch_status()}")
    print(f"CUDA {torch.version.cuda}, {n} device(s):")
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
              f"compute capability {p.major}.{p.minor}")
    if n > 1:
        print("peer access (row can read column):")
        for i in range(n):
            row = " ".join("-" if i == j else ("yes" if torch.cuda.can_device_access_peer(i, j)
                                               else "no") for j in range(n))
            print(f"  cuda:{i}  {row}")
    nbytes = 256 << 20
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for label, host in (("pinned", torch.empty(nbytes, dtype=torch.uint8).pin_memory()),
                        ("pageable", torch.empty(nbytes, dtype=torch.uint8))):
        dev.copy_(host)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        print(f"  host->device {label}: {3 * nbytes / (time.perf_counter() - t0) / 1e9:.1f} GB/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamdag", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"streamdag {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="show streamdag's log on stderr: -v its decisions (INFO: streams, CUDA graphs, "
                             "batching, compile candidates, fall-backs), -vv the details (DEBUG)")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run the built-in benchmark suite and print the tables")
    bench.add_argument("--out", default=DEFAULT_OUT,
                       help="folder for the JSON results, trace.json and timeline.png "
                            f"(default: {DEFAULT_OUT}, in the current directory)")
    bench.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    bench.add_argument("--cpu", action="store_true", help="the CPU suite even when a GPU is present")
    bench.set_defaults(func=_bench)
    doctor = sub.add_parser("doctor", help="devices, peer access, copy bandwidth, versions; exits 1 where "
                                           "a part asked for is missing")
    doctor.add_argument("--native", action="store_true",
                        help="require the compiled hot path (as STREAMDAG_NATIVE=1 does)")
    doctor.add_argument("--cuda", action="store_true",
                        help="require a CUDA GPU and the torch extension that makes its calls in C++")
    doctor.set_defaults(func=_doctor)
    args = parser.parse_args(argv)
    if args.verbose:
        _show_log(logging.DEBUG if args.verbose > 1 else logging.INFO)
    return args.func(args)


def _show_log(level: int) -> None:
    """Send the ``streamdag`` logger's records at ``level`` and above to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    log = logging.getLogger("streamdag")
    log.setLevel(level)
    log.addHandler(handler)


if __name__ == "__main__":
    raise SystemExit(main())
