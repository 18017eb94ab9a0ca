"""The choice between a graph's candidates: the rule that picks one, and their captures on CUDA.

The rule's tests use made-up timings; the ``cuda`` tests capture and time real candidates.
"""

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")

from compile_models import Inception  # noqa: E402
from streamdag.frontend.candidates import Candidate, pick  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _cand(label, streams, ms, mib=10.0):
    return Candidate(label, streams, lambda args: args, ms=ms, peak_mib=mib)


def test_the_fastest_candidate_is_kept():
    cands = [_cand("eager", 1, 2.0), _cand("inductor", 1, 1.5), _cand("regions x2", 2, 1.0)]
    assert cands[pick(cands)].label == "regions x2"


def test_a_tie_goes_to_fewer_streams():
    cands = [_cand("eager", 1, 1.2), _cand("inductor", 1, 1.0), _cand("regions x2", 2, 0.99),
             _cand("regions x3", 3, 0.985)]
    assert cands[pick(cands, tie=0.02)].label == "inductor"


def test_more_streams_must_beat_the_best_on_fewer_not_only_their_own_kind():
    cands = [_cand("inductor", 1, 1.0), _cand("regions x2", 2, 0.9), _cand("regions x3", 3, 0.89)]
    assert cands[pick(cands, tie=0.02)].label == "regions x2"


def test_a_multi_stream_candidate_that_needs_much_more_memory_is_not_kept():
    cands = [_cand("inductor", 1, 1.0, mib=100), _cand("regions x2", 2, 0.5, mib=200)]
    assert cands[pick(cands, memory_ratio=1.1)].label == "inductor"
    assert "not kept" in cands[1].notes[0]


def test_the_memory_rule_counts_the_graphs_weights_with_each_candidates_pool():
    # a one-stream capture that needs no pool of its own must not reject every second stream
    cands = [_cand("inductor", 1, 1.0, mib=0.0), _cand("regions x3", 3, 0.9, mib=22.0)]
    assert cands[pick(cands, memory_ratio=1.1, base_mib=250.0)].label == "regions x3"
    cands = [_cand("inductor", 1, 1.0, mib=0.0), _cand("regions x3", 3, 0.9, mib=80.0)]
    assert cands[pick(cands, memory_ratio=1.1, base_mib=20.0)].label == "inductor"
    assert "with the graph's inputs it needs 100.0 MiB" in cands[1].notes[0]


def test_each_added_stream_may_hold_its_own_allocator_segments_over_the_memory_ratio():
    """A small model's streams each draw whole segments from the pool (the googlenet case: 24 MiB of
    pool on one stream, 52 on three), which the ratio alone would count against a faster replay."""
    from streamdag.frontend.candidates import STREAM_SEGMENTS_MIB

    lean, weights = 24.0, 26.0
    within = lean + 2 * STREAM_SEGMENTS_MIB
    cands = [_cand("inductor", 1, 1.0, mib=lean), _cand("regions x3", 3, 0.67, mib=within)]
    assert cands[pick(cands, memory_ratio=1.1, base_mib=weights)].label == "regions x3"
    cands = [_cand("inductor", 1, 1.0, mib=lean), _cand("regions x2", 2, 0.67, mib=within)]
    assert cands[pick(cands, memory_ratio=1.1, base_mib=weights)].label == "inductor", \
        "one added stream is allowed one stream's segments, not two"


def test_picking_needs_every_candidate_timed():
    with pytest.raises(ValueError, match="needs its time"):
        pick([Candidate("inductor", 1, lambda a: a)])


def test_one_candidate_given_as_a_string_is_one_label_not_its_letters():
    model = torch.nn.Linear(4, 4).eval()
    fast = sd.compile(model, candidates="inductor")
    assert fast.backend.options.candidates == ("inductor",)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))


# -- CUDA --------------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_every_candidate_is_captured_and_timed_and_the_fastest_kept(no_tf32):
    torch.manual_seed(0)
    m = Inception(c=64).eval().cuda()
    c = sd.compile(m, regions="always")
    x = torch.randn(1, 64, 28, 28, device="cuda")
    with torch.inference_mode():
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    runner = c.backend.runners[0]
    labels = [cand.label for cand in runner.candidates]
    assert labels[:2] == ["eager", "inductor"] and any(lb.startswith("regions x") for lb in labels)
    timed = [cand for cand in runner.candidates if cand.ms is not None]
    assert len(timed) == len(runner.candidates), c.explain()
    fewest = min(cand.ms for cand in timed if cand.streams == 1)
    assert runner.chosen.ms <= fewest * 1.0001, c.explain()
    assert "<- chosen" in c.explain()


@pytest.mark.cuda
def test_a_candidates_capture_is_measured_as_what_its_pool_holds():
    from streamdag.frontend.candidates import CapturedGraph, SharedPool

    x = torch.randn(1024, 1024, device="cuda")
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del held  # cached by the allocator: the capture's own emptying of the cache must not offset it
    cand = Candidate("inductor", 1, lambda args: [args[0] * 2 + 1])
    graph = CapturedGraph(cand, [x], [], [], SharedPool(), x.device, private=True)
    assert graph.peak_bytes >= 2 * x.nbytes  # two temporaries of 4 MiB at least


@pytest.mark.cuda
def test_a_candidate_that_cannot_be_captured_leaves_the_random_generator_and_the_pool_usable():
    from streamdag.frontend.candidates import CapturedGraph, SharedPool

    x = torch.randn(64, device="cuda")
    pool = SharedPool()
    syncs = Candidate("eager", 1, lambda args: [args[0] * float(args[0].sum().item())])
    with pytest.raises(RuntimeError):
        CapturedGraph(syncs, [x], [], [], pool, x.device)
    torch.randn(4, device="cuda")  # no "Offset increment outside graph capture"
    fine = CapturedGraph(Candidate("inductor", 1, lambda args: [args[0] * 2]), [x], [], [], pool, x.device)
    torch.testing.assert_close(fine([x])[0], x * 2)


@pytest.mark.cuda
def test_on_cuda_a_capture_holds_the_cublas_workspace_in_its_pool_not_outside_it():
    """A warm-up on the capture stream allocates cuBLAS's workspace outside any pool; dropped
    around the capture, the graph's workspace is allocated in its pool and given back to it, so
    less stays allocated after the capture than before it, and the replay is still right."""
    from streamdag.frontend.candidates import _capture_stream, workspaces_in_pool
    from streamdag.native import load_torch

    if getattr(load_torch(), "clear_blas_workspaces", None) is None:
        pytest.skip("the torch extension drops no workspace on this PyTorch")
    device = torch.device("cuda")
    a = torch.randn(256, 256, device=device)
    stream = _capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        a @ a  # the workspace of this thread's handle on the capture stream
    expected = a @ a  # (first: a workspace of the current stream's, in both measurements)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with workspaces_in_pool(stream), torch.cuda.graph(graph, stream=stream):
        out = a @ a
    graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < before
    torch.testing.assert_close(out, expected)
