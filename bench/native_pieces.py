"""What each compiled piece buys: host time per op with that piece alone in Python, side by side.

Each configuration is its own process (a piece is chosen at import: ``native.twin``), kept in
Python with ``STREAMDAG_PYTHON_TWINS`` (the rest compiled), or all of it with
``STREAMDAG_NATIVE=0``; with ``--against PATH`` a second checkout's ``src`` (built in place) runs
compiled beside this one, for a before and after. The processes take turns, one short round of
every workload each, in alternating order, so that a busy machine's drift falls on all alike;
each cell is the median over rounds of the time per op, and the median of the per-round ratio to
the first configuration (this checkout, all compiled) in the same round.

Workloads, on the CPU (no device): ``inline chain``, a chain of do-nothing ops over 64 tensors
with a backend that runs each op at once (the runtime's bookkeeping alone: submit, tracker,
clocks, finish); ``inline submit+result``, the same with ``result()`` on each future; ``lane
chain``, the chain on one host lane (a lane thread finishes each op); ``lanes submit+result``,
two lanes, each op waited for (a wake-up across threads: noisy); ``recorded g.run() per op``, a
recorded chain of 1,000 ops run whole, by the backend that runs each op at once. Where CUDA is,
also ``cuda chain`` (``bench/overhead.py``'s dependent chain of ``torch.add`` on 8 streams) and
``rt.copy pinned 1 KiB``, with the pieces only a GPU runtime runs each in Python too: the
completion pass, the byte budget's counts, and the torch extension (its CUDA calls then go
through PyTorch's bindings).

Run: python bench/native_pieces.py [--rounds 40] [--ops 2000] [--against /path/to/other/checkout]
(writes bench/results/native_pieces_<device>[_pair].json; _pair: --no-pieces)
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
#: (label, environment): each piece, or group that must go together, kept in Python alone
PIECES = [
    ("all compiled", {}),
    ("Lock in Python", {"STREAMDAG_PYTHON_TWINS": "Lock"}),
    ("RLock in Python", {"STREAMDAG_PYTHON_TWINS": "RLock"}),
    ("submit and finish in Python (setup_submit)", {"STREAMDAG_PYTHON_TWINS": "setup_submit"}),
    ("submit and its records in Python",
     {"STREAMDAG_PYTHON_TWINS": "setup_submit,Counters,Parts,OpFields,FutureFields"}),
    ("tracker, clocks, byte ranges in Python", {"STREAMDAG_PYTHON_TWINS": "TrackerFields"}),
    ("all Python (STREAMDAG_NATIVE=0)", {"STREAMDAG_NATIVE": "0"}),
]
#: the pieces only a GPU runtime runs
CUDA_PIECES = [
    ("completion pass in Python", {"STREAMDAG_PYTHON_TWINS": "completions_pass,completions_finish_one"}),
    ("byte budget counts in Python", {"STREAMDAG_PYTHON_TWINS": "BudgetCounts"}),
    ("CUDA calls through PyTorch's bindings", {"STREAMDAG_PYTHON_TWINS": "use_torch"}),
]


def worker(ops: int) -> None:
    """One configuration: on each ``run`` line from stdin, one round of every workload, as JSON."""
    import torch

    import streamdag as sd
    from streamdag import native
    from streamdag.backends.inline import InlineBackend

    def nothing(*args, **kwargs):
        return None

    bufs = [torch.zeros(256) for _ in range(64)]

    def chain_on(rt):
        def chain(n):
            for i in range(n):
                a, b = bufs[i % 64], bufs[(i + 1) % 64]
                rt.submit(nothing, a, 1, out=b, reads=[a], writes=[b])
            rt.synchronize()
        return chain

    def result_each_on(rt):
        def each(n):
            for i in range(n):
                a, b = bufs[i % 64], bufs[(i + 1) % 64]
                rt.submit(nothing, a, reads=[a], writes=[b]).result()
        return each

    inline = sd.Runtime(backend=InlineBackend("cpu", 8), max_inflight=1 << 20)
    one_lane = sd.Runtime("cpu", streams=1, max_inflight=1 << 20)
    two_lanes = sd.Runtime("cpu", streams=2, max_inflight=1 << 20)
    graph_rt = sd.Runtime(backend=InlineBackend("cpu", 8), max_inflight=1 << 20)
    with graph_rt.record() as g:
        for i in range(1000):
            a, b = bufs[i % 64], bufs[(i + 1) % 64]
            graph_rt.submit(nothing, a, reads=[a], writes=[b])

    def graph_runs(n):
        for _ in range(max(1, n // 1000)):
            g.run().result()

    runtimes = [inline, one_lane, two_lanes, graph_rt]

    workloads = {  # (function, ops per round)
        "inline chain": (chain_on(inline), ops),
        "inline submit+result": (result_each_on(inline), ops // 4),
        "lane chain": (chain_on(one_lane), ops),
        "lanes submit+result": (result_each_on(two_lanes), ops // 4),
        "recorded g.run() per op": (graph_runs, max(1000, ops // 1000 * 1000)),
    }
    if torch.cuda.is_available():
        cuda_rt = sd.Runtime("cuda", streams=8, max_inflight=1 << 20)
        runtimes.append(cuda_rt)
        gpu = [torch.zeros(256, device="cuda") for _ in range(64)]
        pinned = [torch.randn(256).pin_memory() for _ in range(64)]

        def cuda_chain(n):
            for i in range(n):
                a, b = gpu[i % 64], gpu[(i + 1) % 64]
                cuda_rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])
            cuda_rt.synchronize()

        def copies(n):
            for i in range(n):
                cuda_rt.copy(gpu[i % 64], pinned[i % 64])
            cuda_rt.synchronize()

        workloads.update({"cuda chain": (cuda_chain, ops), "rt.copy pinned 1 KiB": (copies, ops)})
    for run, n in workloads.values():  # warm up
        run(n)
    print(json.dumps(_hot_path_report(native)), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        times = {}
        for label, (run, n) in workloads.items():
            t0 = time.perf_counter()
            run(n)
            times[label] = (time.perf_counter() - t0) / n * 1e6
        print(json.dumps(times), flush=True)
    for rt in runtimes:
        rt.close()


def _hot_path_report(native) -> dict:
    """What runs compiled, as this checkout's ``native`` says it; an older checkout (``--against``)
    may lack ``choices`` and ``status``'s keyword, and reports what it has."""
    try:
        status = native.status(where=False)
    except TypeError:
        status = native.status()
    choices = getattr(native, "choices", dict)()
    return {"hot_path": status, "python": sorted(name for name, compiled in choices.items() if not compiled)}


