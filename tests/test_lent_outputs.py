"""A whole call's outputs lent in turn: no later call changes a result its caller still holds.

On the CPU, the stand-in device's replay writes the model's result into the captured outputs, as a
CUDA graph writes into its own memory: a replay into a set the caller still holds would change the
caller's tensors, and the comparisons with values taken at each call catch it (the negative control
shows they do).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from streamdag.frontend import lent_outputs  # noqa: E402
from streamdag.frontend.lent_outputs import LENT_SETS, LentSet  # noqa: E402
from whole_call_stand_in import MODES, compiled_conv_net_on_cuda, mlp, whole  # noqa: E402


def _entry(w):
    return next(iter(w.current.entries.values()))


def _sets_replayed(w):
    """How many replays went to lent sets, and how many copied."""
    entry = _entry(w)
    return entry.replays - entry.sets.copied, entry.sets.copied


@pytest.mark.parametrize("mode", list(MODES))
def test_a_loop_that_keeps_the_last_result_is_served_by_the_lent_sets_in_turn(fake_device, mode):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    y = None
    with MODES[mode]():
        for _ in range(8):
            x = torch.randn(3, 8)
            before = None if y is None else y.clone()
            y = w((x,), {}, dynamo)  # the previous y is still held while this call runs
            torch.testing.assert_close(y, m(x))
            if before is not None:
                assert not torch.equal(before, y)
    assert _sets_replayed(w) == (7, 0), w.explain()
    assert f"outputs lent from {LENT_SETS} sets in turn; copied in 0 replays" in w.explain()
    assert y.is_inference() == (mode == "inference_mode")


def test_results_kept_in_a_list_keep_their_values(fake_device):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        xs = [torch.randn(3, 8) for _ in range(6)]
        outs = [w((x,), {}, dynamo) for x in xs]
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out, m(x))
    lent, copied = _sets_replayed(w)
    assert (lent, copied) == (LENT_SETS, 5 - LENT_SETS), w.explain()


def test_a_view_of_a_result_holds_its_set(fake_device):
    m = mlp()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        w((torch.randn(3, 8),), {}, dynamo)
        x1, x2 = torch.randn(3, 8), torch.randn(3, 8)
        row = w((x1,), {}, dynamo)[1]  # only a view of the first lent result is kept
        other = w((x2,), {}, dynamo)  # the second set
        for _ in range(3):  # every later call finds both sets held
            w((torch.randn(3, 8),), {}, dynamo)
        torch.testing.assert_close(row, m(x1)[1])
        torch.testing.assert_close(other, m(x2))
        assert _entry(w).sets.copied == 3, w.explain()
        del other
        w((torch.randn(3, 8),), {}, dynamo)  # the second set is free again
        torch.testing.assert_close(row, m(x1)[1])
    assert _entry(w).sets.copied == 3, w.explain()


def _a_lent_result(fake_device):
    """A model, its whole calls and Dynamo's path, and an input with its result from a lent set (the
    call after the capture's)."""
    m = mlp()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        w((torch.randn(3, 8),), {}, dynamo)
        x = torch.randn(3, 8)
        return m, w, dynamo, x, w((x,), {}, dynamo)


def test_a_results_storage_object_alone_holds_its_set(fake_device):
    m, w, dynamo, x, y = _a_lent_result(fake_device)
    with torch.no_grad():
        storage, shape = y.untyped_storage(), y.shape  # the memory kept, the tensor let go
        del y
        for _ in range(4):
            w((torch.randn(3, 8),), {}, dynamo)
        torch.testing.assert_close(torch.tensor([]).set_(storage).view(shape), m(x))


def test_a_result_written_in_place_by_the_caller_stays_the_callers(fake_device):
    m, w, dynamo, x, y = _a_lent_result(fake_device)
    with torch.no_grad():
        y.mul_(2)
        for _ in range(4):
            z = w((torch.randn(3, 8),), {}, dynamo)
            torch.testing.assert_close(y, m(x) * 2)
        x = torch.randn(3, 8)
        torch.testing.assert_close(w((x,), {}, dynamo), m(x))
        del z


