// The CUDA calls of a launch and the reads of a tensor's byte range, in C++ against PyTorch's
// headers: through PyTorch's Python bindings each is a Python call that parses its arguments
// (19 of them per op on a GPU runtime), here each is a C++ call. Built by streamdag.native on
// the first GPU runtime (torch.utils.cpp_extension, with CUDA), cached; _speedups.c takes the
// functions from this module's capsule (see _torch_hooks.h) and makes the same calls it makes
// through the bindings otherwise.
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/cuda/PinnedMemoryAllocator.h>
#include <torch/version.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Stream.h>
#include <torch/csrc/cuda/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <dlfcn.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <iterator>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <utility>
#include <vector>

#include "_host_copy.h"
#include "_torch_hooks.h"

#define STREAMDAG_STR2(x) #x
#define STREAMDAG_STR(x) STREAMDAG_STR2(x)
#define STREAMDAG_CAT2(a, b) a##b
#define STREAMDAG_CAT(a, b) STREAMDAG_CAT2(a, b)
#define TORCH_EXTENSION_NAME_STR STREAMDAG_STR(TORCH_EXTENSION_NAME)
#define TORCH_EXTENSION_INIT STREAMDAG_CAT(PyInit_, TORCH_EXTENSION_NAME)

namespace {

// The caught C++ exception as PyTorch raises it in Python (torch.AcceleratorError for a CUDA
// error, torch.OutOfMemoryError, ...; a message without the C++ backtrace); call inside a catch
int fail() {
  torch::translate_exception_to_python(std::current_exception());
  return -1;
}

c10::cuda::CUDAStream stream_of(PyObject* obj) {
  auto* s = reinterpret_cast<THPStream*>(obj);
  return c10::cuda::CUDAStream::unpack3(s->stream_id, static_cast<c10::DeviceIndex>(s->device_index),
                                        static_cast<c10::DeviceType>(s->device_type));
}

at::cuda::CUDAEvent& event_of(PyObject* obj) {
  return reinterpret_cast<THCPEvent*>(obj)->cuda_event;
}

// Whether the CUDA call can skip PyTorch's CUDAEvent method: the event exists on the stream's
// device, which is current, and no stream sanitizer traces events (it hooks those methods)
bool direct(at::cuda::CUDAEvent& ev, const c10::cuda::CUDAStream& stream, long long device) {
  return ev.isCreated() && ev.device_index() == stream.device_index() && device == stream.device_index() &&
         c10::impl::GPUTrace::get_trace() == nullptr;
}

void record_on(at::cuda::CUDAEvent& ev, const c10::cuda::CUDAStream& stream, long long device) {
  if (direct(ev, stream, device)) {
    C10_CUDA_CHECK(cudaEventRecord(ev.event(), stream.stream()));  // (a created event was recorded)
  } else {
    ev.record(stream);
  }
}

void block_on(at::cuda::CUDAEvent& ev, const c10::cuda::CUDAStream& stream, long long device) {
  if (direct(ev, stream, device)) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), ev.event(), 0));
  } else {
    ev.block(stream);
  }
}

int region(PyObject* obj, long long* device, long long* start, long long* end) {
  if (!THPVariable_CheckExact(obj)) return 0;  // a subclass may read differently (__torch_function__)
  try {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.defined() || t.layout() != c10::kStrided || !t.is_contiguous()) return 0;
    if (t.is_cuda()) {
      *device = t.get_device();
    } else if (t.is_cpu()) {
      *device = -1;
    } else {
      return 0;
    }
    *start = static_cast<long long>(reinterpret_cast<intptr_t>(t.data_ptr()));
    *end = *start + static_cast<long long>(t.nbytes());
    return 1;
  } catch (...) {
    return fail();
  }
}

// what an op submitted inside the caller's own CUDA graph capture fails with: streamdag.errors'
// SubmittedInCapture, handed over by set_submitted_in_capture() as the module is loaded
PyObject* submitted_in_capture = nullptr;

// Whether ``stream`` is being captured (an implicit dependency on a capturing stream counts too)
bool capturing(const c10::cuda::CUDAStream& stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(stream.stream(), &status);
  if (err == cudaErrorStreamCaptureImplicit) {
    (void)cudaGetLastError();
    return true;
  }
  C10_CUDA_CHECK(err);
  return status != cudaStreamCaptureStatusNone;
}

// The runtime's streams made blocking (new_stream(device, True)): CUDA orders work on one after all
// earlier work on the legacy default stream of its device (and that stream's later work after it)
std::vector<cudaStream_t> blocking_streams;

// Whether CUDA itself orders work on ``target`` after the caller's earlier work on ``caller``: the
// caller's is the legacy default stream (PyTorch's default stream, handle 0) and ``target`` is
// blocking. Not while a stream sanitizer traces: it sees the order of events alone.
bool ordered_by_cuda(const c10::cuda::CUDAStream& caller, const c10::cuda::CUDAStream& target) {
  cudaStream_t handle = caller.stream();
  if (handle != nullptr && handle != cudaStreamLegacy) return false;
  if (c10::impl::GPUTrace::get_trace() != nullptr) return false;
  cudaStream_t own = target.stream();
  for (cudaStream_t s : blocking_streams)
    if (s == own) return true;
  return false;
}

