"""Host cost per op that streamdag adds on top of PyTorch's own launch (goal: at most 5 µs).

Eager submits (each op's dependencies inferred and launched at once, compiled:
``streamdag.native``); the same with the launch's CUDA calls through PyTorch's
Python bindings (where the torch extension does not build), with the submit
in Python, and all in Python (where no C compiler is); the runtime's bookkeeping alone (a backend
that runs the op and makes no CUDA call of its own); the CUDA calls alone (what
any runtime on PyTorch's streams calls per op, with no bookkeeping: the floor
of this design through PyTorch's Python API); and for comparison the same
chain recorded once and replayed as a captured CUDA graph; and a transfer,
``rt.copy`` of 1 KiB from pinned host memory, and the same through the copy
function ``stream_map`` makes once per input (``transfers.copier``: ``rt.copy``'s
checks decided once), against PyTorch's own ``copy_(non_blocking=True)`` (their
baseline, not the launch). A GPU machine's CPU
speed can drift by tens of percent within a minute, so the variants are timed in
turns, in short rounds whose order alternates, and each reports its median
round and its median over rounds of the time added to PyTorch's launch in
the same round.

``--native`` adds the same CUDA calls made from C++ (an extension built at
start with ``torch.utils.cpp_extension``, about a minute): the floor of this
design once its launch path is native, not through PyTorch's Python API.

Run on a GPU machine: PYTHONPATH=src python bench/overhead.py [--native]
"""

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

import streamdag as sd
from streamdag import native
from streamdag.backends.inline import InlineBackend
from streamdag.graph import buffers, hazards
from streamdag.runtime import accel, arguments, completion
from streamdag.runtime import core as sd_core
from streamdag.schedule import waits
from streamdag.suite.report import format_table, write_json

GRAPH_OPS = 1000
COPY_BASELINE = "PyTorch copy_, pinned 1 KiB host to device"
#: short rounds, many of them, in alternating order: a machine that switches between a fast and a
#: slow state every few seconds still compares variants timed within tens of ms of each other fairly
OPS_PER_ROUND = 1000
ROUNDS = 60


#: what one launch of a stream runtime asks of CUDA, made natively: order the op's stream after the
#: caller's, run the op's function with that stream current, switch back, record its completion event
NATIVE_LAUNCH = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

void launch(py::handle fn, py::handle args, py::handle kwargs, int64_t stream_id, int64_t device_index,
            int64_t device_type, uintptr_t caller_event, uintptr_t done_event) {
  auto index = static_cast<c10::DeviceIndex>(device_index);
  auto stream = c10::cuda::CUDAStream::unpack3(stream_id, index, static_cast<c10::DeviceType>(device_type));
  auto caller = c10::cuda::getCurrentCUDAStream(index);
  C10_CUDA_CHECK(cudaEventRecord(reinterpret_cast<cudaEvent_t>(caller_event), caller.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), reinterpret_cast<cudaEvent_t>(caller_event), 0));
  c10::cuda::setCurrentCUDAStream(stream);
  PyObject* out = PyObject_Call(fn.ptr(), args.ptr(), kwargs.ptr());
  c10::cuda::setCurrentCUDAStream(caller);
  if (out == nullptr) throw py::error_already_set();
  Py_DECREF(out);
  C10_CUDA_CHECK(cudaEventRecord(reinterpret_cast<cudaEvent_t>(done_event), stream.stream()));
}
"""


def build_native_launch():
    """The C++ launch above as a Python function, or None (with the reason printed) if it does not build."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline("streamdag_native_launch", NATIVE_LAUNCH, functions=["launch"], with_cuda=True,
                           extra_cflags=["-O2"], build_directory=_build_dir()).launch
    except Exception as exc:  # no compiler or headers: the row is left out, and said so
        print(f"--native: the C++ launch did not build, its row is left out: {exc}", file=sys.stderr)
        return None


