"""Soak: many small random programs run on streamdag runtimes, each checked against its serial run.

Each program (``bench/soak_programs.py``) mixes eager submits over overlapping views, ops that
raise, recorded graphs run several times, ops and done-callbacks that submit and wait, several
submitting threads and ``close()`` racing them, on the CPU lanes, the simulated device and a
backend that runs ops inside their submit (as CUDA does), with 1-4 lanes and small in-flight
bounds. Every future's value or error (its own, or ``DependencyFailed`` naming a root), every
graph run's, every ``synchronize()``'s group and every buffer must equal the serial run's.

Programs run in worker processes, a chunk of them on one runtime. A program whose waits run
past ``--hang-seconds`` is a hang: its worker dumps every thread's stack (faulthandler), reports
it and exits, and a fresh worker goes on with the next program; a worker stuck where it cannot
look (a submit blocked for good) is dumped and killed by this process. A category that hangs
``--max-hangs`` times is skipped from then on (counted), so that one bug does not eat the soak.

Run: python bench/soak.py --minutes 10 [--seed S] [--native 0/1] [--categories a,b]
     python bench/soak.py --programs 2000
     python bench/soak.py --replay INDEX --seed S    (one program, in this process, shown)
     python bench/soak.py --plant drop_waits         (the negative control: must find mismatches)
Writes bench/results/soak_cpu.json (soak_cpu_python.json with --native 0; with --plant, the
defect's name is added).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import platform
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# this checkout's streamdag and test helpers, whatever an installed copy points at
for extra in (ROOT / "tests", ROOT / "src"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

DEFECTS = {
    "drop_waits": "every cross-stream wait dropped: a dependent may run before its producer on another lane",
    "skip_indirect": "a failure passes to direct dependents only, not to the ops that depend on those",
    "lose_finish": "one op in 300 is never finished: its future never completes (the soak must count hangs)",
}


def plant(defect: str) -> None:
    """Break the runtime on purpose (the soak's negative control): it must then find mismatches."""
    from streamdag.errors import DependencyFailed
    from streamdag.runtime import ops, submitting

    if defect == "drop_waits":
        submitting._DROP_WAITS = True  # (read per launch, and by the compiled submit at its start)
    elif defect == "skip_indirect":
        direct_only = ops.failed_input

        def failed_input(accesses: Any, deps: Any) -> Any:
            return direct_only(accesses, [d for d in deps if not isinstance(d.error, DependencyFailed)])

        ops.failed_input = failed_input
    elif defect == "lose_finish":
        from streamdag.backends.cpu import CpuBackend
        from streamdag.backends.inline import InlineBackend
        from streamdag.backends.sim import SimBackend

        finished = iter(range(1 << 62))
        for backend in (CpuBackend, InlineBackend, SimBackend):
            def when_done(self: Any, stream: Any, event: Any, callback: Any,
                          keep: Any = backend.when_done) -> Any:
                if next(finished) % 300 != 299:
                    return keep(self, stream, event, callback)
                return None

            backend.when_done = when_done
    else:
        raise SystemExit(f"--plant takes one of {sorted(DEFECTS)}, got {defect!r}")


# ------------------------------------------------------------------------------------ worker
class Worker:
    """Runs programs in this process, one at a time, on a thread of their own, with a deadline."""

    def __init__(self, seed: int, categories: list[str], hang_seconds: float) -> None:
        self.seed, self.categories, self.hang_seconds = seed, categories, hang_seconds
        self.rt: Any = None
        self.rt_chunk: int | None = None
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="soak-program").start()

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                self.results.put(("ok", job()))
            except BaseException as exc:  # a Hang, or anything a program raised: reported
                self.results.put(("raised", exc))

    def call(self, job: Any) -> tuple[str, Any]:
        """``job()`` on the program thread; ``("stuck", None)`` past the deadline."""
        self.jobs.put(job)
        try:
            return self.results.get(timeout=self.hang_seconds)
        except queue.Empty:
            return "stuck", None

    def one(self, index: int, disabled: set[str]) -> dict[str, Any]:
        from soak_programs import CHUNK, Hang, generate, run_program

        program = generate(self.seed, index, self.categories)
        record: dict[str, Any] = {"index": index, "category": program.category,
                                  "config": program.config.__dict__, "ops": program.ops()}
        if program.category in disabled:
            record["skipped"] = True
            return record
        chunk = index // CHUNK

        def job() -> dict[str, Any]:
            if program.own_runtime:
                rt = program.config.make()
                try:
                    return run_program(program, rt, time.monotonic() + self.hang_seconds * 0.8)
                finally:
                    rt.close()
            if self.rt is None or self.rt_chunk != chunk:
                self._close_runtime()
                self.rt, self.rt_chunk = program.config.make(), chunk
            out = run_program(program, self.rt, time.monotonic() + self.hang_seconds * 0.8)
            if out["problems"] or index % CHUNK == CHUNK - 1:  # a fresh runtime after a mismatch
                self._close_runtime()
            return out

        started = time.perf_counter()
        status, value = self.call(job)
        record["seconds"] = round(time.perf_counter() - started, 4)
        if status == "ok":
            record.update(value)
        elif status == "raised" and isinstance(value, Hang):
            record.update(hang=str(value), stacks=stacks())
        elif status == "raised":
            record["problems"] = [f"the program raised {type(value).__name__}: {value}"]
            self.rt = None  # (left as it is: closing it might hang)
        else:
            record.update(hang="the program's thread did not return", stacks=stacks())
        return record

    def _close_runtime(self) -> None:
        rt, self.rt, self.rt_chunk = self.rt, None, None
        if rt is not None:
            rt.close()