// The calling thread's current CUDA context (the driver's cuCtxGetCurrent, a thread-local read:
// ~0.01 µs against ~0.13 for cudaGetDevice), or nullptr where it
// cannot tell: before CUDA 12 a cudaSetDevice made its context current only at the next call.
using CtxGetCurrent = int (*)(void**);
CtxGetCurrent ctx_get_current = nullptr;
bool ctx_looked_up = false;

void* current_context() {
  if (!ctx_looked_up) {
    ctx_looked_up = true;
    int runtime = 0;
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);  // loaded by PyTorch's CUDA
    if (lib != nullptr && cudaRuntimeGetVersion(&runtime) == cudaSuccess && runtime >= 12000)
      ctx_get_current = reinterpret_cast<CtxGetCurrent>(dlsym(lib, "cuCtxGetCurrent"));
  }
  void* ctx = nullptr;
  if (ctx_get_current == nullptr || ctx_get_current(&ctx) != 0) return nullptr;
  return ctx;
}

int enter(PyObject* stream, PyObject* caller_event, StreamdagSaved* saved) {
  try {
    auto target = stream_of(stream);
    saved->device = c10::cuda::current_device();  // PyTorch's view (it may name a device not yet set)
    if (saved->device != target.device_index()) c10::cuda::set_device(target.device_index());
    auto caller = c10::cuda::getCurrentCUDAStream(target.device_index());
    // ordered by CUDA: no call onto the caller's stream, which is the legacy default stream (never
    // captured itself), so none that could touch a capture; else, before any call onto it, the
    // caller's capture must stay as it was
    bool implicit = ordered_by_cuda(caller, target);
    if (!implicit && capturing(caller)) {
      if (saved->device != target.device_index())
        c10::cuda::set_device(static_cast<c10::DeviceIndex>(saved->device));
      if (submitted_in_capture != nullptr)
        PyErr_SetNone(submitted_in_capture);
      else
        PyErr_SetString(PyExc_RuntimeError, "streamdag: an op was submitted inside a CUDA graph capture");
      return -1;
    }
    auto packed = caller.pack3();
    saved->stream_id = packed.stream_id;
    saved->device_index = packed.device_index;
    saved->device_type = static_cast<long long>(packed.device_type);
    if (!implicit) {  // work the caller enqueued on its stream first
      auto& fence = event_of(caller_event);
      record_on(fence, caller, target.device_index());
      block_on(fence, target, target.device_index());
    }
    c10::cuda::setCurrentCUDAStream(target);
    saved->context = current_context();  // the op's: leave() asks for the device only if it changed
    return 0;
  } catch (...) {
    return fail();
  }
}

int leave(const StreamdagSaved* saved) {
  try {
    c10::cuda::setCurrentCUDAStream(c10::cuda::CUDAStream::unpack3(
        saved->stream_id, static_cast<c10::DeviceIndex>(saved->device_index),
        static_cast<c10::DeviceType>(saved->device_type)));
    // enter() switched devices, or the op may have (unless its context is the one it began in)
    void* context = saved->context != nullptr ? current_context() : nullptr;
    bool moved = saved->device != saved->device_index || context == nullptr || context != saved->context;
    if (moved && c10::cuda::current_device() != saved->device)
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(saved->device));
    return 0;
  } catch (...) {
    return fail();
  }
}

int record(PyObject* event, PyObject* stream, long long device) {
  try {
    record_on(event_of(event), stream_of(stream), device);
    return 0;
  } catch (...) {
    return fail();
  }
}

int wait(PyObject* event, PyObject* stream, long long device) {
  try {
    block_on(event_of(event), stream_of(stream), device);
    return 0;
  } catch (...) {
    return fail();
  }
}

int query(PyObject* event) {
  try {
    // relaxed: an event query is one of the calls that a CUDA graph capture in PyTorch's default
    // (global) mode refuses, from every thread, ending that capture in an error too; ours only
    // look at events recorded outside any capture, which is safe
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    return event_of(event).query() ? 1 : 0;  // PyTorch's own: clears a not-ready status, raises others
  } catch (...) {
    return fail();
  }
}

// Whether host tensor ``t`` is pinned memory. Memory from PyTorch's pinned allocator (pin_memory(),
// pin_memory=True) is known by its storage's allocator; anything else asks is_pinned(), whose CUDA
// pointer query (with a device guard and a look for a device with a context) is ~1 µs
bool host_pinned(const at::Tensor& t) {
  if (t.has_storage() && t.storage().allocator() == at::cuda::getPinnedMemoryAllocator()) return true;
  return t.is_pinned();
}

