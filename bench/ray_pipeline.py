"""A 4-stage pipeline of CPU work over two Ray nodes: streamdag.ray against hand-written Ray code.

Each micro-batch goes through four stages, ``tanh(x @ W_s)`` in numpy, each stage on its own
worker actor; stages 0 and 1 on one node, 2 and 3 on the other (a local ``ray.cluster_utils``
cluster). Ways to run it, timed in turns in one process:

- Ray actors, by hand: per micro-batch, four chained ``.remote()`` calls passing ObjectRefs;
- a Ray Compiled Graph, by hand: the four stages bound into one DAG, one ``execute`` per micro-batch;
- streamdag.ray, recorded: every micro-batch's four ops recorded once (each stage writes a buffer on
  its worker, the next stage reads it from there), ``g.run(inputs=..., outputs=...)`` per run: one
  compiled-graph ``execute`` for all micro-batches, their inputs and outputs through its channels
  as the hand-written compiled graph's; also with ``rt.put``/``rt.get`` around a plain ``g.run()``
  (eager calls outside the compiled graph), and the run alone (inputs and outputs left as they are);
- streamdag.ray, eager: the same ops submitted every run.

Measured: per-op time of a run with tiny work (the runtime's and Ray's own overhead), throughput
with real work, and the driver's host time per eager submit against the same op written by hand
as an actor method (see ``submit_overhead``).

Run: PYTHONPATH=src python bench/ray_pipeline.py  (writes bench/results/ray_pipeline_cpu_<N>cores.json:
the times depend on how many cores the nodes, actors and driver share)
"""

import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.cluster_utils import Cluster
from ray.dag import InputNode

import streamdag as sd
from streamdag.ray import Runtime
from streamdag.suite.report import format_table, write_json

STAGES = 4
MICRO_BATCHES = 8
ROUNDS = 25  # medians of this many runs in turns: the machine's other load moves single runs by 30%
SHAPES = {"tiny": (1, 16), "work": (64, 384)}  # (rows of a micro-batch, width of each stage)
SUBMITS = 400
SUBMIT_ROUNDS = 15
NOOP = "ray actor .noop.remote(): no arguments, no op (Ray's floor)"
BY_HAND = "ray actor .add.remote(x, 1.0, out): the same op by hand"
BY_HAND_PACKED = "ray actor .add_packed.remote((x, 1.0, out)): the same, one argument"
BY_HAND_REF = "ray actor .add.remote(x, ref, out): reads the other actor's value by hand"
SD_LOCAL = "streamdag submit, local op"
SD_MAIN = "streamdag submit, local op, a function of __main__ (by value)"
SD_REMOTE = "streamdag submit, reads another worker's buffer"
FAIR = "streamdag.ray recorded, g.run(inputs=, outputs=)"


def stage(x, w, out=None):
    y = np.tanh(x @ w)
    if out is None:
        return y
    out[...] = y
    return None


def bump(x, out):  # a function of __main__: pickled by value, as a script's or notebook's own
    np.add(x, 1.0, out=out)


@ray.remote
class Stage:
    def __init__(self, w):
        self.w = w
        self.bufs = {}  # the arrays the hand-written submit baseline keeps on the actor, by name

    def f(self, x):
        return stage(x, self.w)

    def noop(self):
        return None

    def keep(self, key, value):
        self.bufs[key] = np.array(value)

    def value(self, key):
        return self.bufs[key]

    def add(self, x, y, out):  # the op of the submit baseline, written as a method of the actor
        b = self.bufs
        np.add(b[x], b[y] if type(y) is str else y, out=b[out])

    def add_packed(self, call):  # the same, its arguments in one tuple (Ray's cost grows per argument)
        x, y, out = call
        b = self.bufs
        np.add(b[x], y, out=b[out])


def _node_options(s: int) -> dict:
    return {"resources": {f"bench_node{s * 2 // STAGES}": 0.01}}