def _build_dir() -> str:
    import tempfile

    path = Path(tempfile.gettempdir()) / "streamdag_native_launch"
    path.mkdir(exist_ok=True)
    return str(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--native", action="store_true", help="also time the CUDA calls made from C++")
    args = parser.parse_args()
    native_launch = build_native_launch() if args.native else None
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

    def native_calls_only(n):
        """The same CUDA calls, made from C++: one call into the extension per op."""
        caller_ptr = caller_event.cuda_event
        for i in range(n):
            s = streams[i & 7]
            native_launch(torch.add, (bufs[i % 64], 1), {"out": bufs[(i + 1) % 64]},
                          s.stream_id, s.device_index, s.device_type, caller_ptr, event_ptrs[i % 64])

    def chain_on(rt):
        def chain(n):
            for i in range(n):
                a, b = bufs[i % 64], bufs[(i + 1) % 64]
                rt.submit(torch.add, a, 1, out=b, reads=[a], writes=[b])
        return chain

    # host-to-device copies of 1 KiB from pinned memory: the host cost of a transfer (its baseline is
    # PyTorch's own copy_, not the kernel launch)
    pinned = [torch.randn(256).pin_memory() for _ in range(64)]
    copy_bufs = [torch.zeros(256, device="cuda") for _ in range(64)]

    def torch_copies(n):
        for i in range(n):
            copy_bufs[i % 64].copy_(pinned[i % 64], non_blocking=True)

    def copies_on(rt):
        def copies(n):
            for i in range(n):
                rt.copy(copy_bufs[i % 64], pinned[i % 64])
        return copies

    def copier_copies_on(rt):  # stream_map's: rt.copy's checks made once, for every piece
        from streamdag.runtime.transfers import copier

        copy = copier(rt, copy_bufs[0], pinned[0])

        def copies(n):
            for i in range(n):
                copy(copy_bufs[i % 64], pinned[i % 64])
        return copies

    def independent_on(rt):
        def independent(n):
            for i in range(n):
                b = bufs[i % 64]
                rt.submit(b.add_, 1, writes=[b])
        return independent

    rt = sd.Runtime("cuda", streams=8, max_inflight=100000)
    # the same chain while a host-lane op that no op of it follows is pending: each submit checks its
    # accesses against the pending host ops' in C (a Python path there would show here)
    host_pending = sd.Runtime("cuda", streams=8, max_inflight=100000)
    release_lane = threading.Event()
    held_op = host_pending.submit(release_lane.wait, run_on="host", name="pending_host_op")
    # the same, but every op finished by the completion thread (the submitting thread never passes)
    thread_only = sd.Runtime("cuda", streams=8, max_inflight=100000)
    thread_only._finish_ready = []
    bare = sd.Runtime(backend=InlineBackend(f"cuda:{torch.cuda.current_device()}", 8),
                      max_inflight=100000)
    # the same chain with the launch's CUDA calls made through PyTorch's Python bindings (what runs
    # where the torch extension does not build; tensors are still read in C++)
    torch_ext = native.load_torch()
    if torch_ext is not None:
        native.load().use_torch(None)
        bindings = sd.Runtime("cuda", streams=8, max_inflight=100000)
        native.load().use_torch(torch_ext)
    # the same chain with the submit path in Python (the tracker, clocks and accesses compiled)
    sd_core.COMPILED_SUBMIT = False
    python_glue = sd.Runtime("cuda", streams=8, max_inflight=100000)
    # the same chain all in Python: what runs without a compiler
    python_path = sd.Runtime("cuda", streams=8, max_inflight=100000)
    python_path._tracker = hazards.PyDepsTracker(retired=completion.finished_ok)
    python_path._clocks = waits.PyStreamClocks(len(python_path._streams))
    sd_core.COMPILED_SUBMIT = True

    def with_python_accesses(run):
        def python_run(n):
            arguments.accesses_of = buffers._py_accesses
            try:
                run(n)
            finally:
                arguments.accesses_of = accel.accesses
        return python_run

    # the same chain recorded once and run as a captured CUDA graph: host cost per op of g.run(). Its
    # own runtime: a graph's run is one op over all its buffers, whose range would overlap every
    # buffer of the eager chain and make each of its look-ups a search (runs 1-14 had that cost in)
    graph_rt = sd.Runtime("cuda", streams=8, max_inflight=100000)
    with graph_rt.record() as g:
        chain_on(graph_rt)(GRAPH_OPS)
    g.run().result()

    def graph_runs(n):
        for _ in range(max(1, n // GRAPH_OPS)):
            g.run()

    for e in [caller_event, *events]:  # PyTorch makes an event's CUDA event at its first record
        e.record()
    event_ptrs = [e.cuda_event for e in events]
    if native_launch is not None:  # it runs the op, on the op's stream, after the caller's work
        probe = torch.zeros(4, device="cuda")
        probe.fill_(41)
        native_launch(probe.add_, (1,), {}, streams[0].stream_id, streams[0].device_index,
                      streams[0].device_type, caller_event.cuda_event, event_ptrs[0])
        events[0].synchronize()
        assert probe.tolist() == [42.0] * 4, probe
    variants = {
        "PyTorch launch, one stream": torch_loop,
        "the CUDA calls of a stream runtime, no bookkeeping": cuda_calls_only,
        **({"the same CUDA calls made from C++ (native launch)": native_calls_only} if native_launch else {}),
        "streamdag submit, dependent chain": chain_on(rt),
        "streamdag submit, dependent chain, completion thread finishes all": chain_on(thread_only),
        **({"streamdag submit, dependent chain, CUDA calls via PyTorch's bindings": chain_on(bindings)}
           if torch_ext is not None else {}),
        **({"streamdag submit, dependent chain, submit in Python": chain_on(python_glue)}
           if native.load() is not None else {}),
        **({"streamdag submit, dependent chain, all in Python (no compiler)":
            with_python_accesses(chain_on(python_path))} if native.load() is not None else {}),
        "streamdag submit, dependent chain, a host-lane op pending": chain_on(host_pending),
        "streamdag submit, independent ops": independent_on(rt),
        COPY_BASELINE: torch_copies,
        "streamdag rt.copy, pinned 1 KiB host to device": copies_on(rt),
        "streamdag stream_map's copier, pinned 1 KiB host to device": copier_copies_on(rt),
        "streamdag bookkeeping alone, dependent chain": chain_on(bare),
        f"streamdag recorded chain of {GRAPH_OPS}, g.run() per op": graph_runs,
    }
    rounds: dict[str, list[float]] = {label: [] for label in variants}
    for fn in variants.values():  # warm up: caches, event pool, the graph's capture
        fn(500)
    torch.cuda.synchronize()
    order = list(variants.items())
    for _ in range(ROUNDS):
        order.reverse()  # neither variant always follows the same one
        for label, fn in order:
            t0 = time.perf_counter()
            fn(OPS_PER_ROUND)
            rounds[label].append((time.perf_counter() - t0) / OPS_PER_ROUND * 1e6)
            rt.synchronize()
            for d in list(host_pending._pending.values()):  # (synchronize() would wait for the host op)
                if d.future is not held_op:
                    d.future.exception()
            graph_rt.synchronize()
            thread_only.synchronize()
            python_path.synchronize()
            python_glue.synchronize()
            if torch_ext is not None:
                bindings.synchronize()
            torch.cuda.synchronize()
    rt.close()
    release_lane.set()
    host_pending.close()
    graph_rt.close()
    thread_only.close()
    python_path.close()
    python_glue.close()
    if torch_ext is not None:
        bindings.close()
    bare.close()
    medians = {label: statistics.median(ts) for label, ts in rounds.items()}
    t_torch = medians["PyTorch launch, one stream"]
    # each row against its PyTorch baseline: the launch, or for copies PyTorch's copy_
    base = {label: COPY_BASELINE if "copy" in label or "copier" in label else "PyTorch launch, one stream"
            for label in rounds}
    # added over PyTorch within each round, then the median: the host's drift between rounds cancels
    paired = {label: statistics.median(t - b for t, b in zip(ts, rounds[base[label]]))
              for label, ts in rounds.items()}
    rows = [[label, us, us - medians[base[label]], paired[label],
             f"{min(rounds[label]):.1f}-{max(rounds[label]):.1f}"]
            for label, us in medians.items()]
    print(format_table(["per op (host)", "µs (median round)", "added over PyTorch µs",
                        "added, paired by round", "rounds µs"], rows))
    print(write_json(Path(__file__).parent / "results",
                     "overhead_" + torch.cuda.get_device_name().replace(" ", "_"),
                     {"settings": {"ops_per_round": OPS_PER_ROUND, "rounds": ROUNDS, "streams": 8,
                                   "native_launch": native_launch is not None,
                                   "hot_path": native.status(where=False),
                                   "cuda_calls": native.torch_status(where=False)},
                      "us": {"torch_us": t_torch, **{k: v for k, v in medians.items() if k != rows[0][0]}},
                      "added_paired_us": paired,
                      "rounds_us": rounds}))


if __name__ == "__main__":
    main()