// pinned_alike(dst, src, host): the checks of a copy that the compiled rt.copy makes itself (see
// _torch_hooks.h), without PyTorch's Python bindings: is_pinned(), and dtype and shape, which made
// new objects to compare, cost a 1 KiB copy ~1-2 µs there
int pinned_alike(PyObject* dst, PyObject* src, PyObject* host) {
  if (!THPVariable_CheckExact(dst) || !THPVariable_CheckExact(src)) return 0;
  try {
    const at::Tensor& d = THPVariable_Unpack(dst);
    const at::Tensor& s = THPVariable_Unpack(src);
    if (!d.defined() || !s.defined() || d.scalar_type() != s.scalar_type() || d.sizes() != s.sizes()) return 0;
    return host_pinned(host == dst ? d : s) ? 1 : 0;
  } catch (...) {
    return fail();
  }
}

StreamdagTorchHooks hooks = {STREAMDAG_TORCH_HOOKS_VERSION, region, enter, leave, record, wait, query,
                             pinned_alike};

// new_stream(device, blocking=False) -> the address of a new CUDA stream on that GPU, for a
// runtime's own use: PyTorch's streams come from a pool of 32 per device, shared with every other
// torch.cuda.Stream() (another runtime's, a CUDA graph capture's, the user's own). Non-blocking, or
// blocking: ordered after the legacy default stream by CUDA (see ordered_by_cuda), never captured
PyObject* new_stream(PyObject*, PyObject* args) {
  long device = 0;
  int blocking = 0;
  if (!PyArg_ParseTuple(args, "l|p", &device, &blocking)) return nullptr;
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    cudaStream_t stream = nullptr;
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, blocking ? cudaStreamDefault : cudaStreamNonBlocking));
    if (blocking) blocking_streams.push_back(stream);
    return PyLong_FromVoidPtr(stream);
  } catch (...) {
    fail();
    return nullptr;
  }
}

// Each tensor's address, number of dimensions, sizes and strides, appended to ``out``: what a
// captured CUDA graph has baked in of its arguments. 0, or -1 with a TypeError for anything but a
// list of tensors.
int append_layouts(PyObject* list, std::vector<int64_t>& out) {
  if (!PyList_Check(list)) {
    PyErr_SetString(PyExc_TypeError, "layouts() takes a list of tensors");
    return -1;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
    PyObject* obj = PyList_GET_ITEM(list, i);
    if (!THPVariable_Check(obj)) {
      PyErr_SetString(PyExc_TypeError, "layouts() takes a list of tensors");
      return -1;
    }
    const at::Tensor& t = THPVariable_Unpack(obj);
    out.push_back(static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())));
    out.push_back(t.dim());
    for (int64_t size : t.sizes()) out.push_back(size);
    for (int64_t stride : t.strides()) out.push_back(stride);
  }
  return 0;
}

// layouts(tensors: list) -> bytes: the layouts of append_layouts, for same_layouts() to compare
PyObject* layouts(PyObject*, PyObject* list) {
  try {
    std::vector<int64_t> out;
    if (append_layouts(list, out) < 0) return nullptr;
    return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(out.data()),
                                     static_cast<Py_ssize_t>(out.size() * sizeof(int64_t)));
  } catch (...) {
    fail();
    return nullptr;
  }
}

// same_layouts(tensors: list, snapshot: bytes) -> bool: whether every tensor still has the address,
// sizes and strides layouts() saw. One loop in C++ that compares in place and stops at the first
// difference: PyTorch's own checks (its data-pointer check and Dynamo's TensorGuards) take 60 µs for
// the 258 tensors of a small graph, more than its replay; this loop a few.
PyObject* same_layouts(PyObject*, PyObject* args) {
  PyObject *list, *snapshot;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &list, &PyBytes_Type, &snapshot)) return nullptr;
  try {
    const auto* seen = reinterpret_cast<const int64_t*>(PyBytes_AS_STRING(snapshot));
    const int64_t* end = seen + static_cast<size_t>(PyBytes_GET_SIZE(snapshot)) / sizeof(int64_t);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
      PyObject* obj = PyList_GET_ITEM(list, i);
      if (!THPVariable_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "same_layouts() takes a list of tensors");
        return nullptr;
      }
      const at::Tensor& t = THPVariable_Unpack(obj);
      const int64_t dim = t.dim();
      if (end - seen < 2 + 2 * dim ||
          seen[0] != static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())) || seen[1] != dim ||
          !t.sizes().equals(c10::IntArrayRef(seen + 2, static_cast<size_t>(dim))) ||
          !t.strides().equals(c10::IntArrayRef(seen + 2 + dim, static_cast<size_t>(dim))))
        Py_RETURN_FALSE;
      seen += 2 + 2 * dim;
    }
    return PyBool_FromLong(seen == end);
  } catch (...) {
    fail();
    return nullptr;
  }
}

// the threads a host copy spreads over: PyTorch's intra-op threads (torch.set_num_threads), read in
// the calling thread (the copy stream's host functions run in the driver's thread)
int copy_threads() {
  return at::get_num_threads();
}