def stacks() -> str:
    """Every thread's stack, as faulthandler writes it."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        return f.read()


def worker_main(args: argparse.Namespace) -> None:
    """Serve the parent: ``RUN start count disabled`` lines in, one JSON line per program out."""
    import logging

    from streamdag.native import status

    logging.getLogger("streamdag").setLevel(logging.CRITICAL)  # injected BaseExceptions are logged
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's dump of a stuck worker
    if args.plant:
        plant(args.plant)
    worker = Worker(args.seed, args.categories.split(","), args.hang_seconds)
    out = sys.stdout
    out.write(json.dumps({"native": status(where=False)}) + "\n")
    out.flush()
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "RUN":
            return
        start, count = int(words[1]), int(words[2])
        disabled = set(words[3].split(",")) if len(words) > 3 else set()
        for index in range(start, start + count):
            out.write(f"S {index}\n")
            out.flush()
            record = worker.one(index, disabled)
            out.write("R " + json.dumps(record) + "\n")
            out.flush()
            if "hang" in record:  # its runtime, threads and locks are stuck: a fresh process goes on
                os._exit(3)
        out.write("D\n")
        out.flush()


# ------------------------------------------------------------------------------------ parent
class Child:
    """A worker process and the batch it runs."""

    def __init__(self, args: argparse.Namespace, log_dir: Path, number: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
        if args.native is not None:
            env["STREAMDAG_NATIVE"] = str(args.native)
        cmd = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--worker",
               "--seed", str(args.seed), "--categories", args.categories,
               "--hang-seconds", str(args.hang_seconds)]
        if args.plant:
            cmd += ["--plant", args.plant]
        self.log = log_dir / f"worker{number}.log"
        self.log_file = open(self.log, "w")  # noqa: SIM115 - open while the process lives
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file,
                                     text=True, bufsize=1, env=env, cwd=ROOT)
        self.fd = self.proc.stdout.fileno()  # read raw: a buffered reader would hide lines from select()
        self.pending = b""
        self.native = "?"
        self.batch: list[int] = []  # indices sent and not reported yet
        self.current: int | None = None
        self.since = time.monotonic()

    def lines(self) -> list[str] | None:
        """The whole lines the worker has written since the last call; None once it has exited."""
        data = os.read(self.fd, 1 << 16)
        if not data:
            return None
        *done, self.pending = (self.pending + data).split(b"\n")
        return [line.decode() for line in done]

    def send(self, start: int, count: int, disabled: set[str]) -> None:
        self.batch = list(range(start, start + count))
        self.proc.stdin.write(f"RUN {start} {count} {','.join(sorted(disabled))}\n")
        self.proc.stdin.flush()
        self.since = time.monotonic()

    def kill(self) -> str:
        """Dump the worker's stacks, kill it, and return the end of its log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            self.proc.kill()
        self.proc.wait()
        self.log_file.close()
        return self.log.read_text()[-20000:]