def hand_actors(weights):
    actors = [Stage.options(num_cpus=0.25, **_node_options(s)).remote(w) for s, w in enumerate(weights)]

    def run(batches):
        outs = []
        for x in batches:
            ref = x
            for a in actors:
                ref = a.f.remote(ref)
            outs.append(ref)
        return ray.get(outs)

    return actors, run


def hand_compiled(actors):
    with InputNode() as inp:
        node = inp
        for a in actors:
            node = a.f.bind(node)
    dag = node.experimental_compile(_max_inflight_executions=MICRO_BATCHES)

    def run(batches):
        refs = [dag.execute(x) for x in batches]
        # copied: a value read from a compiled graph is a view of its channel, which the next
        # execute cannot write while the view lives
        return [ray.get(r).copy() for r in refs]

    return dag, run


def streamdag_runs(rt, weights, batches_shape):
    ws = [rt.put(w, on=s) for s, w in enumerate(weights)]
    rows, width = batches_shape
    inputs = [rt.empty((rows, width), np.float32, on=0) for _ in range(MICRO_BATCHES)]
    outs = [[rt.empty((rows, width), np.float32, on=s) for _ in range(MICRO_BATCHES)]
            for s in range(STAGES)]

    def submit_all():
        last = []
        for i in range(MICRO_BATCHES):
            h = inputs[i]
            for s in range(STAGES):
                f = rt.submit(stage, sd.read(h), sd.read(ws[s]), sd.write(outs[s][i]), name=f"s{s}[{i}]")
                h = outs[s][i]
            last.append(f)
        return last

    with rt.record() as g:
        submit_all()

    def fill(batches):
        for buf, x in zip(inputs, batches):
            rt.put(x, out=buf)

    def results():
        gets = [rt.get(outs[-1][i]) for i in range(MICRO_BATCHES)]
        return [f.result() for f in gets]

    def recorded(batches):  # inputs and outputs through the compiled graph, as the hand-written one
        return list(g.run(inputs=dict(zip(inputs, batches)), outputs=outs[-1]).result().outputs)

    def recorded_put_get(batches):
        fill(batches)
        g.run().result()
        return results()

    def eager(batches):
        fill(batches)
        for f in submit_all():
            f.result()
        return results()

    def recorded_run_only(_batches):  # the run alone: inputs stay as they are
        g.run().result()

    return g, recorded, recorded_put_get, eager, recorded_run_only