// streaming_copy over PyTorch's CPU threads (at::parallel_for, pieces of 128 KiB; one piece runs in
// the calling thread): the staging copies, in the submitting thread and on the host lanes. (Helper
// threads of our own, as the copy stream's host function uses, make copies through the lanes' rings
// several times slower, for a reason not found: 16 MiB in 1.1 -> 1.8-6.8 ms.)
void parallel_streaming_copy(char* dst, const char* src, size_t n) {
  at::parallel_for(0, static_cast<int64_t>(n), 128 << 10, [&](int64_t begin, int64_t end) {
    streamdag_host_copy::streaming_copy(dst + begin, src + begin, static_cast<size_t>(end - begin));
  });
}

// A host copy that a CUDA stream runs once it reaches it (cudaLaunchHostFunc: on the driver's callback
// thread, which may make no CUDA call): a small pageable copy out unstages so, in stream order after
// its DMA, with no host lane and no Python in between.
struct HostCopy {
  void* dst;
  const void* src;
  size_t n;
  int threads;
};

void CUDART_CB run_host_copy(void* arg) {
  auto* copy = static_cast<HostCopy*>(arg);
  try {  // over helper threads that join as they wake (_host_copy.h): where an OpenMP team's wake-up
         // holds each copy out (2-8 MiB out 0.1-0.2 ms slower, timed in turns)
    streamdag_host_copy::parallel_streaming_copy(static_cast<char*>(copy->dst),
                                                 static_cast<const char*>(copy->src), copy->n, copy->threads);
  } catch (...) {  // (nothing may leave a host function) the helpers could not start: this one alone
    std::memcpy(copy->dst, copy->src, copy->n);
  }
  delete copy;
}

// host_copy(dst, src, nbytes): queue that copy on the current stream; the caller keeps both buffers
// alive until the stream is past it
PyObject* host_copy(PyObject*, PyObject* args) {
  unsigned long long dst, src, n;
  if (!PyArg_ParseTuple(args, "KKK", &dst, &src, &n)) return nullptr;
  try {
    // the current stream of the current device, read here: torch.cuda.current_stream() in Python
    // cost a small copy out several µs
    auto stream = c10::cuda::getCurrentCUDAStream();
    auto* copy = new HostCopy{reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                              static_cast<size_t>(n), copy_threads()};
    cudaError_t err = cudaLaunchHostFunc(stream.stream(), run_host_copy, copy);
    if (err != cudaSuccess) {
      delete copy;
      C10_CUDA_CHECK(err);
    }
    Py_RETURN_NONE;
  } catch (...) {
    fail();
    return nullptr;
  }
}

// body() with the GIL released; 0, or -1 with what it threw raised as PyTorch raises it
template <typename Body>
int without_gil(Body&& body) {
  std::exception_ptr error;
  Py_BEGIN_ALLOW_THREADS
  try {
    body();
  } catch (...) {
    error = std::current_exception();
  }
  Py_END_ALLOW_THREADS
  if (!error) return 0;
  try {
    std::rethrow_exception(error);
  } catch (...) {
    return fail();
  }
}

// spin_wait(event, seconds) -> bool: whether the event has completed, queried over and over with
// the GIL released until it has or ``seconds`` have passed. For a thread that waits on one op: it
// sees the event complete within a query (~1 µs), as torch.cuda.synchronize() does, where a poll
// between sleeps sees it a sleep's overshoot late (tens of µs) and a thread that holds the GIL
// while it polls keeps every other Python thread waiting. Relaxed capture mode, as query().
PyObject* spin_wait(PyObject*, PyObject* args) {
  PyObject* event;
  double seconds;
  if (!PyArg_ParseTuple(args, "Od", &event, &seconds)) return nullptr;
  at::cuda::CUDAEvent& ev = event_of(event);
  int done = 0;
  int status = without_gil([&] {
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (!(done = ev.query() ? 1 : 0) && std::chrono::steady_clock::now() < until) {
      std::this_thread::yield();
    }
  });
  if (status < 0) return nullptr;
  return PyBool_FromLong(done);
}

// query_relaxed(event) -> bool: event.query(), made in relaxed capture mode (as every query of
// ours): a thread that waits on one op finishes it without switching its own mode around the query
// (two driver calls through ctypes, some µs), and a CUDA graph capture in global
// mode in another thread is neither refused nor ended by it.
PyObject* query_relaxed(PyObject*, PyObject* event) {
  try {
    c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    return PyBool_FromLong(event_of(event).query() ? 1 : 0);
  } catch (...) {
    fail();
    return nullptr;
  }
}

