/* What the torch extension (_torch.cpp) hands the compiled hot path (_speedups.c), in a capsule:
 * reads of tensors and CUDA calls made in C++ against PyTorch's own headers, where _speedups.c
 * (plain CPython API) goes through PyTorch's Python bindings. Each returns -1 with a Python
 * exception set on failure. */
#ifndef STREAMDAG_TORCH_HOOKS_H
#define STREAMDAG_TORCH_HOOKS_H

#define STREAMDAG_TORCH_HOOKS_VERSION 5
#define STREAMDAG_TORCH_HOOKS_CAPSULE "streamdag.native._torch.hooks"

/* the caller's stream and device, kept across a launch, and the CUDA context the op began in */
typedef struct { long long stream_id, device_index, device_type, device; void *context; } StreamdagSaved;

typedef struct {
    int version;
    /* a contiguous strided tensor (torch.Tensor or Parameter, on the CPU or a GPU): 1 and its
     * device index (-1: the CPU) and byte range; 0: anything else (the caller reads it itself) */
    int (*region)(PyObject *tensor, long long *device, long long *start, long long *end);
    /* order ``stream`` (a torch.cuda.Stream) after the caller's current stream on its device through
     * ``caller_event`` (a torch.cuda.Event), then make it current (and its device); ``saved``
     * keeps what leave() restores */
    int (*enter)(PyObject *stream, PyObject *caller_event, StreamdagSaved *saved);
    int (*leave)(const StreamdagSaved *saved);
    /* ``event.record(stream)`` and ``event.wait(stream)`` of torch.cuda.Event. ``device``: the
     * current device where the caller knows it (else -1); on the stream's device, with no stream
     * sanitizer tracing, the CUDA call is made directly, without PyTorch's device guard (which asks
     * CUDA for the current device at every call) */
    int (*record)(PyObject *event, PyObject *stream, long long device);
    int (*wait)(PyObject *event, PyObject *stream, long long device);
    /* ``event.query()`` of a torch.cuda.Event (the caller checks the type): 1 completed, 0 not yet */
    int (*query)(PyObject *event);
    /* a copy between torch tensors ``dst`` and ``src``, ``host`` one of them: 1 if ``host`` is in
     * pinned memory and both have one dtype and shape; 0 if not (or either is no plain tensor) */
    int (*pinned_alike)(PyObject *dst, PyObject *src, PyObject *host);
} StreamdagTorchHooks;

#endif
