"""The CUDA backend's completion pass and its finish of one waited op, compiled
(``native/_submit.c``) against the Python code, on stand-in events (no GPU needed); and which CUDA
errors lose the device: told by their own words."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamdag import native

compiled = pytest.mark.skipif(native.load() is None, reason=f"no compiled hot path: {native.status()}")


_ENTRY = st.tuples(st.booleans(), st.booleans(), st.sampled_from(["", "", "", "loses", "raises"]),
                   st.sampled_from(["", "", "sticky", "refused"]))


class _Owner:
    """A completion pass's owner, as ``CudaBackend`` is one: its device loss and its event pool."""

    def __init__(self, lost=None):
        self.lost = lost
        self._free_events = []

    def mark_lost(self, exc):  # as CudaBackend's
        from streamdag.backends import cuda

        if cuda.refused_during_capture(exc):
            return None
        self.lost = self.lost or f"lost: {exc}"
        return self.lost

    def recycle(self, event):
        if not event.timing:
            self._free_events.append(event)


class _Event:
    """A completion event whose query says ``done``, or raises a sticky or a refused CUDA error."""

    def __init__(self, name, done, timing, raises):
        self.name, self.done, self.timing, self.raises = name, done, timing, raises

    def query(self):
        if self.raises == "sticky":
            raise RuntimeError(f"an illegal memory access at {self.name}")
        if self.raises == "refused":
            raise RuntimeError(f"operation not permitted when stream is capturing: {self.name}")
        return self.done


@compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_ENTRY, max_size=6), min_size=1, max_size=4))
def test_the_compiled_completion_pass_finishes_as_the_python_one(queues):
    """``_Completions._pass``, compiled and in Python: the same callbacks with the same errors in the
    same order, the same events back in the pool, the same entries left, the same device loss (a
    query raising a sticky CUDA error marks it, or a callback does; a query refused during a CUDA
    graph capture leaves its entry queued), the same exception from a callback. Each entry: its
    event's query says done, the event times, what its callback does, what its query raises."""
    from collections import deque

    from streamdag.backends import cuda_completions

    def run(compiled):
        owner, log = _Owner(), []
        completions = object.__new__(cuda_completions._Completions)
        completions._owner = owner

        def callback_for(name, does):
            def callback(error):
                log.append((name, error))
                if does == "loses":
                    owner.lost = f"lost in {name}"
                if does == "raises" and error is None:
                    raise ValueError(f"callback {name}")
            return callback

        completions._queues = [
            deque((j, _Event((i, j), done, timing, raises), callback_for((i, j), does))
                  for j, (done, timing, does, raises) in enumerate(entries))
            for i, entries in enumerate(queues)
        ]
        saved = cuda_completions._compiled_pass
        cuda_completions._compiled_pass = native.load().completions_pass if compiled else None
        try:
            outcome = completions._pass()
        except ValueError as exc:
            outcome = str(exc)
        finally:
            cuda_completions._compiled_pass = saved
        left = [[entry[0] for entry in q] for q in completions._queues]
        return outcome, log, [e.name for e in owner._free_events], left, owner.lost

    assert run(compiled=True) == run(compiled=False)


@compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(_ENTRY, max_size=6), st.integers(0, 7), st.booleans())
def test_the_compiled_finish_of_one_waited_op_is_the_python_one(entries, pick, lost_before):
    """``_Completions._finish_one`` (a waiter's op finished ahead of its queue), compiled and in
    Python: the same answer (finished, left queued, gone already), the same callback with the same
    error, the same events back in the pool, the same entries left, the same device loss. Entries
    as in the pass's test; ``pick``: the entry waited on (past the end: one finished already)."""
    from collections import deque

    from streamdag.backends import cuda, cuda_completions

    def run(compiled):
        owner, log = _Owner("lost before" if lost_before and pick % 3 == 0 else None), []
        completions = object.__new__(cuda_completions._Completions)
        completions._owner = owner
        completions._query_relaxed = lambda event: event.query()
        # tokens as put() makes them for queue 1 of 3: 3k + 1, in order
        def callback_for(j, does):
            def callback(error):
                log.append((j, error))
                if does == "raises":
                    raise ValueError(f"callback {j}")
            return callback

        completions._queues = [deque(), deque(
            (3 * j + 1, _Event(j, done, timing, raises), callback_for(j, does))
            for j, (done, timing, does, raises) in enumerate(entries)), deque()]
        token = 3 * pick + 1
        saved = cuda_completions._compiled_finish_one
        cuda_completions._compiled_finish_one = None
        try:
            if compiled:
                outcome = native.load().completions_finish_one(
                    completions, completions._queues[1], token, owner, owner._free_events, cuda.CudaEvent)
            else:
                outcome = completions._finish_one(token, relaxed=True)
        except ValueError as exc:
            outcome = str(exc)
        finally:
            cuda_completions._compiled_finish_one = saved
        left = [entry[0] for entry in completions._queues[1]]
        return outcome, log, [e.name for e in owner._free_events], left, owner.lost

    assert run(compiled=True) == run(compiled=False)


def test_a_query_refused_during_a_capture_is_no_device_loss():
    """While a CUDA graph is captured in PyTorch's default (global) mode, CUDA refuses event
    queries from every thread: the completion pass must query again later, not fail every op."""
    import types

    from streamdag.backends import cuda
    from streamdag.errors import DeviceLost

    owner = types.SimpleNamespace(lost=None, device="cuda:0")
    refused = RuntimeError("CUDA error: operation not permitted when stream is capturing")
    assert cuda.CudaBackend.mark_lost(owner, refused) is None and owner.lost is None
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered")
    lost = cuda.CudaBackend.mark_lost(owner, sticky)
    assert isinstance(lost, DeviceLost) and owner.lost is lost
    assert cuda.CudaBackend.mark_lost(owner, refused) is None and owner.lost is lost


#: what PyTorch appends to the message of every CUDA error it raises
PYTORCH_ADVICE = (
    "\nSearch for `cudaErrorX' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html"
    " for more information.\nCUDA kernel errors might be asynchronously reported at some other API call,"
    " so the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"
    "\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")


@pytest.mark.parametrize("words, sticky, refused", [
    ("CUDA error: an illegal memory access was encountered", True, False),
    ("CUDA error: device-side assert triggered", True, False),
    ("CUDA error: unspecified launch failure", True, False),
    ("CUDA error: invalid argument", False, False),
    ("CUDA error: invalid configuration argument", False, False),
    ("CUDA error: operation not permitted when stream is capturing", False, True),
    ("CUDA error: operation failed due to a previous error during capture", False, False),
])
def test_cuda_errors_are_told_by_their_own_words_not_pytorchs_advice(words, sticky, refused):
    """Only a sticky error loses the device; PyTorch's advice after every CUDA error mentions
    "device-side assertions", which made every CUDA error count as sticky."""
    from streamdag.backends import cuda

    exc = RuntimeError(words + PYTORCH_ADVICE)
    assert cuda.is_sticky(exc) == sticky
    assert cuda.refused_during_capture(exc) == refused


@pytest.mark.cuda
def test_an_op_submitted_while_the_completion_thread_sleeps_wakes_it_and_finishes_unwaited():
    """The submit's put wakes a sleeping completion thread (``woken``, compiled or in Python): each
    op finishes with nobody waiting on it, and the thread then sleeps again with no wake-up pending."""
    import threading
    import time

    import torch

    import streamdag as sd

    rounds = 3
    with sd.Runtime("cuda", streams=2) as rt:
        completions = rt.backend._completions
        x = torch.zeros(16, device="cuda")
        for _ in range(rounds):
            deadline = time.monotonic() + 10
            while completions._counts.woken or any(completions._queues):  # the thread goes to sleep
                assert time.monotonic() < deadline, "the completion thread never went back to sleep"
                time.sleep(0.01)
            done = threading.Event()
            f = rt.submit(torch.add, x, 1, out=x, reads=[x], writes=[x])
            f.add_done_callback(lambda _, done=done: done.set())
            assert done.wait(10), "an op submitted while the completion thread slept never finished"
    assert x.cpu().eq(rounds).all()