// stage_copy(dst, src, nbytes): copy nbytes from address src to address dst (into a pinned staging
// buffer, or out of one into a large destination), over PyTorch's CPU threads (at::parallel_for,
// pieces of 128 KiB) with streaming stores, the GIL released. A pageable copy in stages its data so
// before its DMA: 2 MiB staged and copied in 0.09 ms against 0.13 with PyTorch's copy_ (0.20 for
// PyTorch's own pageable copy), 8 MiB 0.33 against 0.46 (0.70). The caller keeps
// both buffers alive.
PyObject* stage_copy(PyObject*, PyObject* args) {
  unsigned long long dst, src, n;
  if (!PyArg_ParseTuple(args, "KKK", &dst, &src, &n)) return nullptr;
  int status = without_gil([&] {
    parallel_streaming_copy(reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src), static_cast<size_t>(n));
  });
  if (status < 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* set_submitted_in_capture(PyObject*, PyObject* cls) {
  Py_INCREF(cls);
  Py_XSETREF(submitted_in_capture, cls);
  Py_RETURN_NONE;
}

// copy_into(dsts: list, srcs: list) -> bool: each src copied into its dst, one cudaMemcpyAsync each on
// the current stream of their device, where every pair is on one CUDA device with one dtype, the same
// sizes and strides, and dense, so that each is one span of bytes; False, with nothing copied, where a
// pair is not (the caller then copies with copy_). A whole-call replay copies its inputs so before its
// graph launches: copy_'s dispatch is most of the host time before the launch.
PyObject* copy_into(PyObject*, PyObject* args) {
  PyObject *dsts, *srcs;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &dsts, &PyList_Type, &srcs)) return nullptr;
  try {
    Py_ssize_t n = PyList_GET_SIZE(dsts);
    if (PyList_GET_SIZE(srcs) != n) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject *d_obj = PyList_GET_ITEM(dsts, i), *s_obj = PyList_GET_ITEM(srcs, i);
      if (!THPVariable_Check(d_obj) || !THPVariable_Check(s_obj)) Py_RETURN_FALSE;
      const at::Tensor& d = THPVariable_Unpack(d_obj);
      const at::Tensor& s = THPVariable_Unpack(s_obj);
      if (!d.is_cuda() || !s.is_cuda() || d.get_device() != s.get_device() ||
          d.scalar_type() != s.scalar_type() || d.sizes() != s.sizes() || d.strides() != s.strides() ||
          d.is_conj() || s.is_conj() || d.is_neg() || s.is_neg() ||
          !d.is_non_overlapping_and_dense() || !s.is_non_overlapping_and_dense())
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      const at::Tensor& d = THPVariable_Unpack(PyList_GET_ITEM(dsts, i));
      const at::Tensor& s = THPVariable_Unpack(PyList_GET_ITEM(srcs, i));
      size_t bytes = static_cast<size_t>(s.numel()) * s.element_size();
      if (bytes == 0 || d.data_ptr() == s.data_ptr()) continue;
      C10_CUDA_CHECK(cudaMemcpyAsync(d.data_ptr(), s.data_ptr(), bytes, cudaMemcpyDeviceToDevice,
                                     c10::cuda::getCurrentCUDAStream(d.get_device()).stream()));
    }
    Py_RETURN_TRUE;
  } catch (...) {
    fail();
    return nullptr;
  }
}

// Whether ``t`` is a dense CUDA tensor, one span of bytes that one cudaMemcpyAsync copies (checked
// before its sizes are read: a nested or sparse tensor has none)
bool one_span(const at::Tensor& t) {
  return t.layout() == c10::kStrided && !t.is_nested() && t.is_cuda() && !t.is_conj() && !t.is_neg() &&
         t.is_non_overlapping_and_dense();
}

// fresh_copies(tensors: list) -> list | None: a new tensor of each one's layout with its values, on the
// current stream of its device, where every one is a dense CUDA tensor (one span of bytes); None,
// with nothing allocated, otherwise. A whole-call replay hands its outputs to the caller so:
// torch.empty_like's dispatch and a copy per output were most of its host time after the launch.
// One or two outputs are copied by one cudaMemcpyAsync each; three or more of one dtype by one
// _foreach_copy_, whose dispatch costs about two memcpys' host time and whose kernels copy every
// tensor at once (25 outputs, a language model's logits and cache: 52 µs against 182 µs for a memcpy
// each). The copies are made below autograd, as the memcpys are.
constexpr Py_ssize_t kForeachFrom = 3;

// The dtypes _foreach_copy_'s CUDA kernel copies (all types, complex, half, bfloat16, bool); any
// other (unsigned ints past uint8, float8, complex32) is copied by cudaMemcpyAsync
bool foreach_copies(c10::ScalarType t) {
  switch (t) {
    case c10::kByte: case c10::kChar: case c10::kShort: case c10::kInt: case c10::kLong:
    case c10::kFloat: case c10::kDouble: case c10::kComplexFloat: case c10::kComplexDouble:
    case c10::kHalf: case c10::kBFloat16: case c10::kBool:
      return true;
    default:
      return false;
  }
}