class Tally:
    """What the soak found, by category."""

    def __init__(self) -> None:
        self.by: dict[str, Counter[str]] = defaultdict(Counter)
        self.inner: dict[str, Counter[str]] = defaultdict(Counter)
        self.mismatches: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.hangs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.done = 0

    def add(self, r: dict[str, Any]) -> None:
        c = self.by[r["category"]]
        self.done += 1
        if r.get("skipped"):
            c["skipped"] += 1
            return
        c["programs"] += 1
        c["ops"] += r["ops"]
        c["failures_injected"] += r.get("injected", 0)
        c["refused_waits"] += r.get("refused_waits", 0)
        c["refused_submits"] += r.get("refused_submits", 0)
        for x in r.get("inner", ()):
            self.inner[r["category"]][_first_words(x)] += 1
        if "hang" in r:
            c["hangs"] += 1
            if len(self.hangs[r["category"]]) < 3:
                self.hangs[r["category"]].append({k: r[k] for k in ("index", "config", "hang", "stacks")})
        elif r.get("problems"):
            c["mismatches"] += 1
            if len(self.mismatches[r["category"]]) < 5:
                self.mismatches[r["category"]].append(
                    {"index": r["index"], "config": r["config"], "problems": r["problems"][:8]})


def _first_words(text: str) -> str:
    return text.split(":")[0][:80]


