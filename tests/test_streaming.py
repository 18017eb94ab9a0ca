"""``Runtime.stream_map`` on the CPU lanes and the simulated device's random interleavings.

Inputs of random sizes are cut into pieces through a small ring of reused
buffers; the outputs must equal ``fn`` on each whole input exactly, whatever
the interleaving (a piece copied into a buffer before the compute of the
buffer's previous piece read it would show). A piece that fails must fail its
own input's future only: later pieces reuse the buffer it read.
"""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import streamdag as sd
from streamdag.backends.inline import InlineBackend

torch = pytest.importorskip("torch")
EXAMPLES = settings(max_examples=200 if os.environ.get("CI") else 40, deadline=None)


def widen(a):
    """Row-wise, elementwise (so exact whatever the pieces): k columns in, 2k out."""
    return torch.cat([a * 3, a - 1], dim=1)


def runtime_of(device, streams, seed):
    if device == "inline":  # ops run inside their submit, as on CUDA: the first piece's op makes the outputs
        return sd.Runtime(backend=InlineBackend("cpu", streams))
    return sd.Runtime(device, streams=streams, **({"seed": seed} if device == "sim" else {}))


batch_shapes = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5)), min_size=1, max_size=4)


@EXAMPLES
@given(batch_shapes, st.sampled_from([torch.float32, torch.float64, torch.int32]),
       st.integers(1, 200), st.integers(2, 5), st.sampled_from(["cpu", "sim", "inline"]), st.integers(1, 4),
       st.integers(0, 2**16), st.booleans(), st.booleans())
def test_stream_map_equals_fn_on_each_whole_input(shapes, dtype, piece_bytes, buffers, device, streams,
                                                  seed, give_out, capture):
    g = torch.Generator().manual_seed(seed)
    k = shapes[0][1]  # one row width for all, so the inputs share the ring's buffers
    inputs = [(torch.randn(rows, k, generator=g) * 100).to(dtype) for rows, _ in shapes]
    expect = [widen(x) for x in inputs]
    out = [torch.full_like(e, -7) for e in expect] if give_out else None
    with runtime_of(device, streams, seed) as rt:
        futures = rt.stream_map(widen, inputs, out, piece_bytes=piece_bytes, buffers=buffers,
                                capture=capture)
        results = [f.result(timeout=60) for f in futures]
        if capture:  # again, with new data, through the recorded graphs of the first call
            again = [x + 1 for x in inputs]
            for x, f in zip(again, rt.stream_map(widen, again, piece_bytes=piece_bytes, buffers=buffers,
                                                 capture=True)):  # (without out: made as last time)
                got = f.result(timeout=60)
                assert (torch.equal(got, widen(x)) and got.dtype == x.dtype) or x.numel() == 0
    for i, (got, want) in enumerate(zip(results, expect)):
        if give_out:
            assert got is out[i]
        if want.numel():
            assert torch.equal(got, want) and got.dtype == want.dtype
        else:
            assert got.shape[0] == 0


@EXAMPLES
@given(batch_shapes, st.sampled_from([torch.float32, torch.int32]), st.integers(1, 200), st.integers(2, 5),
       st.sampled_from(["cpu", "sim", "inline"]), st.integers(1, 4), st.integers(0, 2**16))
def test_a_recorded_stream_map_computes_into_out_on_every_run_of_the_graph(shapes, dtype, piece_bytes,
                                                                          buffers, device, streams, seed):
    """Inside ``rt.record()`` the pieces' copies and computes are recorded, not run: each run of the
    graph reads the inputs as they are then and fills ``out`` (on CUDA, one captured graph)."""
    g = torch.Generator().manual_seed(seed)
    k = shapes[0][1]
    inputs = [(torch.randn(rows, k, generator=g) * 100).to(dtype) for rows, _ in shapes]
    out = [torch.full((rows, 2 * k), -7, dtype=dtype) for rows, _ in shapes]
    with runtime_of(device, streams, seed) as rt:
        with rt.record() as graph:
            returned = rt.stream_map(widen, inputs, out, piece_bytes=piece_bytes, buffers=buffers)
        assert len(returned) == len(out) and all(r is o for r, o in zip(returned, out))
        assert all(bool((o == -7).all()) for o in out)  # recorded: nothing ran yet
        for _ in range(3):  # new data in the same host tensors each time
            for x in inputs:
                x.add_(1)
            graph.run().result(timeout=60)
            assert all(torch.equal(o, widen(x)) for o, x in zip(out, inputs))


@EXAMPLES
@given(st.lists(st.integers(1, 30), min_size=2, max_size=5), st.data(), st.integers(1, 64),
       st.integers(2, 4), st.integers(1, 3), st.integers(0, 2**16))
def test_a_failing_piece_fails_its_own_input_only(rows, data, piece_bytes, buffers, streams, seed):
    inputs = [torch.arange(n, dtype=torch.float32).reshape(n, 1) + 1000 * b for b, n in enumerate(rows)]
    bad = data.draw(st.sets(st.integers(0, len(rows) - 1), max_size=len(rows) - 1))
    poison = {1000.0 * b + data.draw(st.integers(0, n - 1)) for b, n in enumerate(rows) if b in bad}

    def fn(a):
        if any(float(v) in poison for v in a.flatten()):
            raise KeyError("bad row")
        return a * 2

    with sd.Runtime("sim", streams=streams, seed=seed) as rt:
        futures = rt.stream_map(fn, inputs, [torch.zeros(n, 1) for n in rows], piece_bytes=piece_bytes,
                                buffers=buffers)
        if bad:
            with pytest.raises(sd.ExceptionGroup):
                rt.synchronize()
    for b, f in enumerate(futures):
        if b in bad:
            err = f.exception()
            assert isinstance(err, sd.DependencyFailed) and isinstance(err.root_error, KeyError)
        else:
            assert torch.equal(f.result(), inputs[b] * 2)