PyObject* fresh_copies(PyObject*, PyObject* list) {
  if (!PyList_Check(list)) {
    PyErr_SetString(PyExc_TypeError, "fresh_copies() takes a list of tensors");
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(list);
  bool one_dtype = true;
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* obj = PyList_GET_ITEM(list, i);
      if (!THPVariable_Check(obj)) Py_RETURN_NONE;
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (!one_span(t)) Py_RETURN_NONE;
      one_dtype = one_dtype && t.scalar_type() == THPVariable_Unpack(PyList_GET_ITEM(list, 0)).scalar_type();
    }
  } catch (...) {
    fail();
    return nullptr;
  }
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  try {
    const bool foreach =
        n >= kForeachFrom && one_dtype && foreach_copies(THPVariable_Unpack(PyList_GET_ITEM(list, 0)).scalar_type());
    std::vector<at::Tensor> srcs, dsts;
    if (foreach) {
      srcs.reserve(n);
      dsts.reserve(n);
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      const at::Tensor& t = THPVariable_Unpack(PyList_GET_ITEM(list, i));
      at::Tensor fresh = at::empty_strided(t.sizes(), t.strides(), t.options());
      const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
      if (foreach) {
        if (bytes != 0) {
          srcs.push_back(t);
          dsts.push_back(fresh);
        }
      } else if (bytes != 0) {
        C10_CUDA_CHECK(cudaMemcpyAsync(fresh.data_ptr(), t.data_ptr(), bytes, cudaMemcpyDeviceToDevice,
                                       c10::cuda::getCurrentCUDAStream(t.get_device()).stream()));
      }
      PyObject* wrapped = THPVariable_Wrap(std::move(fresh));
      if (wrapped == nullptr) {
        Py_DECREF(out);
        return nullptr;
      }
      PyList_SET_ITEM(out, i, wrapped);
    }
    if (!dsts.empty()) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      at::_foreach_copy_(dsts, srcs);
    }
  } catch (...) {
    Py_DECREF(out);
    fail();
    return nullptr;
  }
  return out;
}

// -- a whole call's launch -------------------------------------------------------------------
// A whole-call graph (frontend/whole_replay.py) replays only for a call whose arguments match the
// captured call's: each tensor's sizes, strides, dtype, device, requires_grad and inference-ness,
// each other argument's type and value, and the inference mode. In Python the key (a tuple per
// argument, then a dict lookup) and the copies into the graph's inputs took 12-18 µs of host time
// before each launch, at batch 1 as long as some models' whole graph takes to launch. A
// LaunchPlan keeps the captured call's arguments; whole_launch() compares a call with it, copies
// its tensors in and launches the graph in one C++ call.

const char* const kLaunchPlan = "streamdag.whole_launch_plan";

struct ArgPlan {
  PyObject* name = nullptr;      // a keyword argument's name (owned); nullptr for a positional one
  PyObject* constant = nullptr;  // a non-tensor argument's value (owned); nullptr for a tensor
  // a tensor's layout as captured, and the graph's input it is copied into
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype = at::kFloat;
  c10::Device device{c10::kCPU};
  bool requires_grad = false, inference = false;
  at::Tensor input;
  size_t bytes = 0;
};

struct LaunchPlan {
  Py_ssize_t positional = 0, keywords = 0;
  bool inference_mode = false;
  std::vector<ArgPlan> args;  // the positional ones, then the keyword ones
  PyObject* replay = nullptr;  // the graph's replay (owned)

  LaunchPlan() = default;
  LaunchPlan(const LaunchPlan&) = delete;
  LaunchPlan& operator=(const LaunchPlan&) = delete;
  ~LaunchPlan() {  // (a capsule's destructor runs with the GIL held)
    for (auto& a : args) {
      Py_XDECREF(a.name);
      Py_XDECREF(a.constant);
    }
    Py_XDECREF(replay);
  }
};

// Whether ``obj`` is a tensor exactly as ``a`` was captured (a subclass, a Parameter among them, is not)
bool same_tensor(PyObject* obj, const ArgPlan& a) {
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  // (a nested or sparse tensor has no strides to read: its sizes() would throw)
  return t.layout() == c10::kStrided && !t.is_nested() && t.scalar_type() == a.dtype &&
         t.device() == a.device && t.sizes().equals(a.sizes) &&
         t.strides().equals(a.strides) && t.requires_grad() == a.requires_grad &&
         t.is_inference() == a.inference && !t.is_conj() && !t.is_neg();
}

// Whether ``obj`` is the argument ``a`` plans for: the same tensor layout, or an equal constant
bool same_argument(PyObject* obj, const ArgPlan& a) {
  if (a.constant == nullptr) return same_tensor(obj, a);
  if (obj == a.constant) return true;
  if (Py_TYPE(obj) != Py_TYPE(a.constant)) return false;
  int eq = PyObject_RichCompareBool(obj, a.constant, Py_EQ);
  if (eq < 0) PyErr_Clear();  // (a constant's comparison does not raise; a miss if it did)
  return eq == 1;
}

