"""Buffers whose memory moves after it was declared: an empty ``out=`` an op resizes, and a buffer
a recorded graph holds that is resized between runs. Tracked, or refused with the fix; never run
unordered. On the compiled hot path and on its Python reference (the ``path`` fixture)."""

import threading
import time

import numpy as np
import pytest

import streamdag as sd
from streamdag.graph import buffers

torch = pytest.importorskip("torch")

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def _slowly_ones(n):
    def fill(out):
        time.sleep(0.05)  # a reader not ordered after it runs meanwhile, and sees nothing
        torch.ones(n, out=out)
    return fill


@pytest.mark.parametrize("declare", ["marker", "writes"])
def test_readers_of_an_empty_out_tensor_follow_the_op_that_resizes_it(rt, declare):
    out = torch.empty(0)
    if declare == "marker":
        rt.submit(_slowly_ones(1000), sd.write(out))
    else:
        rt.submit(_slowly_ones(1000), out, writes=[out])
    by_reads = rt.submit(lambda: out.sum().item(), reads=[out])
    by_marker = rt.submit(lambda t: t.sum().item(), sd.read(out))
    assert by_reads.result() == by_marker.result() == 1000.0


def test_a_reader_submitted_while_the_op_resizing_its_buffer_runs_follows_it():
    """By the time the reader is submitted the op has given the tensor its memory already: the
    reader's bytes are not the (empty) ones the op declared, and it must follow the op all the same."""
    resized, release = threading.Event(), threading.Event()

    def fill_then_double(out):
        torch.ones(100, out=out)
        resized.set()
        release.wait(10)
        out.mul_(2)

    with sd.Runtime("cpu", streams=3) as rt:
        out = torch.empty(0)
        rt.submit(fill_then_double, sd.write(out))
        assert resized.wait(10)
        reader = rt.submit(lambda t: t.sum().item(), sd.read(out))
        time.sleep(0.1)
        assert not reader.done(), "the reader ran while the op that resized its tensor was running"
        release.set()
        assert reader.result() == 200.0


def test_readers_of_an_empty_numpy_array_an_op_resizes_in_place_follow_it(rt):
    a = np.empty(0)

    def grow(x):
        time.sleep(0.05)
        x.resize(100, refcheck=False)
        x[:] = 3.0

    rt.submit(grow, sd.write(a))
    assert rt.submit(lambda x: x.sum(), sd.read(a)).result() == 300.0


def test_an_object_counts_as_resized_only_while_the_op_that_may_resize_it_is_pending(rt):
    """Then the compiled submit takes ops again (it leaves them to Python while any is pending)."""
    out = torch.empty(0)
    rt.submit(_slowly_ones(10), sd.write(out))
    assert id(out) in buffers._RESIZING
    rt.synchronize()
    assert buffers._RESIZING == {}
    assert rt.submit(lambda t: t.sum().item(), sd.read(out)).result() == 10.0


@pytest.mark.cuda
def test_on_cuda_a_reader_of_an_empty_out_tensor_waits_for_the_kernels_that_fill_it():
    """The op's function runs inside its submit: the tensor has its new memory when the reader is
    submitted, and the kernels filling it are still queued on the op's stream."""
    x = torch.full((1 << 20,), 2.0, device="cuda")
    out = torch.empty(0, device="cuda")

    def slow_double(a, o):
        torch.cuda._sleep(100_000_000)  # the reader, not made to wait, runs meanwhile
        torch.mul(a, 2, out=o)

    with sd.Runtime("cuda", streams=4) as rt:
        rt.submit(slow_double, x, sd.write(out), reads=[x])
        total = rt.submit(lambda t: t.sum(), sd.read(out))
        assert total.result().item() == 4.0 * (1 << 20)


def test_a_recording_refuses_an_empty_output_with_what_to_do(rt):
    out = torch.empty(0)
    with rt.record(), pytest.raises(sd.InvalidBuffer, match="Allocate the buffer at its final size"):
        rt.submit(_slowly_ones(10), sd.write(out))


def test_a_recording_takes_a_write_to_a_zero_size_numpy_view_which_cannot_be_resized(rt):
    """A view such as ``a[5:5]`` does not own its data: numpy cannot resize it, and it has no bytes to
    conflict, so a graph records it as usual (an array that owns its data may be resized: refused)."""
    a = np.arange(10.0)
    with rt.record() as g:
        rt.submit(lambda out: None, out=sd.write(a[5:5]))
        rt.submit(np.add, a, 1, out=a, writes=[a])
    g.run().result()
    assert (a == np.arange(10.0) + 1).all()
    with rt.record(), pytest.raises(sd.InvalidBuffer, match="Allocate the buffer at its final size"):
        rt.submit(lambda out: None, out=sd.write(np.zeros(0)))


def test_a_recording_refuses_a_buffer_that_a_pending_op_may_resize(rt):
    """Its memory at recording is not the memory the graph's runs would use."""
    out = torch.empty(0)
    rt.submit(_slowly_ones(10), sd.write(out))
    with rt.record(), pytest.raises(sd.InvalidBuffer, match=r"after the ops that resize it have run"):
        rt.submit(lambda t: t.sum(), sd.read(out))
    rt.synchronize()
    with rt.record() as g:
        total = rt.submit(lambda t: t.sum().item(), sd.read(out))
    assert g.run().result()[total] == 10.0


def _copy_graph(rt, src, dst):
    with rt.record() as g:
        rt.submit(lambda a, o: o.__setitem__(slice(None), a[:4]), src, dst, reads=[src], writes=[dst])
    g.run().result()
    return g


@pytest.mark.parametrize("move", [
    lambda t: t.resize_(1 << 16),  # larger: new memory
    lambda t: t.set_(torch.ones(4)),  # another storage
    lambda t: t.resize_(2),  # smaller: fewer bytes declared than it reads
], ids=["resize_larger", "set_", "resize_smaller"])
def test_a_graph_refuses_to_run_once_a_tensor_it_declared_has_other_memory(rt, move):
    """Its dependencies were inferred from the old memory: a run would not follow the ops that
    write the new one."""
    x, y = torch.ones(4), torch.zeros(4)
    g = _copy_graph(rt, x, y)
    move(x)
    with pytest.raises(sd.InvalidBuffer, match="Record the graph again"):
        g.run()
    with rt.record() as again:  # as the error says
        rt.submit(lambda a, o: o.copy_(a[:2].repeat(2)), x, y, reads=[x], writes=[y])
    again.run().result()
    assert y.tolist() == [1.0] * 4


def test_a_graph_refuses_to_run_once_a_numpy_array_it_declared_was_resized(rt):
    x, y = np.ones(4), np.zeros(4)
    g = _copy_graph(rt, x, y)
    g.run().result()
    y.resize(1 << 16, refcheck=False)  # (the graph holds it)
    with pytest.raises(sd.InvalidBuffer, match="other memory than at recording"):
        g.run()


def test_a_graph_runs_on_after_a_layout_change_that_keeps_the_memory(rt):
    x, y = torch.arange(4.0).view(2, 2), torch.zeros(2, 2)
    with rt.record() as g:
        rt.submit(lambda a, o: o.copy_(a), x, y, reads=[x], writes=[y])
    g.run().result()
    x.t_()  # a square transpose: the same bytes
    g.run().result()
    assert y.tolist() == [[0.0, 2.0], [1.0, 3.0]]
    undeclared = torch.zeros(2)
    with rt.record() as h:  # an argument it does not declare is not its to check
        rt.submit(lambda o, _: o.fill_(1.0), y, undeclared, writes=[y])
    undeclared.resize_(1 << 16)
    h.run().result()