def test_a_result_fed_back_as_the_next_input_is_read_before_it_is_written(fake_device):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        x = want = torch.randn(3, 8)
        for _ in range(8):
            x, want = w((x,), {}, dynamo), m(want)
            torch.testing.assert_close(x, want)


def test_outputs_over_the_lending_limit_are_copied_and_explain_says_so(fake_device, monkeypatch):
    monkeypatch.setattr(lent_outputs, "LEND_BYTES", 16)
    m = mlp()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 8)
            torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert _entry(w).sets is None
    assert "outputs copied at each replay: their 0 MiB are over the 0 MiB lent in turn" in w.explain()


def test_a_caller_that_resizes_a_lent_result_never_gets_that_set_again(fake_device):
    m, w, dynamo, _, y = _a_lent_result(fake_device)
    with torch.no_grad():
        y.resize_(1000)  # the storage gets other memory: the set's graph would write elsewhere
        del y
        for _ in range(4):
            x = torch.randn(3, 8)
            torch.testing.assert_close(w((x,), {}, dynamo), m(x))
    assert sum(s.spoiled for s in _entry(w).sets.sets) == 1


def test_lending_while_the_caller_holds_the_set_would_be_caught(fake_device, monkeypatch):
    """Negative control: a set taken as free while the caller holds its result is overwritten by
    the next call, and the comparison with the value of then sees it."""
    monkeypatch.setattr(LentSet, "free", lambda self: True)
    m = mlp()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        xs = [torch.randn(3, 8) for _ in range(5)]
        outs = [w((x,), {}, dynamo) for x in xs]
    with pytest.raises(AssertionError):
        for x, out in zip(xs, outs):
            torch.testing.assert_close(out, m(x))


STEPS = st.lists(st.tuples(st.sampled_from(["keep", "drop", "view", "write", "feed"]), st.booleans()),
                 min_size=3, max_size=30)


@given(steps=STEPS)
def test_a_random_pattern_of_holding_results_never_sees_them_change(steps, monkeypatch_module):
    """Each call's result is kept whole, dropped, kept as a view, written in place, or fed back as
    the next input; with or without dropping an older result first. Every result still held equals
    what the model returned for it, at the end."""
    from streamdag.frontend import whole_call as wc
    from streamdag.frontend.whole_call import WholeCall
    from whole_call_stand_in import Dynamo, FakeBackend, FakeDevice

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
    dev = FakeDevice(m)
    monkeypatch_module.setattr(wc, "_device_for", lambda device, pool: dev)
    monkeypatch_module.setattr(wc, "_one_cuda_device", lambda args, kwargs: (torch.device("cpu"), ""))
    w, dynamo = WholeCall(m, FakeBackend()), Dynamo(m)
    held = []  # (tensor the caller holds, the value it must have)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for what, drop_oldest in steps:
            if drop_oldest and held:
                held.pop(0)
            y = w((x,), {}, dynamo)
            want = m(x)
            torch.testing.assert_close(y, want)
            if what == "keep":
                held.append((y, want))
            elif what == "view":
                held.append((y[1:], want[1:]))
            elif what == "write":
                y.add_(1.0)
                held.append((y, want + 1.0))
            elif what == "feed":
                held.append((y, want))
                x = y
                continue
            x = torch.randn(3, 8)
            del y
        for got, want in held:
            torch.testing.assert_close(got, want)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.cuda