// the plan of one argument of the captured call: a tensor with its graph input, or a constant
bool plan_argument(PyObject* obj, PyObject* name, PyObject* inputs, Py_ssize_t* next, LaunchPlan& plan) {
  ArgPlan a;
  if (!THPVariable_Check(obj)) {
    Py_INCREF(obj);
    a.constant = obj;
  } else {
    if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
        *next >= PyList_GET_SIZE(inputs))
      return false;  // a Parameter is keyed by its address too (the Python key does that)
    PyObject* in_obj = PyList_GET_ITEM(inputs, (*next)++);
    if (!THPVariable_Check(in_obj)) return false;
    const at::Tensor& t = THPVariable_Unpack(obj);
    const at::Tensor& in = THPVariable_Unpack(in_obj);
    if (!one_span(t) || !one_span(in) || in.device() != t.device() || in.scalar_type() != t.scalar_type() ||
        !in.sizes().equals(t.sizes()) || !in.strides().equals(t.strides()))
      return false;
    a.sizes = t.sizes().vec();
    a.strides = t.strides().vec();
    a.dtype = t.scalar_type();
    a.device = t.device();
    a.requires_grad = t.requires_grad();
    a.inference = t.is_inference();
    a.input = in;
    a.bytes = static_cast<size_t>(in.numel()) * in.element_size();
  }
  if (name != nullptr) {
    Py_INCREF(name);
    a.name = name;
  }
  plan.args.push_back(std::move(a));
  return true;
}

// launch_plan(args: tuple, kwargs: dict, inputs: list, replay, inference_mode: bool) -> capsule | None:
// the plan of a captured call with these arguments (``inputs``: the graph's input tensors, for the
// tensor arguments in order, the positional ones first), whose graph ``replay()`` launches; None
// where whole_launch() cannot copy one of its tensors (the Python path does)
PyObject* launch_plan(PyObject*, PyObject* args) {
  PyObject *call_args, *call_kwargs, *inputs, *replay;
  int inference_mode;
  if (!PyArg_ParseTuple(args, "O!O!O!Op", &PyTuple_Type, &call_args, &PyDict_Type, &call_kwargs, &PyList_Type,
                        &inputs, &replay, &inference_mode))
    return nullptr;
  try {
    auto plan = std::make_unique<LaunchPlan>();
    plan->positional = PyTuple_GET_SIZE(call_args);
    plan->keywords = PyDict_GET_SIZE(call_kwargs);
    plan->inference_mode = inference_mode != 0;
    Py_ssize_t next = 0;
    for (Py_ssize_t i = 0; i < plan->positional; ++i)
      if (!plan_argument(PyTuple_GET_ITEM(call_args, i), nullptr, inputs, &next, *plan)) Py_RETURN_NONE;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(call_kwargs, &pos, &key, &value))
      if (!plan_argument(value, key, inputs, &next, *plan)) Py_RETURN_NONE;
    if (next != PyList_GET_SIZE(inputs)) Py_RETURN_NONE;
    Py_INCREF(replay);
    plan->replay = replay;
    PyObject* capsule = PyCapsule_New(plan.get(), kLaunchPlan, [](PyObject* c) {
      delete static_cast<LaunchPlan*>(PyCapsule_GetPointer(c, kLaunchPlan));
    });
    if (capsule != nullptr) plan.release();
    return capsule;
  } catch (...) {
    fail();
    return nullptr;
  }
}

// whole_launch(plan, args: tuple, kwargs: dict) -> bool: where the call's arguments are those the
// plan was made for (and grad mode is off), its tensors copied into the graph's inputs (one
// cudaMemcpyAsync each, on the current stream) and the graph launched: True; False, with nothing
// copied or launched, otherwise
PyObject* whole_launch(PyObject*, PyObject* const* argv, Py_ssize_t argc) {
  if (argc != 3) {
    PyErr_SetString(PyExc_TypeError, "whole_launch(plan, args: tuple, kwargs: dict)");
    return nullptr;
  }
  auto* plan = static_cast<LaunchPlan*>(PyCapsule_GetPointer(argv[0], kLaunchPlan));
  if (plan == nullptr) return nullptr;
  PyObject *call_args = argv[1], *call_kwargs = argv[2];
  if (!PyTuple_Check(call_args) || !PyDict_Check(call_kwargs))  // (the Python path keys such a call)
    Py_RETURN_FALSE;
  if (c10::GradMode::is_enabled() || c10::InferenceMode::is_enabled() != plan->inference_mode ||
      PyTuple_GET_SIZE(call_args) != plan->positional || PyDict_GET_SIZE(call_kwargs) != plan->keywords)
    Py_RETURN_FALSE;
  const Py_ssize_t n = static_cast<Py_ssize_t>(plan->args.size());
  PyObject* given[64];
  if (n > 64) Py_RETURN_FALSE;  // (the Python path keys such a call)
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      const ArgPlan& a = plan->args[i];
      PyObject* obj = a.name == nullptr ? PyTuple_GET_ITEM(call_args, i)
                                        : PyDict_GetItemWithError(call_kwargs, a.name);
      if (obj == nullptr) {
        if (PyErr_Occurred()) return nullptr;
        Py_RETURN_FALSE;
      }
      if (!same_argument(obj, a)) Py_RETURN_FALSE;
      given[i] = obj;
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      const ArgPlan& a = plan->args[i];
      if (a.constant != nullptr || a.bytes == 0) continue;
      const at::Tensor& t = THPVariable_Unpack(given[i]);
      if (t.data_ptr() == a.input.data_ptr()) continue;
      C10_CUDA_CHECK(cudaMemcpyAsync(a.input.data_ptr(), t.data_ptr(), a.bytes, cudaMemcpyDeviceToDevice,
                                     c10::cuda::getCurrentCUDAStream(a.device.index()).stream()));
    }
  } catch (...) {
    fail();
    return nullptr;
  }
  PyObject* done = PyObject_CallNoArgs(plan->replay);
  if (done == nullptr) return nullptr;
  Py_DECREF(done);
  Py_RETURN_TRUE;
}