def soak(args: argparse.Namespace) -> dict[str, Any]:
    from soak_programs import CHUNK

    started = time.monotonic()
    deadline = started + args.minutes * 60 if args.minutes else None
    total = args.programs if not args.minutes else None
    tally = Tally()
    disabled: set[str] = set()
    hangs: Counter[str] = Counter()
    log_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    requeue: list[int] = []
    next_chunk = 0
    children: list[Child] = []
    natives: set[str] = set()
    selector = selectors.DefaultSelector()
    made = 0

    def start_child() -> Child:
        nonlocal made
        made += 1
        child = Child(args, log_dir, made)
        selector.register(child.proc.stdout, selectors.EVENT_READ, child)
        children.append(child)
        return child

    def more_work() -> bool:
        if requeue:
            return True
        if deadline is not None:
            return time.monotonic() < deadline
        return next_chunk * CHUNK < total

    def give(child: Child) -> bool:
        nonlocal next_chunk
        if requeue:
            start = requeue.pop(0)
            end = ((start // CHUNK) + 1) * CHUNK  # up to the chunk's end
            count = end - start if total is None else min(end, total) - start
        elif more_work():
            start = next_chunk * CHUNK
            count = CHUNK if total is None else min(CHUNK, total - start)
            next_chunk += 1
        else:
            return False
        child.send(start, count, disabled)
        return True

    def retire(child: Child, why: str | None) -> None:
        """A worker ended (a hang it reported, or killed here): the rest of its batch goes again."""
        selector.unregister(child.proc.stdout)
        children.remove(child)
        log = child.kill()
        rest = [i for i in child.batch if i != child.current]
        if why is not None and child.current is not None:  # stuck where it could not report itself
            from soak_programs import generate

            program = generate(args.seed, child.current, args.categories.split(","))
            tally.add({"index": child.current, "category": program.category,
                       "config": program.config.__dict__, "ops": program.ops(), "hang": why,
                       "stacks": log[-12000:]})
            hangs[program.category] += 1
            if hangs[program.category] >= args.max_hangs:
                disabled.add(program.category)
        if rest:
            requeue.insert(0, rest[0])

    def handle(child: Child, line: str) -> bool:
        """One line from a worker; False once the worker is done with."""
        child.since = time.monotonic()
        if line.startswith("{"):
            child.native = json.loads(line).get("native", "?")
            natives.add(child.native)
        elif line.startswith("S "):
            child.current = int(line.split()[1])
        elif line.startswith("R "):
            record = json.loads(line[2:])
            tally.add(record)
            child.batch.remove(record["index"])
            child.current = None
            if "hang" in record:
                hangs[record["category"]] += 1
                if hangs[record["category"]] >= args.max_hangs:
                    disabled.add(record["category"])
        elif line.startswith("D") and not give(child):
            child.proc.stdin.write("QUIT\n")
            child.proc.stdin.flush()
            selector.unregister(child.proc.stdout)
            children.remove(child)
            child.proc.wait()
            return False
        return True

    for _ in range(args.workers):
        give(start_child())
    last_print = time.monotonic()
    while children:
        for key, _ in selector.select(timeout=0.5):
            child = key.data
            if child not in children:
                continue
            lines = child.lines()
            if lines is None:  # it exited: after reporting a hang, or it crashed
                retire(child, None if child.current is None else "the worker died (see its stacks)")
                if more_work():
                    give(start_child())
                continue
            for line in lines:
                if not handle(child, line):
                    break
        now = time.monotonic()
        for child in list(children):
            if child.current is not None and now - child.since > args.hang_seconds + 10:
                retire(child, f"no report for {now - child.since:.0f} s: stuck where it cannot time out")
                if more_work():
                    give(start_child())
        if now - last_print > 15:
            last_print = now
            bad = sum(c["mismatches"] + c["hangs"] for c in tally.by.values())
            print(f"  {now - started:6.0f} s: {tally.done} programs, {bad} mismatches or hangs", flush=True)
    shutil.rmtree(log_dir, ignore_errors=True)  # (the stacks of each hang are in the report)
    return report(args, tally, time.monotonic() - started, natives, disabled)


def report(args: argparse.Namespace, tally: Tally, seconds: float, natives: set[str],
           disabled: set[str]) -> dict[str, Any]:
    keys = ["programs", "ops", "failures_injected", "mismatches", "hangs", "skipped", "refused_waits",
            "refused_submits"]
    by = {cat: {k: tally.by[cat][k] for k in keys} for cat in sorted(tally.by)}
    totals = {k: sum(c[k] for c in by.values()) for k in keys}
    return {
        "benchmark": "soak",
        **totals,
        "seconds": round(seconds, 1),
        "programs_per_second": round(totals["programs"] / seconds, 1) if seconds else 0,
        "by_category": by,
        "categories_with_findings": sorted(c for c, v in by.items() if v["mismatches"] or v["hangs"]),
        "skipped_after_hangs": sorted(disabled),
        "inside_ops": {c: dict(v) for c, v in sorted(tally.inner.items())},
        "mismatch_examples": dict(tally.mismatches),
        "hang_examples": dict(tally.hangs),
        "settings": {"seed": args.seed, "minutes": args.minutes, "programs": args.programs,
                     "categories": args.categories.split(","), "workers": args.workers,
                     "hang_seconds": args.hang_seconds, "max_hangs": args.max_hangs,
                     "plant": args.plant, "native": args.native},
        "native": sorted(natives),
        "versions": versions(),
    }


def versions() -> dict[str, str]:
    from importlib import metadata

    import numpy

    import streamdag

    out = {"python": platform.python_version(), "numpy": numpy.__version__,
           "streamdag": streamdag.__version__, "platform": platform.platform(),
           "processor": platform.processor() or platform.machine(), "cpus": str(os.cpu_count())}
    with contextlib.suppress(metadata.PackageNotFoundError):
        out["torch"] = metadata.version("torch")
    with contextlib.suppress(OSError):
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True, timeout=10).stdout.strip()
    return out


def print_table(result: dict[str, Any]) -> None:
    cols = ["programs", "ops", "failures_injected", "mismatches", "hangs", "skipped", "refused_waits"]
    heads = ["category", "programs", "ops", "injected", "mismatches", "hangs", "skipped", "refused waits"]
    rows = [[cat, *(str(v[c]) for c in cols)] for cat, v in result["by_category"].items()]
    rows.append(["total", *(str(result[c]) for c in cols)])
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]
    for r in [heads, *rows]:
        print("  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths))))
    print(f"{result['programs']} programs in {result['seconds']} s ({result['programs_per_second']}/s); "
          f"native: {', '.join(result['native'])}")
    for cat, examples in result["mismatch_examples"].items():
        ex = examples[0]
        print(f"- {cat}: mismatch in program {ex['index']} ({ex['config']}): {ex['problems'][0][:300]}")
    for cat, examples in result["hang_examples"].items():
        print(f"- {cat}: hang in program {examples[0]['index']}: {examples[0]['hang']}")


def replay(args: argparse.Namespace) -> int:
    """Run one program in this process on a fresh runtime, and show it and what differs."""
    import logging

    from soak_programs import describe, generate

    logging.getLogger("streamdag").setLevel(logging.CRITICAL)
    if args.plant:
        plant(args.plant)
    program = generate(args.seed, args.replay, args.categories.split(","))
    print(describe(program))
    return show_run(program, args.hang_seconds)


def show_run(program: Any, hang_seconds: float) -> int:
    """Run ``program`` on a fresh runtime and print what differs, or every thread's stack if it hangs."""
    from pprint import pprint

    from soak_programs import Hang, run_program

    faulthandler.dump_traceback_later(hang_seconds + 5, exit=True)  # stacks, should it hang for good
    rt = program.config.make()
    try:
        out = run_program(program, rt, time.monotonic() + hang_seconds)
    except Hang as hang:
        print(f"HANG: {hang}\n{stacks()}")
        return 2
    finally:
        faulthandler.cancel_dump_traceback_later()
    rt.close()
    pprint(out, width=120)
    return 1 if out["problems"] else 0


def shrink_one(args: argparse.Namespace) -> int:
    import logging

    from soak_programs import describe, generate, shrink

    logging.getLogger("streamdag").setLevel(logging.CRITICAL)
    if args.plant:
        plant(args.plant)
    program = generate(args.seed, args.shrink, args.categories.split(","))
    small, how = shrink(program, args.hang_seconds)
    print(f"{how}:\n{describe(small)}")
    if how == "ok":
        return 0
    show_run(small, args.hang_seconds)
    return 1


def main() -> int:
    from soak_programs import CATEGORIES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=None, help="run for this long (else --programs)")
    p.add_argument("--programs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--native", type=int, choices=[0, 1], default=None,
                   help="STREAMDAG_NATIVE for the workers (default: as in the environment)")
    p.add_argument("--categories", default=",".join(CATEGORIES))
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--hang-seconds", type=float, default=10.0)
    p.add_argument("--max-hangs", type=int, default=5, help="hangs after which a category is skipped")
    p.add_argument("--plant", choices=sorted(DEFECTS), default=None, help="a defect the soak must find")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--replay", type=int, default=None, help="run program INDEX here and show it")
    p.add_argument("--shrink", type=int, default=None,
                   help="find a smaller program that fails as program INDEX does, and show it")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = set(args.categories.split(",")) - set(CATEGORIES)
    if unknown:
        p.error(f"unknown categories {sorted(unknown)}; the categories are {', '.join(CATEGORIES)}")
    if args.worker:
        worker_main(args)
        return 0
    if args.replay is not None:
        return replay(args)
    if args.shrink is not None:
        return shrink_one(args)
    result = soak(args)
    print_table(result)
    name = "soak_cpu" + ("_python" if args.native == 0 else "")
    name += f"_plant_{args.plant}.json" if args.plant else ".json"
    path = args.json or HERE / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