@pytest.mark.parametrize("device", ["cpu", "inline"])
def test_without_out_a_failing_first_piece_raises_from_the_call_and_the_runtime_goes_on(device):
    """The first piece makes the outputs (inside its op where ops run at submit): when fn fails there,
    nothing can be made, so the call raises fn's error; later calls run as usual."""
    def fn(a):
        if float(a[0, 0]) < 0:
            raise KeyError("negative first row")
        return a * 2

    inline = device == "inline"
    with sd.Runtime(backend=InlineBackend("cpu", 2)) if inline else sd.Runtime("cpu", streams=2) as rt:
        with pytest.raises(KeyError, match="negative first row"):
            rt.stream_map(fn, -torch.ones(10, 2), piece_bytes=16)
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()  # the failure is the runtime's to report too, once
        x = torch.arange(20.0).reshape(10, 2)
        assert torch.equal(rt.stream_map(fn, x, piece_bytes=16).result(timeout=60), x * 2)


def test_one_input_gives_one_future_and_numpy_inputs_are_read_in_place():
    x = np.arange(60, dtype=np.float64).reshape(20, 3)
    with sd.Runtime("cpu", streams=2) as rt:
        f = rt.stream_map(lambda a: a.sum(dim=1, keepdim=True), x, piece_bytes=48)
        assert isinstance(f, sd.Future)
        assert torch.equal(f.result(), torch.from_numpy(x).sum(dim=1, keepdim=True))
        assert rt.stream_map(widen, []) == []


def test_stream_map_refuses_bad_input_and_says_what_to_do():
    x = torch.ones(8, 2)
    with sd.Runtime("cpu", streams=2) as rt:
        with pytest.raises(ValueError, match="reshape it to"):
            rt.stream_map(widen, torch.tensor(1.0))
        with pytest.raises(ValueError, match="one out per input"):
            rt.stream_map(widen, [x, x], [torch.zeros(8, 4)])
        with pytest.raises(ValueError, match="same dim 0"):
            rt.stream_map(widen, x, torch.zeros(7, 4))
        with pytest.raises(ValueError, match="buffers must be at least 2"):
            rt.stream_map(widen, x, buffers=1)
        with pytest.raises(ValueError, match="piece_bytes must be positive"):
            rt.stream_map(widen, x, piece_bytes=0)
        with pytest.raises(TypeError, match="host tensor or numpy array"):
            rt.stream_map(widen, [[1.0, 2.0]])
        # fn must keep the rows: told at once when stream_map learns the output from the first piece,
        with pytest.raises(ValueError, match="map rows one to one"):
            rt.stream_map(lambda a: a[:1], x, piece_bytes=16)
        # and by the piece's future where `out` fixes the shape
        f = rt.stream_map(lambda a: a[:, :1], x, torch.zeros(8, 2), piece_bytes=16)
        with pytest.raises(sd.DependencyFailed) as failed:
            f.result(timeout=10)
        assert "return the trailing shape of `out`" in str(failed.value.root_error)
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
        with rt.record(), pytest.raises(RuntimeError, match=r"inside `with rt.record\(\)` needs `out`"):
            rt.stream_map(widen, x)


def test_captured_calls_from_two_threads_at_once_each_get_their_own_results():
    """Captured calls keep their ring of buffers for the next call with the same function; two
    calls at once must not share one (their pieces' copies into it would interleave)."""
    import concurrent.futures

    inputs = [[torch.arange(400.0).reshape(100, 4) * (t + 1) + 1000 * k for k in range(3)] for t in range(2)]

    def run(t):
        got = []
        for k in range(3):
            got.append(rt.stream_map(widen, inputs[t][k], piece_bytes=64, buffers=2, capture=True))
        return [f.result(timeout=60) for f in got]

    with sd.Runtime("cpu", streams=3) as rt, concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(5):
            results = list(pool.map(run, range(2)))
            for t in range(2):
                for k in range(3):
                    assert torch.equal(results[t][k], widen(inputs[t][k]))


@pytest.mark.parametrize("capture", [False, True])
def test_pieces_in_flight_stay_bounded_however_long_the_input(capture):
    """The submitter waits before more than 2 x buffers pieces await their copy out, so the device
    memory held (a new output per eager piece) does not grow with the input: 300 pieces here."""
    x = torch.arange(600.0).reshape(300, 2)
    with sd.Runtime("sim", streams=2, seed=1) as rt:
        f = rt.stream_map(widen, x, piece_bytes=8, buffers=2, capture=capture)
        assert torch.equal(f.result(timeout=60), widen(x))
        # 3 ops a piece (copy in, compute, copy out), 2 x 2 pieces awaiting copy out, and the next
        assert rt.statistics().peak_inflight <= 3 * (2 * 2 + 1)
