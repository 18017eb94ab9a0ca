"""Functions the tests share: programs the frontend tests compile, and checks of the runtime."""

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