def _recorded(env: dict[str, str], commit: str | None) -> dict[str, str]:
    """A configuration's settings as the results keep them: a second checkout by its commit."""
    kept = {k: v for k, v in env.items() if k != "_SRC"}
    return {**kept, "checkout": commit or "unknown"} if "_SRC" in env else kept


def start(src: Path, env: dict[str, str], ops: int) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if k not in ("STREAMDAG_PYTHON_TWINS", "STREAMDAG_NATIVE")}
    full.update(PYTHONPATH=str(src), OMP_NUM_THREADS="1", **env)
    return subprocess.Popen([sys.executable, __file__, "--worker", "--ops", str(ops)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=full, cwd=Path(__file__).parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--ops", type=int, default=2000, help="ops per round of a chain")
    parser.add_argument("--against", type=Path, help="another checkout, timed all compiled beside this one")
    parser.add_argument("--against-label", default="", help="its row's name (default: its folder's)")
    parser.add_argument("--label", default="all compiled", help="this checkout's row's name")
    parser.add_argument("--pieces", action=argparse.BooleanOptionalAction, default=True,
                        help="time each piece in Python (--no-pieces: all compiled, and --against, only)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.ops)
        return
    import torch

    configs = (PIECES + (CUDA_PIECES if torch.cuda.is_available() else [])) if args.pieces else PIECES[:1]
    configs = [(args.label, {}), *configs[1:]]
    commit = None
    if args.against is not None:
        args.against = args.against.resolve()  # (the workers start in bench/)
        label = args.against_label or f"{args.against.name}, all compiled"
        configs = [configs[0], (label, {"_SRC": str(args.against / "src")}), *configs[1:]]
        commit = subprocess.run(["git", "-C", str(args.against), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
    procs = {}
    for label, env in configs:
        env = dict(env)
        procs[label] = start(Path(env.pop("_SRC", SRC)), env, args.ops)
    info = {}
    for label, proc in procs.items():
        info[label] = json.loads(proc.stdout.readline())
        print(f"{label}: {info[label]['hot_path']}; in Python: {', '.join(info[label]['python']) or '-'}",
              file=sys.stderr)
    rounds: dict[str, dict[str, list[float]]] = {label: {} for label in procs}
    order = list(procs)
    for _ in range(args.rounds):
        order.reverse()
        for label in order:
            procs[label].stdin.write("run\n")
            procs[label].stdin.flush()
            for work, us in json.loads(procs[label].stdout.readline()).items():
                rounds[label].setdefault(work, []).append(us)
    for proc in procs.values():
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        proc.wait()
    base = configs[0][0]
    medians = {label: {w: statistics.median(ts) for w, ts in by.items()} for label, by in rounds.items()}
    ratios = {label: {w: statistics.median(t / b for t, b in zip(ts, rounds[base][w]))
                      for w, ts in by.items()} for label, by in rounds.items()}
    works = list(rounds[base])
    width = max(map(len, procs))
    print(f"{'µs per op (x the first, paired)':{width}s}" + "".join(f" | {w:>23s}" for w in works))
    for label in procs:
        print(f"{label:{width}s}" + "".join(f" | {medians[label][w]:8.2f} ({ratios[label][w]:5.2f}x)   "
                                            for w in works))
    sys.path.insert(0, str(SRC))
    from streamdag.suite.report import write_json

    device = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
    stem = f"native_pieces_{device}" + ("" if args.pieces else "_pair")
    print(write_json(Path(__file__).parent / "results", stem,
                     {"settings": {"rounds": args.rounds, "ops_per_round": args.ops,
                                   "machine": platform.processor() or platform.machine(),
                                   "configs": {label: {**_recorded(env, commit if "_SRC" in env else None),
                                                       **info[label]} for label, env in configs}},
                      "us": medians, "x_first": ratios, "rounds_us": rounds}))


if __name__ == "__main__":
    main()
