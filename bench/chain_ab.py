"""A/B of two source trees: host cost per op that each adds over PyTorch's launch, in turns.

Each turn runs one process per tree (in alternating order): a chain of submits (each op reads
one tensor and writes the next) and independent ops, 40 rounds of 1000 each, every round paired
with PyTorch's own launch loop in the same process. A process per tree, so that each builds and
loads its own compiled code; turns, so that the lent host's drift falls on both. Prints each
process's medians and the median over turns.

Its resolution is coarse: on the lent hosts two processes of the same code differ by up to ±2 µs
per op even pinned (``taskset``), so a change worth less than that needs a toggle inside one
process, timed in alternating rounds against the old path, as ``overhead.py`` times its variants.

Run on a GPU machine: python bench/chain_ab.py OLD_SRC NEW_SRC [TURNS]
(e.g. a copy of an earlier commit's ``src`` against ``src``).
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, statistics, time, torch, streamdag as sd
bufs = [torch.zeros(256, device="cuda") for _ in range(64)]
rt = sd.Runtime("cuda", streams=8, max_inflight=100000)
def chain(n):
    for i in range(n):
        a, b = bufs[i % 64], bufs[(i + 1) % 64]
        rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])
def independent(n):
    for i in range(n):
        b = bufs[i % 64]
        rt.submit(b.add_, 1, writes=[b])
def torch_loop(n):
    for i in range(n):
        torch.add(bufs[i % 64], 1, out=bufs[(i + 1) % 64])
chain(3000); independent(2000); rt.synchronize(); torch_loop(2000); torch.cuda.synchronize()
out = {"chain": [], "independent": []}
for _ in range(40):
    for name, fn in (("chain", chain), ("independent", independent)):
        t0 = time.perf_counter(); fn(1000); t = (time.perf_counter() - t0) * 1e3
        rt.synchronize(); torch.cuda.synchronize()
        t0 = time.perf_counter(); torch_loop(1000); b = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        out[name].append((t, b))
rt.close()
print("RESULT", json.dumps({k: {"added": statistics.median(t - b for t, b in v),
                                "torch": statistics.median(b for _, b in v)} for k, v in out.items()}))
'''


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python bench/chain_ab.py OLD_SRC NEW_SRC [TURNS]")
    roots = {"old": sys.argv[1], "new": sys.argv[2]}
    turns = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    results: dict[str, list[dict]] = {k: [] for k in roots}
    for turn in range(turns):
        for label in (list(roots) if turn % 2 == 0 else list(roots)[::-1]):
            env = dict(os.environ, PYTHONPATH=roots[label], STREAMDAG_NATIVE="1")
            proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if not lines:
                raise SystemExit(f"{label} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(lines[0][len("RESULT "):])
            results[label].append(r)
            print(f"turn {turn} {label}: added µs per op, chain {r['chain']['added']:.2f}, independent "
                  f"{r['independent']['added']:.2f} (PyTorch's launch {r['chain']['torch']:.2f})", flush=True)
    for label, rs in results.items():
        print(f"{label} ({roots[label]}): median over turns, added µs per op: chain "
              f"{statistics.median(r['chain']['added'] for r in rs):.2f}, independent "
              f"{statistics.median(r['independent']['added'] for r in rs):.2f}")
    for kind in ("chain", "independent"):  # each turn's two processes ran back to back: pair them
        diffs = [n[kind]["added"] - o[kind]["added"] for o, n in zip(results["old"], results["new"])]
        print(f"new minus old, {kind}: median over turns {statistics.median(diffs):+.2f} µs per op "
              f"(turns: {', '.join(f'{d:+.2f}' for d in diffs)})")


if __name__ == "__main__":
    main()