def test_on_cuda_a_loop_is_lent_its_outputs_and_results_kept_keep_their_values(no_tf32):
    m, c = compiled_conv_net_on_cuda()
    with torch.inference_mode():
        entry = next(iter(c.whole.current.entries.values()))
        assert entry.sets is not None, c.explain()
        lent_memory = {s.outputs[0].untyped_storage().data_ptr() for s in entry.sets.sets}
        kept, lent, y = [], [], None
        for i in range(8):  # every odd call's result kept: from the fourth call on, both sets are
            x = torch.randn(2, 3, 32, 32, device="cuda")  # held at every odd call
            y = c(x)
            lent.append(y.untyped_storage().data_ptr() in lent_memory)
            if i % 2:
                kept.append((x, y))
        for x, y in kept:
            torch.testing.assert_close(y, m(x), rtol=1e-4, atol=1e-4)
    assert lent == [True, True, True, False, True, False, True, False], c.explain()
    assert entry.sets.copied == 3, c.explain()


def test_a_set_waits_for_the_stream_it_was_last_lent_on_and_is_marked_for_streams_not_its_own(monkeypatch):
    """The streams' order, with CUDA's stream calls stood in for: a set replayed on another stream
    than its last (the default stream, whose handle is 0, included) waits for that one first, and
    is marked with record_stream once for each stream other than the one its memory came from."""
    current = [0]  # the current stream's handle; 0: the default stream, where the sets were made
    streams = {}

    class Stream:
        def __init__(self, raw):
            self.raw, self.waited = raw, []

        def wait_stream(self, other):
            self.waited.append(other.raw)

    def stream_now(device=None):
        return streams.setdefault(current[0], Stream(current[0]))

    marked = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: current[0], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", stream_now)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: marked.append((t.data_ptr(), s.raw)))

    class Graph:
        def replay(self):
            pass

    a, b = (LentSet(Graph(), [torch.zeros(4)]) for _ in range(2))
    sets = lent_outputs.OutputSets(Graph(), [a, b], torch.device("cuda", 0))
    steps = [(0, a, [], []), (0, b, [], []),
             (7, a, [0], [7]),  # from the default stream to stream 7: waits for it, marked for 7
             (7, b, [0], [7]),
             (7, a, [], []),  # the same stream: no wait, marked once
             (0, b, [7], []),  # back on the sets' own stream: waits, not marked
             (0, a, [7], []),
             (7, b, [0], [])]  # on stream 7 again: waits, marked for it once already
    for raw, expected, waits, marks in steps:
        current[0] = raw
        streams.pop(raw, None)
        marked.clear()
        sets.replay()
        assert sets.lent_now is expected
        assert stream_now().waited == waits
        assert marked == [(expected.outputs[0].data_ptr(), m) for m in marks]


@pytest.mark.cuda
def test_on_cuda_results_lent_on_two_streams_keep_their_values(no_tf32):
    """A result lent on one stream and read there late, while the next calls run on another: its
    value stays. (On an H200 this holds even without the wait for the stream a set was lent on:
    something else orders the replay there, so the test does not single that wait out.)"""
    import streamdag as sd

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()).eval().cuda()
    c = sd.compile(m)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.inference_mode():
        for _ in range(3):
            c(torch.randn(8, 64, device="cuda"))
        entry = next(iter(c.whole.current.entries.values()))
        assert entry.sets is not None, c.explain()
        xs = [torch.randn(8, 64, device="cuda") for _ in range(3)]
        torch.cuda.synchronize()
        with torch.cuda.stream(first):
            y1 = c(xs[0])
        second.wait_stream(first)
        with torch.cuda.stream(second):
            y2 = c(xs[1])
        with torch.cuda.stream(first):
            torch.cuda._sleep(50_000_000)  # the caller reads its first result late, on the first stream
            read = y1 * 1.0
        del y1
        with torch.cuda.stream(second):
            y3 = c(xs[2])  # the first result's set is free by count: written after that read only
        torch.cuda.synchronize()
        torch.testing.assert_close(read, m(xs[0]), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y3, m(xs[2]), rtol=1e-4, atol=1e-4)
        del y2
    assert entry.sets.copied == 0, c.explain()
    # both sets replayed on streams other than the one their memory came from, which frees it
    assert all(s.recorded for s in entry.sets.sets)