// Drops cuBLAS's and cuBLASLt's workspaces of one stream (its address), as newer PyTorch's
// clearCublasWorkspacesForStream does: torch._C._cuda_clearCublasWorkspaces drops every
// stream's, and a graph captured elsewhere may still read the workspace of its own stream.
// False where this PyTorch's workspace maps are not known to be guarded by their mutex.
PyObject* clear_blas_workspaces(PyObject*, PyObject* arg) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
  void* stream = PyLong_AsVoidPtr(arg);
  if (stream == nullptr && PyErr_Occurred()) return nullptr;
  try {
    at::cuda::clearCublasWorkspacesForStream(static_cast<cudaStream_t>(stream));
  } catch (...) {
    fail();
    return nullptr;
  }
  Py_RETURN_TRUE;
#elif TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11
  void* stream = PyLong_AsVoidPtr(arg);
  if (stream == nullptr && PyErr_Occurred()) return nullptr;
  try {  // (what clearCublasWorkspacesForStream does, before PyTorch declared it)
    for (auto* workspaces : {&at::cuda::cublas_handle_stream_to_workspace(),
                             &at::cuda::cublaslt_handle_stream_to_workspace()}) {
      std::unique_lock<std::shared_mutex> lock(workspaces->mutex);
      auto& map = workspaces->map;
      for (auto it = map.begin(); it != map.end();) {
        it = std::get<1>(it->first) == stream ? map.erase(it) : std::next(it);
      }
    }
  } catch (...) {
    fail();
    return nullptr;
  }
  Py_RETURN_TRUE;
#else
  (void)arg;
  Py_RETURN_FALSE;
#endif
}

PyMethodDef module_methods[] = {
    {"clear_blas_workspaces", clear_blas_workspaces, METH_O,
     "clear_blas_workspaces(stream address) -> bool: cuBLAS's workspaces of that stream dropped"},
    {"launch_plan", launch_plan, METH_VARARGS,
     "launch_plan(args, kwargs, inputs, replay, inference_mode) -> the plan of whole_launch(), or None"},
    {"whole_launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(whole_launch)), METH_FASTCALL,
     "whole_launch(plan, args, kwargs) -> bool: the graph launched for a call like the planned one"},
    {"fresh_copies", fresh_copies, METH_O,
     "fresh_copies(tensors) -> a new copy of each (dense CUDA tensors), or None"},
    {"copy_into", copy_into, METH_VARARGS,
     "copy_into(dsts, srcs) -> bool: dense same-layout CUDA copies on the current stream, or False"},
    {"new_stream", new_stream, METH_VARARGS,
     "new_stream(device, blocking=False) -> address of a new CUDA stream, non-blocking unless asked"},
    {"layouts", layouts, METH_O, "layouts(tensors) -> bytes: their addresses, sizes and strides"},
    {"same_layouts", same_layouts, METH_VARARGS,
     "same_layouts(tensors, layouts) -> bool: whether each still has the address, sizes and strides"},
    {"host_copy", host_copy, METH_VARARGS,
     "host_copy(dst, src, nbytes): a host copy (over helper threads) that the current stream runs in order"},
    {"stage_copy", stage_copy, METH_VARARGS,
     "stage_copy(dst, src, nbytes): a host copy over PyTorch's threads with streaming stores"},
    {"query_relaxed", query_relaxed, METH_O,
     "query_relaxed(event) -> bool: whether the event has completed, queried in relaxed capture mode"},
    {"spin_wait", spin_wait, METH_VARARGS,
     "spin_wait(event, seconds) -> bool: whether the event completed, queried with the GIL released"},
    {"set_submitted_in_capture", set_submitted_in_capture, METH_O,
     "set_submitted_in_capture(cls): the exception an op submitted inside a CUDA graph capture raises"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, TORCH_EXTENSION_NAME_STR,
                          "streamdag's CUDA calls in C++ (see _torch_hooks.h).", -1, module_methods};

}  // namespace

PyMODINIT_FUNC TORCH_EXTENSION_INIT(void) {
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  PyObject* capsule = PyCapsule_New(&hooks, STREAMDAG_TORCH_HOOKS_CAPSULE, nullptr);
  if (capsule == nullptr || PyModule_AddObject(m, "hooks", capsule) < 0) {
    Py_XDECREF(capsule);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
