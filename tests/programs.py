"""Functions the tests share: programs the frontend tests compile, checks of the runtime, and the
random programs over overlapping views that the random-program tests and ``bench/soak.py`` run."""

from functools import cache

import numpy as np

#: the devices the runtime's behaviour tests run on: the CPU lanes and the simulated device
DEVICES = ["cpu", "sim"]
#: the devices the host-lane tests run beside: the simulated device, and a backend that runs each op
#: inside its submit (as CUDA does)
KINDS = ["sim", "inline"]


def make(kind: str, streams: int = 2, max_inflight: int = 256):
    """A runtime on one of :data:`KINDS`, with its host lanes."""
    import streamdag as sd
    from streamdag.backends.inline import InlineBackend

    if kind == "inline":  # each device op runs inside its submit, as on CUDA
        return sd.Runtime(backend=InlineBackend("sim", streams), max_inflight=max_inflight)
    return sd.Runtime(kind, streams=streams, max_inflight=max_inflight)


def submitted_or_recorded(rt, record: bool, submit, *args) -> None:
    """``submit(rt, *args)``: its ops run eagerly, or (``record``) are recorded once and the graph
    run, its result waited for."""
    if record:
        with rt.record() as g:
            submit(rt, *args)
        g.run().result()
    else:
        submit(rt, *args)


def wide_fn(ws):
    """Branches of ``relu(h @ w)`` layers over one input (``ws[branch][layer]``), summed at the end."""
    import torch

    def wide(x):
        outs = []
        for branch in ws:
            h = x
            for w in branch:
                h = torch.relu(h @ w)
            outs.append(h)
        return torch.stack(outs).sum(0)

    return wide


def closed_runtime_freed_at_once(make_runtime, use) -> bool:
    """Whether a runtime, used (``use(rt)``), closed and dropped, is freed by reference counting
    alone, with the cycle collector off: not left for a later collector pass, which may come at
    any point (inside someone's CUDA graph capture, say)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        rt = make_runtime()
        use(rt)
        rt.close()
        gone = weakref.ref(rt)
        del rt
        return gone() is None
    finally:
        gc.enable()


def ops_left_to_the_cycle_collector(work) -> int:
    """How many finished ops running ``work()`` leaves alive only in reference cycles.

    Such ops are freed only by Python's cycle collector, whose passes stall
    submits (a full pass walks every object in the process).
    """
    import gc

    from streamdag.runtime.ops import Op

    gc.collect()
    gc.disable()
    try:
        work()
        held = sum(type(o) is Op for o in gc.get_objects())  # garbage in cycles counts too
        gc.collect()
        live = sum(type(o) is Op for o in gc.get_objects())  # only what the runtime holds
    finally:
        gc.enable()
    return held - live


N = 24  # elements per base buffer
# a view is (base index, kind, a, b)
VIEW_KINDS = ["slice", "step", "reverse", "matrix_T", "whole"]


def make_view(bases, spec):
    base, kind, a, b = spec
    arr = bases[base]
    lo, hi = min(a, b), max(a, b) + 1
    if kind == "slice":
        return arr[lo:hi]
    if kind == "step":
        return arr[lo:hi:2]
    if kind == "reverse":
        return arr[lo:hi][::-1]
    if kind == "matrix_T":
        return arr.reshape(4, 6).T[: (hi - lo) % 6 + 1]
    return arr


@cache  # a view's extent depends on its spec alone; the soak asks for it per op
def elements(spec):
    """Flat element indices a view spans by its extent (the documented conservative rule)."""
    probe = [np.arange(N, dtype=np.int64) for _ in range(4)]
    idx = make_view(probe, spec)
    return spec[0], int(idx.min()), int(idx.max())


def writes_into(op_a, op_b):
    """Whether ``op_a`` writes memory ``op_b`` reads or writes: a failure of ``op_a`` passes to ``op_b``
    (an op that only overwrites what a failed op read runs: the failed reader changed nothing)."""
    ba, la, ha = elements(op_a["write"])
    for bb, lb, hb in [elements(v) for v in op_b["reads"]] + [elements(op_b["write"])]:
        if ba == bb and la <= hb and lb <= ha:
            return True
    return False


def run_op(op, bases, fail=False):
    if fail:
        raise RuntimeError(f"injected failure in {op['name']}")
    w = make_view(bases, op["write"])
    acc = np.int64(op["k"])
    for r in op["reads"]:
        acc = acc + make_view(bases, r).sum() % 1009
    w[...] = (w * 3 + acc) % 1000003
    return int(w.sum())


def initial_bases():
    return [np.arange(N, dtype=np.int64) * (i + 7) for i in range(3)]


def serial(program, failing=frozenset()):
    bases = initial_bases()
    results = []
    failed, roots = set(), set()
    for i, op in enumerate(program):
        op["name"] = f"op{i}"
        if any(j in failed and writes_into(program[j], op) for j in range(i)):
            failed.add(i)  # a dependency failed: the op does not run, even if it would fail itself
            results.append(None)
        elif i in failing:
            failed.add(i)
            roots.add(i)
            results.append(None)
        else:
            results.append(run_op(op, bases))
    return bases, results, failed, roots