def time_rounds(variants: dict[str, Callable[[list[np.ndarray]], Any]], batches: list[np.ndarray],
                rounds: int) -> dict[str, list[float]]:
    """Each variant's time per round, in an order shuffled afresh every round (seeded): on cores
    that the driver, the actors and both compiled graphs' polling share, a variant's time depends
    on what ran just before it, so no variant may keep one predecessor (a rotation would keep it
    in all but the rounds where the variant goes first)."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants)
        random.Random(r).shuffle(order)
        for label in order:
            fn = variants[label]
            t0 = time.perf_counter()
            fn(batches)
            times[label].append((time.perf_counter() - t0) * 1e3)
    return times


def submit_overhead(rt, actors) -> tuple[dict[str, float], dict[str, float]]:
    """Driver host time per call, not waiting (and per call up to its completion): eager submits
    against the same op written by hand as a method of the actor.

    The fair baseline is what a Ray user writes for the op ``np.add(a, 1.0, out=a)`` on an array
    ``a`` that lives on the actor: a method defined on the actor that takes the op's arguments (the
    array's name, the scalar, the output's name) and applies it to its own arrays, at its best: the
    cheaper of positional arguments and one tuple (Ray's cost grows with a call's arguments). A
    submit does that and more (it names the function, infers the op's order, and settles a future
    when it ends), so that is the cost it is held to. A method that takes no arguments and does
    nothing (``noop.remote()``) is Ray's floor, no way to run the op: shown beside it. An op reading
    another worker's buffer is held to the same method passed a ref to the other actor's value.
    """
    a = rt.put(np.zeros(4, np.float32), on=0)
    b = rt.put(np.zeros(4, np.float32), on=1)
    rt.synchronize()
    ray.get([actors[0].keep.remote("a", np.zeros(4, np.float32)),
             actors[1].keep.remote("b", np.zeros(4, np.float32))])
    b_ref = actors[1].value.remote("b")  # fetched once, as streamdag sends an unchanged buffer once
    calls = {
        NOOP: lambda: actors[0].noop.remote(),
        BY_HAND: lambda: actors[0].add.remote("a", 1.0, "a"),
        BY_HAND_PACKED: lambda: actors[0].add_packed.remote(("a", 1.0, "a")),
        BY_HAND_REF: lambda: actors[0].add.remote("a", b_ref, "a"),
        SD_LOCAL: lambda: rt.submit(np.add, sd.read(a), 1.0, out=sd.write(a)),
        SD_MAIN: lambda: rt.submit(bump, sd.read(a), out=sd.write(a)),
        SD_REMOTE: lambda: rt.submit(np.add, sd.read(a), sd.read(b), out=sd.write(a)),
    }
    sent: dict[str, list[float]] = {k: [] for k in calls}
    done: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(SUBMIT_ROUNDS):  # in turns, so that a change of the machine's load hits every way
        for label, call in calls.items():
            t0 = time.perf_counter()
            refs = [call() for _ in range(SUBMITS)]
            t1 = time.perf_counter()
            if label.startswith("ray"):
                ray.get(refs)
            else:
                rt.synchronize()
            sent[label].append((t1 - t0) / SUBMITS * 1e6)
            done[label].append((time.perf_counter() - t0) / SUBMITS * 1e6)
    return ({k: statistics.median(v) for k, v in sent.items()},
            {k: statistics.median(v) for k, v in done.items()})


def main() -> None:
    node = {"num_cpus": 1, "object_store_memory": 100 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "resources": {"bench_node0": 1}})
    cluster.add_node(**node, resources={"bench_node1": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    rng = np.random.default_rng(0)
    results: dict = {"ms": {}, "rounds_ms": {}}
    try:
        for case, (rows, width) in SHAPES.items():
            weights = [(rng.standard_normal((width, width)) / width**0.5).astype(np.float32)
                       for _ in range(STAGES)]
            batches = [rng.standard_normal((rows, width)).astype(np.float32) for _ in range(MICRO_BATCHES)]
            expected = batches
            for w in weights:
                expected = [stage(x, w) for x in expected]
            actors, by_actors = hand_actors(weights)
            dag, by_dag = hand_compiled(actors)
            rt = Runtime(STAGES, num_cpus=0.25, worker_options=[_node_options(s) for s in range(STAGES)])
            g, recorded, put_get, eager, run_only = streamdag_runs(rt, weights, (rows, width))
            variants = {"ray actors (hand-written)": by_actors,
                        "ray compiled graph (hand-written)": by_dag,
                        FAIR: recorded,
                        "streamdag.ray recorded, rt.put/rt.get around g.run()": put_get,
                        "streamdag.ray recorded, run alone": run_only,
                        "streamdag.ray eager": eager}
            for label, fn in variants.items():  # warm up, and check every way's outputs
                got = fn(batches)
                if got is not None:
                    for a, b in zip(got, expected):
                        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=label)
            rounds = time_rounds(variants, batches, ROUNDS)
            ms = {k: statistics.median(v) for k, v in rounds.items()}
            results["ms"][case] = ms
            results["rounds_ms"][case] = rounds
            if case == "tiny":
                results["explain"] = g.explain().splitlines()[:2]
            dag.teardown()
            rt.close()
            for a in actors:
                ray.kill(a)
        # on a cluster running nothing else: a compiled graph's actors poll their channels, and on a
        # machine of few cores that load moved the calls' times by more than the gap measured
        actors, _ = hand_actors(weights)
        with Runtime(STAGES, num_cpus=0.25, worker_options=[_node_options(s) for s in range(STAGES)]) as rt:
            results["submit_us"], results["submit_to_done_us"] = submit_overhead(rt, actors)
        for a in actors:
            ray.kill(a)
    finally:
        ray.shutdown()
        cluster.shutdown()
    ops = STAGES * MICRO_BATCHES
    tiny, work = results["ms"]["tiny"], results["ms"]["work"]
    dag_key, sd_key = "ray compiled graph (hand-written)", "streamdag.ray recorded, run alone"
    per_op = {k: v / ops * 1e3 for k, v in tiny.items()}
    throughput = {k: MICRO_BATCHES / (v / 1e3) for k, v in work.items()}
    sub, done = results["submit_us"], results["submit_to_done_us"]
    fair = min(sub[BY_HAND], sub[BY_HAND_PACKED])  # the hand-written call at its best
    results["per_op_us_tiny"] = per_op
    results["micro_batches_per_s"] = throughput
    put_get = "streamdag.ray recorded, rt.put/rt.get around g.run()"
    results["goals"] = {
        "recorded per-op time, inputs and outputs through g.run, vs hand-written compiled graph "
        "(goal <= 1.2x)": per_op[FAIR] / per_op[dag_key],
        "recorded throughput, inputs and outputs through g.run, vs hand-written compiled graph "
        "(goal >= 0.95x)": throughput[FAIR] / throughput[dag_key],
        "recorded per-op time, the run alone, vs hand-written compiled graph":
            per_op[sd_key] / per_op[dag_key],
        "recorded throughput, the run alone, vs hand-written compiled graph":
            throughput[sd_key] / throughput[dag_key],
        "recorded throughput, rt.put/rt.get around g.run(), vs hand-written compiled graph":
            throughput[put_get] / throughput[dag_key],
        "eager submit host time vs Ray's own actor call for the same op by hand, at its best "
        "(goal <= 1.2x)": sub[SD_LOCAL] / fair,
        "eager submit host time, a function of __main__, vs the same by hand": sub[SD_MAIN] / fair,
        "eager submit host time, op with a transfer, vs the same by hand (a ref to the other actor's "
        "value)": sub[SD_REMOTE] / sub[BY_HAND_REF],
        "eager submit host time vs a no-argument .noop.remote() (Ray's floor, not the op)":
            sub[SD_LOCAL] / sub[NOOP],
        "eager submit to completion vs the same op by hand to completion, at its best":
            done[SD_LOCAL] / min(done[BY_HAND], done[BY_HAND_PACKED]),
    }
    rows_ = [[k, tiny[k], per_op[k], work[k], throughput[k]] for k in tiny]
    print(format_table(["way", "tiny: ms per run", "tiny: µs per op", "work: ms per run",
                        "work: micro-batches/s"], rows_))
    print(format_table(["driver host time per call", "µs, sent", "µs, up to its completion"],
                       [[k, v, done[k]] for k, v in sub.items()]))
    print(format_table(["goal", "ratio"], list(results["goals"].items())))
    settings = {"stages": STAGES, "micro_batches": MICRO_BATCHES, "rounds": ROUNDS, "shapes": SHAPES,
                "nodes": 2, "node_cpus": 1, "actor_cpus": 0.25, "object_store_mb": 100,
                "submits_timed": SUBMITS, "submit_rounds": SUBMIT_ROUNDS, "ray": ray.__version__,
                "native": os.environ.get("STREAMDAG_NATIVE")}
    print(write_json(Path(__file__).parent / "results", f"ray_pipeline_cpu_{os.cpu_count()}cores",
                     {"settings": settings, **results}))


if __name__ == "__main__":
    sys.exit(main())
