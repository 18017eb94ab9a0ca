"""What the CUDA calls of one launch cost the host, in C++ (no Python around each call).

Loops of tiny PyTorch launches (``x.add_(1)``) on a side stream, as a stream runtime makes them,
with each of the calls it adds around a launch, alone or together: the completion event's record (a
plain event, or a blocking-sync one whose host wait sleeps until an interrupt), the order after the
caller's stream (an event recorded on it and waited on), or instead a query of the caller's stream,
and the check that the caller's stream is not being captured into a CUDA graph (``enter`` makes it
before that order); and the launch on a blocking stream instead, which CUDA itself orders after
the legacy default stream, the caller's (a runtime's streams with ``default_stream_sync``);
and the current device asked before and after the launch, through the runtime API or the driver's
current context.
A GPU machine's CPU speed can drift by tens of percent within seconds, so the variants run in short
rounds of 2,000 launches in alternating order, and each row is the median over rounds of the time
added to the first variant's in the same round.

Run on a GPU machine: PYTHONPATH=src python bench/cuda_calls.py (builds a small extension; writes
bench/results/cuda_calls_<gpu>.json)
"""

import statistics
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from streamdag.suite.report import format_table, write_json

LAUNCHES, ROUNDS = 2000, 60

SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <chrono>
#include <dlfcn.h>

using clk = std::chrono::steady_clock;

// ns per launch of variant ``v`` over ``n`` launches
double loop(int v, int n) {
  static bool made = false;
  static cudaEvent_t fence;
  static std::vector<cudaEvent_t> plain(64), blocking(64);
  static c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false);
  static cudaStream_t blocking_handle = nullptr;
  if (blocking_handle == nullptr) cudaStreamCreateWithFlags(&blocking_handle, cudaStreamDefault);
  static c10::cuda::CUDAStream blocking_side =
      c10::cuda::getStreamFromExternal(blocking_handle, c10::cuda::current_device());
  // v == 9: the driver's cuCtxGetCurrent, from the libcuda the process has loaded
  typedef int (*ctx_get_current_t)(void**);
  static ctx_get_current_t ctx_get_current = reinterpret_cast<ctx_get_current_t>(
      dlsym(dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD), "cuCtxGetCurrent"));
  if (v == 9 && ctx_get_current == nullptr) return -1.0;
  // v == 7: a blocking stream, which CUDA orders after the legacy default stream (the caller's)
  c10::cuda::CUDAStream s = v == 7 ? blocking_side : side;
  static torch::Tensor *x = nullptr;  // never freed: no teardown after CUDA's at exit
  if (!made) {
    cudaEventCreateWithFlags(&fence, cudaEventDisableTiming);
    for (int i = 0; i < 64; i++) {
      cudaEventCreateWithFlags(&plain[i], cudaEventDisableTiming);
      cudaEventCreateWithFlags(&blocking[i], cudaEventDisableTiming | cudaEventBlockingSync);
    }
    x = new torch::Tensor(torch::zeros({256}, torch::kCUDA));
    made = true;
  }
  auto caller = c10::cuda::getCurrentCUDAStream();
  {
    cudaDeviceSynchronize();
    auto t = clk::now();
    for (int i = 0; i < n; i++) {
      if (v == 6) {  // is the caller's stream being captured? (then the order, as v == 3)
        cudaStreamCaptureStatus status;
        cudaError_t err = cudaStreamIsCapturing(caller.stream(), &status);
        if (err != cudaSuccess || status != cudaStreamCaptureStatusNone) return -1.0;
      }
      if (v == 3 || v == 6) {  // order after the caller's stream
        cudaEventRecord(fence, caller.stream());
        cudaStreamWaitEvent(s.stream(), fence, 0);
      }
      if (v == 4 && cudaStreamQuery(caller.stream()) != cudaSuccess) {
        cudaEventRecord(fence, caller.stream());
        cudaStreamWaitEvent(s.stream(), fence, 0);
      }
      int device = 0;
      void* ctx = nullptr;
      if (v == 8) cudaGetDevice(&device);  // the caller's device, before the launch and after
      if (v == 9) ctx_get_current(&ctx);
      c10::cuda::setCurrentCUDAStream(s);
      x->add_(1);
      c10::cuda::setCurrentCUDAStream(caller);
      if (v == 8) cudaGetDevice(&device);
      if (v == 9) ctx_get_current(&ctx);
      if (v == 1 || v == 3 || v == 4 || v == 6 || v >= 7) cudaEventRecord(plain[i & 63], s.stream());
      if (v == 2) cudaEventRecord(blocking[i & 63], s.stream());
      if (v == 5 && (i & 7) == 7) cudaEventRecord(plain[i & 63], s.stream());
    }
    double ns = std::chrono::duration<double, std::nano>(clk::now() - t).count() / n;
    cudaDeviceSynchronize();
    return ns;
  }
}
"""

LABELS = [
    "launch on a side stream (switch there and back)",
    "+ plain completion event",
    "+ blocking-sync completion event",
    "+ plain completion event + order after the caller's stream",
    "+ plain completion event + query the caller's stream (idle) instead",
    "+ plain completion event every 8th launch",
    "+ plain completion event + order after the caller's stream + check it is not capturing",
    "+ plain completion event, on a blocking stream (CUDA orders it after the default stream)",
    "+ plain completion event + the current device asked twice (cudaGetDevice)",
    "+ plain completion event + the current context asked twice (the driver's cuCtxGetCurrent)",
]


def main() -> None:
    torch.cuda.init()
    module = load_inline("streamdag_bench_cuda_calls", SOURCE, functions=["loop"], with_cuda=True,
                         extra_cflags=["-O2"])
    variants = list(range(len(LABELS)))
    for v in variants:  # warm up
        module.loop(v, LAUNCHES)
    rounds: list[list[float]] = [[] for _ in variants]
    for _ in range(ROUNDS):
        variants.reverse()
        for v in variants:
            rounds[v].append(module.loop(v, LAUNCHES))
    rows, ns = [], {}
    for v, label in enumerate(LABELS):
        added = [t - b for t, b in zip(rounds[v], rounds[0])]
        ns[label] = {"median": statistics.median(rounds[v]), "added_paired": statistics.median(added),
                     "rounds": rounds[v]}
        rows.append([label, statistics.median(rounds[v]) / 1e3, statistics.median(added) / 1e3,
                     f"{min(rounds[v]) / 1e3:.2f}-{max(rounds[v]) / 1e3:.2f}"])
    print(format_table(["per launch (host, C++)", "µs (median round)", "added µs, paired by round",
                        "rounds µs"], rows))
    name = "cuda_calls_" + torch.cuda.get_device_name().replace(" ", "_")
    print(write_json(Path(__file__).parent / "results", name,
                     {"settings": {"launches_per_round": LAUNCHES, "rounds": ROUNDS}, "ns_per_launch": ns}))


if __name__ == "__main__":
    main()
